# Paper 2 (DeepLoop) at laptop size: the base config of `python lab/ablate.py deeploop`, which sets block,
# depth_scaling, n_loop and learning_rate per run (docs/papers.md §2, "Project readings where the paper is
# silent"). Char-level Tiny Shakespeare, d 128, K 2, GPT-2 init, RoPE, GELU MLP and terminal supervision as in
# config/deeploop_small.py; constant LR with no warmup (a warmup would hide exactly the early instability this
# sweep looks for). One run by hand: python train.py config/laptop_deeploop.py config/deeploop.py --n_loop=8
dataset = 'shakespeare_char'     # python prepare.py shakespeare_char
n_layer = 2                      # K: distinct layers (the sweep sets R = n_loop)
n_head = 4                       # heads of size 32
n_embd = 128                     # d
block_size = 64                  # context length
batch_size = 8                   # sequences per step
gradient_accumulation_steps = 1  # no accumulation
dropout = 0.0                    # no dropout at this size
init = 'gpt2'                    # N(0, 0.02), as in config/deeploop_small.py
pos = 'rope'                     # rotary position embedding
mlp = 'gelu'                     # GPT-style MLP
supervision = 'terminal'         # a standard looped LM: loss at the last loop only
readout = 'rmsnorm'              # norm before the LM head
lr_schedule = 'constant'         # the sweep sets learning_rate; held constant...
warmup_iters = 0                 # ...with no warmup
beta1 = 0.9                      # AdamW betas
beta2 = 0.99                     # (train.py's default)
weight_decay = 0.01              # AdamW weight decay
grad_clip = 1.0                  # clip the gradient norm at 1
max_iters = 300                  # training steps
eval_interval = 25               # evaluate this often: the loss curves' resolution
eval_iters = 4                   # batches per evaluation
log_interval = 100               # print the training loss this often
device = 'cpu'                   # a laptop: one CPU core per run
compile = False                  # torch.compile does not pay off for runs this short
