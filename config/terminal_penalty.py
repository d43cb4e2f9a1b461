# Paper 1, "terminal + penalty": CE at exit R only, RMSNorm readout, plus lambda * mean_k mean(h_k^2) over all
# R loop states, lambda = 0.01.
supervision = 'terminal'
readout = 'rmsnorm'
norm_penalty = 0.01
inter_loop_norm = 'none'
