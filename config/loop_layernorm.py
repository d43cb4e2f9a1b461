# Paper 1, per-loop + LayerNorm readout: scale-invariant like RMSNorm, so the same blind spot
# (docs/papers.md §1).
supervision = 'per_loop'
readout = 'layernorm'
norm_penalty = 0.0
inter_loop_norm = 'none'
