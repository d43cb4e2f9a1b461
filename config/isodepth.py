# The iso-depth paper's looped model (Schwethelm et al. 2026; docs/papers.md §3, docs/isodepth.md): the
# prelude output e and the state s enter every recurrence, the first included, as u = W [e; s] with
# W = [I 0] at init (the block first reads e), RMSNorm on the state after every recurrence (the coda reads
# it too), and the loss at the last loop. The sizes (prelude, looped blocks, coda, r) are the sweep's:
#   python train.py config/laptop_isodepth.py config/isodepth.py --n_prelude=1 --n_layer=4 --n_loop=2 \
#       --n_coda=1
injection = 'iso'                 # u = W [e; s] before every loop, s_0 = e
adapter_init = 'identity'         # W = [I 0]: at init u = e
inter_loop_norm = 'rmsnorm'       # s_k = RMSNorm(h_k), what the next loop and the coda read
supervision = 'terminal'          # last-loop supervision
