# Huginn's recurrent depth (Geiping et al. 2025; docs/papers.md §4): sandwich-normed blocks everywhere
# (a norm before and after every sublayer, so the state's scale is removed by construction), an untied
# prelude and coda block around the shared loop, the prelude output re-injected before every loop after the
# first through a plain linear adapter W [x; e], a random loop count per step (mean n_loop + 1) with
# gradients through the last 2 loops only, and the loss at the last exit. Where it still departs from
# Huginn (first-loop state, the final norm before the coda, init, the depth cap): docs/papers.md §4.
# assets/recurrent.md's huginn arm ran before pos = 'rope' was set here (learned positions). With a size:
#   python train.py config/laptop_blindspot.py config/huginn.py
block = 'sandwich'                # Norm(x + f(Norm x)) for every sublayer, alpha = 1 (no depth scaling)
n_prelude = 1                     # untied blocks before the loop
n_coda = 1                        # untied blocks after every exit
injection = 'concat'              # W [x; e] before loops 2..R
adapter_init = 'default'          # W a plain linear layer at init, as Huginn's adapter
loop_sampling = 'poisson_lognormal'  # R ~ Poisson(exp(tau)) + 1 per step
backprop_loops = 2                # truncated backprop: the last 2 loops
supervision = 'terminal'          # the loss at the last exit only
pos = 'rope'                      # Huginn's positions are rotary (its code: rope_base), not learned
