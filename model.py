"""
A looped (weight-tied, depth-recurrent) GPT language model in one file.

A looped transformer keeps K distinct layers (`n_layer`) and applies that stack R times (`n_loop`), so the
unrolled depth is N = K*R while the parameter count stays that of K layers. Every round ("loop") ends in an
exit: the state h_k can be read out into logits, which gives per-loop supervision and early exits for free.

The two papers this file implements (formulas in ../shared/papers.md):
1) The readout blind spot (papers.md §1): per-loop cross-entropy through a scale-invariant readout (RMSNorm,
   LayerNorm) cannot see ||h||, so pre-norm recurrence lets the hidden-state scale grow unchecked. Knobs:
   `readout`, `supervision`, `norm_penalty`, `inter_loop_norm`.
2) DeepLoop (papers.md §2): post-norm blocks with alpha = (2N)^p on the skip path and an init-only gain
   beta = (8N)^-p; p = 1/4 is DeepNorm, p = 1/2 is DeepLoop. Knobs: `block`, `depth_scaling`.

Where to look: the loop is GPT.loop_states, the readout GPT.readout, the loss GPT.forward / linear_cross_entropy,
the scaling rule GPTConfig.alpha / GPTConfig.beta and GPT._init_weights.
"""

import math
import inspect
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

# the named choices of every knob; GPTConfig.__post_init__ checks against these
CHOICES = dict(
    pos=('learned', 'rope'),
    mlp=('swiglu', 'gelu'),
    norm=('rmsnorm', 'layernorm'),
    init=('reference', 'gpt2'),
    readout=('rmsnorm', 'layernorm', 'raw', 'final_only'),
    supervision=('per_loop', 'terminal'),
    inter_loop_norm=('none', 'rmsnorm', 'layernorm'),
    block=('preln', 'postln', 'sandwich'),
)
# depth_scaling by name -> exponent p of alpha = (2N)^p, beta = (8N)^-p (papers.md §2)
DEPTH_EXPONENTS = {'none': 0.0, 'deepnorm': 0.25, 'deeploop': 0.5}


@dataclass
class GPTConfig:
    block_size: int = 256          # context length T
    vocab_size: int = 65           # V (65 = shakespeare_char)
    n_layer: int = 2               # K: distinct layers in the shared stack
    n_loop: int = 4                # R: rounds through that stack; N = K*R unrolled blocks
    n_head: int = 4
    n_embd: int = 128              # C
    dropout: float = 0.0
    bias: bool = False             # biases in Linear and LayerNorm layers
    pos: str = 'learned'           # learned absolute position embedding | rope
    mlp: str = 'swiglu'            # swiglu (width 4C, three matrices) | gelu (nanoGPT's MLP)
    norm: str = 'rmsnorm'          # the norm inside blocks
    tie_weights: bool = True       # LM head shares the token embedding matrix
    init: str = 'reference'        # reference: PyTorch defaults, wte ~ N(0,1) (paper 1's code) | gpt2: N(0, 0.02)
    readout: str = 'rmsnorm'       # what sits between h_k and the LM head (papers.md §1)
    supervision: str = 'per_loop'  # per_loop: weighted mean of the R exit CEs | terminal: exit R only
    exit_weights: tuple = ()       # per-exit loss weights under per_loop; () = uniform 1/R
    norm_penalty: float = 0.0      # lambda of lambda * mean_k mean(h_k^2); 0 = off
    inter_loop_norm: str = 'none'  # a norm applied to h between loops (scale-removing recurrence, as in Ouro)
    block: str = 'preln'           # preln: x + f(Norm x) | postln: Norm(a x + f(x)) | sandwich: Norm(a x + f(Norm x))
    depth_scaling: object = 'none'  # none | deepnorm (p=1/4) | deeploop (p=1/2) | a number p
    loop_eps: float = 0.0          # lambda of the pre-norm branch multiplier lambda/(R sqrt K) (papers.md §3); 0 = off

    def __post_init__(self):
        for key, allowed in CHOICES.items():
            value = getattr(self, key)
            if value not in allowed:
                raise ValueError(f"{key}={value!r}: choose one of {', '.join(allowed)}")
        for key in ('block_size', 'vocab_size', 'n_layer', 'n_loop', 'n_head', 'n_embd'):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{key}={value!r}: must be an integer >= 1")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.pos == 'rope' and (self.n_embd // self.n_head) % 2 != 0:
            raise ValueError(f"pos='rope' needs an even head size, got n_embd/n_head = {self.n_embd // self.n_head}")
        for key in ('dropout', 'norm_penalty', 'loop_eps'):
            if not math.isfinite(getattr(self, key)):
                raise ValueError(f"{key}={getattr(self, key)!r}: must be a finite number")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout!r}: must be in [0, 1)")
        if self.norm_penalty < 0:
            raise ValueError(f"norm_penalty={self.norm_penalty!r}: must be >= 0")
        if self.loop_eps < 0:
            raise ValueError(f"loop_eps={self.loop_eps!r}: must be >= 0 (0 = off)")
        if self.loop_eps > 0 and self.block != 'preln':
            raise ValueError("loop_eps scales pre-norm branches: it needs block='preln'")
        self.exit_weights = tuple(float(w) for w in self.exit_weights)
        if self.exit_weights and (len(self.exit_weights) != self.n_loop or min(self.exit_weights) < 0
                                  or not all(map(math.isfinite, self.exit_weights))):
            raise ValueError(f"exit_weights={self.exit_weights}: give n_loop={self.n_loop} weights >= 0, or () for uniform")
        # depth_scaling: a name, or the exponent p itself (also as a string such as '0.3')
        p = self.depth_scaling
        if isinstance(p, str) and p not in DEPTH_EXPONENTS:
            try:
                p = float(p)
            except ValueError:
                raise ValueError(f"depth_scaling={p!r}: choose one of none, deepnorm, deeploop, or a number p >= 0") from None
        if isinstance(p, bool) or not isinstance(p, (str, int, float)) or (not isinstance(p, str) and not 0 <= p < 10):
            raise ValueError(f"depth_scaling={p!r}: choose one of none, deepnorm, deeploop, or a number p >= 0")
        self.depth_scaling = p
        if self.p > 0 and self.block == 'preln':
            raise ValueError(f"depth_scaling={self.depth_scaling!r} scales post-norm skips: use block='postln' or 'sandwich'")

    # ---- the depth-scaling rule, in one place (papers.md §2) ----
    @property
    def p(self):
        return DEPTH_EXPONENTS[self.depth_scaling] if isinstance(self.depth_scaling, str) else float(self.depth_scaling)

    @property
    def n_unrolled(self):
        # N counts unrolled blocks K*R (every visit of a shared layer is one more block of depth), the reading
        # DeepLoop argues for; DeepNorm in an untied model would use N = K. The training R is used, also when
        # n_loop is changed at inference time: alpha and beta are fixed when the model is built.
        return self.n_layer * self.n_loop

    @property
    def alpha(self):
        return (2 * self.n_unrolled) ** self.p      # papers.md §2: alpha = (2N)^p multiplies the skip path

    @property
    def beta(self):
        return (8 * self.n_unrolled) ** (-self.p)   # papers.md §2: beta = (8N)^-p, an init-only gain

    @property
    def branch_eps(self):
        # papers.md §3 (Wang et al.): h <- h + eps f(h), eps = lambda / (R sqrt K); 1 when loop_eps is off
        return self.loop_eps / (self.n_loop * math.sqrt(self.n_layer)) if self.loop_eps > 0 else 1.0


def make_norm(kind, n_embd, bias):
    # RMSNorm with a learned gain and eps 1e-6 as in the reference code; LayerNorm with an optional bias
    return nn.RMSNorm(n_embd, eps=1e-6) if kind == 'rmsnorm' else nn.LayerNorm(n_embd, bias=bias)


def apply_rope(x, cos, sin):
    # x (B, nh, T, hs); rotate the two halves of each head by position-dependent angles
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v in one matrix
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd

    def heads(self, t, B, T):
        return t.view(B, T, self.n_head, self.n_embd // self.n_head).transpose(1, 2)  # (B, nh, T, hs)

    def kv(self, x, rope, cache, pos):
        # keys and values of x; with a cache they are written into this visit's slot and the whole
        # history (positions 0..pos+T-1) is returned
        B, T, C = x.size()
        k, v = F.linear(x, self.c_attn.weight[C:],
                        None if self.c_attn.bias is None else self.c_attn.bias[C:]).split(C, dim=2)
        k, v = self.heads(k, B, T), self.heads(v, B, T)
        if rope is not None:
            k = apply_rope(k, *rope)
        if cache is not None:
            cache[0][:, :, pos:pos + T] = k
            cache[1][:, :, pos:pos + T] = v
            k, v = cache[0][:, :, :pos + T], cache[1][:, :, :pos + T]
        return k, v

    def forward(self, x, rope=None, cache=None, pos=0):
        B, T, C = x.size()
        q = self.heads(F.linear(x, self.c_attn.weight[:C],
                                None if self.c_attn.bias is None else self.c_attn.bias[:C]), B, T)
        if rope is not None:
            q = apply_rope(q, *rope)
        k, v = self.kv(x, rope, cache, pos)
        # a prompt is only ever processed at pos 0, so is_causal (top-left aligned) is right; one new token
        # attends to the whole cache
        assert T == 1 or pos == 0, "multi-token steps are only supported at position 0"
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_dropout if self.training else 0,
                                           is_causal=T > 1)  # (B, nh, T, hs), flash attention where available
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.swiglu = config.mlp == 'swiglu'
        hidden = 4 * config.n_embd
        # swiglu: c_fc holds the gate and the up projection side by side (two of the three matrices)
        self.c_fc = nn.Linear(config.n_embd, (2 if self.swiglu else 1) * hidden, bias=config.bias)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        x = self.c_fc(x)
        if self.swiglu:
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate) * up
        else:
            x = F.gelu(x)
        return self.dropout(self.c_proj(x))


class Block(nn.Module):
    """One residual layer; all three block types are the same line with different pieces switched in:
        x <- post_norm( alpha * x + eps * f( pre_norm(x) ) )
    preln:    pre_norm = Norm, post_norm = identity, alpha = 1            (x + f(Norm x); eps from loop_eps)
    postln:   pre_norm = identity, post_norm = Norm                       (DeepNorm: Norm(alpha x + f(x)))
    sandwich: pre_norm = Norm, post_norm = Norm                           (DeepLoop: Norm(alpha x + f(Norm x)))
    """

    def __init__(self, config):
        super().__init__()
        pre, post = config.block in ('preln', 'sandwich'), config.block in ('postln', 'sandwich')
        norm = lambda on: make_norm(config.norm, config.n_embd, config.bias) if on else nn.Identity()
        self.ln_1, self.ln_2 = norm(pre), norm(pre)     # pre-norms (GPT-2's names)
        self.pn_1, self.pn_2 = norm(post), norm(post)   # post-norms
        self.attn = CausalSelfAttention(config)
        self.mlp = MLP(config)
        self.alpha = config.alpha       # papers.md §2: alpha = (2N)^p on the skip path (1 unless depth_scaling)
        self.eps = config.branch_eps    # papers.md §3: eps = lambda/(R sqrt K) on the branch (1 unless loop_eps)

    def forward(self, x, rope=None, cache=None, pos=0):
        x = self.pn_1(self.alpha * x + self.eps * self.attn(self.ln_1(x), rope, cache, pos))
        x = self.pn_2(self.alpha * x + self.eps * self.mlp(self.ln_2(x)))
        return x

    def fill_cache(self, x, rope, cache, pos):
        # the K/V this visit would write for input x, without running the rest of the block
        self.attn.kv(self.ln_1(x), rope, cache, pos)


def ce_chunk_rows(V, device):
    # rows per chunk of the readout: (rows, V) fp32 logits take ~16 MiB on a CPU, ~1 GiB on a GPU (where few,
    # large matmuls are what keeps the head fast)
    return max(1, (2 ** 28 if device.type == 'cuda' else 2 ** 22) // V)


class LinearCrossEntropy(torch.autograd.Function):
    """sum_k w_k * CE(h_k @ W^T, targets) without keeping any (B, T, V) logits alive.

    Per-loop supervision reads out R states; naive autograd would save R logit tensors of size B*T*V for
    the backward pass (the largest tensors in the model at GPT-2's vocabulary). Here the forward pass walks
    over row chunks, computes each chunk's logits, its loss and at once its gradient (softmax - onehot), and
    keeps only dL/dh (B, T, C) and one shared dL/dW (V, C). The backward pass only scales them. Flops are the
    same as forward + backward of a plain head, and the memory of R exits is about that of one.
    """

    @staticmethod
    def forward(ctx, weight, targets, exit_weights, hs):
        # hs (E, B, T, C): the readout inputs of the E supervised exits; exit_weights: E floats
        V, C = weight.shape
        tgt = targets.reshape(-1)
        valid = tgt != -1
        tgt = tgt.clamp(min=0)
        n = valid.sum().clamp(min=1).float()
        rows = ce_chunk_rows(V, weight.device)
        loss = torch.zeros((), dtype=torch.float32, device=weight.device)
        grad_w = torch.zeros(V, C, dtype=torch.float32, device=weight.device)
        grad_hs = torch.empty_like(hs)
        for e, wk in enumerate(exit_weights):
            x, grad_x = hs[e].reshape(-1, C), grad_hs[e].view(-1, C)
            for i in range(0, x.size(0), rows):
                xc, tc, vc = x[i:i + rows], tgt[i:i + rows], valid[i:i + rows]
                logits = (xc @ weight.t()).float()                                  # (rows, V)
                logp = torch.log_softmax(logits, dim=-1)
                loss = loss - wk * (logp.gather(1, tc[:, None]).squeeze(1) * vc).sum()
                del logp
                # softmax through its own kernel: on CPUs exp() of shifted logits that underflow (common at
                # early exits, where h_1 is close to the token's own embedding) is ~10x slower
                g = torch.softmax(logits, dim=-1)                                   # (rows, V)
                del logits
                g[torch.arange(g.size(0), device=g.device), tc] -= 1.0              # dCE/dlogits = p - onehot
                g *= (vc * (wk / n))[:, None]
                g = g.to(xc.dtype)
                grad_x[i:i + rows] = g @ weight.to(xc.dtype)
                grad_w += g.t() @ xc
        ctx.save_for_backward(grad_w.to(weight.dtype), grad_hs)
        return loss / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_w, grad_hs = ctx.saved_tensors
        return grad_w * grad_out, None, None, grad_hs * grad_out


def cross_entropy_chunked(h, weight, targets):
    # CE(h @ W^T, targets) without grad, in the same row chunks: used for diagnostics at every exit
    V, C = weight.shape
    x, tgt = h.reshape(-1, C), targets.reshape(-1)
    rows = ce_chunk_rows(V, h.device)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for i in range(0, x.size(0), rows):
        total += F.cross_entropy((x[i:i + rows] @ weight.t()).float(), tgt[i:i + rows], ignore_index=-1,
                                 reduction='sum')
    return total / (tgt != -1).sum().clamp(min=1)


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        C = config.n_embd
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, C),
            wpe=nn.Embedding(config.block_size, C) if config.pos == 'learned' else nn.Identity(),
            drop=nn.Dropout(config.dropout),
            # DeepLoop puts an RMSNorm on the embedding so RMS(x) = 1 at loop entry in post-norm stacks
            ln_emb=make_norm(config.norm, C, config.bias) if config.block != 'preln' else nn.Identity(),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),  # the K shared layers
            ln_loop=nn.Identity() if config.inter_loop_norm == 'none' else make_norm(config.inter_loop_norm, C, config.bias),
            ln_out=nn.Identity() if config.readout == 'raw' else make_norm(
                'layernorm' if config.readout == 'layernorm' else 'rmsnorm', C, config.bias),
        ))
        self.lm_head = nn.Linear(C, config.vocab_size, bias=False)
        if config.tie_weights:
            self.transformer.wte.weight = self.lm_head.weight
        if config.pos == 'rope':
            hs = C // config.n_head
            inv_freq = 1.0 / (10000 ** (torch.arange(0, hs, 2).float() / hs))
            freqs = torch.outer(torch.arange(config.block_size).float(), inv_freq)  # (T, hs/2)
            self.register_buffer('rope_cos', freqs.cos(), persistent=False)
            self.register_buffer('rope_sin', freqs.sin(), persistent=False)
        self._init_weights()
        print("number of parameters: %.2fM (K=%d layers looped R=%d times, N=%d unrolled)"
              % (self.get_num_params() / 1e6, config.n_layer, config.n_loop, config.n_unrolled))

    @torch.no_grad()
    def _init_weights(self):
        cfg = self.config
        if cfg.init == 'reference':
            # paper 1's code keeps PyTorch's defaults (Linear: Kaiming-uniform; Embedding: N(0, 1)); the tied
            # matrix is the embedding's, so the initial state norm is about sqrt(C) (papers.md §1)
            nn.init.normal_(self.transformer.wte.weight, mean=0.0, std=1.0)
        else:
            # nanoGPT: N(0, 0.02) everywhere, residual projections scaled by 1/sqrt(2N) with N unrolled blocks
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    std = 0.02 / math.sqrt(2 * cfg.n_unrolled) if name.endswith('c_proj.weight') else 0.02
                    nn.init.normal_(p, mean=0.0, std=std)
                elif name.endswith('.bias'):
                    nn.init.zeros_(p)
        # papers.md §2: beta is an init-only gain on the value projection, the attention output projection
        # and every MLP matrix (not Q, K or the embeddings); DeepNorm's code scales their biases as well
        beta = cfg.beta
        if beta != 1.0:
            C = cfg.n_embd
            for block in self.transformer.h:
                block.attn.c_attn.weight[2 * C:] *= beta    # rows of W_v inside the fused q|k|v matrix
                if block.attn.c_attn.bias is not None:
                    block.attn.c_attn.bias[2 * C:] *= beta
                for lin in (block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj):
                    lin.weight *= beta
                    if lin.bias is not None:
                        lin.bias *= beta

    def get_num_params(self, non_embedding=True):
        # parameters() yields each shared tensor once: the K layers count once however many loops run,
        # and the tied head counts once with the embedding
        n_params = sum(p.numel() for p in self.parameters())
        if non_embedding and self.config.pos == 'learned':
            n_params -= self.transformer.wpe.weight.numel()
        return n_params

    # ---- the loop ----
    def embed(self, idx, pos=0):
        B, T = idx.size()
        assert pos + T <= self.config.block_size, \
            f"cannot forward a sequence of length {pos + T}, block size is only {self.config.block_size}"
        x = self.transformer.wte(idx)  # (B, T, C)
        if self.config.pos == 'learned':
            x = x + self.transformer.wpe(torch.arange(pos, pos + T, dtype=torch.long, device=idx.device))
        return self.transformer.ln_emb(self.transformer.drop(x))

    def rope(self, pos, T):
        return (self.rope_cos[pos:pos + T], self.rope_sin[pos:pos + T]) if self.config.pos == 'rope' else None

    def loop_states(self, idx, n_loop=None):
        """The R hidden states h_1..h_R, each after loop k's layers, before its readout and any loop norm."""
        R = self.config.n_loop if n_loop is None else n_loop
        assert isinstance(R, int) and R >= 1, f"n_loop must be an integer >= 1, got {R!r}"
        x = self.embed(idx)
        rope = self.rope(0, idx.size(1))
        states = []
        for k in range(1, R + 1):
            for block in self.transformer.h:    # the same K blocks every round: weights are shared across loops
                x = block(x, rope)
            states.append(x)                    # ||h_k|| is measured here (papers.md §1: before readout and loop norm)
            if k < R:
                x = self.transformer.ln_loop(x)  # identity unless inter_loop_norm is set (scale-removing recurrence)
        return states

    # ---- the readout ----
    def readout_norm(self, h, k):
        # papers.md §1: RMSNorm/LayerNorm readouts are scale-invariant, so d(loss)/dh is orthogonal to h and
        # nothing in the loss sees ||h||. 'raw' shows the scale; 'final_only' shows it at exits 1..R-1.
        if self.config.readout == 'raw' or (self.config.readout == 'final_only' and k < self.config.n_loop):
            return h
        return self.transformer.ln_out(h)

    def readout(self, h, k):
        """Logits of exit k (1-based) from the state h_k: (B, T, C) -> (B, T, V)."""
        return self.lm_head(self.readout_norm(h, k))

    # ---- the loss ----
    def exit_weights(self, R):
        # papers.md §1: per-loop = (1/R) sum_k CE_k (or the configured weights); terminal = CE_R only
        if self.config.supervision == 'terminal':
            return [0.0] * (R - 1) + [1.0]
        if self.config.exit_weights and R == self.config.n_loop:
            return list(self.config.exit_weights)
        return [1.0 / R] * R

    def forward(self, idx, targets=None, n_loop=None):
        states = self.loop_states(idx, n_loop)
        R = len(states)
        if targets is None:
            # inference: only the last position of the final exit is needed
            return self.readout(states[-1][:, [-1], :], R), None
        weights = self.exit_weights(R)
        exits = [k for k in range(1, R + 1) if weights[k - 1] > 0]
        hs = [self.readout_norm(states[k - 1], k) for k in exits]
        loss = LinearCrossEntropy.apply(self.lm_head.weight, targets, tuple(weights[k - 1] for k in exits),
                                        torch.stack(hs))
        if self.config.norm_penalty > 0:
            # papers.md §1: lambda * mean_k mean_{b,t,d} h_k^2 over the pre-norm states of all R loops,
            # also when only the last loop is supervised
            loss = loss + self.config.norm_penalty * torch.stack([h.float().pow(2).mean() for h in states]).mean()
        return None, loss

    @torch.no_grad()
    def exit_losses(self, idx, targets, n_loop=None):
        """Diagnostics: CE at every exit 1..R and the mean per-token L2 norm ||h_k|| of every loop state."""
        states = self.loop_states(idx, n_loop)
        ce = torch.stack([cross_entropy_chunked(self.readout_norm(h, k), self.lm_head.weight, targets)
                          for k, h in enumerate(states, start=1)])
        norms = torch.stack([h.float().norm(dim=-1).mean() for h in states])
        return ce, norms  # (R,), (R,)

    # ---- optimizer and accounting (as in nanoGPT) ----
    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]    # matrices and embeddings decay; gains and biases don't
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{'params': decay, 'weight_decay': weight_decay}, {'params': no_decay, 'weight_decay': 0.0}]
        print(f"num decayed parameter tensors: {len(decay)}, with {sum(p.numel() for p in decay):,} parameters")
        print(f"num non-decayed parameter tensors: {len(no_decay)}, with {sum(p.numel() for p in no_decay):,} parameters")
        fused = 'fused' in inspect.signature(torch.optim.AdamW).parameters and device_type == 'cuda'
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **(dict(fused=True) if fused else {}))

    def flops_per_token(self, T=None, n_loop=None):
        """Training flops per token (forward + backward = 6 per weight use, PaLM appendix B style)."""
        cfg = self.config
        T = cfg.block_size if T is None else T
        R = cfg.n_loop if n_loop is None else n_loop
        layer_params = sum(p.numel() for p in self.transformer.h.parameters())
        head = cfg.vocab_size * cfg.n_embd
        n_exits = sum(w > 0 for w in self.exit_weights(R))
        # every loop re-uses the K layers' weights, every supervised exit re-uses the head
        return 6 * (layer_params * R + head * n_exits) + 12 * cfg.n_layer * R * cfg.n_embd * T

    # bf16 dense peak FLOP/s by device name (datasheet numbers, no sparsity)
    PEAK_FLOPS = {'H200': 989e12, 'H100': 989e12, 'A100': 312e12, 'L40S': 362e12, 'L4': 121e12,
                  'A10': 125e12, 'RTX 4090': 165e12, 'RTX 3090': 71e12, 'V100': 125e12, 'T4': 65e12}

    @staticmethod
    def peak_flops(device_name):
        for name, flops in GPT.PEAK_FLOPS.items():
            if name.lower() in str(device_name).lower():
                return flops
        return None

    def estimate_mfu(self, fwdbwd_per_iter, dt, peak_flops=None, T=None):
        """Model flops utilisation of fwdbwd_per_iter sequences in dt seconds, against peak_flops (FLOP/s);
        by default the peak of the current CUDA device from PEAK_FLOPS (None if unknown)."""
        T = self.config.block_size if T is None else T
        if peak_flops is None and torch.cuda.is_available():
            peak_flops = self.peak_flops(torch.cuda.get_device_name())
        if peak_flops is None:
            return None
        return self.flops_per_token(T) * T * fwdbwd_per_iter / dt / peak_flops

    # ---- decoding with a KV cache ----
    def new_cache(self, B, R, device, dtype):
        # one (k, v) slot per (loop, layer) visit: loop k re-uses layer j's weights but sees other inputs,
        # so it has its own keys and values. Slot index = (k-1)*K + j.
        cfg = self.config
        shape = (B, cfg.n_head, cfg.block_size, cfg.n_embd // cfg.n_head)
        return [(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
                for _ in range(R * cfg.n_layer)]

    def step(self, idx, cache, pos, R, exit_threshold=None, exit_policy='maxprob'):
        """Run tokens idx (B, T) at positions pos.. through up to R loops, writing the cache.
        Returns the last position's logits (B, V) at each row's exit and the loops used (B,)."""
        B, T = idx.size()
        K = self.config.n_layer
        x = self.embed(idx, pos)
        rope = self.rope(pos, T)
        done = torch.zeros(B, dtype=torch.bool, device=idx.device)
        used = torch.full((B,), float(R), device=idx.device)
        logits = None
        for k in range(1, R + 1):
            if exit_threshold is not None and bool(done.all()):
                # every row has exited: the slots of the skipped loops are filled from the exit state, i.e.
                # each skipped visit writes the K/V of the (frozen) state the row left with
                for kk in range(k, R + 1):
                    for j, block in enumerate(self.transformer.h):
                        block.fill_cache(x, rope, cache[(kk - 1) * K + j], pos)
                break
            for j, block in enumerate(self.transformer.h):
                x_new = block(x, rope, cache[(k - 1) * K + j], pos)
                # exited rows keep their state; their K/V above came from that frozen state
                x = x_new if exit_threshold is None else torch.where(done[:, None, None], x, x_new)
            if exit_threshold is None and k < R:
                x = self.transformer.ln_loop(x)
                continue
            logits_k = self.readout(x[:, -1, :], k).float()   # (B, V)
            if exit_threshold is None:
                logits = logits_k
                break
            if exit_policy == 'maxprob':
                score = logits_k.softmax(dim=-1).max(dim=-1).values
            else:  # 'margin': top1 - top2 logit
                top2 = logits_k.topk(2, dim=-1).values
                score = top2[:, 0] - top2[:, 1]
            exits = ~done & ((score >= exit_threshold) | (k == R))
            logits = logits_k if logits is None else torch.where(exits[:, None], logits_k, logits)
            used = torch.where(exits, torch.full_like(used, k), used)
            if k < R:
                x = torch.where(done[:, None, None], x, self.transformer.ln_loop(x))
            done = done | exits
        return logits, used

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, n_loop=None, exit_threshold=None,
                 exit_policy='maxprob', use_cache=True):
        """Sample max_new_tokens after idx (B, T). Fixed exit: every token stops at loop n_loop (default R).
        Adaptive exit (exit_threshold): a token stops at the first loop whose confidence (exit_policy 'maxprob'
        or 'margin' = top1 - top2 logit) reaches the threshold. temperature 0 = greedy.
        The prompt always runs all n_loop loops, so the first new token (read off the prompt pass) uses all of
        them too. model.last_loops_used holds (B, new) loops per new token."""
        R = self.config.n_loop if n_loop is None else n_loop
        assert exit_policy in ('maxprob', 'margin'), f"exit_policy={exit_policy!r}: choose maxprob or margin"
        assert use_cache or exit_threshold is None, "adaptive exit needs the KV cache"
        bs = self.config.block_size
        cache, pos, used_all = None, 0, []
        for _ in range(max_new_tokens):
            if not use_cache:
                logits, _ = self(idx[:, -bs:], n_loop=R)
                logits, used = logits[:, -1, :].float(), torch.full((idx.size(0),), float(R), device=idx.device)
            elif cache is None or pos == bs:
                # (re)fill the cache from the context cropped to the block size, exactly what the uncached
                # forward sees; positions restart at 0 after a crop, so old keys are invalid
                idx_cond = idx[:, -bs:]
                cache = self.new_cache(idx.size(0), R, idx.device, self.lm_head.weight.dtype)
                logits, used = self.step(idx_cond, cache, 0, R)
                pos = idx_cond.size(1)
            else:
                logits, used = self.step(idx[:, -1:], cache, pos, R, exit_threshold, exit_policy)
                pos += 1
            if temperature == 0:
                idx_next = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                    logits[logits < v[:, [-1]]] = -float('Inf')
                idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
            used_all.append(used)
        self.last_loops_used = torch.stack(used_all, dim=1) if used_all else torch.zeros(idx.size(0), 0)
        return idx
