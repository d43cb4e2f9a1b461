"""
A looped (weight-tied, depth-recurrent) GPT language model in one file.

A looped transformer keeps K distinct layers (`n_layer`) and runs that stack R times (`n_loop`): the
unrolled depth is N = K*R, the parameters those of K layers. Each round ("loop") ends in an exit, where
the state h_k can be read out into logits: per-loop supervision and early exits.

Where to look: GPTConfig groups its keys by paper (docs/papers.md), the loop is GPT.loops, the readout
GPT.readout_norm, the loss GPT.loss, the scaling rule GPTConfig.alpha and .beta. The speed kernels are in
compute/kernels.py; decoding (KV cache, early exits, many prompts at once) in decoding/, which asks the model.
"""

import math
from collections import namedtuple
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

from compute import kernels

LOOP_SIGMA = 0.5  # sigma of the sampled depth's log-normal (Huginn's 1/2, docs/papers.md §4)
# depth_scaling by name -> the exponent p of alpha = (2N)^p and beta = (8N)^-p (§2)
DEPTH_EXPONENTS = {'none': 0.0, 'deepnorm': 0.25, 'deeploop': 0.5}
# what loop k reads besides h_{k-1}, e and its slots (each keeps rows at other loops out of one call);
# carried: from loop 1 in one pass (then no exit, no draft)
LoopFeature = namedtuple('LoopFeature', 'key carried why')


@dataclass
class GPTConfig:
    # every field is also a train.py key (--n_loop=8), checked in configurator.py; defaults: the default run
    # ---- the looped GPT ----
    block_size: int = 64           # context length T
    vocab_size: int = 65           # V; train.py reads it from meta.json unless set
    n_layer: int = 2               # K: distinct layers in the shared stack
    n_loop: int = 4                # R: rounds through that stack; N = K*R unrolled blocks
    n_head: int = 4
    n_embd: int = 128              # C
    dropout: float = 0.0
    pos: str = 'learned'           # learned (absolute position embedding) | rope
    mlp: str = 'swiglu'            # swiglu (4C wide, 3 matrices) | gelu (nanoGPT's) | gelu_tanh (GPT-2's)
    bias: bool = False             # biases in the blocks' Linears and LayerNorms (GPT-2's weights have them)
    norm: str = 'rmsnorm'          # the norm inside blocks: rmsnorm | layernorm
    init: str = 'reference'        # reference (PyTorch defaults, wte ~ N(0,1)) | gpt2 (N(0, 0.02))
    embd_std: float = 0.0          # std of wte (and a learned wpe) at init; 0 = the init's own (1 | 0.02)
    tie_head: bool = True          # the LM head is wte; False: a head of its own, on the init's own scale
    attn_impl: str = 'auto'        # auto | sdpa | math | explicit: one result, only speed differs
    # ---- §1 the readout blind spot ----
    readout: str = 'rmsnorm'       # before the LM head: rmsnorm | layernorm | raw | final_only
    supervision: str = 'per_loop'  # per_loop (mean of the R exit CEs) | terminal (exit R only)
    norm_penalty: float = 0.0      # lambda of lambda * mean_k mean(h_k^2); 0 = off
    inter_loop_norm: str = 'none'  # none | rmsnorm | layernorm between loops | readout (Ouro, §4)
    # ---- §2 DeepLoop ----
    block: str = 'preln'           # preln | postln (DeepNorm) | sandwich (DeepLoop), see Block
    depth_scaling: object = 'none'  # none | deepnorm (p = 1/4) | deeploop (p = 1/2) | a number p
    # ---- §3 loop-scaled residuals ----
    loop_lambda: float = 0.0       # lambda of the branch scale eps = lambda/(R sqrt K); 0 = off
    # ---- §4 the recurrent-depth family; the defaults switch every piece off ----
    n_prelude: int = 0             # untied blocks before the loop; their output e is re-injected
    n_coda: int = 0                # untied blocks after every exit, before the readout norm
    injection: str = 'none'        # how e re-enters loops 2..R: none | add | concat (W [x; e]) | iso (§3)
    adapter_init: str = 'identity'  # W at init: identity ([I 0], iso-depth) | default (Huginn)
    loop_sampling: str = 'fixed'   # R per training step: fixed | poisson_lognormal (mean R + 1)
    max_loop: int = 0              # cap on the sampled R; 0 = 4 x n_loop
    backprop_loops: int = 0        # gradients through the last this many loops only; 0 = all
    hyper_lanes: int = 0           # hyper-connections (§3): L lanes carried between loops; 0 = off
    exit_gate: str = 'none'        # none | learned: lambda_k = sigmoid(w . z_k + b)
    exit_entropy: float = 0.0      # learned gate: minus this times the entropy of p(k) in the loss
    # ---- §5 Looped-MoE: a mixture of experts in place of the MLP ----
    n_expert: int = 0              # E experts per MoE layer; 0 = the dense MLP
    top_k: int = 2                 # k experts per token (token choice, dropless)
    expert_hidden: int = 0         # an expert's hidden width; 0 = the MLP's 4C / k (active = dense)
    aux_loss_coef: float = 0.01    # weight of the load-balancing loss E sum_i f_i P_i
    z_loss_coef: float = 0.001     # weight of the router z-loss mean(logsumexp(logits)^2)
    tied_routing: bool = False     # loops 2..R reuse loop 1's experts, token by token
    disjoint_routing: bool = False  # loop k picks among its own E/R experts only (forced divergence)

    @property
    def loop_features(self):  # those switched on (Decoding.why_not reads them); new ones go here
        return [LoopFeature(key, carried, why) for key, on, carried, why in (
            ('hyper_lanes', self.hyper_lanes, True, 'hyper-connection lanes are carried from loop 1 '
             '(hyper-connections, hyper_lanes)'),
            ('tied_routing', self.tied_routing, True, "tied routing reads loop 1's experts"),
            ('injection', self.injection == 'iso', False, "injection='iso' acts before loop 1 too"),
            ('disjoint_routing', self.disjoint_routing, False, 'disjoint routing gives each loop its own '
             'experts')) if on]

    @property
    def loop_cap(self):
        return self.max_loop or 4 * self.n_loop  # the most loops a training step may draw

    def draw_n_loop(self, generator, mean=None):
        # R of a training step (mean: a curriculum's now, docs/papers.md §6; else n_loop). poisson_lognormal
        # (Huginn, §4): 1 + Poisson(e^tau), tau ~ N(log mean - sigma^2/2, sigma), capped; alike on every rank
        if self.loop_sampling == 'fixed':
            return self.n_loop if mean is None else max(1, round(mean))
        mu = math.log(mean or self.n_loop) - LOOP_SIGMA ** 2 / 2
        tau = torch.normal(mu, LOOP_SIGMA, (1,), generator=generator)
        return min(int(torch.poisson(tau.exp(), generator=generator).item()) + 1, self.loop_cap)

    # ---- the depth-scaling rule, in one place (docs/papers.md §2) ----
    @property
    def depth_exponent(self):
        p = self.depth_scaling  # a name, or the number p itself
        return DEPTH_EXPONENTS[p] if p in DEPTH_EXPONENTS else float(p)

    @property
    def n_unrolled(self):
        # N: every visit of a shared layer is a block of depth (DeepLoop's reading), at the training R
        return self.n_prelude + self.n_layer * self.n_loop + self.n_coda

    @property
    def alpha(self):
        return (2 * self.n_unrolled) ** self.depth_exponent     # §2: alpha = (2N)^p, on the skip

    @property
    def beta(self):
        return (8 * self.n_unrolled) ** (-self.depth_exponent)  # §2: beta = (8N)^-p, init only

    @property
    def branch_scale(self):
        # §3 (Wang et al.): h <- h + eps f(h) with eps = lambda / (R sqrt K); 1 when off
        return self.loop_lambda / (self.n_loop * math.sqrt(self.n_layer)) if self.loop_lambda else 1.0


def make_norm(kind, n_embd, bias=False):
    # RMSNorm with eps 1e-6 as in paper 1's code; LayerNorm without a bias as in both papers (GPT-2: with)
    return nn.RMSNorm(n_embd, eps=1e-6) if kind == 'rmsnorm' else nn.LayerNorm(n_embd, bias=bias)


def apply_rope(x, cos, sin):
    # x (B, nh, T, hs); rotate the two halves of each head by position-dependent angles
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # query, key, value
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = config.dropout  # on the attention weights; none after c_proj, as paper 1's code
        self.attn_impl, self.n_head = config.attn_impl, config.n_head

    def qkv(self, x, rope=None):
        B, T, C = x.size()
        q, key, value = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
                         for t in self.c_attn(x).split(C, dim=2))
        if rope is not None:
            q, key = apply_rope(q, *rope), apply_rope(key, *rope)
        return q, key, value

    def forward(self, x, rope=None, slot=None, pos=0):
        B, T, C = x.size()
        q, key, value = self.qkv(x, rope)
        # decoding: key, value join this visit's slot; queries see 0..pos+T-1 (rows at own pos: a mask)
        key, value, mask = slot.update(key, value, pos) if slot is not None else (key, value, None)
        # softmax(q key^T / sqrt(hs) + causal mask) value; the T queries are the last T of the keys
        dropout = self.attn_dropout if self.training else 0.0
        y = kernels.attention(q, key, value, T > 1, self.attn_impl, dropout, mask)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, nh, T, hs) -> (B, T, C)
        return self.c_proj(y)


def activation(x, mlp):
    # swiglu: x holds the gate and the up projection side by side; else GELU, GPT-2's in its tanh form
    if mlp == 'swiglu':
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(x, approximate='tanh' if mlp == 'gelu_tanh' else 'none')


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.kind, hidden = config.mlp, 4 * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, (2 if self.kind == 'swiglu' else 1) * hidden, bias=config.bias)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(activation(self.c_fc(x), self.kind)))


Route = namedtuple('Route', 'logits idx')  # one visit's routing: logits (BT, E) in fp32, experts (BT, top_k)


class MoE(nn.Module):
    """Looped-MoE's feed-forward (docs/papers.md §5): E MLPs ("experts") and a router, each token to its
    top_k; dropless token choice: its experts never depend on the batch (cached decoding = recompute)."""

    def __init__(self, config):
        super().__init__()
        E, C, top_k = config.n_expert, config.n_embd, config.top_k
        H = config.expert_hidden or 4 * C // top_k  # top_k experts of 4C/top_k: the dense MLP's active ones
        self.kind, self.swiglu, self.top_k = config.mlp, config.mlp == 'swiglu', top_k
        self.groups = config.n_loop if config.disjoint_routing else 0  # disjoint: E/R experts a loop
        self.router = nn.Linear(C, E, bias=False)
        # the experts' matrices stacked (E, in, out), each with nn.Linear's default init
        self.c_fc = nn.Parameter(torch.empty(E, C, (1 + self.swiglu) * H).uniform_(-C ** -0.5, C ** -0.5))
        self.c_proj = nn.Parameter(torch.empty(E, H, C).uniform_(-H ** -0.5, H ** -0.5))
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x, tied=None, k=1):
        # (y, this visit's Route) at loop k; tied: loop 1's experts (BT, top_k), which tied routing reuses
        B, T, C = x.size()
        x = x.view(B * T, C)                               # (BT, C): every token routes alone
        with torch.autocast(x.device.type, enabled=False):  # routing decisions in fp32, under AMP too
            logits = self.router(x.float())                # (BT, E)
        if self.groups:  # disjoint routing: loop k reaches its own E/R experts only
            group = torch.arange(logits.size(-1), device=x.device) // (logits.size(-1) // self.groups)
            logits = logits.masked_fill(group != (k - 1) % self.groups, float('-inf'))
        probs = logits.softmax(dim=-1)
        idx = probs.topk(self.top_k, dim=-1).indices if tied is None else tied  # (BT, top_k)
        w = probs.gather(-1, idx)
        w = w / w.sum(dim=-1, keepdim=True)                # the top_k weights renormalised
        # y_t = sum_j w_tj expert_{idx_tj}(x_t), tokens grouped by expert (kernels.py)
        y = kernels.moe(x, idx, w, self.c_fc, self.c_proj, lambda h: activation(h, self.kind))
        return self.dropout(y.view(B, T, C)), Route(logits, idx)


def router_losses(routes):
    # §5: the load-balancing loss E sum_i f_i P_i (f_i: the share of token slots sent to expert i, P_i: its
    # mean router probability) and the z-loss mean(logsumexp(logits)^2), per visit, then averaged (pooled
    # over loops, experts used by one loop each would look balanced)
    balance, z = [], []
    for logits, idx in routes:
        E = logits.size(-1)
        f = F.one_hot(idx, E).flatten(0, -2).float().mean(0)  # (E,) over the BT top_k slots, sums to 1
        balance.append(E * (f * logits.softmax(-1).mean(0)).sum())
        z.append(logits.logsumexp(-1).pow(2).mean())
    return torch.stack(balance).mean(), torch.stack(z).mean()


class Block(nn.Module):
    """One residual layer. The three block types are one formula with other pieces switched in:
        x <- post_norm( alpha * x + eps * f( pre_norm(x) ) )
    preln:    pre_norm = Norm, post_norm = identity    x + eps f(Norm x)       (eps: §3)
    postln:   pre_norm = identity, post_norm = Norm    Norm(alpha x + f(x))    (DeepNorm, §2)
    sandwich: pre_norm = Norm, post_norm = Norm        Norm(alpha x + f(Norm x)) (DeepLoop, §2)
    """

    def __init__(self, config, moe=False):
        super().__init__()
        pre, post = config.block in ('preln', 'sandwich'), config.block in ('postln', 'sandwich')
        norm = lambda on: make_norm(config.norm, config.n_embd, config.bias) if on else nn.Identity()
        self.ln_1, self.ln_2 = norm(pre), norm(pre)     # pre-norms (GPT-2's names)
        self.pn_1, self.pn_2 = norm(post), norm(post)   # post-norms
        self.attn = CausalSelfAttention(config)
        self.mlp = MoE(config) if moe else MLP(config)  # experts where §5 puts them
        self.alpha = config.alpha       # docs/papers.md §2: alpha = (2N)^p on the skip path
        self.eps = config.branch_scale  # docs/papers.md §3: eps = lambda/(R sqrt K) on the branch

    def forward(self, x, rope=None, slot=None, pos=0, tied=None, k=1):
        # (x after the block, the experts' Route of this visit or None); k: the loop it runs in
        x = self.pn_1(self.residual(x, self.attn(self.ln_1(x), rope, slot, pos)))
        u = self.ln_2(x)
        y, route = self.mlp(u, tied, k) if isinstance(self.mlp, MoE) else (self.mlp(u), None)
        return self.pn_2(self.residual(x, y)), route

    def residual(self, x, fx):
        # alpha * x + eps * f(x); a factor of 1 is left out: exact, and one pass less over the tensor
        return (x if self.alpha == 1 else self.alpha * x) + (fx if self.eps == 1 else self.eps * fx)

    def kv(self, x, rope=None):
        # the key and value (B, nh, T, hs) this block's attention makes of input x (a skipped visit's)
        return self.attn.qkv(self.ln_1(x), rope)[1:]


class Lanes(nn.ParameterList):
    """Hyper-connections (§3): L lanes, e at first, carry the recurrence. Loop k's alpha_k (L), M_k (L x L),
    beta_k (L) in one 1-D tensor (no decay), cyclic init alpha_k = e_(k-1 mod L), M_k = I, beta_k = 1."""

    def __init__(self, L, n_loop):
        I = torch.eye(L)
        super().__init__(torch.cat([I[k % L], I.flatten(), torch.ones(L)]) for k in range(n_loop))
        self.L = L

    def read(self, lanes, k):
        # u = sum_l alpha_l lane_l, what loop k's blocks read; lanes (L, B, T, C)
        return torch.einsum('l,l...->...', self[k - 1][:self.L], lanes)

    def write(self, lanes, s, k):
        # lanes <- M lanes + beta s, s the normed state after loop k
        L = self.L
        _, M, beta = self[k - 1].split([L, L * L, L])
        return torch.einsum('ml,l...->m...', M.view(L, L), lanes) + beta.view(L, 1, 1, 1) * s


def exit_distribution(lam):
    # §4 (Ouro): p(k) = lambda_k prod_{j<k} (1 - lambda_j) for k < R, exit R the rest; lam, p (R, ...)
    stay = torch.cumprod(1 - lam, dim=0)                       # prod_{j<=k} (1 - lambda_j)
    before = torch.cat([torch.ones_like(lam[:1]), stay[:-1]])  # prod_{j<k}
    return torch.cat([lam[:-1] * before[:-1], before[-1:]])


def gate_loss(ce, lam, exit_entropy, valid):
    # §4: per token sum_k p(k) CE_k - exit_entropy * H(p), p = exit_distribution(lam); ce, lam (R, BT)
    p = exit_distribution(lam)
    H = -(p * p.clamp(min=1e-12).log()).sum(0)
    per_token = (p * ce).sum(0) - exit_entropy * H
    return (per_token * valid).sum() / valid.sum().clamp(min=1)


Loops = namedtuple('Loops', 'states routes')  # [h_k], and each shared layer's Route per visit (§5)


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config, C = config, config.n_embd
        # the readout norm (none if 'raw') and the inter-loop norm (§1); 'readout' feeds the first back (§4)
        ln_out = nn.Identity() if config.readout == 'raw' else make_norm(
            'layernorm' if config.readout == 'layernorm' else 'rmsnorm', C, config.bias)
        ln_loop = dict(none=nn.Identity(), readout=ln_out).get(config.inter_loop_norm) \
            or make_norm(config.inter_loop_norm, C)
        blocks = lambda n, moe=False: nn.ModuleList([Block(config, moe) for _ in range(n)])
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, C),
            wpe=nn.Embedding(config.block_size, C) if config.pos == 'learned' else nn.Identity(),
            drop=nn.Dropout(config.dropout),
            # DeepLoop norms the embedding, so a post-norm stack starts at RMS(x) = 1
            ln_emb=make_norm(config.norm, C) if config.block != 'preln' else nn.Identity(),
            prelude=blocks(config.n_prelude),             # untied, run once (§4)
            h=blocks(config.n_layer, config.n_expert > 0),  # the K shared layers, experts in them (§5)
            coda=blocks(config.n_coda),                   # untied, at every exit (§4)
            ln_loop=ln_loop, ln_out=ln_out,  # between loops (§1), before the LM head
        ))
        if config.injection in ('concat', 'iso'):
            self.transformer.adapter = nn.Linear(2 * C, C, bias=False)  # W [x; e] (Huginn), W [e; s] (§3)
        if config.hyper_lanes:
            self.transformer.lanes = Lanes(config.hyper_lanes, config.n_loop)  # §3
        if config.exit_gate == 'learned':
            self.exit_gate = nn.Linear(C, 1)  # lambda_k = sigmoid(w . z_k + b) (Ouro, §4)
        self.lm_head = nn.Linear(C, config.vocab_size, bias=False)
        if config.tie_head:  # as in both papers' models: then embd_std is the head's scale too
            self.transformer.wte.weight = self.lm_head.weight
        if config.pos == 'rope':
            hs = C // config.n_head
            inv_freq = 1.0 / (10000 ** (torch.arange(0, hs, 2).float() / hs))
            freqs = torch.outer(torch.arange(config.block_size).float(), inv_freq)  # (T, hs/2)
            self.register_buffer('rope_cos', freqs.cos(), persistent=False)
            self.register_buffer('rope_sin', freqs.sin(), persistent=False)
        init_weights(self)

    def get_num_params(self, non_embedding=True):
        wpe = self.transformer.wpe.weight.numel() if non_embedding and self.config.pos == 'learned' else 0
        return sum(w.numel() for w in self.parameters()) - wpe  # shared: the K layers once, a tied head once

    # ---- the loop ----
    def positions(self, pos, T):
        # pos..pos+T-1: (T,), or (B, T) for rows at their own pos (B,), unchecked: no host sync (batching.py)
        if torch.is_tensor(pos):
            return pos[:, None] + torch.arange(T, device=pos.device)
        assert pos + T <= self.config.block_size, f"{pos + T} positions exceed {self.config.block_size}"
        return torch.arange(pos, pos + T, device=self.lm_head.weight.device)

    def embed(self, idx, pos=0):
        t = self.positions(pos, idx.size(1))
        x = self.transformer.wte(idx)  # (B, T, C)
        if self.config.pos == 'learned':
            x = x + self.transformer.wpe(t)
        return self.transformer.ln_emb(self.transformer.drop(x))

    def rope(self, pos, T):
        # cos, sin at positions pos..pos+T-1: (T, hs/2), or (B, 1, T, hs/2) for rows at their own
        if self.config.pos != 'rope':
            return None
        t = self.positions(pos, T)
        cos, sin = self.rope_cos[t], self.rope_sin[t]
        return (cos, sin) if t.dim() == 1 else (cos[:, None], sin[:, None])

    def untied(self, part, x, cache=None, pos=0):
        # the prelude or the coda (§4): dense blocks of their own, run once per pass, each with a slot
        rope = self.rope(pos, x.size(1))
        for j, block in enumerate(self.transformer[part]):
            x, _ = block(x, rope, None if cache is None else cache.slot(part, j), pos)
        return x

    def begin(self, idx, cache=None, pos=0):
        # e, what loop 1 reads and the injection re-feeds: tokens idx (B, T) at pos.. embedded, then prelude
        return self.untied('prelude', self.embed(idx, pos), cache, pos)

    def inject(self, x, e):
        # e re-enters (§4): added, or through the adapter W [x; e] (Huginn) | W [e; s] (§3: on s_0 = e too)
        if self.config.injection == 'add':
            return x + e
        if self.config.injection in ('concat', 'iso'):  # (B, T, 2C) -> (B, T, C)
            pair = [x, e] if self.config.injection == 'concat' else [e, x]  # W [x; e] | u = W [e; s]
            return self.transformer.adapter(torch.cat(pair, dim=-1))
        return x

    def carry(self, h, e):
        # what loop k+1 reads of h_k: the inter-loop norm (§1), then the injection (§4)
        return self.inject(self.transformer.ln_loop(h), e)

    def visit(self, x, rope, cache, k, pos, tied=None):
        # the K shared blocks once at loop k (or each row's, (B,)): (h, Routes); tied: loop 1's Routes (§5)
        routes = []
        for j, block in enumerate(self.transformer.h):  # the same K blocks every loop: weights are shared
            slot = None if cache is None else cache.slot('loop', j, k)
            x, route = block(x, rope, slot, pos, None if tied is None else tied[j].idx, k)
            routes += [route] if route else []
        return x, routes

    def advance(self, h, e, k, cache, pos):
        # every row one loop on (depth batching), each at its own loop k (B,) and pos (B,): h_k (B, 1, C)
        x = torch.where((k == 1)[:, None, None], e, self.carry(h, e).to(e.dtype))
        return self.visit(x, self.rope(pos, 1), cache, k, pos)[0]

    def loops(self, x, e, loops, cache=None, pos=0):
        """h_k = blocks(carry(h_{k-1}, e)), h_0 = e, for k in loops (in order; range(1, R + 1): a pass) from
        x (B, T, C), e or h_{k-1}: Loops([h_k], routes), h_k before any norm, where ||h_k|| is measured
        (docs/papers.md §1); routes the experts' choice at every visit of a shared layer (§5; [] dense)."""
        cfg, rope, states, routes = self.config, self.rope(pos, x.size(1)), [], []
        last, b, grad = loops[-1], cfg.backprop_loops, torch.is_grad_enabled()
        lanes = e.expand(cfg.hyper_lanes, *e.shape) if cfg.hyper_lanes else None  # §3, L lanes
        assert not (cfg.hyper_lanes or cfg.tied_routing) or loops[0] == 1, "these loops run from loop 1"
        for k in loops:
            # truncated backprop (§4): only the last b loops build a graph (b = 0: all of them)
            with torch.set_grad_enabled(grad and (b == 0 or k > last - b)):
                if lanes is not None:
                    x = self.transformer.lanes.read(lanes, k)
                elif k > 1:
                    x = self.carry(x, e)
                elif cfg.injection == 'iso':
                    x = self.inject(x, e)
                tied = routes if cfg.tied_routing and k > 1 else None  # tied routing (§5): loop 1's experts
                x, visited = self.visit(x, rope, cache, k, pos, tied)
                routes += visited
                if lanes is not None:  # exit k reads the lanes' sum
                    lanes = self.transformer.lanes.write(lanes, self.transformer.ln_loop(x), k)
                    x = lanes.sum(0)
            states.append(x)
        return Loops(states, routes)

    def run(self, idx, n_loop=None):
        # the Loops of tokens idx (B, T) through the whole pass; n_loop overrides the trained R
        R = self.config.n_loop if n_loop is None else n_loop
        assert isinstance(R, int) and R >= 1, f"n_loop must be an integer >= 1, got {R!r}"
        e = self.begin(idx)
        return self.loops(e, e, range(1, R + 1))

    # ---- the readout ----
    def readout_norm(self, h, k, R=None):
        # docs/papers.md §1: an RMSNorm/LayerNorm readout is scale-invariant (dL/dh is orthogonal to h):
        # 'raw' shows the scale; 'final_only' too at exits k < R (R: this pass's loops, default n_loop)
        R, norm = self.config.n_loop if R is None else R, self.transformer.ln_out  # (an identity if 'raw')
        if self.config.readout != 'final_only':
            return norm(h)
        if torch.is_tensor(k):  # rows at other exits (B,): depth batching
            return torch.where((k >= R).view(-1, *[1] * (h.dim() - 1)), norm(h), h)
        return norm(h) if k >= R else h

    def coda_readout(self, h, k, cache=None, pos=0, R=None):
        # z_k, what the LM head and the exit gate read at exit k: the coda, then the readout norm. Under
        # 'iso' the coda reads the normed state s_k, as the loop after it would (§3)
        h = self.transformer.ln_loop(h) if self.config.injection == 'iso' else h
        return self.readout_norm(self.untied('coda', h, cache, pos), k, R)

    def readout(self, h, k, cache=None, pos=0):
        # the logits of exit k (1-based) from its state h_k: (..., C) -> (..., V); decoders pass the cache
        return self.lm_head(self.coda_readout(h, k, cache, pos))

    def exit(self, h, k, cache=None, pos=0, last=None):
        # a decoder's exit k: (z_k (B, C), logits (B, V)) of h's last position, or each row's in last (B,)
        z = self.coda_readout(h, k, cache, pos)
        z = z[:, -1] if last is None else z[torch.arange(z.size(0), device=z.device), last]
        return z, self.lm_head(z).float()

    def gate(self, z):
        # §4 (Ouro): lambda_k = sigmoid(w . z_k + b), P(stop at exit k | not before); z (..., C) -> (...)
        return torch.sigmoid(self.exit_gate(z).float()).squeeze(-1)

    # ---- the loss ----
    def exit_weights(self, R):
        # docs/papers.md §1: per-loop = (1/R) sum_k CE_k; terminal = CE_R only
        return [1.0 / R] * R if self.config.supervision == 'per_loop' else [0.0] * (R - 1) + [1.0]

    def exit_inputs(self, states):
        # z_k of the supervised exits, each read under this pass's R (a sampled depth's)
        R = len(states)
        return [self.coda_readout(states[k - 1], k, R=R) for k, w in enumerate(self.exit_weights(R), 1) if w]

    def loss(self, out, targets, zs=None):
        # the exit CEs (weighted, or the gate's expectation), norm penalty, router losses; zs: exit inputs
        cfg, W, states = self.config, self.lm_head.weight, out.states
        zs = self.exit_inputs(states) if zs is None else zs
        if cfg.exit_gate == 'learned':
            ce = torch.stack([kernels.token_ce(z, W, targets) for z in zs])      # (R, B*T)
            lam = torch.stack([self.gate(z).flatten() for z in zs])              # (R, B*T)
            loss = gate_loss(ce, lam, cfg.exit_entropy, (targets.reshape(-1) != -1).float())
        else:
            # sum_k w_k CE(z_k W^T, y), computed without keeping R (B, T, V) logits (kernels.py)
            weights = tuple(w for w in self.exit_weights(len(states)) if w > 0)
            loss = kernels.LinearCrossEntropy.apply(W, targets, weights, torch.stack(zs))
        if cfg.norm_penalty > 0:
            # §1: lambda * mean_k mean_{b,t,d} h_k^2 over all R pre-norm states, supervised or not
            loss = loss + cfg.norm_penalty * torch.stack([h.float().pow(2).mean() for h in states]).mean()
        if cfg.n_expert:
            balance, z = router_losses(out.routes)
            loss = loss + cfg.aux_loss_coef * balance + cfg.z_loss_coef * z
        return loss

    def forward(self, idx, targets=None, n_loop=None):
        # the logits of the last position at the final exit (B, 1, V); with targets, the loss too
        out = self.run(idx, n_loop)
        if targets is None:  # inference: the coda sees every position, the head only the last
            return self.lm_head(self.coda_readout(out.states[-1], len(out.states))[:, [-1], :]), None
        zs = self.exit_inputs(out.states)  # the last is exit R's: every supervision reads exit R
        return self.lm_head(zs[-1][:, [-1], :]), self.loss(out, targets, zs)

    @torch.no_grad()
    def exit_metrics(self, idx, targets, n_loop=None):
        # diagnostics: CE at every exit 1..R, mean per-token ||h_k|| per loop, experts' (balance, z) or None
        out, W = self.run(idx, n_loop), self.lm_head.weight
        ce = torch.stack([kernels.cross_entropy_chunked(self.coda_readout(h, k), W, targets)
                          for k, h in enumerate(out.states, start=1)])
        norms = torch.stack([h.float().norm(dim=-1).mean() for h in out.states])
        return ce, norms, torch.stack(router_losses(out.routes)) if out.routes else None  # (R,), (R,), (2,)

    # ---- the optimizer, as in nanoGPT ----
    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        params = [w for w in self.parameters() if w.requires_grad]  # matrices, embeddings decay; gains don't
        groups = [{'params': [w for w in params if w.dim() >= 2], 'weight_decay': weight_decay},
                  {'params': [w for w in params if w.dim() < 2], 'weight_decay': 0.0}]
        # the fused kernel (one pass over every tensor), on GPUs and CPUs alike (PyTorch 2.4+)
        extra = dict(fused=True) if device_type in ('cuda', 'cpu') else {}
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **extra)


@torch.no_grad()
def init_weights(model):
    cfg, C, t = model.config, model.config.n_embd, model.transformer
    if cfg.init == 'reference':
        # paper 1's code: PyTorch's defaults (Kaiming-uniform Linear, N(0, 1) wte: ||h_0|| ~ sqrt(C), §1)
        nn.init.normal_(t.wte.weight, mean=0.0, std=1.0)
    else:
        # N(0, 0.02) for every matrix at every R: DeepLoop's baseline (§2; GPT-2's 1/sqrt(2N) unused)
        for w in model.parameters():
            if w.dim() >= 2:  # matrices, and the experts' stacked matrices (§5)
                nn.init.normal_(w, mean=0.0, std=0.02)
    if cfg.embd_std > 0:  # one init's embedding scale under the other's matrices: it splits the two (§1)
        for emb in (t.wte, t.wpe):
            if isinstance(emb, nn.Embedding):
                nn.init.normal_(emb.weight, mean=0.0, std=cfg.embd_std)
    if cfg.beta != 1.0:  # docs/papers.md §2: an init-only gain on W_v, attn.c_proj, the MLP; not W_q, W_k
        for block in (*t.prelude, *t.h, *t.coda):
            block.attn.c_attn.weight[2 * C:] *= cfg.beta   # the W_v rows of the q|k|v matrix
            # the MLP's matrices: a Linear's weight, or every expert's stacked (§5; not the router)
            ffn = [getattr(m, 'weight', m) for m in (block.mlp.c_fc, block.mlp.c_proj)]
            for w in (block.attn.c_proj.weight, *ffn):
                w *= cfg.beta
    if cfg.injection in ('concat', 'iso') and cfg.adapter_init == 'identity':
        # §3 (iso-depth): W = [I 0]: at first W [x; e] = x passes the state on, W [e; s] = e reads e
        t.adapter.weight.copy_(torch.cat([torch.eye(C), torch.zeros(C, C)], dim=1))
