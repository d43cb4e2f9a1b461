# Retrofitted recurrence from GPT-2 small (docs/papers.md §6), for one GPU node: GPT-2's 12 layers as
# prelude 4 | loop 4 | coda 4 (layers 0-3 | 4-7 | 8-11, none dropped), the loop's input through the concat
# adapter W [x; e] at identity, a Huginn-style sampled depth (mean n_loop + 1 = 5) whose mean ramps up from 1
# over the first quarter, loss at the last loop only, gradients through the last 4 loops. FineWeb-Edu
# (python prepare.py fineweb_edu). The shape keys below are GPT-2's own (init_from='gpt2' would set them
# anyway): spelled out so that lab/ablate.py's --dry_run sizes the model without downloading it.
#   python train.py config/retrofit_gpt2.py                         # needs pip install transformers
#   python lab/ablate.py retrofit_gpt2 --dry_run                    # this run and GPT-2 trained on: GPU-hours
# Not the paper's recipe: it retrofits TinyLlama / Llama-3.2-1B / OLMo-2-1B on its own data mix with Muon;
# the learning rate, the ramp's share and the token budget here are this project's choices.
init_from = 'gpt2'
dataset = 'fineweb_edu'
n_prelude = 4                       # GPT-2's layers 0-3, run once
n_layer = 4                         # layers 4-7, the loop
n_coda = 4                          # layers 8-11, at the exit
n_loop = 4                          # R: the sampled depth's mean is n_loop + 1
loop_sampling = 'poisson_lognormal'
backprop_loops = 4                  # truncated backprop through the last 4 loops (Huginn's 8, halved)
loop_schedule = 0.25                # the mean loop count ramps up over the first quarter of training
injection = 'concat'                # W [x; e] with W = [I 0] at first: the model starts as GPT-2
supervision = 'terminal'
n_head = 12                         # GPT-2 small's shape, as from_pretrained('gpt2') gives it
n_embd = 768
block_size = 1024
vocab_size = 50257                  # GPT-2's own, unpadded (its weights have 50,257 rows)
pos = 'learned'
mlp = 'gelu_tanh'
norm = 'layernorm'
bias = True
readout = 'layernorm'
dropout = 0.0
batch_size = 12
gradient_accumulation_steps = 40    # 12 x 40 = 480 sequences (491,520 tokens) per step on 1, 2, 4 or 8 GPUs
learning_rate = 1e-4                # a continued run: below nanoGPT's 6e-4 from scratch
lr_schedule = 'cosine'
warmup_iters = 100
lr_decay_iters = 2000
min_lr = 1e-5
max_iters = 2000                    # 2K x 491,520 = ~1B tokens
beta1 = 0.9
beta2 = 0.95
weight_decay = 0.1
grad_clip = 1.0
eval_interval = 250
eval_iters = 100
compile = True
