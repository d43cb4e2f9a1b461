# Paper 1 (readout blind spot), 44M preset for a GPU: d 512, 8 heads, K = 8 layers looped R = 4 times,
# batch 64 x 256 tokens, AdamW 3e-4 constant (no warmup), betas (0.9, 0.999), wd 0.01, clip 1.0, dropout 0.1,
# reference init (docs/papers.md §1). Compose with an arm, which applies after it:
#   python train.py config/paper_44m.py config/loop_raw.py --out_dir=out-44m-raw
# Data: WikiText-103 with the paper's word-level tokenizer (python prepare.py wikitext103_word; vocab_size
# comes from its meta.json: 20,000). For GPT-2 BPE instead: --dataset=wikitext103, and set max_iters anew.
# Steps: the reference protocol, 4 epochs of windows of 256 tokens at stride 128 (each epoch passes over
# every token twice), batch 64: max_iters = 4 * ceil(n_windows / 64), n_windows = (T - 256 - 1) // 128 + 1.
# T, the word-token count of the train split, is an ESTIMATE here: WikiText-103's published 103,227,021
# tokens (Merity et al.), each followed by whitespace in the raw text, so ~2 pattern tokens apiece:
# T ~ 2 * 103,227,021 = 206,454,042 -> n_windows 1,612,921 -> 4 * 25,202 = 100,808 steps
# (prepare.WIKITEXT103_WORD_TOKENS, protocol_steps). prepare.py prints the exact max_iters for the data it
# wrote. train.py draws random windows rather than stride-128 epochs: as many tokens seen, not in that order.
dataset = 'wikitext103_word'
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
max_iters = 100808       # the estimate above: 4 epochs of the protocol
eval_interval = 1000
eval_iters = 50
log_interval = 100
compile = True
