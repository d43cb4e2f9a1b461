# Paper 1 (readout blind spot), 44M preset for a GPU: d 512, 8 heads, K = 8 layers looped R = 4 times,
# batch 64 x 256 tokens, AdamW 3e-4 constant (no warmup), betas (0.9, 0.999), wd 0.01, clip 1.0, dropout 0.1,
# reference init (docs/papers.md §1). Compose with an arm, which applies after it:
#   python train.py config/paper_44m.py config/loop_raw.py --out_dir=out-44m-raw
# Data: WikiText-103 with GPT-2 BPE (python prepare.py wikitext103); the paper used a 20k word-level
# vocabulary, so absolute perplexities differ from its tables.
dataset = 'wikitext103'
n_layer = 8
n_loop = 4
n_head = 8
n_embd = 512
block_size = 256
batch_size = 8                       # sequences per micro-batch
gradient_accumulation_steps = 8      # 8 x 8 = 64 sequences per step on any of 1, 2, 4 or 8 GPUs
dropout = 0.1
init = 'reference'
learning_rate = 3e-4
lr_schedule = 'constant'
warmup_iters = 0
beta1 = 0.9
beta2 = 0.999
weight_decay = 0.01
grad_clip = 1.0
max_iters = 30000        # ~4 epochs of WikiText-103's ~120M GPT-2 tokens at 16k tokens per step
eval_interval = 1000
eval_iters = 50
log_interval = 100
compile = True
