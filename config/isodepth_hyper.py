# The iso-depth paper's hyper-connections (docs/papers.md §3): 2 lanes, both e at first, carry the
# recurrence instead of W [e; s]; per loop k static alpha_k, M_k, beta_k: u = sum_n alpha_k,n lane_n,
# s = RMSNorm(blocks(u)), lanes <- M_k lanes + beta_k s, the lanes summed before the coda. The cyclic init
# (alpha_k = e_(k-1 mod 2), M = I, beta = 1) makes loop 1 the plain loop. Compose after config/isodepth.py.
injection = 'none'                # the lanes replace the injection layer
hyper_lanes = 2                   # N lanes
inter_loop_norm = 'rmsnorm'       # s = RMSNorm(h), what the lanes take in
supervision = 'terminal'          # last-loop supervision
