# Paper 2, DeepLoop (p = 1/2): sandwich blocks Norm(alpha x + f(Norm x)), alpha = (2N)^(1/2) on the skip,
# init gain beta = (8N)^(-1/2) on W_v, W_o and the MLP, N = K*R unrolled blocks (docs/papers.md §2). The
# paper's baseline is the default pre-norm block: python train.py config/deeploop_small.py --block=preln
# --depth_scaling=none
block = 'sandwich'
depth_scaling = 'deeploop'
