"""
A looped (weight-tied, depth-recurrent) GPT language model in one file.

A looped transformer keeps K distinct layers (`n_layer`) and runs that stack R times (`n_loop`):
the unrolled depth is N = K*R, the parameters are those of K layers. Each round ("loop") ends in an
exit, where the state h_k can be read out into logits: per-loop supervision and early exits.

GPTConfig groups its keys by the paper each implements (formulas and numbers in docs/papers.md):
the readout blind spot (§1), DeepLoop's depth-scaled post-norm blocks (§2), loop-scaled residuals
(§3) and the recurrent-depth family: prelude, coda, injection, sampled depth, exit gate (§4).

Where to look: the loop is GPT.loops, the readout GPT.readout_norm, the loss GPT.loss, the scaling
rule GPTConfig.alpha and GPTConfig.beta. The speed kernels (attention, the chunked cross-entropy)
are in kernels.py; decoding (KV cache, early exits) is in engine.py and exits.py.
"""

import inspect
import math
from collections import namedtuple
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

import kernels
from hardware import peak_flops

LOOP_SIGMA = 0.5  # sigma of the sampled depth's log-normal (Huginn's 1/2, docs/papers.md §4)
# depth_scaling by name -> the exponent p of alpha = (2N)^p and beta = (8N)^-p (§2)
DEPTH_EXPONENTS = {'none': 0.0, 'deepnorm': 0.25, 'deeploop': 0.5}


@dataclass
class GPTConfig:
    # every field is a config key of train.py too (--n_loop=8); choices and ranges are checked in
    # configurator.py; the defaults are the embedded default run
    # ---- the looped GPT ----
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
    loop_lambda: float = 0.0       # lambda of the branch multiplier eps = lambda/(R sqrt K); 0 = off
    # ---- §4 the recurrent-depth family; the defaults switch every piece off ----
    n_prelude: int = 0             # untied blocks before the loop; their output e is re-injected
    n_coda: int = 0                # untied blocks after every exit, before the readout norm
    injection: str = 'none'        # how e re-enters loops 2..R: none | add | concat (W [x; e]) | iso (§3)
    adapter_init: str = 'identity'  # W at init: identity ([I 0], iso-depth) | default (Huginn)
    loop_sampling: str = 'fixed'   # R per training step: fixed | poisson_lognormal (mean R + 1)
    max_loop: int = 0              # cap on the sampled R; 0 = 4 x n_loop
    backprop_loops: int = 0        # gradients through the last this many loops only; 0 = all
    hyper_lanes: int = 0           # hyper-connections (§3): N lanes carried between loops; 0 = off
    exit_gate: str = 'none'        # none | learned: lambda_k = sigmoid(w . z_k + b)
    exit_entropy: float = 0.0      # learned gate: minus this times the entropy of p(k) in the loss
    # ---- §5 Looped-MoE: a mixture of experts in place of the MLP ----
    n_expert: int = 0              # E experts per MoE layer; 0 = the dense MLP
    top_k: int = 2                 # k experts per token (token choice, dropless)
    expert_hidden: int = 0         # an expert's hidden width; 0 = the MLP's 4C / k (active = dense)
    moe_where: str = 'loop'        # loop (the K shared layers) | all (prelude and coda too)
    aux_loss_coef: float = 0.01    # weight of the load-balancing loss E sum_i f_i P_i
    z_loss_coef: float = 0.001     # weight of the router z-loss mean(logsumexp(logits)^2)
    tied_routing: bool = False     # loops 2..R reuse loop 1's experts, token by token

    @property
    def loop_cap(self):
        return self.max_loop or 4 * self.n_loop  # the most loops a training step may draw

    def draw_n_loop(self, generator):
        # the loop count of one training step. poisson_lognormal (Huginn, docs/papers.md §4):
        # tau ~ Normal(log n_loop - sigma^2/2, sigma), R = Poisson(e^tau) + 1, capped. The draws
        # come from `generator` alone: seeded alike on every rank, every rank draws the same R.
        if self.loop_sampling == 'fixed':
            return self.n_loop
        mu = math.log(self.n_loop) - LOOP_SIGMA ** 2 / 2
        tau = torch.normal(mu, LOOP_SIGMA, (1,), generator=generator)
        return min(int(torch.poisson(tau.exp(), generator=generator).item()) + 1, self.loop_cap)

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
    def eps(self):
        # §3 (Wang et al.): h <- h + eps f(h) with eps = lambda / (R sqrt K); 1 when off
        return self.loop_lambda / (self.n_loop * math.sqrt(self.n_layer)) if self.loop_lambda else 1.0


def make_norm(kind, n_embd):
    # RMSNorm with eps 1e-6 as in paper 1's code; LayerNorm without a bias, as in both papers
    return nn.RMSNorm(n_embd, eps=1e-6) if kind == 'rmsnorm' else nn.LayerNorm(n_embd, bias=False)


def apply_rope(x, cos, sin):
    # x (B, nh, T, hs); rotate the two halves of each head by position-dependent angles
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        # q, k, v in one matrix
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.attn_dropout = config.dropout  # on the attention weights; none after c_proj, as paper 1's code
        self.attn_impl = config.attn_impl
        self.n_head = config.n_head

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
        # softmax(q k^T / sqrt(hs) + causal mask) v; the T queries are the last T of the keys
        dropout = self.attn_dropout if self.training else 0.0
        y = kernels.attention(q, k, v, T > 1, self.attn_impl, dropout)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, nh, T, hs) -> (B, T, C)
        return self.c_proj(y)


def activation(x, swiglu):
    # swiglu: x holds the gate and the up projection side by side; else nanoGPT's GELU
    if swiglu:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(x)


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
        return self.dropout(self.c_proj(activation(self.c_fc(x), self.swiglu)))


Route = namedtuple('Route', 'logits idx')  # one visit's routing: logits (N, E) in fp32, experts (N, k)


class MoE(nn.Module):
    """Looped-MoE's feed-forward (docs/papers.md §5): E MLPs ("experts") and a router; each token
    takes its top k. Token choice and dropless (no capacity): a token's experts never depend on the
    rest of the batch, so cached decoding routes as recompute does."""

    def __init__(self, config, tied=False):
        super().__init__()
        E, C, k = config.n_expert, config.n_embd, config.top_k
        H = config.expert_hidden or 4 * C // k  # k experts of 4C/k: the dense MLP's active parameters
        self.swiglu, self.top_k, self.tied = config.mlp == 'swiglu', k, tied
        self.router = nn.Linear(C, E, bias=False)
        # the experts' matrices stacked (E, in, out), each with nn.Linear's default init
        self.c_fc = nn.Parameter(torch.empty(E, C, (1 + self.swiglu) * H).uniform_(-C ** -0.5, C ** -0.5))
        self.c_proj = nn.Parameter(torch.empty(E, H, C).uniform_(-H ** -0.5, H ** -0.5))
        self.dropout = nn.Dropout(config.dropout)
        self.visits = []  # this pass's Route per visit, in order: a shared layer's loop k at [k - 1]

    def forward(self, x):
        B, T, C = x.size()
        x = x.view(B * T, C)                               # (N, C): every token routes alone
        logits = self.router(x).float()                    # (N, E), softmax over all E in fp32
        probs = logits.softmax(dim=-1)
        if self.tied and self.visits:  # tied routing: loop 1's experts, weights from this visit's probs
            idx = self.visits[0].idx
        else:
            idx = probs.topk(self.top_k, dim=-1).indices   # (N, k)
        w = probs.gather(-1, idx)
        w = w / w.sum(dim=-1, keepdim=True)                # the k weights renormalised
        self.visits.append(Route(logits, idx))
        # y_t = sum_j w_tj expert_{idx_tj}(x_t), tokens grouped by expert (kernels.py)
        y = kernels.moe(x, idx, w, self.c_fc, self.c_proj, lambda h: activation(h, self.swiglu))
        return self.dropout(y.view(B, T, C))


class Block(nn.Module):
    """One residual layer. The three block types are one formula with other pieces switched in:
        x <- post_norm( alpha * x + eps * f( pre_norm(x) ) )
    preln:    pre_norm = Norm, post_norm = identity    x + eps f(Norm x)       (eps: §3)
    postln:   pre_norm = identity, post_norm = Norm    Norm(alpha x + f(x))    (DeepNorm, §2)
    sandwich: pre_norm = Norm, post_norm = Norm        Norm(alpha x + f(Norm x)) (DeepLoop, §2)
    """

    def __init__(self, config, moe=False, tied=False):
        super().__init__()
        pre, post = config.block in ('preln', 'sandwich'), config.block in ('postln', 'sandwich')
        norm = lambda on: make_norm(config.norm, config.n_embd) if on else nn.Identity()
        self.ln_1, self.ln_2 = norm(pre), norm(pre)     # pre-norms (GPT-2's names)
        self.pn_1, self.pn_2 = norm(post), norm(post)   # post-norms
        self.attn = CausalSelfAttention(config)
        self.mlp = MoE(config, tied) if moe else MLP(config)  # experts where §5 puts them
        self.alpha = config.alpha       # docs/papers.md §2: alpha = (2N)^p on the skip path
        self.eps = config.eps           # docs/papers.md §3: eps = lambda/(R sqrt K) on the branch

    def forward(self, x, rope=None, kv=None, pos=0):
        x = self.pn_1(self.residual(x, self.attn(self.ln_1(x), rope, kv, pos)))
        x = self.pn_2(self.residual(x, self.mlp(self.ln_2(x))))
        return x

    def keys_values(self, x, rope=None):
        # the keys and values this block's attention computes from x (B, T, C): what a cache holds
        _, k, v = self.attn.qkv(self.ln_1(x), rope)
        return k, v

    def residual(self, x, fx):
        # alpha * x + eps * f(x). A factor of 1 is left out: exact, and in eager mode on a CPU it
        # saves a pass over the tensor (~14% of a bf16 block's time when alpha = eps = 1)
        return (x if self.alpha == 1 else self.alpha * x) + (fx if self.eps == 1 else self.eps * fx)


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
        ln_loop = dict(none=nn.Identity(), readout=ln_out).get(config.inter_loop_norm) \
            or make_norm(config.inter_loop_norm, C)
        moe, everywhere = config.n_expert > 0, config.moe_where == 'all'
        blocks = lambda n, moe, tied=False: nn.ModuleList([Block(config, moe, tied) for _ in range(n)])
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, C),
            wpe=nn.Embedding(config.block_size, C) if config.pos == 'learned' else nn.Identity(),
            drop=nn.Dropout(config.dropout),
            # DeepLoop norms the embedding, so a post-norm stack starts at RMS(x) = 1
            ln_emb=make_norm(config.norm, C) if config.block != 'preln' else nn.Identity(),
            prelude=blocks(config.n_prelude, moe and everywhere),  # untied, run once (§4)
            h=blocks(config.n_layer, moe, config.tied_routing),     # the K shared layers
            coda=blocks(config.n_coda, moe and everywhere),         # untied, at every exit (§4)
            ln_loop=ln_loop,
            ln_out=ln_out,
        ))
        if config.injection in ('concat', 'iso'):
            self.transformer.adapter = nn.Linear(2 * C, C, bias=False)  # W [x; e] (Huginn), W [e; s] (§3)
        if config.hyper_lanes:
            # §3: per loop k, alpha_k (N), M_k (N x N), beta_k (N) in one 1-D tensor (no weight decay, no
            # matrix init), at the cyclic init alpha_k = e_(k-1 mod N), M_k = I, beta_k = 1
            I = torch.eye(config.hyper_lanes)
            self.transformer.lanes = nn.ParameterList(
                torch.cat([I[k % len(I)], I.flatten(), torch.ones(len(I))]) for k in range(config.n_loop))
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
                if p.dim() >= 2:  # matrices, and the experts' stacked matrices (§5)
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
                # the MLP's matrices: a Linear's weight, or every expert's stacked (§5; not the router)
                ffn = [getattr(m, 'weight', m) for m in (block.mlp.c_fc, block.mlp.c_proj)]
                for w in (block.attn.c_proj.weight, *ffn):
                    w *= cfg.beta
        if cfg.injection in ('concat', 'iso') and cfg.adapter_init == 'identity':
            # docs/papers.md §3 (iso-depth): W = [I 0], so at first W [x; e] = x passes the state through
            # and the paper's W [e; s] = e reads the prelude output
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

    def run_untied(self, part, x, cache=None, pos=0):
        # the prelude or the coda (§4): blocks of their own, run once per pass, each with a cache slot
        rope = self.rope(pos, x.size(1))
        for j, block in enumerate(self.transformer[part]):
            x = block(x, rope, None if cache is None else cache.slot(part, j), pos)
        return x

    def prelude(self, idx, cache=None, pos=0):
        # e, what loop 1 reads and injection re-feeds: the embedded tokens after the prelude (§4).
        # A pass starts here: the experts forget the last pass's routing (§5)
        for moe in self.moe_layers():
            moe.visits.clear()
        return self.run_untied('prelude', self.embed(idx, pos), cache, pos)

    def loop_input(self, h, e, k=2):
        # what enters loop k: the inter-loop norm (§1), then the prelude output e (§4); 'iso' (§3) acts
        # before loop 1 too, on s_0 = e
        x = self.transformer.ln_loop(h) if k > 1 else h
        if self.config.injection == 'add':
            return x + e
        if self.config.injection == 'concat':
            return self.transformer.adapter(torch.cat([x, e], dim=-1))  # (B, T, 2C) -> (B, T, C)
        if self.config.injection == 'iso':
            return self.transformer.adapter(torch.cat([e, x], dim=-1))  # u = W [e; s]
        return x

    def loops(self, x, e, ks, cache=None, pos=0):
        """The recurrence h_k = blocks(loop_input(h_{k-1}, e)), h_0 = e, for the loops k in ks (in
        order: range(1, R + 1) is a whole pass). x (B, T, C) is what the first of them reads: e for
        loop 1, else h_{k-1}. Returns [h_k for k in ks], each the state after loop k's blocks,
        before any norm: where ||h_k|| is measured (docs/papers.md §1)."""
        rope, states = self.rope(pos, x.size(1)), []
        last, b, grad = ks[-1], self.config.backprop_loops, torch.is_grad_enabled()
        N = self.config.hyper_lanes  # §3: N lanes, each e at first, carry the recurrence instead of h_k
        assert not N or (ks[0] == 1 and last <= self.config.n_loop), "hyper-connections run loops 1..n_loop"
        lanes = e.expand(N, *e.shape) if N else None
        for k in ks:
            # truncated backprop (§4): only the last b loops build a graph (b = 0: all of them)
            with torch.set_grad_enabled(grad and (b == 0 or k > last - b)):
                if N:
                    alpha, M, beta = self.transformer.lanes[k - 1].split([N, N * N, N])
                    x = torch.einsum('n,n...->...', alpha, lanes)  # u = sum_n alpha_n lane_n
                elif k > 1 or self.config.injection == 'iso':
                    x = self.loop_input(x, e, k)
                for j, block in enumerate(self.transformer.h):  # the same K blocks every round
                    x = block(x, rope, None if cache is None else cache.slot('loop', j, k), pos)
                if N:  # lanes <- M lanes + beta s, s the normed state; exit k reads the lanes' sum
                    s = self.transformer.ln_loop(x)
                    lanes = torch.einsum('mn,n...->m...', M.view(N, N), lanes) + beta.view(N, 1, 1, 1) * s
                    x = lanes.sum(0)
            states.append(x)
        return states

    def states(self, idx, n_loop=None):
        # [h_1, ..., h_R] of tokens idx (B, T); n_loop overrides the trained R
        R = self.config.n_loop if n_loop is None else n_loop
        assert isinstance(R, int) and R >= 1, f"n_loop must be an integer >= 1, got {R!r}"
        e = self.prelude(idx)
        return self.loops(e, e, range(1, R + 1))

    def moe_layers(self):
        return [m for m in self.modules() if isinstance(m, MoE)]

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
        # z_k, what the LM head and the exit gate read at exit k: the coda, then the readout norm. Under
        # 'iso' the coda reads the normed state s_k, as the loop after it would (§3)
        h = self.transformer.ln_loop(h) if self.config.injection == 'iso' else h
        return self.readout_norm(self.run_untied('coda', h, cache, pos), k, R)

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

    def scale_penalty(self, states):
        # §1: norm_penalty * mean_k mean_{b,t,d} h_k^2 over the pre-norm states of all R loops, also
        # when only the last loop is supervised
        mean_sq = torch.stack([h.float().pow(2).mean() for h in states])
        return self.config.norm_penalty * mean_sq.mean()

    def gate_loss(self, zs, targets):
        # §4 (Ouro): per token sum_k p(k) CE_k - exit_entropy * H(p), p the exit distribution of
        # the learned gate over the exits' inputs zs [z_1..z_R] (B, T, C)
        W = self.lm_head.weight
        ce = torch.stack([kernels.token_ce(z, W, targets) for z in zs])         # (R, B*T)
        p = exit_distribution(torch.stack([self.gate(z).flatten() for z in zs]))  # (R, B*T)
        H = -(p * p.clamp(min=1e-12).log()).sum(0)
        valid = (targets.reshape(-1) != -1).float()
        per_token = (p * ce).sum(0) - self.config.exit_entropy * H
        return (per_token * valid).sum() / valid.sum().clamp(min=1)

    def exit_inputs(self, states):
        # z_k of the supervised exits, each read under this pass's R (a sampled depth's)
        R = len(states)
        exits = [k for k, w in enumerate(self.exit_weights(R), start=1) if w > 0]
        return [self.head_input(states[k - 1], k, R=R) for k in exits]

    def loss(self, states, targets, zs=None):
        # the weighted exit CEs (or the gate's expected CE) of the loop states + the norm penalty;
        # zs: the exits' inputs, if the caller has them already
        zs = self.exit_inputs(states) if zs is None else zs
        if self.config.exit_gate == 'learned':
            loss = self.gate_loss(zs, targets)
        else:
            # sum_k w_k CE(z_k W^T, y), computed without keeping R (B, T, V) logits (kernels.py)
            weights = tuple(w for w in self.exit_weights(len(states)) if w > 0)
            W = self.lm_head.weight
            loss = kernels.LinearCrossEntropy.apply(W, targets, weights, torch.stack(zs))
        if self.config.norm_penalty > 0:
            loss = loss + self.scale_penalty(states)
        if self.config.n_expert:
            balance, z = self.router_losses()
            loss = loss + self.config.aux_loss_coef * balance + self.config.z_loss_coef * z
        return loss

    def router_losses(self):
        # §5: the load-balancing loss E sum_i f_i P_i (f_i: the share of token slots sent to expert i,
        # P_i: its mean router probability) and the z-loss mean(logsumexp(logits)^2), per layer per
        # visit, then averaged: pooled over loops, experts used by one loop each would look balanced
        balance, z = [], []
        for moe in self.moe_layers():
            for logits, idx in moe.visits:
                E = logits.size(-1)
                f = F.one_hot(idx, E).flatten(0, -2).float().mean(0)  # (E,) over the N k slots, sums to 1
                balance.append(E * (f * logits.softmax(-1).mean(0)).sum())
                z.append(logits.logsumexp(-1).pow(2).mean())
        return torch.stack(balance).mean(), torch.stack(z).mean()

    def forward(self, idx, targets=None, n_loop=None):
        # the logits of the last position at the final exit (B, 1, V); with targets, the loss too
        states = self.states(idx, n_loop)
        if targets is None:  # inference: the coda sees every position, the head only the last
            return self.lm_head(self.head_input(states[-1], len(states))[:, [-1], :]), None
        zs = self.exit_inputs(states)  # the last is exit R's: every supervision reads exit R
        return self.lm_head(zs[-1][:, [-1], :]), self.loss(states, targets, zs)

    @torch.no_grad()
    def exit_metrics(self, idx, targets, n_loop=None):
        # diagnostics: the CE at every exit 1..R, and the mean per-token norm ||h_k|| of every loop
        states = self.states(idx, n_loop)
        W = self.lm_head.weight
        ce = torch.stack([kernels.cross_entropy_chunked(self.head_input(h, k), W, targets)
                          for k, h in enumerate(states, start=1)])
        norms = torch.stack([h.float().norm(dim=-1).mean() for h in states])
        return ce, norms  # (R,), (R,)

    # ---- the optimizer, as in nanoGPT ----
    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]    # matrices and embeddings decay; gains don't
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{'params': decay, 'weight_decay': weight_decay},
                  {'params': no_decay, 'weight_decay': 0.0}]
        # the fused kernel (one pass over every tensor), on GPUs and CPUs alike (PyTorch 2.4+)
        fused = 'fused' in inspect.signature(torch.optim.AdamW).parameters
        extra = dict(fused=True) if fused and device_type in ('cuda', 'cpu') else {}
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **extra)

# -----------------------------------------------------------------------------
# accounting, as in nanoGPT


def param_counts(model):
    # (N_once, N_rec) as the iso-depth scaling law counts them (docs/isodepth.md): N_once the blocks
    # run once (prelude, coda) and the norms outside the loop, N_rec the K shared blocks, the inter-loop
    # norm and the concat adapter (2 C^2, which the paper counts with the looped block). The embedding,
    # positions, LM head and exit gate are in neither: N is the law's non-embedding count
    t = model.transformer
    n = lambda *parts: sum(p.numel() for part in parts for p in part.parameters())
    loop_norm = () if t.ln_loop is t.ln_out else (t.ln_loop,)  # 'readout': the readout norm, once
    rec = (t.h, *loop_norm, *(t[part] for part in ('adapter', 'lanes') if part in t))
    return n(t.prelude, t.coda, t.ln_emb, t.ln_out), n(*rec)


def flops_per_token(model, T=None, n_loop=None):
    # training flops per token: forward + backward = 6 per weight use (PaLM appendix B)
    cfg = model.config
    T = cfg.block_size if T is None else T
    R = cfg.n_loop if n_loop is None else n_loop
    n_exits = sum(w > 0 for w in model.exit_weights(R))
    # truncated backprop (§4): loops 1..R-b build no graph, so they cost the forward pass only,
    # 2 flops per weight use and a third of the attention's 12 C T (the adapter before loop k is loop k's)
    free = R - cfg.backprop_loops if 0 < cfg.backprop_loops < R else 0
    # the K layers run every loop, the coda and head at every supervised exit, the prelude
    # once, the injection adapter before every loop after the first
    N = cfg.hyper_lanes  # the lanes' mixing: (N^2 + 2N) C per loop, as the paper counts it (§3)
    adapter = 2 * cfg.n_embd ** 2 if cfg.injection in ('concat', 'iso') else (N * N + 2 * N) * cfg.n_embd
    first = cfg.injection != 'concat'  # iso's W and the lanes act before loop 1 too
    # weights in use: a token's k experts of E and the router (active_params, §5)
    head = active_params(model.transformer.coda) + cfg.vocab_size * cfg.n_embd
    loops = lambda n: active_params(model.transformer.h) * n + adapter * max(n - 1 + first, 0)  # loops 1..n
    weights = loops(R) - loops(free) + active_params(model.transformer.prelude)
    visits = cfg.n_layer * (R - free) + cfg.n_prelude + cfg.n_coda * n_exits
    attn = 12 * visits * cfg.n_embd * T + 4 * cfg.n_layer * free * cfg.n_embd * T  # QK^T and AV per visit
    return 6 * (weights + head * n_exits) + 2 * loops(free) + attn


def active_params(module):
    # the parameters one token uses: k of an MoE layer's E stacked experts (§5), all of everything else
    share = lambda m, p: m.top_k / len(p) if isinstance(m, MoE) and p.dim() == 3 else 1
    return round(sum(p.numel() * share(m, p) for m in module.modules() for p in m.parameters(recurse=False)))


def estimate_mfu(model, fwdbwd_per_iter, dt, peak=None, T=None):
    # model flops utilisation of fwdbwd_per_iter sequences in dt seconds against peak FLOP/s;
    # by default the bf16 peak of this CUDA device (hardware.peak_flops; None if unknown)
    T = model.config.block_size if T is None else T
    if peak is None and torch.cuda.is_available():
        peak = peak_flops(torch.cuda.get_device_name())
    if peak is None:
        return None
    return flops_per_token(model, T) * T * fwdbwd_per_iter / dt / peak
