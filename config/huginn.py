# Huginn-like recurrent depth (Geiping et al. 2025; docs/papers.md §4): an untied prelude block and coda
# block around the shared loop, the prelude output re-injected into every loop through W [x; e] (W = [I 0] at
# init), a random loop count per step (mean n_loop + 1) with gradients through the last 2 loops only, and
# the loss at the last exit. Combine with a size: python train.py config/laptop_blindspot.py config/huginn.py
n_prelude = 1
n_coda = 1
injection = 'concat'
loop_sampling = 'poisson_lognormal'
backprop_loops = 2
supervision = 'terminal'
