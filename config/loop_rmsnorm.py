# Paper 1, "per-loop + RMSNorm": CE at every exit through a scale-invariant readout. The blind spot:
# the loss cannot see ||h||, so the loop-state norm grows unchecked (docs/papers.md §1).
supervision = 'per_loop'
readout = 'rmsnorm'
norm_penalty = 0.0
inter_loop_norm = 'none'
