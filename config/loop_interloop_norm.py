# Paper 1's other fix, scale-removing recurrence ("inter-loop normalization", as in Ouro): per-loop CE,
# RMSNorm readout, and an RMSNorm on the state between loops. Not one of the paper's seven arms
# (docs/papers.md §1).
supervision = 'per_loop'
readout = 'rmsnorm'
norm_penalty = 0.0
inter_loop_norm = 'rmsnorm'
