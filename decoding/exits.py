"""
Early exits in decoding: a token stops at the first loop whose exit score reaches a threshold, and what it
leaves in the cache slots of the loops it skips (docs/decoding.md). engine.generate (adaptive_step) and
batching.serve (score_at_exit, fill_skipped) call this file only when an exit threshold is set;
fixed-depth decoding never does.

    logits, used = adaptive_step(model, idx, cache, pos, R, score_threshold('maxprob', 0.9), 'maxprob')

Exit policies score how ready a position is to stop at exit k (docs/papers.md §1; §4 for kl and gate):
three confidences of one exit's logits, the KL between successive exits (Huginn) and the learned gate's
cumulative exit probability (Ouro).

A row that exits at loop k skips loops k+1..R, but later tokens attend to those visits' slots. What it
leaves there is the kv_policy:
  recompute  the K/V of its exit state carried into the next loop, carry(h_k, e), in every skipped
             visit (CALM): exact for that state
  copy       the K/V it wrote at loop k for the same layer (Huginn): no compute at all
  shared     kv_slots slots per layer, loop k in slot (k-1) mod kv_slots (Huginn's sharing): memory
             independent of R; later loops overwrite earlier ones, and a skipped visit writes nothing
             unless its slot holds nothing of this token yet (then it copies loop k's)
  active     nothing: loop k's attention sees only the positions that reached loop k (MoR)
"""
import itertools
import math

import torch

EXIT_POLICIES = ('maxprob', 'margin', 'entropy', 'kl', 'gate')
KV_POLICIES = ('recompute', 'copy', 'shared', 'active')
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
                     f"(kl and gate need score_at_exit)")


def score_at_exit(model, policy, z, logits, prev=None):
    """(score, prev') at exit k, called for k = 1, 2, ... in order: how ready each position is to stop
    there (higher = readier), from its readout input z_k and logits_k (..., V), and what exit k+1's
    score needs of it, passed back in as prev (None at exit 1). 'kl' scores -KL(p_{k-1} || p_k)
    (-inf at exit 1) and passes log p_k on; 'gate' scores the learned gate's cumulative exit
    probability 1 - prod_{j<=k} (1 - lambda_j) and passes the product on; the others need nothing."""
    if policy == 'gate':
        lam = model.gate(z)
        stay = 1 - lam if prev is None else prev * (1 - lam)  # the chance of not having exited yet
        return 1 - stay, stay
    if policy == 'kl':
        logp = logits.float().log_softmax(-1)
        if prev is None:
            return torch.full(logp.shape[:-1], -math.inf, device=logp.device), logp
        return -(prev.exp() * (prev - logp)).sum(-1), logp  # -KL(p_{k-1} || p_k)
    return exit_score(logits, policy), None


def fill_skipped(model, cache, rows, h, e, exit_k, pos, R):
    """Cache rows `rows` (P,) whose tokens at positions pos (P,) exit at loops exit_k (P,) < R, with states h
    (P, 1, C) and prelude outputs e: fill the slots of the loops they skip as cache.policy says, in one
    write for every row, loop and layer (KVCache.fill). Eager decoding passes one exit loop and position as
    ints (rows None: all of them), depth batching tensors."""
    key = value = None  # copy, shared: the keys and values each row wrote at its exit loop
    if cache.policy == 'recompute':
        x, rope = model.carry(h, e), model.rope(pos, 1)  # what loop k+1 would read, the same in each
        kv = [block.kv(x, rope) for block in model.transformer.h]       # each layer's (P, nh, 1, hs) twice
        key, value = (torch.stack(t, 1)[:, :, :, 0] for t in zip(*kv))  # (P, K, nh, hs)
    cache.fill(rows, pos, exit_k, R, key, value)


@torch.no_grad()
def adaptive_forward(model, idx, cache, pos, R, threshold, policy, rows=None):
    """Run tokens idx (B, T) at positions pos.. through up to R loops, writing the cache: the last
    position's logits (B, V) at each row's exit and the loops each row used (B,). A row stops at the
    first loop whose score reaches threshold (a score: see score_threshold), and leaves the batch for the
    loops after it; fill_skipped fills the slots it skips ('active': hides them). rows: the cache rows
    idx's rows are (default: all)."""
    B = idx.size(0)
    every = torch.arange(B, device=idx.device)

    def cache_rows(r):
        # the cache rows of idx's rows r; None: all of them, as one slice, as fixed-depth decoding reads them
        return rows[r] if rows is not None else None if r.numel() == B else r

    view = lambda r: cache.view(cache_rows(r))  # the cache seen through idx's rows r

    logits = torch.zeros(B, model.config.vocab_size, device=idx.device)
    used = torch.full((B,), float(R), device=idx.device)
    h = e = model.begin(idx, view(every), pos)
    live, prev = every, None                   # the rows still looping; what their next score needs
    h_exit = torch.zeros_like(e)               # the state each row exited with (for the coda)
    for k in range(1, R + 1):
        h, = model.loops(h, e, [k], view(live), pos).states  # loop k, on the rows still looping
        z, logits_k = model.exit(h, k, view(live), pos)       # (B', C), (B', V); the coda writes its slots
        score, prev = score_at_exit(model, policy, z, logits_k, prev)
        out = torch.ones_like(live, dtype=torch.bool) if k == R else score >= threshold
        if not bool(out.any()):
            continue
        done = live[out]
        logits[done], used[done], h_exit[done] = logits_k[out], float(k), h[out]
        if k < R and cache.policy == 'active':  # loops k+1..R's attention will not see this position
            for later, j in itertools.product(range(k + 1, R + 1), range(cache.K)):
                view(done).slot('loop', j, later).hide(pos)
        elif k < R:  # done's cache rows, each exiting at loop k, position pos
            fill_skipped(model, cache, cache_rows(done), h[out], e[out], k, pos, R)
        live, stay = live[~out], ~out
        if live.numel() == 0:
            break
        h, e = h[stay], e[stay]                             # the next loops run on the rows that stay
        prev = None if prev is None else prev[stay]
    if model.config.n_coda:
        model.untied('coda', h_exit, view(every), pos)      # the coda's slots at pos, from each exit state
    return logits, used


def adaptive_step(model, idx, cache, pos, R, threshold, policy):
    """adaptive_forward for the tokens idx (B, T) at pos; under kv_policy 'active' a batch goes one row
    at a time, since each row's attention sees the positions that reached the loop in its own history."""
    if cache.policy != 'active' or idx.size(0) == 1:
        return adaptive_forward(model, idx, cache, pos, R, threshold, policy)
    out = [adaptive_forward(model, idx[b:b + 1], cache, pos, R, threshold, policy,
                            rows=torch.tensor([b], device=idx.device)) for b in range(idx.size(0))]
    return torch.cat([o[0] for o in out]), torch.cat([o[1] for o in out])
