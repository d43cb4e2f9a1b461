"""
Continuous depth batching (Schwethelm et al. 2026; docs/decoding.md): the loop's weights are shared, so
tokens at *different* loops can go through the *same* block call. Every call advances each row one loop;
a row whose token exits is read out, samples, and starts its next token at loop 1 in the next call, while
the others go on. A row is a request: when it has its tokens, the next prompt takes its place.

    outs, used, stats = serve(model, prompts, 200, Decoding(batch_size=8, exit_threshold=0.9, temperature=0))

Each row attends to the cache slots of its own (loop, layer) visit at its own position: RowSlot gathers
them per row and masks the positions past the row's own. A token that exits at loop k leaves in the slots
of loops k+1..R what kv_policy says (exits.fill_skipped, as at batch 1), written with the next call's
exits (a skipped slot is first read two calls on). The state of the B rows in flight is indexed by their
place in the batch, so that a full batch needs no gather of it. A prompt's prefill, a window that slides
past the block size and the first token after them run all R loops, as engine.generate does, through
engine.decode_step: the cache holds up to 2B rows, so the next B prompts take that pass together and
wait, passed, for rows to free (not one prompt a pass, each time a row frees).
"""
from dataclasses import replace

import torch

import exits
from engine import Decoding, KVCache, decode_step, pick


# -----------------------------------------------------------------------------
# the cache, seen by rows at their own loops and positions

class RowSlot:
    """One part's keys and values seen by some rows, each at its own visit: k and v flattened to
    (visits x rows, nh, T, hs), and idx (B',) the entry each row reads and writes. index_select on the
    first dimension gathers far faster than an index over two dimensions (plane, row)."""

    def __init__(self, k, v, idx):
        self.k, self.v, self.idx = k.flatten(0, -4), v.flatten(0, -4), idx

    def write(self, k, v, pos):
        # k, v (B', nh, 1, hs): each row's new token at its own position pos (B',)
        self.k[self.idx, :, pos] = k[:, :, 0].to(self.k.dtype)  # (AMP computes in bf16)
        self.v[self.idx, :, pos] = v[:, :, 0].to(self.v.dtype)

    def update(self, k, v, pos):
        # write, then each row's keys and values 0..max(pos) and the mask of the positions it has
        self.write(k, v, pos)
        n = int(pos.max()) + 1
        keys, values = (t[:, :, :n].index_select(0, self.idx) for t in (self.k, self.v))  # (B', nh, n, hs)
        mask = torch.arange(n, device=pos.device) <= pos[:, None]                     # (B', n)
        return keys, values, mask[:, None, None, :]


class RowView:
    """The cache seen by cache rows `rows` (B',): what GPT.loops and GPT.untied ask for. With loops
    (B',) each row's loop slots are its own loop's, whatever loop the caller names: GPT.loops then runs
    one loop for rows that stand at different loops."""

    def __init__(self, cache, rows, loops=None):
        self.cache, self.rows, self.loops, self.K, self.n = cache, rows, loops, cache.K, cache.n
        self.B = cache.loop_k.size(2)
        self.entry = None if loops is None else self.layer_0(loops)  # once a view, not once a layer

    def layer_0(self, k):
        # the loop's tensors are (slots, K, B, ...): row b at loop k reads entry ((k-1) mod n, j, b), j = 0
        return (k - 1) % self.n * self.K * self.B + self.rows

    def slot(self, part, j, k=1):
        c = self.cache
        if part != 'loop':
            s = c.slots[part][j]
            return RowSlot(s.k, s.v, self.rows)
        entry = self.entry if self.entry is not None else self.layer_0(k)
        return RowSlot(c.loop_k, c.loop_v, entry + j * self.B)

# -----------------------------------------------------------------------------
# one call: every row one loop

def readout(model, h, ks, view, pos):
    """z_k and the logits (B', V) of rows at exits ks (B',): the coda and the readout norm, which
    depends on the exit only for 'final_only' (exit R is normed, the others are not)."""
    if model.config.readout != 'final_only':
        z = model.coda_readout(h, 1, view, pos)[:, -1]
    else:
        z = torch.empty_like(h[:, -1])
        for k in ks.unique().tolist():
            r = (ks == k).nonzero().squeeze(1)
            z[r] = model.coda_readout(h[r], k, RowView(view.cache, view.rows[r]), pos[r])[:, -1]
    return z, model.lm_head(z).float()


def score(model, policy, z, logits, prev, first):
    """exits.score_at_exit for rows each at its own exit: rows at exit 1 (first) start afresh, the
    others go on from prev (None: every row is at exit 1)."""
    fresh, fresh_prev = exits.score_at_exit(model, policy, z, logits)
    if prev is None or fresh_prev is None or bool(first.all()):
        return fresh, fresh_prev
    later, later_prev = exits.score_at_exit(model, policy, z, logits, prev)
    pick_fresh = lambda a, b: torch.where(first.view(-1, *[1] * (a.dim() - 1)), a, b)
    return pick_fresh(fresh, later), pick_fresh(fresh_prev, later_prev)


def fill_skipped(model, cache, rows, h, e, ks, pos, R):
    """Rows `rows` that exit at loops ks < R fill the slots of the loops they skip, as exits.fill_skipped
    does at batch 1, in one write for every row, skipped loop and layer: the keys and values of
    carry(h_k, e) (recompute) or of the row's own exit loop (copy, shared). A row may come twice (two
    tokens' exits, at two positions)."""
    # shared: loops 1..k filled slots 1..min(k, n) at pos; only the slots past them hold nothing of it
    last = min(R, cache.n) if cache.policy == 'shared' else R
    loops = torch.arange(1, last + 1, device=ks.device)
    i, c = (loops > ks[:, None]).nonzero().unbind(1)  # row i skips loop loops[c]
    layers = torch.arange(cache.K, device=ks.device) * cache.loop_k.size(2)
    entry = lambda k: (RowView(cache, rows[i]).layer_0(k)[:, None] + layers).flatten()  # (P K,)
    to, p = entry(loops[c]), pos[i].repeat_interleave(cache.K)
    keys, values = cache.loop_k.flatten(0, 2), cache.loop_v.flatten(0, 2)  # (n K N, nh, T, hs)
    if cache.policy == 'recompute':
        x, rope = model.carry(h, e), model.rope(pos, 1)  # what loop k+1 would read, the same in each
        kv = [block.attn.qkv(block.ln_1(x), rope)[1:] for block in model.transformer.h]
        for t, new in ((keys, [k for k, _ in kv]), (values, [v for _, v in kv])):
            t[to, :, p] = torch.stack(new, 1)[i, :, :, 0].flatten(0, 1).to(t.dtype)  # (P K, nh, hs)
    else:
        frm = entry(ks[i])
        for t in (keys, values):
            t[to, :, p] = t[frm, :, p]

# -----------------------------------------------------------------------------
# serving many prompts

class Requests:
    """The prompts, their tokens so far and the loops each new token used; which request each cache row
    serves, and each row's window start (a window slides to its last half past the block size)."""

    def __init__(self, prompts, B, max_new_tokens, block_size):
        self.tokens = [list(p) for p in prompts]
        self.used, self.queue = [[] for _ in prompts], list(range(len(prompts)))
        self.row, self.start = [None] * B, [0] * B
        self.n, self.bs, self.refills = max_new_tokens, block_size, 0

    def add(self, b, token, loops):
        """Row b's next token, which used `loops`: 'done' (the request has its tokens, the row is free),
        'slide' (the window is full: it moves to its last half, to be refilled), or its position."""
        r = self.row[b]
        self.tokens[r].append(token)
        self.used[r].append(loops)
        if len(self.used[r]) == self.n:
            self.row[b] = None
            return 'done'
        if len(self.tokens[r]) - self.start[b] > self.bs:
            self.start[b] = len(self.tokens[r]) - max(1, self.bs // 2)
            self.refills += 1
            return 'slide'
        return len(self.tokens[r]) - 1 - self.start[b]

    def window(self, b):
        return self.tokens[self.row[b]][self.start[b]:]


@torch.no_grad()
def serve(model, prompts, max_new_tokens, opts=Decoding()):
    """Decode max_new_tokens after each prompt (lists of token ids) as opts say, opts.batch_size rows in
    flight, with continuous depth batching. Returns the token lists (prompt and new tokens) in prompt
    order, the loops each new token used, and counts: calls (of the loop's blocks), refills (windows that
    slid), passes (prompt passes), full (the share of the calls' B places that held a row)."""
    cfg, device = model.config, model.lm_head.weight.device
    R, exit_policy = opts.n_loop or cfg.n_loop, opts.exit_policy
    temperature, top_k = opts.temperature, opts.top_k
    why = replace(opts, batch_size=2).why_not(cfg, loose=True)  # one row in flight runs at its own loop
    assert why is None, why
    if max_new_tokens == 0:
        return [list(p) for p in prompts], [[] for _ in prompts], dict(calls=0, refills=0, passes=0, full=0.0)
    t = opts.exit_threshold
    threshold = None if t is None else exits.score_threshold(exit_policy, t)
    B = max(1, min(opts.batch_size, len(prompts)))
    # the cache holds up to 2B rows: B in flight and up to B more whose prompt pass is done, so that the
    # prompts go through their pass B at a time (as engine.generate's batches do), not one by one
    N = max(B, min(2 * B, len(prompts)))
    cache = KVCache(model, N, R, device, model.lm_head.weight.dtype, opts.kv_policy, opts.kv_slots)
    req, calls, passes, ran = Requests(prompts, N, max_new_tokens, cfg.block_size), 0, 0, 0
    # the B places in flight, each a cache row with its token in flight: the state is indexed by place,
    # so that a full batch runs a call without gathering it
    at = [None] * B                                          # each place's cache row
    rows = torch.zeros(B, dtype=torch.long, device=device)   # the same, as a tensor
    ks = torch.zeros(B, dtype=torch.long, device=device)     # the last loop run (0: a new token)
    pos = torch.zeros(B, dtype=torch.long, device=device)    # the token's position in its window
    h, e = (torch.zeros(B, 1, cfg.n_embd, device=device, dtype=model.lm_head.weight.dtype) for _ in range(2))
    ready, waiting, prev = [], [], None  # (row, token, position) passed; rows to pass again; score state
    starts = []    # (place, row, token, position): the tokens that start at loop 1 in the next call
    unfilled = []  # the last call's early exits: (rows, h_k, e, loops, positions), for fill_skipped

    def refill(free):
        # free places take the rows that are ready (when none is, one prompt pass makes more); then the
        # tokens that start are placed and embedded, all at once. A place that none takes leaves the
        # batch: then nothing is left to pass, so this happens only at the end
        nonlocal at, rows, ks, pos, h, e, prev
        for p in free:
            while not ready and (waiting or req.queue):
                prompt_pass()
            at[p] = ready[0][0] if ready else None
            if ready:
                starts.append((p, *ready.pop(0)))
        if starts:  # embed and prelude, each token at its own position
            p, c, t, q = (torch.tensor(v, device=device) for v in zip(*starts))
            rows[p], pos[p], ks[p] = c, q, 0
            e[p] = model.prelude(model.embed(t[:, None], q), RowView(cache, c), q).to(e.dtype)
            starts.clear()
        if None in at:
            keep = [p for p, c in enumerate(at) if c is not None]
            keep = torch.tensor(keep, dtype=torch.long, device=device)
            rows, ks, pos, h, e = (t[keep] for t in (rows, ks, pos, h, e))
            prev = None if prev is None else prev[keep]
            at = [c for c in at if c is not None]

    def prompt_pass():
        # the rows whose window slid and the next prompts, into free cache rows, take one pass together,
        # their windows right-padded to the longest: padding sits past each row's own tokens, where no
        # query of that row looks before its own token overwrites it; then each samples from its last token
        nonlocal passes
        fill()  # before a new prompt's pass can write over a finished row's slots
        free = [c for c in range(N) if req.row[c] is None][:max(0, B - len(waiting))]
        passing = waiting[:] + [c for c in free if enter(c)]
        waiting.clear()
        windows = [req.window(c) for c in passing]
        n = max(map(len, windows))
        idx = torch.tensor([w + w[-1:] * (n - len(w)) for w in windows], device=device)
        last = torch.tensor([len(w) - 1 for w in windows], device=device)
        logits = decode_step(model, idx, cache.select(torch.tensor(passing, device=device)), 0, R, last)
        passes += 1
        for c, t in zip(passing, pick(logits, temperature, top_k)[:, 0].tolist()):
            step = req.add(c, t, R)
            if goes_on(c, step):
                ready.append((c, t, step))

    def goes_on(c, step):
        # whether cache row c runs its new token next (step: its position), or frees its place: its request
        # is done, or its window slid and it waits to pass again
        if step == 'slide':
            waiting.append(c)
        return step not in ('done', 'slide')

    def fill():
        # a skipped slot is first read two calls after its exit (loop 2 of the next token), so the exits
        # of two calls fill their slots in one pass: the weights of the recompute are read half as often
        if unfilled:
            fill_skipped(model, cache, *(torch.cat(t) for t in zip(*unfilled)), R)
            unfilled.clear()

    def enter(c):
        # the next prompt into free cache row c (its window: the prompt's last block_size tokens)
        if not req.queue:
            return False
        req.row[c] = req.queue.pop(0)
        req.start[c] = max(0, len(req.tokens[req.row[c]]) - cfg.block_size)
        return True

    refill(range(B))
    while at:
        first = ks == 0  # the tokens that start (refill embedded them)
        # what loop k+1 reads of h_k: the inter-loop norm, then the injection (a new token reads e)
        x = torch.where(first[:, None, None], e, model.carry(h, e).to(e.dtype))
        ks += 1
        view = RowView(cache, rows, ks)
        # one block call per layer for every place, each at its own loop (its slots) and position
        h = model.loops(x, e, [1], view, pos).states[0].to(e.dtype)
        calls, ran = calls + 1, ran + len(at)
        z, logits = readout(model, h, ks, view, pos)
        done = ks == R
        if threshold is not None:
            s, prev = score(model, exit_policy, z, logits, prev, first)
            done |= s >= threshold
        out, stale = done.nonzero().squeeze(1), bool(unfilled)  # stale: the last call's exits wait
        early = out[ks[out] < R]
        if early.numel():
            unfilled.append((rows[early], h[early], e[early], ks[early], pos[early]))
        if stale:
            fill()
        if out.numel() == 0:
            continue
        free = []  # the places whose request is done or must pass again
        for p, t, used in zip(out.tolist(), pick(logits[out], temperature, top_k)[:, 0].tolist(),
                              ks[out].tolist()):
            step = req.add(at[p], t, used)
            if goes_on(at[p], step):
                starts.append((p, at[p], t, step))
            else:
                free.append(p)
        refill(free)
    full = ran / (calls * B) if calls else 0.0
    return req.tokens, req.used, dict(calls=calls, refills=req.refills, passes=passes, full=full)
