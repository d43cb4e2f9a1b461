# The iso-depth sweep at laptop size: the base config of `python lab/isodepth.py` (docs/isodepth.md), which
# sets the width, the prelude / looped blocks / coda, r, the steps of each FLOP budget and the LR schedule's
# lengths per run. Char-level Tiny Shakespeare, GPT-2 init, RoPE, GELU MLP (8 C^2, as the paper's relu^2),
# AdamW 3e-3 cosine to 3e-4 (each run decays over its own steps: a budget's runs end annealed, as a scaling
# law needs), the final val loss over 20 batches.
dataset = 'shakespeare_char'     # python prepare.py shakespeare_char
block_size = 64                  # context length
batch_size = 16                  # sequences per step: 1,024 tokens
gradient_accumulation_steps = 1  # no accumulation
dropout = 0.0                    # no dropout at this size
init = 'gpt2'                    # N(0, 0.02)
pos = 'rope'                     # rotary position embedding, as the paper's
mlp = 'gelu'                     # a 4C hidden layer of two matrices
readout = 'rmsnorm'              # norm before the LM head
learning_rate = 3e-3             # peak LR, untuned at this size
lr_schedule = 'cosine'           # warmup, then cosine to min_lr at each run's last step
min_lr = 3e-4                    # learning_rate / 10
beta1 = 0.9                      # AdamW betas
beta2 = 0.99                     # (train.py's default)
weight_decay = 0.01              # AdamW weight decay
grad_clip = 1.0                  # clip the gradient norm at 1
eval_iters = 20                  # batches per evaluation: the final loss's sample
log_interval = 100               # print the training loss this often
device = 'cpu'                   # a laptop: one CPU core per run
compile = False                  # torch.compile does not pay off for runs this short
