# Looped-MoE, GPT-2-small class, for one GPU node (docs/papers.md §5; docs/performance.md, "Looped-MoE"):
# the paper's 8 layers looped twice, every feed-forward a mixture of E = 8 SwiGLU experts with each token
# routed to its top 2 on every loop. d 768, 12 heads, context 1024, GPT-2 BPE on FineWeb-Edu
# (python prepare.py fineweb_edu). An expert is 4C/k = 1,536 wide, so the active parameters per token are a
# dense SwiGLU model's: 114M active (75M outside the embedding) of 284M, 16 layer visits per token.
# As close as this model gets, not the paper's recipe: its optimizer, schedule and token budget are not
# ours; this takes nanoGPT's GPT-2 recipe (AdamW 6e-4, cosine, warmup) for one pass over sample-10BT.
#   python train.py config/looped_moe_gpt2s.py
#   python lab/ablate.py moe --base config/looped_moe_gpt2s.py --dry_run   # the sweep at this width
dataset = 'fineweb_edu'
n_layer = 8                         # K: the paper's 8 shared layers ...
n_loop = 2                          # ... looped R = 2 times
n_head = 12
n_embd = 768
block_size = 1024
vocab_size = 50304                  # GPT-2's 50257 padded to a multiple of 64 (faster matmuls)
pos = 'rope'
mlp = 'swiglu'                      # the experts are SwiGLU MLPs
init = 'gpt2'
n_expert = 8                        # E experts per layer
top_k = 2                           # k experts per token (token choice, dropless)
aux_loss_coef = 0.01                # load balancing E sum_i f_i P_i, per layer per visit
z_loss_coef = 0.001                 # router z-loss mean(logsumexp^2)
supervision = 'per_loop'            # CE at both exits: the loop boundary is the paper's early exit
readout = 'rmsnorm'
dropout = 0.0
batch_size = 12
gradient_accumulation_steps = 40    # 12 x 40 = 480 sequences (491,520 tokens) per step on 1, 2, 4 or 8 GPUs
learning_rate = 6e-4
lr_schedule = 'cosine'
warmup_iters = 700
lr_decay_iters = 20000
min_lr = 6e-5
max_iters = 20000                   # 20K x 491,520 = ~9.8B tokens: one pass over FineWeb-Edu sample-10BT
beta1 = 0.9
beta2 = 0.95
weight_decay = 0.1
grad_clip = 1.0
eval_interval = 1000
eval_iters = 100
log_interval = 10
compile = True                      # bf16 on the GPU: F.grouped_mm traces (in float32 under compile the
                                    # experts run eagerly, one graph break per visit: docs/performance.md)
