# Paper 1, "terminal + RMSNorm": CE at exit R only, RMSNorm readout (early exits are untrained).
supervision = 'terminal'
readout = 'rmsnorm'
norm_penalty = 0.0
inter_loop_norm = 'none'
