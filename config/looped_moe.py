# Looped-MoE at laptop size (docs/papers.md §5): every feed-forward of the K shared layers a mixture of
# E = 8 experts, each token routed to its top 2 on every loop. An expert's hidden width is the dense MLP's
# divided by k, so the active parameters per token equal config/loop_rmsnorm.py's dense model; the routing
# per loop is what python lab/routing.py out-looped-moe measures against chance. Not the sweep's base:
# python lab/ablate.py moe runs its dense and expert arms on config/laptop_deeploop.py with SwiGLU.
# python train.py config/looped_moe.py
n_expert = 8                     # E experts per layer
top_k = 2                        # k experts per token (token choice, dropless)
aux_loss_coef = 0.01             # load balancing E sum_i f_i P_i, per layer per visit
z_loss_coef = 0.001              # router z-loss mean(logsumexp^2)
supervision = 'per_loop'         # CE at every exit: the CE per loop boundary is what the paper compares
readout = 'rmsnorm'              # per-loop RMSNorm readout
out_dir = 'out-looped-moe'       # where ckpt.pt goes
