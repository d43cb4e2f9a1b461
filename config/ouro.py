# Ouro-like LoopLM (docs/papers.md §4): per-loop CE through the RMSNorm readout, whose output is also what
# enters the next loop, and a learned exit gate: loss sum_k p(k) CE_k - 0.05 H(p). Sample with
# python sample.py --exit_policy=gate --exit_threshold=0.5
supervision = 'per_loop'
readout = 'rmsnorm'
inter_loop_norm = 'readout'
exit_gate = 'learned'
exit_entropy = 0.05
