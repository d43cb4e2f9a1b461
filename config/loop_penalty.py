# Paper 1, "per-loop + penalty": RMSNorm readout plus lambda * mean_k mean(h_k^2), lambda = 0.01 (scale made
# visible by an explicit loss term).
supervision = 'per_loop'
readout = 'rmsnorm'
norm_penalty = 0.01
inter_loop_norm = 'none'
