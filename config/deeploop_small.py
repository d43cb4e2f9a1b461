# Paper 2 (DeepLoop), "small" preset for GPUs: d 768, 12 heads, K = 12 layers looped R = 3 times, RoPE, tied
# embeddings, GPT-2 BPE on FineWeb-Edu (python prepare.py fineweb_edu), context 1024, global batch 480
# sequences, 100K steps (docs/papers.md §2). DeepLoop block: sandwich norms, alpha = (2N)^(1/2),
# beta = (8N)^(-1/2). The paper does not state its optimizer or schedule: this uses nanoGPT's GPT-2 recipe
# (AdamW 6e-4, cosine, warmup).
dataset = 'fineweb_edu'
n_layer = 12
n_loop = 3
n_head = 12
n_embd = 768
block_size = 1024
vocab_size = 50304                  # GPT-2's 50257 padded to a multiple of 64 (faster matmuls)
pos = 'rope'
mlp = 'gelu'                        # GPT-style MLP
init = 'gpt2'
block = 'sandwich'
depth_scaling = 'deeploop'
supervision = 'terminal'            # a standard looped LM: loss at the last loop only
readout = 'rmsnorm'
dropout = 0.0
batch_size = 12
gradient_accumulation_steps = 40    # 12 x 40 = 480 sequences per step on any of 1, 2, 4 or 8 GPUs
learning_rate = 6e-4
lr_schedule = 'cosine'
warmup_iters = 2000
lr_decay_iters = 100000
min_lr = 6e-5
max_iters = 100000                  # 100K x 480 x 1,024 = ~49B tokens, as the paper's ~50B: about 5 passes
                                    # over FineWeb-Edu sample-10BT, ~49 over --num_docs=1000000 (~1B)
beta1 = 0.9
beta2 = 0.95
weight_decay = 0.1
grad_clip = 1.0
eval_interval = 1000
eval_iters = 100
log_interval = 10
compile = True
