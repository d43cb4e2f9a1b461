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
And the recurrent-depth family around them (§4, all off by default): untied prelude/coda blocks, the
prelude output injected into every loop, a random loop count per training step with truncated backprop
(Huginn), and a learned exit gate (Ouro). Knobs: `n_prelude`, `n_coda`, `injection`, `loop_sampling`,
`max_loop`, `backprop_loops`, `exit_gate`, `exit_entropy`.

Where to look: the loop is GPT.loops (written once: training, decoding, early exit and every diagnostic go
through it), the readout GPT.readout, the loss GPT.loss / LinearCrossEntropy, the scaling rule
GPTConfig.alpha / GPTConfig.beta, applied in Block and GPT._init_weights; the exits' scores exit_score /
GPT.exit_scorer.
"""

import math
import inspect
from contextlib import nullcontext
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
LOOP_SIGMA = 0.5  # sigma of the log-normal in loop_sampling='poisson_lognormal' (Huginn's 1/2, §4)
# depth_scaling by name -> exponent p of alpha = (2N)^p, beta = (8N)^-p (docs/papers.md §2)
DEPTH_EXPONENTS = {'none': 0.0, 'deepnorm': 0.25, 'deeploop': 0.5}


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
    attn_impl: str = 'auto'        # attention kernel: auto (measured pick, see attention_path) | sdpa | math
                                   # | explicit; the same result, only speed differs (resume may change it)
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
            if getattr(self, key) not in allowed:
                raise ValueError(f"{key}={getattr(self, key)!r}: choose one of {', '.join(allowed)}")
        for key in ('block_size', 'vocab_size', 'n_layer', 'n_loop', 'n_head', 'n_embd'):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{key}={value!r}: must be an integer >= 1")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.pos == 'rope' and (self.n_embd // self.n_head) % 2 != 0:
            raise ValueError(f"pos='rope' needs an even head size, got n_embd/n_head = "
                             f"{self.n_embd // self.n_head}")
        for key in ('n_prelude', 'n_coda', 'max_loop', 'backprop_loops'):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{key}={value!r}: must be an integer >= 0")
        for key in ('dropout', 'norm_penalty', 'loop_eps', 'exit_entropy'):
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
        self.check_family()
        self.depth_scaling = self.parse_depth_scaling(self.depth_scaling)
        if self.depth_exponent > 0 and self.block == 'preln':
            raise ValueError(f"depth_scaling={self.depth_scaling!r} scales post-norm skips: "
                             f"use block='postln' or 'sandwich'")

    def check_family(self):
        # the keys of the recurrent-depth family that only make sense together
        if self.max_loop and self.max_loop < self.n_loop:
            raise ValueError(f"max_loop={self.max_loop} is below n_loop={self.n_loop}: the cap on the "
                             f"sampled depth must be >= n_loop (or 0 = 4 x n_loop)")
        if self.backprop_loops > self.loop_cap:
            raise ValueError(f"backprop_loops={self.backprop_loops} exceeds max_loop={self.loop_cap}: no "
                             f"step runs that many loops")
        if self.exit_gate == 'learned' and self.supervision == 'terminal':
            raise ValueError("exit_gate='learned' weights every exit's CE: it needs supervision='per_loop', "
                             "not 'terminal'")
        if self.exit_entropy != 0 and self.exit_gate != 'learned':
            raise ValueError(f"exit_entropy={self.exit_entropy!r} is the learned gate's entropy bonus: set "
                             f"exit_gate='learned' (or exit_entropy=0)")
        if self.inter_loop_norm == 'readout' and self.readout not in ('rmsnorm', 'layernorm'):
            raise ValueError(f"inter_loop_norm='readout' feeds the readout norm back: it needs "
                             f"readout='rmsnorm' or 'layernorm', not {self.readout!r}")
        if self.exit_entropy < 0:
            raise ValueError(f"exit_entropy={self.exit_entropy!r}: must be >= 0")

    @property
    def loop_cap(self):
        return self.max_loop or 4 * self.n_loop  # the most loops a training step may draw

    @staticmethod
    def parse_depth_scaling(p):
        # a name, or the exponent p itself (also as a string such as '0.3')
        bad = ValueError(f"depth_scaling={p!r}: choose one of none, deepnorm, deeploop, or a number p >= 0")
        if isinstance(p, str) and p not in DEPTH_EXPONENTS:
            try:
                p = float(p)
            except ValueError:
                raise bad from None
        if isinstance(p, bool) or not isinstance(p, (str, int, float)):
            raise bad
        if not isinstance(p, str) and not 0 <= p < 10:
            raise bad
        return p

    # ---- the depth-scaling rule, in one place (docs/papers.md §2) ----
    @property
    def depth_exponent(self):
        p = self.depth_scaling
        return DEPTH_EXPONENTS[p] if isinstance(p, str) else float(p)

    @property
    def n_unrolled(self):
        # N counts unrolled blocks K*R (every visit of a shared layer is one more block of depth), the reading
        # DeepLoop argues for; DeepNorm in an untied model would use N = K. The training R is used, also when
        # n_loop is changed at inference time: alpha and beta are fixed when the model is built. Prelude and
        # coda blocks add their depth.
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


def make_norm(kind, n_embd):
    # RMSNorm with a learned gain and eps 1e-6 as in paper 1's code; LayerNorm without a bias (as the papers)
    return nn.RMSNorm(n_embd, eps=1e-6) if kind == 'rmsnorm' else nn.LayerNorm(n_embd, bias=False)


def apply_rope(x, cos, sin):
    # x (B, nh, T, hs); rotate the two halves of each head by position-dependent angles
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def attention(q, k, v, causal, impl='auto', dropout_p=0.0):
    """softmax(q k^T / sqrt(hs) + mask) v for q (B, nh, Tq, hs) and k, v (B, nh, Tk, hs), by one of three
    paths with the same result: 'sdpa' (F.scaled_dot_product_attention, flash where available), 'math' (its
    reference kernel) or 'explicit' (two matmuls and a masked softmax). causal: the top-left aligned mask
    of is_causal (query i sees keys 0..i), used for a prompt at position 0."""
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

    def heads(self, t, B, T):
        return t.view(B, T, self.n_head, self.n_embd // self.n_head).transpose(1, 2)  # (B, nh, T, hs)

    def qkv(self, x, rope, cache, pos):
        """Queries, keys and values of x (B, T, C), each (B, nh, T, hs), from one matmul. With a cache, the
        keys and values are written into this visit's slot and the whole history (positions 0..pos+T-1)
        is returned."""
        B, T, C = x.size()
        q, k, v = (self.heads(t, B, T) for t in self.c_attn(x).split(C, dim=2))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:
            cache[0][:, :, pos:pos + T] = k
            cache[1][:, :, pos:pos + T] = v
            k, v = cache[0][:, :, :pos + T], cache[1][:, :, :pos + T]
        return q, k, v

    def forward(self, x, rope=None, cache=None, pos=0):
        B, T, C = x.size()
        q, k, v = self.qkv(x, rope, cache, pos)
        # a prompt is only ever processed at pos 0, so is_causal (top-left aligned) is right; one new token
        # attends to the whole cache
        assert T == 1 or pos == 0, "multi-token steps are only supported at position 0"
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


def times(c, t):
    # c * t; t itself where c = 1 (alpha and eps of a plain pre-norm block): exact, and one pass over t fewer
    # forward and backward
    return t if c == 1.0 else c * t


class Block(nn.Module):
    """One residual layer; all three block types are the same line with different pieces switched in:
        x <- post_norm( alpha * x + eps * f( pre_norm(x) ) )
    preln:    pre_norm = Norm, post_norm = identity, alpha = 1     (x + f(Norm x); eps from loop_eps)
    postln:   pre_norm = identity, post_norm = Norm                (DeepNorm: Norm(alpha x + f(x)))
    sandwich: pre_norm = Norm, post_norm = Norm                    (DeepLoop: Norm(alpha x + f(Norm x)))
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

    def forward(self, x, rope=None, cache=None, pos=0):
        x = self.pn_1(times(self.alpha, x) + times(self.eps, self.attn(self.ln_1(x), rope, cache, pos)))
        x = self.pn_2(times(self.alpha, x) + times(self.eps, self.mlp(self.ln_2(x))))
        return x

    def fill_cache(self, x, rope, cache, pos):
        # the K/V this visit would write for input x, without running the rest of the block
        self.attn.qkv(self.ln_1(x), rope, cache, pos)


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


# exit policies: the three confidences of one exit's logits, the KL between successive exits (Huginn) and the
# learned gate's cumulative exit probability (Ouro); GPT.exit_scorer scores them all
EXIT_POLICIES = ('maxprob', 'margin', 'entropy', 'kl', 'gate')
# the range of each policy's exit_threshold; kl's threshold is a KL bound (exit when KL <= it), the others
# a score to reach
THRESHOLD_RANGES = dict(maxprob=(0.0, 1.0), margin=(0.0, math.inf), entropy=(0.0, 1.0), kl=(0.0, math.inf),
                        gate=(0.0, 1.0))


def score_threshold(policy, threshold):
    """The score an exit must reach under `policy` for a user's exit_threshold, checked against its range:
    -threshold for 'kl' (scores are -KL), the threshold itself for the others."""
    low, high = THRESHOLD_RANGES[policy]
    if not low <= threshold <= high:
        raise ValueError(f"exit_threshold={threshold!r} is outside [{low:g}, {high:g}], the range of "
                         f"exit_policy={policy!r}")
    return -threshold if policy == 'kl' else threshold


def exit_score(logits, policy):
    """How sure an exit is of its next token, from its logits (..., V); higher = more sure. Adaptive exit
    stops at the first loop whose score reaches a threshold (docs/papers.md §1, variable-depth benchmark)."""
    logits = logits.float()
    if policy == 'maxprob':                               # the top token's probability, in (0, 1]
        return logits.softmax(-1).amax(-1)
    if policy == 'margin':                                # top1 - top2 logit, >= 0
        top2 = logits.topk(2, dim=-1).values
        return top2[..., 0] - top2[..., 1]
    if policy == 'entropy':                               # 1 - H / log V, in [0, 1]
        logp = logits.log_softmax(-1)
        H = -(logp.exp() * logp).sum(-1)
        return 1.0 - H / math.log(logits.size(-1))
    raise ValueError(f"exit policy {policy!r}: choose one of maxprob, margin, entropy (kl and gate need "
                     f"GPT.exit_scorer)")


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

    def untied(self, blocks, x, cache, pos):
        # the prelude or the coda: untied blocks run once, each with its own cache slot when decoding
        rope = self.rope(pos, x.size(1))
        for j, block in enumerate(blocks):
            x = block(x, rope, None if cache is None else cache[j], pos)
        return x

    def inject(self, x, e):
        # docs/papers.md §4: the prelude output e re-enters every loop after the first
        if self.config.injection == 'add':
            return x + e
        if self.config.injection == 'concat':
            return self.transformer.adapter(torch.cat([x, e], dim=-1))  # W [x; e], (B, T, 2C) -> (B, T, C)
        return x

    def loops(self, x, n_loop, pos=0, cache=None, between=None, halted=None):
        """The recurrence, written once: the prelude, then the K shared blocks applied n_loop times to the
        embedded tokens x (B, T) at positions pos... Yields (k, h_k) for k = 1..n_loop: h_k is the state after
        loop k's blocks, before its readout and any loop norm (where ||h_k|| is measured, docs/papers.md §1).

        carry(h, rows=None)    what enters loop k+1 after state h: the inter-loop norm, then the injection of
                               the prelude output e (rows: the rows still in the batch if a caller drops any)
        between(k, h_k, carry) -> x   what enters loop k+1; default carry(h_k); diagnostics pass their own
                               (a radial clamp, dropping rows that have exited)
        cache                  decoding: new_cache's slots, one (K, V) per (loop, layer) visit, written at pos
        halted                 decoding with early exit: a (B,) bool mask that the caller sets between
                               loops. A halted row keeps the state it would have entered the next loop
                               with, and every visit it skips writes the K/V of that state.
        With backprop_loops = b > 0 (and grad enabled), loops 1..n_loop-b run without a graph (§4).
        """
        rope = self.rope(pos, x.size(1))
        K = self.config.n_layer
        x = e = self.untied(self.transformer.prelude, x, None if cache is None else cache['prelude'], pos)
        b = self.config.backprop_loops
        first_grad = n_loop - b + 1 if b and torch.is_grad_enabled() else 1  # the first loop with a graph
        grad = lambda k: nullcontext() if first_grad <= 1 else torch.set_grad_enabled(k >= first_grad)

        def carry(h, rows=None):
            nonlocal e
            e = e if rows is None else e[rows]
            return self.inject(self.transformer.ln_loop(h), e)

        for k in range(1, n_loop + 1):
            with grad(k):
                for j, block in enumerate(self.transformer.h):  # the same K blocks every round: shared
                    slot = None if cache is None else cache['loop'][(k - 1) * K + j]
                    if halted is None:
                        x = block(x, rope, slot, pos)
                    elif bool(halted.all()):
                        block.fill_cache(x, rope, slot, pos)    # every row has exited: only K/V left to write
                    else:
                        x = torch.where(halted[:, None, None], x, block(x, rope, slot, pos))
            was_halted = None if halted is None else halted.clone()
            yield k, x                                       # the caller reads out h_k, or halts rows
            if k < n_loop:
                with grad(k + 1):                            # the carry belongs to the loop it enters
                    x_next = carry(x) if between is None else between(k, x, carry)
                x = x_next if halted is None else torch.where(was_halted[:, None, None], x, x_next)

    def states(self, idx, n_loop=None):
        """[h_1, ..., h_R]: every loop state of tokens idx (B, T); n_loop overrides the trained R."""
        R = self.config.n_loop if n_loop is None else n_loop
        assert isinstance(R, int) and R >= 1, f"n_loop must be an integer >= 1, got {R!r}"
        return [h for _, h in self.loops(self.embed(idx), R)]

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
        """z_k, what the LM head (and the exit gate) read at exit k: the coda blocks (§4; none by default),
        then the readout norm. h (B, T, C); decoding passes the coda's cache slots."""
        if self.config.n_coda:
            h = self.untied(self.transformer.coda, h, cache, pos)
        return self.readout_norm(h, k)

    def readout(self, h, k):
        """Logits of exit k (1-based) from the state h_k: (..., C) -> (..., V)."""
        return self.lm_head(self.head_input(h, k))

    def gate(self, z):
        # docs/papers.md §4 (Ouro): lambda_k = sigmoid(w . z_k + b), the probability to stop at exit k if
        # no earlier exit stopped; z (..., C) -> (...)
        return torch.sigmoid(self.exit_gate(z).float()).squeeze(-1)

    def exit_scorer(self, policy):
        """score(z_k, logits_k) -> (...): called for exits k = 1, 2, ... in order, how ready each position
        is to stop at exit k (higher = readier). The three confidence policies see only the logits; 'kl'
        scores -KL(p_{k-1} || p_k) between successive exits (Huginn; -inf at exit 1); 'gate' the learned
        gate's cumulative exit probability 1 - prod_{j<=k} (1 - lambda_j) (Ouro)."""
        assert policy in EXIT_POLICIES, f"exit policy {policy!r}: choose one of {', '.join(EXIT_POLICIES)}"
        assert policy != 'gate' or self.config.exit_gate == 'learned', "policy 'gate' needs a learned gate"
        prev, stay = None, None  # the previous exit's log-probs; the probability of not having exited yet

        def score(z, logits):
            nonlocal prev, stay
            if policy == 'gate':
                lam = self.gate(z)
                stay = 1 - lam if stay is None else stay * (1 - lam)
                return 1 - stay
            if policy == 'kl':
                logp = logits.float().log_softmax(-1)
                out = torch.full(logp.shape[:-1], -math.inf, device=logp.device) if prev is None else \
                    -(prev.exp() * (prev - logp)).sum(-1)
                prev = logp
                return out
            return exit_score(logits, policy)
        return score

    # ---- the loss ----
    def exit_weights(self, R):
        # docs/papers.md §1: per-loop = (1/R) sum_k CE_k; terminal = CE_R only
        return [1.0 / R] * R if self.config.supervision == 'per_loop' else [0.0] * (R - 1) + [1.0]

    def norm_penalty(self, states):
        # docs/papers.md §1: lambda * mean_k mean_{b,t,d} h_k^2 over the pre-norm states of all R loops, also
        # when only the last loop is supervised
        return self.config.norm_penalty * torch.stack([h.float().pow(2).mean() for h in states]).mean()

    def gate_loss(self, zs, targets):
        """docs/papers.md §4 (Ouro): per token, sum_k p(k) CE_k - exit_entropy * H(p), with the exit
        distribution p(k) of the learned gate over the exits' inputs zs [z_1..z_R] (B, T, C)."""
        ce = torch.stack([token_ce(z, self.lm_head.weight, targets) for z in zs])   # (R, B*T)
        p = exit_distribution(torch.stack([self.gate(z).flatten() for z in zs]))  # (R, B*T)
        H = -(p * p.clamp(min=1e-12).log()).sum(0)
        valid = (targets.reshape(-1) != -1).float()
        per_token = (p * ce).sum(0) - self.config.exit_entropy * H
        return (per_token * valid).sum() / valid.sum().clamp(min=1)

    def loss(self, states, targets):
        """The training loss of the loop states [h_1..h_R]: the weighted exit CEs (or the learned gate's
        expected CE) plus the norm penalty."""
        weights = self.exit_weights(len(states))
        exits = [k for k, w in enumerate(weights, start=1) if w > 0]
        zs = [self.head_input(states[k - 1], k) for k in exits]
        if self.config.exit_gate == 'learned':
            loss = self.gate_loss(zs, targets)
        else:
            exit_w = tuple(weights[k - 1] for k in exits)
            xs = torch.stack(zs)  # (E, B, T, C)
            loss = LinearCrossEntropy.apply(self.lm_head.weight, targets, exit_w, xs)
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
        default the bf16 peak of the current CUDA device from PEAK_FLOPS (None if unknown)."""
        T = self.config.block_size if T is None else T
        if peak is None and torch.cuda.is_available():
            peak = peak_flops(torch.cuda.get_device_name())
        if peak is None:
            return None
        return self.flops_per_token(T) * T * fwdbwd_per_iter / dt / peak

    # ---- decoding with a KV cache ----
    def new_cache(self, B, R, device, dtype):
        # one (k, v) slot per (loop, layer) visit: loop k re-uses layer j's weights but sees other inputs,
        # so it has its own keys and values. 'loop' slot index = (k-1)*K + j; the prelude and the coda (run
        # once per token) have one slot per block.
        cfg = self.config
        shape = (B, cfg.n_head, cfg.block_size, cfg.n_embd // cfg.n_head)
        slots = lambda n: [(torch.zeros(shape, device=device, dtype=dtype),
                            torch.zeros(shape, device=device, dtype=dtype)) for _ in range(n)]
        return dict(prelude=slots(cfg.n_prelude), loop=slots(R * cfg.n_layer), coda=slots(cfg.n_coda))

    def decode_step(self, idx, cache, pos, n_loop, exit_threshold=None, exit_policy='maxprob'):
        """Run tokens idx (B, T) at positions pos.. through up to n_loop loops, writing the cache.
        Returns the last position's logits (B, V) at each row's exit and the loops each row used (B,).
        Without exit_threshold every row runs all n_loop loops; with it (a score, see score_threshold) a row
        stops at the first loop whose exit_scorer score reaches it (the last loop always exits). The coda's
        slots end up holding the K/V of the state each row exited with."""
        B = idx.size(0)
        halted = torch.zeros(B, dtype=torch.bool, device=idx.device)
        used = torch.full((B,), float(n_loop), device=idx.device)
        logits = torch.zeros(B, self.config.vocab_size, device=idx.device)
        adaptive = exit_threshold is not None
        score, h_exit = self.exit_scorer(exit_policy) if adaptive else None, None
        for k, h in self.loops(self.embed(idx, pos), n_loop, pos, cache, halted=halted if adaptive else None):
            if (k < n_loop and not adaptive) or bool(halted.all()):
                continue
            z = self.head_input(h, k, cache['coda'], pos)[:, -1]  # (B, C)
            logits_k = self.lm_head(z).float()                    # (B, V)
            sure = True if k == n_loop else score(z, logits_k) >= exit_threshold  # (B,)
            exits = ~halted & sure
            logits = torch.where(exits[:, None], logits_k, logits)
            used = torch.where(exits, float(k), used)
            h_exit = h if h_exit is None else torch.where(exits[:, None, None], h, h_exit)
            halted |= exits                                  # the loop keeps these rows' state from here on
        if adaptive and self.config.n_coda:
            self.untied(self.transformer.coda, h_exit, cache['coda'], pos)  # rewrite the coda's K/V at pos
        return logits, used

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, n_loop=None, exit_threshold=None,
                 exit_policy='maxprob', use_cache=True):
        """Sample max_new_tokens after idx (B, T). Fixed exit: every token stops at loop n_loop (default R).
        Adaptive exit (exit_threshold, in the range of exit_policy: score_threshold): a token stops at the
        first loop whose exit score reaches the threshold (for 'kl': whose KL to the previous exit is at most
        the threshold). temperature 0 = greedy. The prompt always runs all n_loop loops, so the first new
        token (read off the prompt pass) uses all of them too. self.last_loops_used: (B, new) loops per
        token."""
        R = self.config.n_loop if n_loop is None else n_loop
        assert exit_policy in EXIT_POLICIES, f"exit_policy={exit_policy!r}: choose one of {EXIT_POLICIES}"
        assert use_cache or exit_threshold is None, "adaptive exit needs the KV cache"
        threshold = None if exit_threshold is None else score_threshold(exit_policy, exit_threshold)
        bs = self.config.block_size
        cache, pos, used_all = None, 0, []
        for _ in range(max_new_tokens):
            if not use_cache:
                logits, _ = self(idx[:, -bs:], n_loop=R)
                logits = logits[:, -1, :].float()
                used = torch.full((idx.size(0),), float(R), device=idx.device)
            elif cache is None or pos == bs:
                # (re)fill the cache from the context cropped to the block size, exactly what the uncached
                # forward sees; positions restart at 0 after a crop, so old keys are invalid
                idx_cond = idx[:, -bs:]
                cache = self.new_cache(idx.size(0), R, idx.device, self.lm_head.weight.dtype)
                logits, used = self.decode_step(idx_cond, cache, 0, R)
                pos = idx_cond.size(1)
            else:
                logits, used = self.decode_step(idx[:, -1:], cache, pos, R, threshold, exit_policy)
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
