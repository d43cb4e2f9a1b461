# Paper 1, "terminal + raw": CE at exit R only, no norm before the LM head.
supervision = 'terminal'
readout = 'raw'
norm_penalty = 0.0
inter_loop_norm = 'none'
