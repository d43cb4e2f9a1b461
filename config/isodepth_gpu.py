# The iso-depth sweep at the paper's size (docs/papers.md §3): the base config of
# `python lab/isodepth.py --preset=gpu`, which sets width (d = 64 s, heads of 128), 2 prelude + 16/r blocks
# x r + 2 coda, and each budget's steps per run. FineWeb-Edu with GPT-2 BPE (the paper: its own data and
# tokenizer), context 2,048, 128 sequences = 262,144 tokens per step as the paper's batch; AdamW with a
# cosine schedule over each run's steps (the paper trains with Muon: the LR here is not the paper's, untuned).
dataset = 'fineweb_edu'             # python prepare.py fineweb_edu
block_size = 2048                   # the paper's context
vocab_size = 50304                  # GPT-2's 50257 padded to a multiple of 64
batch_size = 16
gradient_accumulation_steps = 8     # 16 x 8 = 128 sequences per step on 1, 2, 4 or 8 GPUs
pos = 'rope'
mlp = 'gelu'                        # 8 C^2, as the paper's relu^2 MLP
init = 'gpt2'
readout = 'rmsnorm'
dropout = 0.0
learning_rate = 1e-3
lr_schedule = 'cosine'
min_lr = 1e-4
beta1 = 0.9
beta2 = 0.95
weight_decay = 0.1
grad_clip = 1.0
eval_iters = 50                     # 50 x 16 sequences of 2,048 tokens: the final loss's sample
log_interval = 50
compile = True
