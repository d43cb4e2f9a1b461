# Huginn's recurrent-depth pieces on pre-norm blocks (not Huginn's architecture, whose blocks are sandwich-
# normed: config/huginn.py): an untied prelude and coda block, W [x; e] injection with W = [I 0] at init (the
# iso-depth paper's adapter, docs/papers.md §3), a random loop count per step with gradients through the
# last 2 loops, and the loss at the last exit. The state's scale is left to the loop, so the blind spot can
# act:  python train.py config/laptop_blindspot.py config/recurrent_preln.py
n_prelude = 1                     # untied blocks before the loop
n_coda = 1                        # untied blocks after every exit
injection = 'concat'              # W [x; e] before loops 2..R
adapter_init = 'identity'         # W = [I 0]: at init the adapter passes the state through
loop_sampling = 'poisson_lognormal'  # R ~ Poisson(exp(tau)) + 1 per step
backprop_loops = 2                # truncated backprop: the last 2 loops
supervision = 'terminal'          # the loss at the last exit only
