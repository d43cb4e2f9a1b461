# Paper 1 (readout blind spot) at laptop size: the base config of `python lab/ablate.py blindspot`, which adds
# one arm file (config/loop_raw.py, ...) per run (docs/papers.md §1, "Where nanoloop departs from the paper").
# d 128, K 2, R 4 on Tiny Shakespeare characters, AdamW 3e-4 constant with no warmup, betas (0.9, 0.999),
# wd 0.01, clip 1.0, reference init (wte ~ N(0, 1)). One run per CPU core, ~13 min each (assets/blindspot.md).
# One arm by hand: python train.py config/laptop_blindspot.py config/loop_raw.py --out_dir=out-laptop-raw
dataset = 'shakespeare_char'     # python prepare.py shakespeare_char
n_layer = 2                      # K: distinct layers
n_loop = 4                       # R: loops through them
n_head = 4                       # heads of size 32
n_embd = 128                     # d
block_size = 64                  # context length
batch_size = 16                  # sequences per step
gradient_accumulation_steps = 1  # no accumulation
dropout = 0.0                    # no dropout at this size
init = 'reference'               # PyTorch's default init, wte ~ N(0, 1), as in the paper
learning_rate = 3e-4             # the paper's AdamW learning rate...
lr_schedule = 'constant'         # ...held constant
warmup_iters = 0                 # no warmup
beta1 = 0.9                      # AdamW betas as in the paper
beta2 = 0.999                    # (train.py's default is 0.99)
weight_decay = 0.01              # the paper's weight decay
grad_clip = 1.0                  # clip the gradient norm at 1
max_iters = 600                  # training steps
eval_interval = 25               # evaluate (||h_k||, CE per exit) this often: the norm curves' resolution
eval_iters = 4                   # batches per evaluation
log_interval = 100               # print the training loss this often
device = 'cpu'                   # a laptop: one CPU core per run
compile = False                  # torch.compile does not pay off for runs this short
