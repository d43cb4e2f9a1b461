# Paper 1, "per-loop + raw": CE at every exit, no norm before the LM head (scale visible to the loss).
supervision = 'per_loop'
readout = 'raw'
norm_penalty = 0.0
inter_loop_norm = 'none'
