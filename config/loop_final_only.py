# Paper 1, "per-loop + final-only norm": raw readout at exits 1..R-1, RMSNorm only at exit R (scale visible
# at the early exits).
supervision = 'per_loop'
readout = 'final_only'
norm_penalty = 0.0
inter_loop_norm = 'none'
