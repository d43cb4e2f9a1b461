# Retrofitted recurrence at laptop size (docs/papers.md §6): the base config of `python lab/ablate.py
# retrofit`, which pretrains a unique 6-layer model on it, loops that model's layers and trains on. GPT-2's
# layout at d 128 (learned positions, tanh GELU, LayerNorms with biases, a LayerNorm readout, GPT-2's init),
# so that the same mapping as init_from='gpt2' runs; loss at the last loop only, as the paper trains.
# By hand: python train.py config/laptop_retrofit.py --n_layer=6 --n_loop=1 --out_dir=out-unique, then
#          python train.py config/laptop_retrofit.py --init_from=out-unique --n_prelude=1 --n_layer=2 \
#              --n_coda=1 --n_loop=4 --injection=concat --loop_schedule=0.5 --out_dir=out-retrofit
dataset = 'shakespeare_char'     # python prepare.py shakespeare_char
n_head = 4                       # heads of size 32
n_embd = 128                     # d
block_size = 64                  # context length
pos = 'learned'                  # GPT-2's absolute positions
mlp = 'gelu_tanh'                # GPT-2's MLP
norm = 'layernorm'               # GPT-2's LayerNorms...
bias = True                      # ...and biases
readout = 'layernorm'            # GPT-2's ln_f before the tied head
init = 'gpt2'                    # N(0, 0.02)
supervision = 'terminal'         # the loss at the last loop only
batch_size = 16                  # sequences per step
dropout = 0.0                    # no dropout at this size
learning_rate = 1e-3             # AdamW, held constant: a continued run goes on at the same LR
lr_schedule = 'constant'         # (a decay would end the pretraining in a state no continuation has)
warmup_iters = 0                 # no warmup
beta2 = 0.99                     # AdamW's second-moment decay
weight_decay = 0.01              # AdamW weight decay
grad_clip = 1.0                  # clip the gradient norm at 1
eval_interval = 100              # evaluate this often
eval_iters = 20                  # batches per evaluation
log_interval = 100               # print the training loss this often
device = 'cpu'                   # a laptop: one CPU core per run
compile = False                  # torch.compile does not pay off for runs this short
