"""
A looped (weight-tied, depth-recurrent) GPT language model in one file.

A looped transformer keeps K distinct layers (`n_layer`) and runs that stack R times (`n_loop`):
the unrolled depth is N = K*R, the parameters are those of K layers. Each round ("loop") ends in an
exit, where the state h_k can be read out into logits: per-loop supervision and early exits.

It implements two papers (formulas and numbers in docs/papers.md):
1) The readout blind spot (§1): cross-entropy through a scale-invariant readout cannot see ||h||,
   so pre-norm recurrence lets the state grow. Keys: readout, supervision, norm_penalty,
   inter_loop_norm.
2) DeepLoop (§2): post-norm blocks with alpha = (2N)^p on the skip path and an init gain
   beta = (8N)^-p; p = 1/4 is DeepNorm, p = 1/2 DeepLoop. Keys: block, depth_scaling.
And the recurrent-depth family around them (§4, off by default): prelude and coda blocks,
input injection, a random loop count per step (Huginn) and a learned exit gate (Ouro).

Where to look: the loop is GPT.loops, the readout GPT.readout_norm, the loss GPT.loss, the scaling
rule GPTConfig.alpha and GPTConfig.beta. Decoding (KV cache, early exits) lives in engine.py.
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

LOOP_SIGMA = 0.5  # sigma of the sampled depth's log-normal (Huginn's 1/2, docs/papers.md §4)
# depth_scaling by name -> the exponent p of alpha = (2N)^p and beta = (8N)^-p (§2)
DEPTH_EXPONENTS = {'none': 0.0, 'deepnorm': 0.25, 'deeploop': 0.5}


@dataclass
class GPTConfig:
    # every field is a config key of train.py too (--n_loop=8); choices and ranges are checked in
    # configurator.py; the defaults are the embedded default run
    block_size: int = 64           # context length T
    vocab_size: int = 65           # V; train.py reads it from meta.json unless set
    n_layer: int = 2               # K: distinct layers in the shared stack
    n_loop: int = 4                # R: rounds through that stack; N = K*R unrolled blocks
    n_head: int = 4
    n_embd: int = 128              # C
    dropout: float = 0.0
    pos: str = 'learned'           # learned (absolute position embedding) | rope
    mlp: str = 'swiglu'            # swiglu (width 4C, three matrices) | gelu (nanoGPT's)
    norm: str = 'rmsnorm'          # the norm inside blocks: rmsnorm | layernorm
    init: str = 'reference'        # reference (PyTorch defaults, wte ~ N(0,1)) | gpt2 (N(0, 0.02))
    embd_std: float = 0.0          # std of wte (and a learned wpe) at init; 0 = the init's own (1 | 0.02)
    readout: str = 'rmsnorm'       # before the LM head: rmsnorm | layernorm | raw | final_only (§1)
    supervision: str = 'per_loop'  # per_loop (mean of the R exit CEs) | terminal (exit R only)
    norm_penalty: float = 0.0      # lambda of lambda * mean_k mean(h_k^2) (§1); 0 = off
    inter_loop_norm: str = 'none'  # none | rmsnorm | layernorm between loops | readout (Ouro, §4)
    block: str = 'preln'           # preln | postln (DeepNorm) | sandwich (DeepLoop), see Block
    depth_scaling: object = 'none'  # none | deepnorm (p = 1/4) | deeploop (p = 1/2) | a number p
    loop_eps: float = 0.0          # lambda of the branch multiplier lambda/(R sqrt K) (§3); 0 = off
    attn_impl: str = 'auto'        # auto | sdpa | math | explicit: one result, only speed differs
    # the recurrent-depth family (docs/papers.md §4); the defaults switch every piece off
    n_prelude: int = 0             # untied blocks before the loop; their output e is re-injected
    n_coda: int = 0                # untied blocks after every exit, before the readout norm
    injection: str = 'none'        # how e re-enters loops 2..R: none | add | concat (W [x; e])
    adapter_init: str = 'identity'  # concat's W at init: identity ([I 0], iso-depth) | default (Huginn)
    loop_sampling: str = 'fixed'   # R per training step: fixed | poisson_lognormal (mean R + 1)
    max_loop: int = 0              # cap on the sampled R; 0 = 4 x n_loop
    backprop_loops: int = 0        # gradients through the last this many loops only; 0 = all
    exit_gate: str = 'none'        # none | learned: lambda_k = sigmoid(w . z_k + b)
    exit_entropy: float = 0.0      # learned gate: minus this times the entropy of p(k) in the loss

    @property
    def loop_cap(self):
        return self.max_loop or 4 * self.n_loop  # the most loops a training step may draw

    # ---- the depth-scaling rule, in one place (docs/papers.md §2) ----
    @property
    def depth_exponent(self):
        p = self.depth_scaling  # a name, or the number p itself
        return DEPTH_EXPONENTS[p] if p in DEPTH_EXPONENTS else float(p)

    @property
    def n_unrolled(self):
        # N counts every visit of a shared layer as one more block of depth (DeepLoop's reading).
        # It is fixed at build time: the training R counts, whatever n_loop inference uses.
        return self.n_prelude + self.n_layer * self.n_loop + self.n_coda

    @property
    def alpha(self):
        return (2 * self.n_unrolled) ** self.depth_exponent     # §2: alpha = (2N)^p, on the skip

    @property
    def beta(self):
        return (8 * self.n_unrolled) ** (-self.depth_exponent)  # §2: beta = (8N)^-p, init only

    @property
    def branch_eps(self):
        # §3 (Wang et al.): h <- h + eps f(h) with eps = lambda / (R sqrt K); 1 when off
        if self.loop_eps == 0:
            return 1.0
        return self.loop_eps / (self.n_loop * math.sqrt(self.n_layer))


def make_norm(kind, n_embd):
    # RMSNorm with eps 1e-6 as in paper 1's code; LayerNorm without a bias, as in both papers
    return nn.RMSNorm(n_embd, eps=1e-6) if kind == 'rmsnorm' else nn.LayerNorm(n_embd, bias=False)


def apply_rope(x, cos, sin):
    # x (B, nh, T, hs); rotate the two halves of each head by position-dependent angles
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def attention(q, k, v, causal, impl='auto', dropout_p=0.0):
    """softmax(q k^T / sqrt(hs) + mask) v, q (B, nh, Tq, hs), k and v (B, nh, Tk, hs).
    Three paths give one result: 'sdpa' (flash where available), 'math' (its reference kernel)
    and 'explicit'; 'auto' takes the fastest here (hardware.py). causal: query i is position
    Tk - Tq + i and sees keys 0..Tk - Tq + i (the queries are the last Tq of the keys)."""
    impl = attention_path(impl, q.device.type, q.dtype, k.size(-2))
    B, nh, Tq, hs = q.shape
    Tk = k.size(-2)
    assert Tq <= Tk, f"{Tq} queries but only {Tk} keys: the queries must be the last of the keys"
    if impl in ('sdpa', 'math'):
        # is_causal aligns its mask top-left, right only when Tq == Tk (training, a prompt at 0);
        # new tokens after a cached history (Tq < Tk) need it bottom-right: a boolean mask
        mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(Tk - Tq) \
            if causal and Tq < Tk else None
        args = dict(attn_mask=mask, dropout_p=dropout_p, is_causal=causal and mask is None)
        if impl == 'math':
            with sdpa_kernel(SDPBackend.MATH):
                return F.scaled_dot_product_attention(q, k, v, **args)
        return F.scaled_dot_product_attention(q, k, v, **args)
    # scores / sqrt(hs) + mask in one batched matmul; the mask is -inf above the diagonal that
    # starts at key Tk - Tq (the main one when Tq == Tk)
    mask = torch.full((Tq, Tk), -math.inf if causal else 0.0, dtype=q.dtype, device=q.device)
    att = torch.baddbmm(mask.triu(1 + Tk - Tq), q.reshape(B * nh, Tq, hs),
                        k.reshape(B * nh, Tk, hs).transpose(1, 2), alpha=1.0 / math.sqrt(hs))
    att = F.softmax(att, dim=-1)  # (B*nh, Tq, Tk)
    att = F.dropout(att, dropout_p) if dropout_p > 0 else att
    return (att @ v.reshape(B * nh, Tk, hs)).view(B, nh, Tq, hs)


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        # q, k, v in one matrix
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.attn_dropout = config.dropout  # on the attention weights; none after c_proj, as paper 1's code
        self.attn_impl = config.attn_impl
        self.n_head = config.n_head
        self.n_embd = config.n_embd

    def qkv(self, x, rope=None):
        B, T, C = x.size()
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
                   for t in self.c_attn(x).split(C, dim=2))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return q, k, v

    def forward(self, x, rope=None, kv=None, pos=0):
        B, T, C = x.size()
        q, k, v = self.qkv(x, rope)
        if kv is not None:
            # decoding (engine.py): the new keys and values join this visit's cache slot, and the
            # T new tokens (a prompt at 0, or drafts to verify at pos > 0) see positions 0..pos+T-1
            k, v = kv.update(k, v, pos)
        y = attention(q, k, v, T > 1, self.attn_impl, self.attn_dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, nh, T, hs) -> (B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.swiglu = config.mlp == 'swiglu'
        hidden = 4 * config.n_embd
        # swiglu: c_fc holds the gate and the up projection side by side
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
    """One residual layer. The three block types are one formula with other pieces switched in:
        x <- post_norm( alpha * x + eps * f( pre_norm(x) ) )
    preln:    pre_norm = Norm, post_norm = identity    x + eps f(Norm x)       (eps: §3)
    postln:   pre_norm = identity, post_norm = Norm    Norm(alpha x + f(x))    (DeepNorm, §2)
    sandwich: pre_norm = Norm, post_norm = Norm        Norm(alpha x + f(Norm x)) (DeepLoop, §2)
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
        x = self.pn_1(self.residual(x, self.attn(self.ln_1(x), rope, kv, pos)))
        x = self.pn_2(self.residual(x, self.mlp(self.ln_2(x))))
        return x

    def residual(self, x, fx):
        # alpha * x + eps * f(x). A factor of 1 is left out: exact, and in eager mode on a CPU it
        # saves a pass over the tensor (~14% of a bf16 block's time when alpha = eps = 1)
        return (x if self.alpha == 1 else self.alpha * x) + (fx if self.eps == 1 else self.eps * fx)


def ce_chunk_rows(V, device):
    # rows per chunk of the readout: the (rows, V) fp32 logits take ~16 MiB on a CPU and ~1 GiB
    # on a GPU, where a few large matmuls keep the head fast
    return max(1, (2 ** 28 if device.type == 'cuda' else 2 ** 22) // V)


class LinearCrossEntropy(torch.autograd.Function):
    """sum_k w_k * CE(h_k @ W^T, targets) without keeping any (B, T, V) logits alive.

    Per-loop supervision reads out R states, and autograd would keep R logit tensors of B*T*V
    floats for the backward pass (the largest tensors in the model at GPT-2's vocabulary). Here
    the forward pass walks over row chunks and computes each chunk's logits, loss and gradient
    (softmax - onehot) at once, keeping only dL/dh (B, T, C) and one dL/dW (V, C). The backward
    pass only scales them. The flops are a plain head's; the memory of R exits about one's.
    """

    @staticmethod
    def forward(ctx, weight, targets, exit_weights, xs):
        # xs (E, B, T, C): the readout inputs of the E supervised exits, one tensor (a list would
        # break torch.compile's graph); exit_weights: E floats
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
                logits = (xc @ weight.t()).float()                        # (rows, V)
                logp = torch.log_softmax(logits, dim=-1)
                loss = loss - wk * (logp.gather(1, tc[:, None]).squeeze(1) * vc).sum()
                del logp
                # softmax has its own kernel: exp() of shifted logits that underflow (common at
                # early exits) is ~10x slower on CPUs
                g = torch.softmax(logits, dim=-1)                         # (rows, V)
                del logits
                g[torch.arange(g.size(0), device=g.device), tc] -= 1.0    # p - onehot
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
    # CE(h @ W^T, targets) without grad, in the same row chunks (diagnostics at every exit)
    V, C = weight.shape
    x, tgt = h.reshape(-1, C), targets.reshape(-1)
    rows = ce_chunk_rows(V, h.device)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for i in range(0, x.size(0), rows):
        logits = (x[i:i + rows] @ weight.t()).float()
        total += F.cross_entropy(logits, tgt[i:i + rows], ignore_index=-1, reduction='sum')
    return total / (tgt != -1).sum().clamp(min=1)


def token_ce(h, weight, targets):
    # per-token CE (B*T,) of h @ W^T with a gradient, for losses that weight every token's CE
    # (the learned gate). Each chunk's logits are recomputed in the backward pass (checkpoint),
    # so no (B*T, V) tensor outlives its chunk.
    V, C = weight.shape
    x, tgt = h.reshape(-1, C), targets.reshape(-1)
    rows = ce_chunk_rows(V, h.device)
    ce = lambda xc, tc: F.cross_entropy((xc @ weight.t()).float(), tc, ignore_index=-1,
                                        reduction='none')
    return torch.cat([checkpoint(ce, x[i:i + rows], tgt[i:i + rows], use_reentrant=False)
                      for i in range(0, x.size(0), rows)])


def exit_distribution(lam):
    # docs/papers.md §4 (Ouro): p(k) = lambda_k prod_{j<k} (1 - lambda_j) for k < R; the last exit
    # takes the rest, so p sums to 1. lam (R, ...) -> p (R, ...)
    stay = torch.cumprod(1 - lam, dim=0)                       # prod_{j<=k} (1 - lambda_j)
    before = torch.cat([torch.ones_like(lam[:1]), stay[:-1]])  # prod_{j<k}
    return torch.cat([lam[:-1] * before[:-1], before[-1:]])


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        C = config.n_embd
        # the readout norm (none for a raw readout) and the inter-loop norm (identity unless set,
        # docs/papers.md §1); inter_loop_norm='readout' feeds the readout norm back (Ouro, §4)
        ln_out = nn.Identity() if config.readout == 'raw' else make_norm(
            'layernorm' if config.readout == 'layernorm' else 'rmsnorm', C)
        if config.inter_loop_norm == 'readout':
            ln_loop = ln_out
        elif config.inter_loop_norm == 'none':
            ln_loop = nn.Identity()
        else:
            ln_loop = make_norm(config.inter_loop_norm, C)
        blocks = lambda n: nn.ModuleList([Block(config) for _ in range(n)])
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, C),
            wpe=nn.Embedding(config.block_size, C) if config.pos == 'learned' else nn.Identity(),
            drop=nn.Dropout(config.dropout),
            # DeepLoop norms the embedding, so a post-norm stack starts at RMS(x) = 1
            ln_emb=make_norm(config.norm, C) if config.block != 'preln' else nn.Identity(),
            prelude=blocks(config.n_prelude),  # untied, run once (§4)
            h=blocks(config.n_layer),          # the K shared layers
            coda=blocks(config.n_coda),        # untied, run at every exit (§4)
            ln_loop=ln_loop,
            ln_out=ln_out,
        ))
        if config.injection == 'concat':
            self.transformer.adapter = nn.Linear(2 * C, C, bias=False)  # W [x; e] (Huginn)
        if config.exit_gate == 'learned':
            self.exit_gate = nn.Linear(C, 1)  # lambda_k = sigmoid(w . z_k + b) (Ouro, §4)
        self.lm_head = nn.Linear(C, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as in both papers' models
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
        cfg, C = self.config, self.config.n_embd
        if cfg.init == 'reference':
            # paper 1's code keeps PyTorch's defaults (Kaiming-uniform Linear, N(0, 1) embedding):
            # the initial state norm is about sqrt(C) (docs/papers.md §1)
            nn.init.normal_(self.transformer.wte.weight, mean=0.0, std=1.0)
        else:
            # N(0, 0.02) for every matrix and no residual scaling: DeepLoop's baseline ("standard init,
            # no residual scaling", docs/papers.md §2), the same at every R. Depth scaling then only
            # multiplies by beta below, so p -> 0 meets p = 0. (GPT-2's own 1/sqrt(2N) is not used.)
            for p in self.parameters():
                if p.dim() == 2:
                    nn.init.normal_(p, mean=0.0, std=0.02)
        if cfg.embd_std > 0:
            # one init's embedding scale under the other's block matrices: it splits the two (§1)
            for emb in (self.transformer.wte, self.transformer.wpe):
                if isinstance(emb, nn.Embedding):
                    nn.init.normal_(emb.weight, mean=0.0, std=cfg.embd_std)
        # docs/papers.md §2: beta is an init-only gain on W_v, the attention output projection and
        # every MLP matrix (not on W_q, W_k or the embeddings)
        if cfg.beta != 1.0:
            for block in (*self.transformer.prelude, *self.transformer.h, *self.transformer.coda):
                block.attn.c_attn.weight[2 * C:] *= cfg.beta   # the W_v rows of the q|k|v matrix
                for lin in (block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj):
                    lin.weight *= cfg.beta
        if cfg.injection == 'concat' and cfg.adapter_init == 'identity':
            # docs/papers.md §3 (iso-depth): W = [I 0], so at first W [x; e] = x passes the state through
            eye = torch.cat([torch.eye(C), torch.zeros(C, C)], dim=1)
            self.transformer.adapter.weight.copy_(eye)

    def get_num_params(self, non_embedding=True):
        # parameters() yields a shared tensor once: the K layers count once however many loops
        # run, and the tied head once with the embedding
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
            x = x + self.transformer.wpe(torch.arange(pos, pos + T, device=idx.device))
        return self.transformer.ln_emb(self.transformer.drop(x))

    def rope(self, pos, T):
        if self.config.pos != 'rope':
            return None
        return self.rope_cos[pos:pos + T], self.rope_sin[pos:pos + T]

    def untied(self, part, x, cache=None, pos=0):
        # the prelude or the coda (§4): blocks that run once, each with its own cache slot
        rope = self.rope(pos, x.size(1))
        for j, block in enumerate(self.transformer[part]):
            x = block(x, rope, None if cache is None else cache.slot(part, j), pos)
        return x

    def carry(self, h, e):
        # what enters the next loop: the inter-loop norm (§1), then the prelude output e (§4)
        x = self.transformer.ln_loop(h)
        if self.config.injection == 'add':
            return x + e
        if self.config.injection == 'concat':
            return self.transformer.adapter(torch.cat([x, e], dim=-1))  # (B, T, 2C) -> (B, T, C)
        return x

    def loops(self, x, n_loop, cache=None, pos=0):
        """The recurrence. x (B, T, C) enters loop 1: the embedded tokens after the prelude, and
        the e that injection re-feeds. Yields (k, h_k) for k = 1..n_loop, h_k being the state
        after loop k's blocks, before any norm: where ||h_k|| is measured (docs/papers.md §1).
        A caller that acts between loops sends back (h_k, e) changed: a clamp, fewer rows."""
        rope = self.rope(pos, x.size(1))
        e, b, grad = x, self.config.backprop_loops, torch.is_grad_enabled()
        for k in range(1, n_loop + 1):
            # truncated backprop (§4): only the last b loops build a graph (b = 0: all of them)
            with torch.set_grad_enabled(grad and (b == 0 or k > n_loop - b)):
                if k > 1:
                    x = self.carry(x, e)
                for j, block in enumerate(self.transformer.h):  # the same K blocks every round
                    x = block(x, rope, None if cache is None else cache.slot('loop', j, k), pos)
            sent = yield k, x
            if sent is not None:
                x, e = sent

    def states(self, idx, n_loop=None):
        # [h_1, ..., h_R] of tokens idx (B, T); n_loop overrides the trained R
        R = self.config.n_loop if n_loop is None else n_loop
        assert isinstance(R, int) and R >= 1, f"n_loop must be an integer >= 1, got {R!r}"
        return [h for _, h in self.loops(self.untied('prelude', self.embed(idx)), R)]

    def draw_n_loop(self, generator):
        # the loop count of one training step. poisson_lognormal (Huginn, docs/papers.md §4):
        # tau ~ Normal(log n_loop - sigma^2/2, sigma), R = Poisson(e^tau) + 1, capped. The draws
        # come from `generator` alone: seeded alike on every rank, every rank draws the same R.
        cfg = self.config
        if cfg.loop_sampling == 'fixed':
            return cfg.n_loop
        mu = math.log(cfg.n_loop) - LOOP_SIGMA ** 2 / 2
        tau = torch.normal(mu, LOOP_SIGMA, (1,), generator=generator)
        return min(int(torch.poisson(tau.exp(), generator=generator).item()) + 1, cfg.loop_cap)

    # ---- the readout ----
    def readout_norm(self, h, k, R=None):
        # docs/papers.md §1: an RMSNorm/LayerNorm readout is scale-invariant, so dL/dh is orthogonal
        # to h and the loss cannot see ||h||. 'raw' shows the scale; 'final_only' at exits 1..R-1,
        # R the loops of this pass (a sampled depth's, in training), by default the trained n_loop
        cfg = self.config
        R = cfg.n_loop if R is None else R
        if cfg.readout == 'raw' or (cfg.readout == 'final_only' and k < R):
            return h
        return self.transformer.ln_out(h)

    def head_input(self, h, k, cache=None, pos=0, R=None):
        # z_k, what the LM head and the exit gate read at exit k: the coda, then the readout norm
        return self.readout_norm(self.untied('coda', h, cache, pos), k, R)

    def readout(self, h, k):
        # the logits of exit k (1-based) from its state h_k: (..., C) -> (..., V)
        return self.lm_head(self.head_input(h, k))

    def gate(self, z):
        # §4 (Ouro): lambda_k = sigmoid(w . z_k + b), the chance to stop at exit k if no earlier
        # exit stopped; z (..., C) -> (...)
        return torch.sigmoid(self.exit_gate(z).float()).squeeze(-1)

    # ---- the loss ----
    def exit_weights(self, R):
        # docs/papers.md §1: per-loop = (1/R) sum_k CE_k; terminal = CE_R only
        return [1.0 / R] * R if self.config.supervision == 'per_loop' else [0.0] * (R - 1) + [1.0]

    def norm_penalty(self, states):
        # §1: lambda * mean_k mean_{b,t,d} h_k^2 over the pre-norm states of all R loops, also when
        # only the last loop is supervised
        mean_sq = torch.stack([h.float().pow(2).mean() for h in states])
        return self.config.norm_penalty * mean_sq.mean()

    def gate_loss(self, zs, targets):
        # §4 (Ouro): per token sum_k p(k) CE_k - exit_entropy * H(p), p the exit distribution of
        # the learned gate over the exits' inputs zs [z_1..z_R] (B, T, C)
        ce = torch.stack([token_ce(z, self.lm_head.weight, targets) for z in zs])   # (R, B*T)
        p = exit_distribution(torch.stack([self.gate(z).flatten() for z in zs]))  # (R, B*T)
        H = -(p * p.clamp(min=1e-12).log()).sum(0)
        valid = (targets.reshape(-1) != -1).float()
        per_token = (p * ce).sum(0) - self.config.exit_entropy * H
        return (per_token * valid).sum() / valid.sum().clamp(min=1)

    def loss(self, states, targets):
        # the weighted exit CEs (or the gate's expected CE) of the loop states + the norm penalty
        weights = self.exit_weights(len(states))
        exits = [k for k, w in enumerate(weights, start=1) if w > 0]
        zs = [self.head_input(states[k - 1], k, R=len(states)) for k in exits]
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
            # inference: only the last position of the final exit is needed
            z = self.head_input(states[-1], len(states))  # the coda sees every position
            return self.lm_head(z[:, [-1], :]), None
        return None, self.loss(states, targets)

    @torch.no_grad()
    def exit_losses(self, idx, targets, n_loop=None):
        # diagnostics: the CE at every exit 1..R, and the mean per-token norm ||h_k|| of every loop
        states = self.states(idx, n_loop)
        W = self.lm_head.weight
        ce = torch.stack([cross_entropy_chunked(self.head_input(h, k), W, targets)
                          for k, h in enumerate(states, start=1)])
        norms = torch.stack([h.float().norm(dim=-1).mean() for h in states])
        return ce, norms  # (R,), (R,)

    # ---- optimizer and accounting (as in nanoGPT) ----
    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]    # matrices and embeddings decay; gains don't
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{'params': decay, 'weight_decay': weight_decay},
                  {'params': no_decay, 'weight_decay': 0.0}]
        print(f"num decayed parameter tensors: {len(decay)}, "
              f"with {sum(p.numel() for p in decay):,} parameters")
        print(f"num non-decayed parameter tensors: {len(no_decay)}, "
              f"with {sum(p.numel() for p in no_decay):,} parameters")
        # the fused kernel (one pass over every tensor), on GPUs and CPUs alike (PyTorch 2.4+)
        fused = 'fused' in inspect.signature(torch.optim.AdamW).parameters
        extra = dict(fused=True) if fused and device_type in ('cuda', 'cpu') else {}
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **extra)

    def flops_per_token(self, T=None, n_loop=None):
        # training flops per token: forward + backward = 6 per weight use (PaLM appendix B)
        cfg = self.config
        T = cfg.block_size if T is None else T
        R = cfg.n_loop if n_loop is None else n_loop
        n_params = lambda blocks: sum(p.numel() for p in blocks.parameters())
        n_exits = sum(w > 0 for w in self.exit_weights(R))
        # the K layers run every loop, the coda and head at every supervised exit, the prelude
        # once, the injection adapter before every loop after the first
        adapter = 2 * cfg.n_embd ** 2 * (R - 1) if cfg.injection == 'concat' else 0
        head = n_params(self.transformer.coda) + cfg.vocab_size * cfg.n_embd
        weights = n_params(self.transformer.h) * R + n_params(self.transformer.prelude)
        visits = cfg.n_layer * R + cfg.n_prelude + cfg.n_coda * n_exits
        attn = 12 * visits * cfg.n_embd * T  # QK^T and AV of every visit
        return 6 * (weights + adapter + head * n_exits) + attn

    def estimate_mfu(self, fwdbwd_per_iter, dt, peak=None, T=None):
        # model flops utilisation of fwdbwd_per_iter sequences in dt seconds against peak FLOP/s;
        # by default the bf16 peak of this CUDA device (hardware.peak_flops; None if unknown)
        T = self.config.block_size if T is None else T
        if peak is None and torch.cuda.is_available():
            peak = peak_flops(torch.cuda.get_device_name())
        if peak is None:
            return None
        return self.flops_per_token(T) * T * fwdbwd_per_iter / dt / peak
