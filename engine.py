"""
Decoding a looped GPT: the KV cache, a decode step with a fixed or an adaptive exit, generate,
self-speculative decoding (docs/decoding.md).

The model knows nothing of this file: its attention asks the cache for a visit's slot
(cache.slot(part, j, k)) and hands it the new keys and values (slot.update). Everything else about
decoding lives here: which rows are still looping, what a row that exited early leaves in the
slots of the visits it skips (the kv_policy), the context past the block size, and when to stop.

    cache = KVCache(model, B, R, device, dtype, policy='recompute')
    logits, used = decode_step(model, idx, cache, pos, R, threshold, policy)
    idx, used = generate(model, idx, max_new_tokens, temperature=0.8, exit_threshold=0.9)
    idx, used = generate(model, idx, max_new_tokens, draft_loops=2, speculate=4)  # fixed-R's tokens

Exit policies score how ready a position is to stop at exit k (docs/papers.md §1; §4 for kl and
gate): three confidences of one exit's logits, the KL between successive exits (Huginn) and the
learned gate's cumulative exit probability (Ouro).
"""
import math

import torch
from torch.nn import functional as F

EXIT_POLICIES = ('maxprob', 'margin', 'entropy', 'kl', 'gate')
# the range of each policy's exit_threshold: a score to reach, or for kl a bound (exit when KL <= it)
THRESHOLD_RANGES = dict(maxprob=(0.0, 1.0), margin=(0.0, math.inf), entropy=(0.0, 1.0),
                        kl=(0.0, math.inf), gate=(0.0, 1.0))


def score_threshold(policy, threshold):
    """The score an exit must reach under `policy` for a user's exit_threshold, checked against its
    range: -threshold for 'kl' (its scores are -KL), the threshold itself for the others."""
    low, high = THRESHOLD_RANGES[policy]
    if not low <= threshold <= high:
        raise ValueError(f"exit_threshold={threshold!r} is outside [{low:g}, {high:g}], the range of "
                         f"exit_policy={policy!r}")
    return -threshold if policy == 'kl' else threshold


def exit_score(logits, policy):
    """How sure an exit is of its next token, from its logits (..., V); higher = more sure."""
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
    raise ValueError(f"exit policy {policy!r}: choose one of maxprob, margin, entropy "
                     f"(kl and gate need an ExitScorer)")


def check_decoding(R, policy, slots, k, speculate, exit_threshold):
    """kv_policy, kv_slots, draft_loops (k) and speculate that make sense together at R loops:
    ValueError, in the terms of sample.py's flags, for a combination that does not."""
    def require(ok, msg):
        if not ok:
            raise ValueError(msg)
    require(slots is None or policy == 'shared',
            f"--kv_slots={slots} sets the slots of --kv_policy=shared: add it, or drop --kv_slots")
    require(policy != 'shared' or slots is not None,
            f"--kv_policy=shared needs --kv_slots=N, the cache slots per layer (1..{R})")
    require(policy != 'shared' or slots <= R,
            f"--kv_slots={slots}: a token runs only {R} loops, so this model uses at most {R} slots")
    require(policy not in ('copy', 'active') or exit_threshold is not None or k is not None,
            f"--kv_policy={policy} decides what exited tokens leave in the cache: add --exit_threshold")
    require(speculate is None or k is not None,
            f"--speculate={speculate} is the draft length of self-speculative decoding: add --draft_loops")
    if k is None:
        return
    require(k < R, f"--draft_loops={k}: drafts must use fewer loops than the {R} each token runs "
            f"(1..{R - 1})")
    require(exit_threshold is None,
            "--draft_loops: self-speculative decoding gives fixed-depth tokens; drop --exit_threshold")
    require(policy != 'shared',
            "--draft_loops: verifying drafts needs every loop's own cache slots; drop --kv_policy=shared")


class ExitScorer:
    """score(z_k, logits_k) -> (...), called for exits k = 1, 2, ... in order: how ready each
    position is to stop at exit k (higher = readier). 'kl' scores -KL(p_{k-1} || p_k) between
    successive exits (-inf at exit 1); 'gate' the learned gate's cumulative exit probability
    1 - prod_{j<=k} (1 - lambda_j). keep(rows) follows the rows that stay in the batch."""

    def __init__(self, model, policy):
        assert policy in EXIT_POLICIES, f"exit policy {policy!r}: choose one of {EXIT_POLICIES}"
        assert policy != 'gate' or model.config.exit_gate == 'learned', "'gate' needs a learned gate"
        self.model, self.policy = model, policy
        self.prev = None  # kl: the last exit's log-probs; gate: the chance of not having exited yet

    def __call__(self, z, logits):
        if self.policy == 'gate':
            lam = self.model.gate(z)
            self.prev = 1 - lam if self.prev is None else self.prev * (1 - lam)
            return 1 - self.prev
        if self.policy == 'kl':
            logp = logits.float().log_softmax(-1)
            if self.prev is None:
                out = torch.full(logp.shape[:-1], -math.inf, device=logp.device)
            else:
                out = -(self.prev.exp() * (self.prev - logp)).sum(-1)  # -KL(p_{k-1} || p_k)
            self.prev = logp
            return out
        return exit_score(logits, self.policy)

    def keep(self, rows):
        self.prev = None if self.prev is None else self.prev[rows]


KV_POLICIES = ('recompute', 'copy', 'shared', 'active')


class Slot:
    """The keys and values of one visit, (B, nh, block_size, hs) each. Under kv_policy 'active' also
    which positions reached this visit, (B, block_size): attention sees only those."""

    def __init__(self, cache, shape, device, dtype, reach=False):
        self.cache = cache
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.reach = torch.zeros(shape[0], shape[2], dtype=torch.bool, device=device) if reach else None

    def update(self, k, v, pos):
        # write k, v (B', nh, T, hs) at positions pos..pos+T-1 and return the history 0..pos+T-1
        T, rows = k.size(2), self.cache.rows
        r = slice(None) if rows is None else rows
        self.k[r, :, pos:pos + T], self.v[r, :, pos:pos + T] = k, v
        if self.reach is None:
            return self.k[r, :, :pos + T], self.v[r, :, :pos + T]
        # 'active': hand attention only the positions that reached this visit. That is a key mask
        # without one in the model, but it must be the same for every row in the step: decode_step
        # runs rows whose earlier tokens exited at other loops one at a time
        self.reach[r, pos:pos + T] = True
        seen = self.reach[r, :pos + T]
        if bool(seen.all()):
            return self.k[r, :, :pos + T], self.v[r, :, :pos + T]
        assert bool((seen == seen[:1]).all()), "'active' rows with other histories go one at a time"
        at = seen[0].nonzero().squeeze(1)
        return self.k[r][:, :, at], self.v[r][:, :, at]

    def copy(self, other, pos):
        # this visit's K/V at pos are other's: no compute (kv_policy 'copy')
        r = slice(None) if self.cache.rows is None else self.cache.rows
        self.k[r, :, pos], self.v[r, :, pos] = other.k[r, :, pos], other.v[r, :, pos]


class KVCache:
    """One slot per (loop, layer) visit: loop k re-uses layer j's weights but sees other inputs, so
    it has its own keys and values. The prelude and the coda (run once per token) have one slot
    per block. rows: the batch rows the model runs on now (None = all); exited rows leave.

    A row that exits at loop k skips loops k+1..R, but later tokens attend to those visits' slots.
    What it leaves there is the policy (docs/decoding.md):
      recompute  the K/V of its exit state carried forward (CALM): exact for that state
      copy       the K/V it wrote at loop k for the same layer (Huginn): no compute at all
      shared     kv_slots slots per layer, loop k in slot (k-1) mod kv_slots (Huginn's sharing):
                 memory independent of R; later loops overwrite earlier ones, and a skipped
                 visit writes nothing unless its slot holds nothing of this token yet (then copy)
      active     nothing: loop k's attention sees only the positions that reached loop k (MoR)
    """

    def __init__(self, model, B, R, device, dtype, policy='recompute', kv_slots=None):
        assert policy in KV_POLICIES, f"kv_policy={policy!r}: choose one of {', '.join(KV_POLICIES)}"
        n = kv_slots if policy == 'shared' else R
        assert isinstance(n, int) and n >= 1, f"kv_slots={n!r}: the shared policy needs >= 1 slot"
        cfg = model.config
        shape = (B, cfg.n_head, cfg.block_size, cfg.n_embd // cfg.n_head)
        new = lambda n, reach=False: [Slot(self, shape, device, dtype, reach) for _ in range(n)]
        self.slots = dict(prelude=new(cfg.n_prelude), loop=new(n * cfg.n_layer, policy == 'active'),
                          coda=new(cfg.n_coda))
        self.K, self.n, self.policy, self.rows = cfg.n_layer, n, policy, None
        self.offset = 0  # loops already run: the model's loop k is loop offset + k (speculative)

    def slot(self, part, j, k=1):
        if part != 'loop':
            return self.slots[part][j]
        return self.slots['loop'][(k + self.offset - 1) % self.n * self.K + j]

    def nbytes(self):
        tensors = [t for s in sum(self.slots.values(), []) for t in (s.k, s.v, s.reach) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def skip(self, model, h, e, k, R, pos):
        """Rows self.rows exited at loop k with state h (B', T, C) and prelude output e: fill the
        slots of the visits of loops k+1..R at pos, as the policy says."""
        loop = lambda k2, j: self.slot('loop', j, k2)
        if self.policy == 'recompute':
            x, rope = model.carry(h, e), model.rope(pos, h.size(1))  # what loop k+1 would read
            for k2 in range(k + 1, R + 1):
                for j, block in enumerate(model.transformer.h):
                    _, keys, values = block.attn.qkv(block.ln_1(x), rope)
                    loop(k2, j).update(keys, values, pos)
        elif self.policy == 'copy':
            for k2 in range(k + 1, R + 1):
                for j in range(self.K):
                    loop(k2, j).copy(loop(k, j), pos)
        elif self.policy == 'shared':
            # loops 1..k filled slots 1..min(k, n) at pos; any slot left would hold no K/V of it
            for k2 in range(k + 1, min(R, self.n) + 1):
                for j in range(self.K):
                    loop(k2, j).copy(loop(k, j), pos)
        else:  # active: loops k+1..R's attention will not see this position
            r = slice(None) if self.rows is None else self.rows
            for k2 in range(k + 1, R + 1):
                for j in range(self.K):
                    loop(k2, j).reach[r, pos] = False


@torch.no_grad()
def decode_step(model, idx, cache, pos, n_loop, threshold=None, policy='maxprob', rows=None):
    """Run tokens idx (B, T) at positions pos.. through up to n_loop loops, writing the cache.
    Returns the last position's logits (B, V) at each row's exit and the loops each row used (B,).
    Without a threshold every row runs n_loop loops; with one (a score, see score_threshold) a row
    stops at the first loop whose score reaches it and leaves the batch for the loops after it;
    cache.skip fills the slots it skips. rows: the cache rows idx's rows are (default: all)."""
    B = idx.size(0)
    every = torch.arange(B, device=idx.device)

    def run_on(r):
        # the model runs on rows r of idx next: the cache reads and writes their rows (None = all)
        if rows is not None:
            cache.rows = rows[r]
        else:
            cache.rows = None if r.numel() == B else r

    run_on(every)
    logits = torch.zeros(B, model.config.vocab_size, device=idx.device)
    used = torch.full((B,), float(n_loop), device=idx.device)
    x = e = model.untied('prelude', model.embed(idx, pos), cache, pos)
    score = None if threshold is None else ExitScorer(model, policy)
    live = every                               # the rows still looping
    h_exit = torch.zeros_like(x)               # the state each row exited with (for the coda)
    loops, sent = model.loops(x, n_loop, cache, pos), None
    for k in range(1, n_loop + 1):
        _, h = loops.send(sent)
        sent = None
        if score is None and k < n_loop:
            continue
        z = model.head_input(h, k, cache, pos)[:, -1]      # (B', C); the coda writes its slots
        logits_k = model.lm_head(z).float()                # (B', V)
        last = torch.ones_like(live, dtype=torch.bool)
        out = last if k == n_loop else score(z, logits_k) >= threshold
        if not bool(out.any()):
            continue
        done = live[out]
        logits[done], used[done], h_exit[done] = logits_k[out], float(k), h[out]
        if k < n_loop:
            run_on(done)
            cache.skip(model, h[out], e[out], k, n_loop, pos)
        live, stay = live[~out], ~out
        if live.numel() == 0:
            break
        run_on(live)    # the next loops run on the rows that stay
        e = e[stay]
        score.keep(stay)
        sent = (h[stay], e)
    run_on(every)
    if score is not None and model.config.n_coda:
        model.untied('coda', h_exit, cache, pos)  # the coda's slots at pos, from each exit state
    cache.rows = None
    return logits, used


def step(model, idx, cache, pos, n_loop, threshold, policy):
    """decode_step for the last tokens idx (B, 1); under kv_policy 'active' a batch whose rows exit
    at other loops goes one row at a time, since each row's attention sees other positions."""
    if cache.policy != 'active' or threshold is None or idx.size(0) == 1:
        return decode_step(model, idx, cache, pos, n_loop, threshold, policy)
    out = [decode_step(model, idx[b:b + 1], cache, pos, n_loop, threshold, policy,
                       rows=torch.tensor([b], device=idx.device)) for b in range(idx.size(0))]
    return torch.cat([o[0] for o in out]), torch.cat([o[1] for o in out])


def probs(logits, temperature, top_k):
    # the distribution a token is sampled from: logits / temperature, only the top_k kept
    logits = logits / temperature
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits[logits < v[:, [-1]]] = -float('Inf')
    return F.softmax(logits, dim=-1)


def pick(logits, temperature, top_k):
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    return torch.multinomial(probs(logits, temperature, top_k), num_samples=1)


def draft(model, idx, cache, pos, k):
    """Loops 1..k of the tokens idx (B, 1) at pos, writing their slots: exit k's logits (B, V) and
    the state (h_k, e) (B, 1, C) each that verify goes on from."""
    e = model.untied('prelude', model.embed(idx, pos), cache, pos)
    for _, h in model.loops(e, k, cache, pos):
        pass
    z = model.head_input(h, k, cache, pos)[:, -1]  # (its coda slot is rewritten by verify)
    return model.lm_head(z).float(), (h, e)


def verify(model, state, cache, pos, k, R):
    """Loops k+1..R and the coda of the T drafted positions pos..pos+T-1 in one pass, from their
    states (h_k, e) (B, T, C) after loop k: exit R's logits (B, T, V), the numbers fixed-R steps
    compute, since loops 1..k are the draft's own. The T positions go through the model as one
    multi-token step (the causal mask puts draft i after drafts 0..i-1), writing their slots of
    loops k+1..R and of the coda; where decoding reads the weights, T cost about what one does."""
    h, e = state
    cache.offset = k  # the model numbers these loops 1..R-k: they are loops k+1..R
    loops, sent = model.loops(model.carry(h, e), R - k, cache, pos), None
    for _ in range(R - k):
        _, h = loops.send(sent)
        sent = (h, e)  # the generator took its input for e: send the prelude's back
    cache.offset = 0
    return model.lm_head(model.head_input(h, R, cache, pos)).float()


def speculate_round(model, idx, cache, pos, R, k, gamma, temperature, top_k, stats):
    """One round of self-speculative decoding after idx (B, T), whose last token (at pos) has not
    run yet: draft gamma tokens with loops 1..k, then verify them with loops k+1..R from the
    drafted states, all gamma positions in one pass. Returns the 1..gamma tokens (B, n) kept,
    fixed-R decoding's own: greedy, the same tokens; sampled, the same distribution (accept a
    draft x with probability min(1, p_R(x) / p_k(x)), else resample from max(0, p_R - p_k),
    normalised). A batch keeps tokens up to the first position some row rejects (exact for every
    row). Slots past the kept positions hold drafts: each is rewritten before any query reads it
    (the next round drafts and verifies from the first position not kept)."""
    tok, drafts, states = idx[:, -1:], [], []
    for i in range(gamma):
        q_logits, state = draft(model, tok, cache, pos + i, k)
        tok = pick(q_logits, temperature, top_k)
        drafts.append((q_logits, tok))
        states.append(state)
    h, e = (torch.cat(s, dim=1) for s in zip(*states))   # (B, gamma, C) each
    p_all = verify(model, (h, e), cache, pos, k, R)       # (B, gamma, V)
    out = []
    for i, (q_logits, tok) in enumerate(drafts):
        p_logits = p_all[:, i]
        if temperature == 0:
            fix = p_logits.argmax(dim=-1, keepdim=True)
            ok = fix == tok
        else:
            p, q = probs(p_logits, temperature, top_k), probs(q_logits, temperature, top_k)
            px, qx = p.gather(1, tok), q.gather(1, tok)
            ok = torch.rand_like(px) * qx < px            # u < p(x) / q(x), u ~ U[0, 1)
            rest = (p - q).clamp(min=0)
            rest = torch.where(rest.sum(-1, keepdim=True) > 0, rest, p)  # (rows that accept anyway)
            fix = torch.multinomial(rest, num_samples=1)
        stats['checked'] += ok.numel()
        stats['accepted'] += int(ok.sum())
        out.append(torch.where(ok, tok, fix))
        if not bool(ok.all()):
            break
    stats['drafted'] += gamma * idx.size(0)
    return torch.cat(out, dim=1)


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, n_loop=None,
             exit_threshold=None, exit_policy='maxprob', use_cache=True, kv_policy='recompute',
             kv_slots=None, draft_loops=None, speculate=None, stats=None):
    """Sample max_new_tokens after idx (B, T); returns (idx with them, loops per new token (B, new)).
    Fixed exit: every token stops at loop n_loop (default R). Adaptive exit: a token stops at the
    first loop whose exit score reaches exit_threshold (for 'kl': whose KL to the previous exit is
    at most it). temperature 0 = greedy. The prompt runs all n_loop loops, and so does the first
    new token, which is read off the prompt pass. kv_policy (and kv_slots for 'shared'): what an
    exited token leaves in the cache slots of the loops it skips (KVCache). Self-speculative
    decoding: draft_loops=k and speculate=gamma draft gamma tokens with loops 1..k and keep those
    that loops k+1..R confirm: fixed-R decoding, exactly (speculate_round). stats: a dict to count
    in: refills (the window slid); drafted, checked and accepted drafts (speculative).

    Past the block size the context is cropped as in nanoGPT, but half a block at a time: when the
    window idx[:, start:] is full, it slides to its last block_size/2 tokens and the cache is
    refilled from them (positions restart at 0 after a crop, so the old keys are invalid). A refill
    is one pass over block_size/2 tokens every block_size/2 + 1 tokens: O(1) per token; cropping
    to the last block_size tokens at every step re-runs the whole window for every token. The
    price: a token past the first block sees block_size/2..block_size tokens of context, not always
    block_size. The uncached path crops the same way, so both decode alike (docs/decoding.md)."""
    R = model.config.n_loop if n_loop is None else n_loop
    assert exit_policy in EXIT_POLICIES, f"exit_policy={exit_policy!r}: one of {EXIT_POLICIES}"
    assert use_cache or exit_threshold is None, "adaptive exit needs the KV cache"
    threshold = None if exit_threshold is None else score_threshold(exit_policy, exit_threshold)
    assert draft_loops is None or (1 <= draft_loops < R and speculate >= 1 and use_cache
                                   and exit_threshold is None and kv_policy != 'shared'), \
        "speculative decoding drafts with 1..R-1 loops, speculate >= 1, fixed exits, an exact cache"
    stats = {} if stats is None else stats
    for key in ('refills', 'drafted', 'checked', 'accepted'):
        stats.setdefault(key, 0)
    bs = model.config.block_size
    start = max(0, idx.size(1) - bs)  # the context window is idx[:, start:]
    cache, used_all, n_new = None, [], 0
    while n_new < max_new_tokens:
        if idx.size(1) - start > bs:
            start, cache = idx.size(1) - max(1, bs // 2), None
            stats['refills'] += 1
        pos = idx.size(1) - 1 - start  # the last token's position in the window (once cached)
        if not use_cache:
            logits, _ = model(idx[:, start:], n_loop=R)
            logits = logits[:, -1, :].float()
            used = torch.full((idx.size(0),), float(R), device=idx.device)
        elif cache is None:
            cache = KVCache(model, idx.size(0), R, idx.device, model.lm_head.weight.dtype,
                            kv_policy, kv_slots)
            logits, used = decode_step(model, idx[:, start:], cache, 0, R)
        elif draft_loops is not None:
            # the drafts stay inside the window and the tokens asked for
            gamma = min(speculate, bs - pos, max_new_tokens - n_new)
            new = speculate_round(model, idx, cache, pos, R, draft_loops, gamma, temperature, top_k,
                                  stats)
            idx, n_new = torch.cat((idx, new), dim=1), n_new + new.size(1)
            used_all += [torch.full((idx.size(0),), float(R), device=idx.device)] * new.size(1)
            continue
        else:
            logits, used = step(model, idx[:, -1:], cache, pos, R, threshold, exit_policy)
        idx, n_new = torch.cat((idx, pick(logits, temperature, top_k)), dim=1), n_new + 1
        used_all.append(used)
    return idx, torch.stack(used_all, dim=1) if used_all else torch.zeros(idx.size(0), 0)
