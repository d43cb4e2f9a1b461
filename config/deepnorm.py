# Paper 2's comparison point, DeepNorm (p = 1/4): post-norm blocks Norm(alpha x + f(x)), alpha = (2N)^(1/4)
# on the skip, init gain beta = (8N)^(-1/4), N = K*R unrolled blocks (docs/papers.md §2).
block = 'postln'
depth_scaling = 'deepnorm'
