"""
A looped (weight-tied, depth-recurrent) GPT language model in one file.

A looped transformer keeps K distinct layers (`n_layer`) and applies that stack R times (`n_loop`), so the
unrolled depth is N = K*R while the parameter count stays that of K layers. Every round ("loop") ends in an
exit: the state h_k can be read out into logits, which gives per-loop supervision and early exits for free.

The two papers this file implements (formulas and numbers in docs/papers.md):
1) The readout blind spot (§1): per-loop cross-entropy through a scale-invariant readout (RMSNorm,
   LayerNorm) cannot see ||h||, so pre-norm recurrence lets the hidden-state scale grow unchecked. Knobs:
   `readout`, `supervision`, `norm_penalty`, `inter_loop_norm`.
2) DeepLoop (§2): post-norm blocks with alpha = (2N)^p on the skip path and an init-only gain
   beta = (8N)^-p; p = 1/4 is DeepNorm, p = 1/2 is DeepLoop. Knobs: `block`, `depth_scaling`.
And the recurrent-depth family around them (§4, all off by default): untied prelude and coda blocks, the
prelude output injected into every loop, a random loop count per training step with truncated backprop
(Huginn), and a learned exit gate (Ouro).

Where to look: the loop is GPT.loops, the readout GPT.readout_norm, the loss GPT.loss, the scaling rule
GPTConfig.alpha and GPTConfig.beta (used in Block and GPT._init_weights). Decoding (the KV cache and early
exits) lives in engine.py.
"""

import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from hardware import attention_path, peak_flops

# the named choices of every model key; GPTConfig.__post_init__ checks against these
MODEL_CHOICES = dict(
    pos=('learned', 'rope'),
    mlp=('swiglu', 'gelu'),
    norm=('rmsnorm', 'layernorm'),
    init=('reference', 'gpt2'),
    readout=('rmsnorm', 'layernorm', 'raw', 'final_only'),
    supervision=('per_loop', 'terminal'),
    inter_loop_norm=('none', 'rmsnorm', 'layernorm', 'readout'),
    block=('preln', 'postln', 'sandwich'),
    attn_impl=('auto', 'sdpa', 'math', 'explicit'),
    injection=('none', 'add', 'concat'),
    loop_sampling=('fixed', 'poisson_lognormal'),
    exit_gate=('none', 'learned'),
)
# the integer keys and their least value
INT_KEYS = dict(block_size=1, vocab_size=1, n_layer=1, n_loop=1, n_head=1, n_embd=1,
                n_prelude=0, n_coda=0, max_loop=0, backprop_loops=0)
LOOP_SIGMA = 0.5  # sigma of the log-normal in loop_sampling='poisson_lognormal' (Huginn's 1/2, §4)
# depth_scaling by name -> exponent p of alpha = (2N)^p, beta = (8N)^-p (docs/papers.md §2)
DEPTH_EXPONENTS = {'none': 0.0, 'deepnorm': 0.25, 'deeploop': 0.5}


def require(ok, msg):
    # a config value this file cannot build: one line, in the terms the user typed
    if not ok:
        raise ValueError(msg)


@dataclass
class GPTConfig:
    # every field is also a config key of train.py (`--n_loop=8`); the defaults are the embedded default run
    block_size: int = 64           # context length T
    vocab_size: int = 65           # V; train.py reads it from meta.json unless set (larger pads the head)
    n_layer: int = 2               # K: distinct layers in the shared stack
    n_loop: int = 4                # R: rounds through that stack; N = K*R unrolled blocks
    n_head: int = 4
    n_embd: int = 128              # C
    dropout: float = 0.0
    pos: str = 'learned'           # learned absolute position embedding | rope
    mlp: str = 'swiglu'            # swiglu (width 4C, three matrices) | gelu (nanoGPT's MLP)
    norm: str = 'rmsnorm'          # the norm inside blocks: rmsnorm | layernorm
    init: str = 'reference'        # reference: PyTorch defaults, wte ~ N(0,1) (paper 1) | gpt2: N(0, 0.02)
    readout: str = 'rmsnorm'       # between h_k and the LM head: rmsnorm | layernorm | raw | final_only (§1)
    supervision: str = 'per_loop'  # per_loop: mean of the R exit CEs | terminal: exit R only
    norm_penalty: float = 0.0      # lambda of lambda * mean_k mean(h_k^2) (§1; paper 1 uses 0.01); 0 = off
    inter_loop_norm: str = 'none'  # none | rmsnorm | layernorm: norm the state between loops (scale-removing)
                                   # | readout: the readout norm itself, fed back (Ouro, §4)
    block: str = 'preln'           # preln | postln (DeepNorm) | sandwich (DeepLoop): see Block (§2)
    depth_scaling: object = 'none'  # none | deepnorm (p=1/4) | deeploop (p=1/2) | a number p (§2)
    loop_eps: float = 0.0          # lambda of the pre-norm branch multiplier lambda/(R sqrt K) (§3); 0 = off
    attn_impl: str = 'auto'        # attention kernel: auto (see hardware.py) | sdpa | math | explicit; the
                                   # same result, only speed differs (a resumed run may change it)
    # the recurrent-depth family (docs/papers.md §4); the defaults switch every piece off
    n_prelude: int = 0             # untied blocks before the loop; their output e is what injection re-feeds
    n_coda: int = 0                # untied blocks after every exit, before the readout (shared by all exits)
    injection: str = 'none'        # how e re-enters loops 2..R: none | add (x + e) | concat (W [x; e])
    loop_sampling: str = 'fixed'   # training R per step: fixed (n_loop) | poisson_lognormal (mean n_loop + 1)
    max_loop: int = 0              # cap on the sampled R; 0 = 4 x n_loop
    backprop_loops: int = 0        # truncated backprop: gradients through the last k loops only; 0 = all
    exit_gate: str = 'none'        # none | learned: lambda_k = sigmoid(w . z_k + b), loss sum_k p(k) CE_k
    exit_entropy: float = 0.0      # learned gate: minus this times the entropy of p(k) in the loss

    def __post_init__(self):
        for key, allowed in MODEL_CHOICES.items():
            value = getattr(self, key)
            require(value in allowed, f"{key}={value!r}: choose one of {', '.join(allowed)}")
        for key, low in INT_KEYS.items():
            value = getattr(self, key)
            require(isinstance(value, int) and not isinstance(value, bool) and value >= low,
                    f"{key}={value!r}: must be an integer >= {low}")
        for key in ('dropout', 'norm_penalty', 'loop_eps', 'exit_entropy'):
            value = getattr(self, key)
            require(math.isfinite(value), f"{key}={value!r}: must be a finite number")
        require(self.n_embd % self.n_head == 0,
                f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        require(self.pos != 'rope' or (self.n_embd // self.n_head) % 2 == 0,
                f"pos='rope' needs an even head size, got n_embd/n_head = {self.n_embd // self.n_head}")
        require(0.0 <= self.dropout < 1.0, f"dropout={self.dropout!r}: must be in [0, 1)")
        require(self.norm_penalty >= 0, f"norm_penalty={self.norm_penalty!r}: must be >= 0")
        require(self.loop_eps >= 0, f"loop_eps={self.loop_eps!r}: must be >= 0 (0 = off)")
        require(self.loop_eps == 0 or self.block == 'preln',
                "loop_eps scales pre-norm branches: it needs block='preln'")
        self.check_family()
        self.depth_scaling = parse_depth_scaling(self.depth_scaling)
        require(self.depth_exponent == 0 or self.block != 'preln', f"depth_scaling={self.depth_scaling!r} "
                f"scales post-norm skips: use block='postln' or 'sandwich'")

    def check_family(self):
        # the keys of the recurrent-depth family that only make sense together
        require(not self.max_loop or self.max_loop >= self.n_loop, f"max_loop={self.max_loop} is below "
                f"n_loop={self.n_loop}: the cap on the sampled depth must be >= n_loop (or 0 = 4 x n_loop)")
        require(self.backprop_loops <= self.loop_cap, f"backprop_loops={self.backprop_loops} exceeds "
                f"max_loop={self.loop_cap}: no step runs that many loops")
        require(self.exit_gate != 'learned' or self.supervision != 'terminal', "exit_gate='learned' weights "
                "every exit's CE: it needs supervision='per_loop', not 'terminal'")
        require(self.exit_entropy == 0 or self.exit_gate == 'learned', f"exit_entropy={self.exit_entropy!r} "
                f"is the learned gate's entropy bonus: set exit_gate='learned' (or exit_entropy=0)")
        require(self.inter_loop_norm != 'readout' or self.readout in ('rmsnorm', 'layernorm'),
                f"inter_loop_norm='readout' feeds the readout norm back: it needs readout='rmsnorm' or "
                f"'layernorm', not {self.readout!r}")
        require(self.exit_entropy >= 0, f"exit_entropy={self.exit_entropy!r}: must be >= 0")

    @property
    def loop_cap(self):
        return self.max_loop or 4 * self.n_loop  # the most loops a training step may draw

    # ---- the depth-scaling rule, in one place (docs/papers.md §2) ----
    @property
    def depth_exponent(self):
        p = self.depth_scaling
        return DEPTH_EXPONENTS[p] if isinstance(p, str) else float(p)

    @property
    def n_unrolled(self):
        # N counts unrolled blocks K*R: every visit of a shared layer is one more block of depth (DeepLoop's
        # reading; DeepNorm in an untied model would use N = K). alpha and beta are fixed when the model is
        # built, so the training R counts, also when n_loop changes at inference. Prelude and coda add depth.
        return self.n_prelude + self.n_layer * self.n_loop + self.n_coda

    @property
    def alpha(self):
        return (2 * self.n_unrolled) ** self.depth_exponent     # §2: alpha = (2N)^p multiplies the skip path

    @property
    def beta(self):
        return (8 * self.n_unrolled) ** (-self.depth_exponent)  # §2: beta = (8N)^-p, an init-only gain

    @property
    def branch_eps(self):
        # docs/papers.md §3 (Wang et al.): h <- h + eps f(h), eps = lambda / (R sqrt K); 1 when off
        return self.loop_eps / (self.n_loop * math.sqrt(self.n_layer)) if self.loop_eps > 0 else 1.0


def parse_depth_scaling(p):
    # a name, or the exponent p itself (also as a string such as '0.3')
    bad = f"depth_scaling={p!r}: choose one of none, deepnorm, deeploop, or a number p >= 0"
    if isinstance(p, str) and p not in DEPTH_EXPONENTS:
        try:
            p = float(p)
        except ValueError:
            raise ValueError(bad) from None
    require(not isinstance(p, bool) and isinstance(p, (str, int, float)), bad)
    require(isinstance(p, str) or 0 <= p < 10, bad)
    return p


def make_norm(kind, n_embd):
    # RMSNorm with a learned gain and eps 1e-6 as in paper 1's code; LayerNorm without a bias (as the papers)
    return nn.RMSNorm(n_embd, eps=1e-6) if kind == 'rmsnorm' else nn.LayerNorm(n_embd, bias=False)


def apply_rope(x, cos, sin):
    # x (B, nh, T, hs); rotate the two halves of each head by position-dependent angles
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def attention(q, k, v, causal, impl='auto', dropout_p=0.0):
    """softmax(q k^T / sqrt(hs) + mask) v for q (B, nh, Tq, hs) and k, v (B, nh, Tk, hs). Three paths give the
    same result: 'sdpa' (F.scaled_dot_product_attention, flash where available), 'math' (its reference
    kernel) and 'explicit' (two matmuls and a masked softmax); 'auto' picks the fastest one here. causal is
    is_causal's top-left aligned mask (query i sees keys 0..i), right for a prompt at position 0."""
    impl = attention_path(impl, q.device.type, q.dtype, k.size(-2))
    if impl == 'sdpa':
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal)
    if impl == 'math':
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal)
    B, nh, Tq, hs = q.shape
    Tk = k.size(-2)
    # scores / sqrt(hs) + mask in one batched matmul; the mask adds -inf above the diagonal (none for T = 1)
    mask = torch.full((Tq, Tk), float('-inf') if causal else 0.0, dtype=q.dtype, device=q.device).triu(1)
    att = torch.baddbmm(mask, q.reshape(B * nh, Tq, hs), k.reshape(B * nh, Tk, hs).transpose(1, 2),
                        alpha=1.0 / math.sqrt(hs))                         # (B*nh, Tq, Tk)
    att = F.dropout(F.softmax(att, dim=-1), dropout_p) if dropout_p > 0 else F.softmax(att, dim=-1)
    return (att @ v.reshape(B * nh, Tk, hs)).view(B, nh, Tq, hs)


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)  # q, k, v in one matrix
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.attn_dropout = config.dropout
        self.attn_impl = config.attn_impl
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd

    def qkv(self, x, rope=None):
        # queries, keys and values of x (B, T, C) from one matmul, each (B, nh, T, hs)
        B, T, C = x.size()
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.c_attn(x).split(C, dim=2))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return q, k, v

    def forward(self, x, rope=None, kv=None, pos=0):
        B, T, C = x.size()
        q, k, v = self.qkv(x, rope)
        if kv is not None:
            # decoding (engine.py): this visit's keys and values join its cache slot, and the queries see
            # the whole history 0..pos+T-1. A prompt starts at pos 0, so is_causal's mask is right for it
            assert T == 1 or pos == 0, "multi-token steps are only supported at position 0"
            k, v = kv.update(k, v, pos)
        y = attention(q, k, v, T > 1, self.attn_impl, self.attn_dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, nh, T, hs) -> (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.swiglu = config.mlp == 'swiglu'
        hidden = 4 * config.n_embd
        # swiglu: c_fc holds the gate and the up projection side by side (two of the three matrices)
        self.c_fc = nn.Linear(config.n_embd, (2 if self.swiglu else 1) * hidden, bias=False)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=False)
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
    """One residual layer. The three block types are one formula with different pieces switched in:
        x <- post_norm( alpha * x + eps * f( pre_norm(x) ) )
    preln:    pre_norm = Norm, post_norm = identity, alpha = 1     (x + f(Norm x); eps from loop_eps, §3)
    postln:   pre_norm = identity, post_norm = Norm                (DeepNorm: Norm(alpha x + f(x)), §2)
    sandwich: pre_norm = Norm, post_norm = Norm                    (DeepLoop: Norm(alpha x + f(Norm x)), §2)
    """

    def __init__(self, config):
        super().__init__()
        pre, post = config.block in ('preln', 'sandwich'), config.block in ('postln', 'sandwich')
        norm = lambda on: make_norm(config.norm, config.n_embd) if on else nn.Identity()
        self.ln_1, self.ln_2 = norm(pre), norm(pre)     # pre-norms (GPT-2's names)
        self.pn_1, self.pn_2 = norm(post), norm(post)   # post-norms
        self.attn = CausalSelfAttention(config)
        self.mlp = MLP(config)
        self.alpha = config.alpha       # docs/papers.md §2: alpha = (2N)^p on the skip path
        self.eps = config.branch_eps    # docs/papers.md §3: eps = lambda/(R sqrt K) on the branch

    def forward(self, x, rope=None, kv=None, pos=0):
        x = self.pn_1(self.alpha * x + self.eps * self.attn(self.ln_1(x), rope, kv, pos))
        x = self.pn_2(self.alpha * x + self.eps * self.mlp(self.ln_2(x)))
        return x


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
    def forward(ctx, weight, targets, exit_weights, xs):
        # xs (E, B, T, C): the readout inputs of the E supervised exits (one stacked tensor, not a list: a
        # list argument breaks torch.compile's graph); exit_weights: E floats
        V, C = weight.shape
        tgt = targets.reshape(-1)
        valid = tgt != -1
        tgt = tgt.clamp(min=0)
        n = valid.sum().clamp(min=1).float()
        rows = ce_chunk_rows(V, weight.device)
        loss = torch.zeros((), dtype=torch.float32, device=weight.device)
        grad_w = torch.zeros(V, C, dtype=torch.float32, device=weight.device)
        grad_xs = torch.empty_like(xs)
        for e, wk in enumerate(exit_weights):
            x, grad_x = xs[e].reshape(-1, C), grad_xs[e].view(-1, C)
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
        ctx.save_for_backward(grad_w.to(weight.dtype), grad_xs)
        return loss / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_w, grad_xs = ctx.saved_tensors
        return grad_w * grad_out, None, None, grad_xs * grad_out


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


def token_ce(h, weight, targets):
    """Per-token CE (B*T,) of h @ W^T, with a gradient, in the same row chunks: each chunk's logits are
    recomputed in the backward pass (torch.utils.checkpoint), so no (B*T, V) tensor outlives its chunk. For
    losses that weight every token's CE differently (the learned exit gate)."""
    V, C = weight.shape
    x, tgt = h.reshape(-1, C), targets.reshape(-1)
    rows = ce_chunk_rows(V, h.device)
    ce = lambda xc, tc: F.cross_entropy((xc @ weight.t()).float(), tc, ignore_index=-1, reduction='none')
    return torch.cat([checkpoint(ce, x[i:i + rows], tgt[i:i + rows], use_reentrant=False)
                      for i in range(0, x.size(0), rows)])


def exit_distribution(lam):
    """docs/papers.md §4 (Ouro): p(k) = lambda_k prod_{j<k} (1 - lambda_j) for k < R, and the last exit
    takes the remainder prod_{j<R} (1 - lambda_j), so p sums to 1. lam (R, ...) -> p (R, ...)."""
    stay = torch.cumprod(1 - lam, dim=0)                   # prod_{j<=k} (1 - lambda_j)
    before = torch.cat([torch.ones_like(lam[:1]), stay[:-1]])  # prod_{j<k}
    return torch.cat([lam[:-1] * before[:-1], before[-1:]])



class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        C = config.n_embd
        # the readout norm; a raw readout has none
        ln_out = nn.Identity() if config.readout == 'raw' else make_norm(
            'layernorm' if config.readout == 'layernorm' else 'rmsnorm', C)
        # the inter-loop norm (scale-removing recurrence, docs/papers.md §1); identity unless configured;
        # 'readout' feeds the readout norm's output back into the next loop (Ouro, §4)
        if config.inter_loop_norm == 'readout':
            ln_loop = ln_out
        elif config.inter_loop_norm == 'none':
            ln_loop = nn.Identity()
        else:
            ln_loop = make_norm(config.inter_loop_norm, C)
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, C),
            wpe=nn.Embedding(config.block_size, C) if config.pos == 'learned' else nn.Identity(),
            drop=nn.Dropout(config.dropout),
            # DeepLoop puts an RMSNorm on the embedding so RMS(x) = 1 at loop entry in post-norm stacks
            ln_emb=make_norm(config.norm, C) if config.block != 'preln' else nn.Identity(),
            prelude=nn.ModuleList([Block(config) for _ in range(config.n_prelude)]),  # untied, run once (§4)
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),  # the K shared layers
            coda=nn.ModuleList([Block(config) for _ in range(config.n_coda)]),  # untied, after every exit
            ln_loop=ln_loop,
            ln_out=ln_out,
        ))
        if config.injection == 'concat':
            self.transformer.adapter = nn.Linear(2 * C, C, bias=False)  # W [x; e] (Huginn); [I 0] below
        if config.exit_gate == 'learned':
            self.exit_gate = nn.Linear(C, 1)  # lambda_k = sigmoid(w . z_k + b) (Ouro, §4)
        self.lm_head = nn.Linear(C, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied: both papers' models share this matrix
        if config.pos == 'rope':
            head_size = C // config.n_head
            inv_freq = 1.0 / (10000 ** (torch.arange(0, head_size, 2).float() / head_size))
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
            # matrix is the embedding's, so the initial state norm is about sqrt(C) (docs/papers.md §1)
            nn.init.normal_(self.transformer.wte.weight, mean=0.0, std=1.0)
        else:
            # nanoGPT: N(0, 0.02) everywhere, residual projections scaled by 1/sqrt(2N), N unrolled blocks.
            # Under depth scaling beta does that job instead (docs/papers.md §2; DeepNorm's reference: a
            # plain init, then beta), so c_proj is not scaled twice.
            resid = 1.0 if cfg.beta != 1.0 else 1.0 / math.sqrt(2 * cfg.n_unrolled)
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    std = 0.02 * resid if name.endswith('c_proj.weight') else 0.02
                    nn.init.normal_(p, mean=0.0, std=std)
        # docs/papers.md §2: beta is an init-only gain on the value projection, the attention output
        # projection and every MLP matrix (not Q, K or the embeddings)
        if cfg.beta != 1.0:
            C = cfg.n_embd
            for block in (*self.transformer.prelude, *self.transformer.h, *self.transformer.coda):
                block.attn.c_attn.weight[2 * C:] *= cfg.beta   # rows of W_v inside the fused q|k|v matrix
                for lin in (block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj):
                    lin.weight *= cfg.beta
        if cfg.injection == 'concat':
            # docs/papers.md §4: W = [I 0], so at initialisation W [x; e] = x passes the state through
            C = cfg.n_embd
            self.transformer.adapter.weight.copy_(torch.cat([torch.eye(C), torch.zeros(C, C)], dim=1))

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

    def untied(self, part, x, cache=None, pos=0):
        # the prelude or the coda (§4): untied blocks that run once, each with its own cache slot
        rope = self.rope(pos, x.size(1))
        for j, block in enumerate(self.transformer[part]):
            x = block(x, rope, None if cache is None else cache.slot(part, j), pos)
        return x

    def carry(self, h, e):
        # what enters the next loop: the inter-loop norm (§1), then the prelude output e re-injected (§4)
        x = self.transformer.ln_loop(h)
        if self.config.injection == 'add':
            return x + e
        if self.config.injection == 'concat':
            return self.transformer.adapter(torch.cat([x, e], dim=-1))  # W [x; e], (B, T, 2C) -> (B, T, C)
        return x

    def loops(self, x, n_loop, cache=None, pos=0):
        """The recurrence. x (B, T, C): what enters loop 1 (the embedded tokens after the prelude), also the
        e that injection re-feeds. Yields (k, h_k) for k = 1..n_loop, h_k being the state after loop k's
        blocks, before its readout and any loop norm: where ||h_k|| is measured (docs/papers.md §1).
        A caller that acts between loops (a clamp, dropping rows that exited) sends back (h_k, e) changed."""
        rope = self.rope(pos, x.size(1))
        e, b, grad = x, self.config.backprop_loops, torch.is_grad_enabled()
        for k in range(1, n_loop + 1):
            # truncated backprop (§4): only the last b loops build a graph (b = 0: all of them)
            with torch.set_grad_enabled(grad and (b == 0 or k > n_loop - b)):
                if k > 1:
                    x = self.carry(x, e)
                for j, block in enumerate(self.transformer.h):  # the same K blocks every round: shared
                    x = block(x, rope, None if cache is None else cache.slot('loop', j, k), pos)
            sent = yield k, x
            if sent is not None:
                x, e = sent

    def states(self, idx, n_loop=None):
        """[h_1, ..., h_R]: every loop state of tokens idx (B, T); n_loop overrides the trained R."""
        R = self.config.n_loop if n_loop is None else n_loop
        assert isinstance(R, int) and R >= 1, f"n_loop must be an integer >= 1, got {R!r}"
        return [h for _, h in self.loops(self.untied('prelude', self.embed(idx)), R)]

    def draw_n_loop(self, generator):
        """The loop count of one training step. loop_sampling='poisson_lognormal' (Huginn, docs/papers.md
        §4): tau ~ Normal(log n_loop - sigma^2/2, sigma), R = Poisson(e^tau) + 1, capped at max_loop. The
        draws come from `generator` alone: seeded alike on every rank, every rank draws the same R."""
        cfg = self.config
        if cfg.loop_sampling == 'fixed':
            return cfg.n_loop
        tau = torch.normal(math.log(cfg.n_loop) - LOOP_SIGMA ** 2 / 2, LOOP_SIGMA, (1,), generator=generator)
        return min(int(torch.poisson(tau.exp(), generator=generator).item()) + 1, cfg.loop_cap)

    # ---- the readout ----
    def readout_norm(self, h, k):
        # docs/papers.md §1: RMSNorm/LayerNorm readouts are scale-invariant, so d(loss)/dh is orthogonal to h
        # and nothing in the loss sees ||h||. 'raw' shows the scale; 'final_only' shows it at exits 1..R-1.
        if self.config.readout == 'raw' or (self.config.readout == 'final_only' and k < self.config.n_loop):
            return h
        return self.transformer.ln_out(h)

    def head_input(self, h, k, cache=None, pos=0):
        # z_k, what the LM head (and the exit gate) read at exit k: the coda (§4), then the readout norm
        return self.readout_norm(self.untied('coda', h, cache, pos), k)

    def readout(self, h, k):
        """Logits of exit k (1-based) from the state h_k: (..., C) -> (..., V)."""
        return self.lm_head(self.head_input(h, k))

    def gate(self, z):
        # docs/papers.md §4 (Ouro): lambda_k = sigmoid(w . z_k + b), the probability to stop at exit k if
        # no earlier exit stopped; z (..., C) -> (...)
        return torch.sigmoid(self.exit_gate(z).float()).squeeze(-1)

    # ---- the loss ----
    def exit_weights(self, R):
        # docs/papers.md §1: per-loop = (1/R) sum_k CE_k; terminal = CE_R only
        return [1.0 / R] * R if self.config.supervision == 'per_loop' else [0.0] * (R - 1) + [1.0]

    def norm_penalty(self, states):
        # docs/papers.md §1: lambda * mean_k mean_{b,t,d} h_k^2 over the pre-norm states of all R loops, also
        # when only the last loop is supervised
        return self.config.norm_penalty * torch.stack([h.float().pow(2).mean() for h in states]).mean()

    def gate_loss(self, zs, targets):
        # docs/papers.md §4 (Ouro): per token, sum_k p(k) CE_k - exit_entropy * H(p), with the exit
        # distribution p(k) of the learned gate over the exits' inputs zs [z_1..z_R] (B, T, C)
        ce = torch.stack([token_ce(z, self.lm_head.weight, targets) for z in zs])   # (R, B*T)
        p = exit_distribution(torch.stack([self.gate(z).flatten() for z in zs]))  # (R, B*T)
        H = -(p * p.clamp(min=1e-12).log()).sum(0)
        valid = (targets.reshape(-1) != -1).float()
        per_token = (p * ce).sum(0) - self.config.exit_entropy * H
        return (per_token * valid).sum() / valid.sum().clamp(min=1)

    def loss(self, states, targets):
        # the weighted exit CEs (or the learned gate's expected CE) of the loop states, plus the norm penalty
        weights = self.exit_weights(len(states))
        exits = [k for k, w in enumerate(weights, start=1) if w > 0]
        zs = [self.head_input(states[k - 1], k) for k in exits]
        if self.config.exit_gate == 'learned':
            loss = self.gate_loss(zs, targets)
        else:
            exit_w = tuple(weights[k - 1] for k in exits)
            loss = LinearCrossEntropy.apply(self.lm_head.weight, targets, exit_w, torch.stack(zs))
        if self.config.norm_penalty > 0:
            loss = loss + self.norm_penalty(states)
        return loss

    def forward(self, idx, targets=None, n_loop=None):
        states = self.states(idx, n_loop)
        if targets is None:
            # inference: only the last position of the final exit is needed (the coda sees every position)
            return self.lm_head(self.head_input(states[-1], len(states))[:, [-1], :]), None
        return None, self.loss(states, targets)

    @torch.no_grad()
    def exit_losses(self, idx, targets, n_loop=None):
        """Diagnostics: CE at every exit 1..R and the mean per-token L2 norm ||h_k|| of every loop state."""
        states = self.states(idx, n_loop)
        ce = torch.stack([cross_entropy_chunked(self.head_input(h, k), self.lm_head.weight, targets)
                          for k, h in enumerate(states, start=1)])
        norms = torch.stack([h.float().norm(dim=-1).mean() for h in states])
        return ce, norms  # (R,), (R,)

    # ---- optimizer and accounting (as in nanoGPT) ----
    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]    # matrices and embeddings decay; gains don't
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{'params': decay, 'weight_decay': weight_decay}, {'params': no_decay, 'weight_decay': 0.0}]
        print(f"num decayed parameter tensors: {len(decay)}, "
              f"with {sum(p.numel() for p in decay):,} parameters")
        print(f"num non-decayed parameter tensors: {len(no_decay)}, "
              f"with {sum(p.numel() for p in no_decay):,} parameters")
        # the fused kernel (one pass over every tensor) on GPUs and CPUs alike (PyTorch 2.4+ on CPUs)
        fused = 'fused' in inspect.signature(torch.optim.AdamW).parameters and device_type in ('cuda', 'cpu')
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **(dict(fused=True) if fused else {}))

    def flops_per_token(self, T=None, n_loop=None):
        """Training flops per token (forward + backward = 6 per weight use, PaLM appendix B style)."""
        cfg = self.config
        T = cfg.block_size if T is None else T
        R = cfg.n_loop if n_loop is None else n_loop
        n_params = lambda blocks: sum(p.numel() for p in blocks.parameters())
        n_exits = sum(w > 0 for w in self.exit_weights(R))
        # every loop re-uses the K layers' weights, every supervised exit re-uses the coda and the head; the
        # prelude runs once, the injection adapter before every loop after the first
        adapter = 2 * cfg.n_embd ** 2 * (R - 1) if cfg.injection == 'concat' else 0
        weight_flops = 6 * (n_params(self.transformer.h) * R + n_params(self.transformer.prelude) + adapter
                            + (n_params(self.transformer.coda) + cfg.vocab_size * cfg.n_embd) * n_exits)
        visits = cfg.n_layer * R + cfg.n_prelude + cfg.n_coda * n_exits
        attention_flops = 12 * visits * cfg.n_embd * T  # QK^T and AV of every visit
        return weight_flops + attention_flops

    def estimate_mfu(self, fwdbwd_per_iter, dt, peak=None, T=None):
        """Model flops utilisation of fwdbwd_per_iter sequences in dt seconds, against peak (FLOP/s); by
        default the bf16 peak of the current CUDA device (hardware.peak_flops; None if unknown)."""
        T = self.config.block_size if T is None else T
        if peak is None and torch.cuda.is_available():
            peak = peak_flops(torch.cuda.get_device_name())
        if peak is None:
            return None
        return self.flops_per_token(T) * T * fwdbwd_per_iter / dt / peak
