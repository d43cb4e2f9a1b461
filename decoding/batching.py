"""
Continuous depth batching (Schwethelm et al. 2026; docs/decoding.md): the loop's weights are shared, so
tokens at *different* loops can go through the *same* block call. Every call (step) advances each place
one loop; a row whose token exits samples and starts its next token at loop 1 the next call. A row is a
request: when it has its tokens, the next prompt takes its place (scheduling: Requests, prompt_pass).

    outs, used, stats = serve(model, prompts, 200, Decoding(batch_size=8, exit_threshold=0.9, temperature=0))

Each row attends to the slots of its own (loop, layer) visit at its own position (KVCache.view, given
each row's loop). An exit at loop k leaves in the slots of loops k+1..R what kv_policy says
(exits.fill_skipped, as at batch 1), written with the next call's exits (a skipped slot is first read two
calls on). Prompt passes and slid windows run all R loops (engine.decode_step), B rows at a time: the cache
holds up to 2B rows, passed ones waiting for a place.
"""
import functools
import time
from dataclasses import replace

import torch

from decoding import exits
from decoding.engine import Decoding, KVCache, decode_step, pick, slide


# -----------------------------------------------------------------------------
# one call: every place one loop (step), a function of tensors

def score(model, policy, z, logits, prev, first):
    """exits.score_at_exit for rows each at its own exit: rows at exit 1 (first) start afresh, the
    others go on from prev (None: every row is at exit 1)."""
    fresh, fresh_prev = exits.score_at_exit(model, policy, z, logits)
    if prev is None or fresh_prev is None:
        return fresh, fresh_prev
    later, later_prev = exits.score_at_exit(model, policy, z, logits, prev)
    pick_fresh = lambda a, b: torch.where(first.view(-1, *[1] * (a.dim() - 1)), a, b)
    return pick_fresh(fresh, later), pick_fresh(fresh_prev, later_prev)


def step(model, cache, f, R, threshold, policy):
    """Every place of flight f one loop (GPT.advance), each at its own loop, position and slots, then its
    exit and exit score: (h_k, loops run, score state, logits (B, V), done (B,): the rows that exit)."""
    first, loops = f.loops == 0, f.loops + 1  # first: the tokens that start (Flight.place began them)
    view = cache.view(f.rows, loops)
    h = model.advance(f.h, f.e, loops, view, f.pos).to(f.e.dtype)  # one block call per layer for all
    z, logits = model.exit(h, loops, view, f.pos)  # each row's exit: the readout norm follows its loop
    done, prev = loops == R, f.prev
    if threshold is not None:
        s, prev = score(model, policy, z, logits, prev, first)
        done = done | (s >= threshold)
    return h, loops, prev, logits, done


@functools.cache
def compiled(device_type):
    """step as one graph (fullgraph: a host sync inside fails the capture), on CUDA replayed as CUDA graphs;
    its shapes are the B places' and the cache's, until the last rows leave (one graph more, dynamic in B)."""
    if device_type != 'cuda':
        return torch.compile(step, fullgraph=True)
    graphs = torch.compile(step, fullgraph=True, mode='reduce-overhead')
    # a replay writes its outputs where the last one did, and serve keeps h, loops and prev for the next call
    return lambda *args: tuple(t if t is None else t.clone() for t in graphs(*args))


class FirstCalls:
    """A compiled step whose first call at each batch size is timed apart: torch.compile compiles a graph
    then, so a decoding rate leaves those seconds out (sample.py prints them beside it)."""

    def __init__(self, run):
        self.run, self.sizes, self.seconds = run, set(), 0.0

    def __call__(self, model, cache, f, *args):
        if len(f.held) in self.sizes:
            return self.run(model, cache, f, *args)
        t0 = time.perf_counter()
        out = self.run(model, cache, f, *args)
        out[-1].cpu()  # (a GPU runs the call asynchronously: wait for it)
        self.sizes.add(len(f.held))
        self.seconds += time.perf_counter() - t0
        return out

# -----------------------------------------------------------------------------
# scheduling: the requests, the places in flight, the prompt passes

class Requests:
    """The prompts, their tokens so far and the loops each new token used; which request each cache row
    serves and its window start (a window slides to its last half past the block size); the cache rows
    whose window slid, waiting to pass again, and those passed, ready for a place: (row, token, pos)."""

    def __init__(self, prompts, n_rows, max_new_tokens, block_size):
        self.tokens = [list(prompt) for prompt in prompts]
        self.used, self.queue = [[] for _ in prompts], list(range(len(prompts)))
        self.row, self.start, self.waiting, self.ready = [None] * n_rows, [0] * n_rows, [], []
        self.n, self.bs, self.refills = max_new_tokens, block_size, 0

    def add(self, c, token, loops):
        """Cache row c's next token, which used `loops`: its position, or None when the row leaves its
        place (its request has its tokens, or its window slid: it waits to pass again)."""
        r = self.row[c]
        self.tokens[r].append(token)
        self.used[r].append(loops)
        if len(self.used[r]) == self.n:
            self.row[c] = None
            return None
        if (s := slide(len(self.tokens[r]), self.start[c], self.bs)) != self.start[c]:
            self.start[c] = s
            self.refills += 1
            self.waiting.append(c)
            return None
        return len(self.tokens[r]) - 1 - self.start[c]

    def admit(self, B):
        """The cache rows of the next prompt pass: those whose window slid, then free rows that take the
        next prompts (a prompt's window: its last block_size tokens), at most B."""
        free = [c for c, r in enumerate(self.row) if r is None][:max(0, B - len(self.waiting))]
        for c in free[:len(self.queue)]:
            self.row[c] = self.queue.pop(0)
            self.start[c] = max(0, len(self.tokens[self.row[c]]) - self.bs)
        passing, self.waiting = self.waiting + free[:len(self.queue) + len(free)], []
        return [c for c in passing if self.row[c] is not None]

    def window(self, c):
        return self.tokens[self.row[c]][self.start[c]:]


def prompt_pass(model, cache, req, opts, B, R):
    """The rows req.admit gives take one pass (engine.decode_step, all R loops) together, their windows
    right-padded to the longest: padding sits past each row's own tokens, where no query of that row
    looks before its own token overwrites it. Each samples from its last token; those that go on are
    ready for a place."""
    passing, device = req.admit(B), cache.loop_key.device
    windows = [req.window(c) for c in passing]
    n = max(map(len, windows))
    idx = torch.tensor([w + w[-1:] * (n - len(w)) for w in windows], device=device)
    last = torch.tensor([len(w) - 1 for w in windows], device=device)
    logits = decode_step(model, idx, cache.view(torch.tensor(passing, device=device)), 0, R, last)
    for c, t in zip(passing, pick(logits, opts.temperature, opts.top_k)[:, 0].tolist()):
        if (pos := req.add(c, t, R)) is not None:
            req.ready.append((c, t, pos))


class Flight:
    """The B places in flight, one record of tensors indexed by place (a full batch runs a call without a
    gather): each place's cache row, the loop its token last ran (0: a new token), its position, its
    state h and prelude output e (B, 1, C), the exit score's state; held: the cache rows, on the host."""

    def __init__(self, model, B):
        w = model.lm_head.weight
        self.held, self.prev = [None] * B, None
        self.rows, self.loops, self.pos = (torch.zeros(B, dtype=torch.long, device=w.device) for _ in 'rlp')
        self.h, self.e = (w.new_zeros(B, 1, model.config.n_embd) for _ in range(2))

    def place(self, model, cache, free, ready):
        # the rows ready (row, token, position) take the free places in order, their tokens begun at once
        # to start at loop 1 next call; places left free leave the batch. Returns the rows left waiting
        if starts := [(place, *r) for place, r in zip(free, ready)]:
            place, c, token, pos = (torch.tensor(v, device=self.loops.device) for v in zip(*starts))
            self.rows[place], self.pos[place], self.loops[place] = c, pos, 0
            self.e[place] = model.begin(token[:, None], cache.view(c), pos).to(self.e.dtype)
            for place, c, _, _ in starts:
                self.held[place] = c
        if len(starts) < len(free):
            self.drop(free[len(starts):])
        return ready[len(starts):]

    def drop(self, empty):  # (only at the end: then nothing is left to pass)
        keep = [place for place in range(len(self.held)) if place not in empty]
        keep = torch.tensor(keep, dtype=torch.long, device=self.loops.device)
        self.rows, self.loops, self.pos = self.rows[keep], self.loops[keep], self.pos[keep]
        self.h, self.e = self.h[keep], self.e[keep]
        self.prev = None if self.prev is None else self.prev[keep]
        self.held = [c for place, c in enumerate(self.held) if place not in empty]


def fill_pending(model, cache, pending, R):
    # the skipped slots of the exits pending (rows, h_k, e, loops, positions each), in one write
    if pending:
        exits.fill_skipped(model, cache, *(torch.cat(t) for t in zip(*pending)), R)
    return []


@torch.no_grad()
def serve(model, prompts, max_new_tokens, opts=Decoding()):
    """Decode max_new_tokens after each prompt (token lists), opts.batch_size rows in flight: the token lists
    in prompt order, the loops each new token used, and counts: calls (of the blocks), refills (windows
    slid), passes (prompt passes), full (the share of the calls' B places that held a row), compiling (with
    opts.compile: the seconds of the calls that compiled, the first at each batch shape)."""
    R, o = opts.n_loop or model.config.n_loop, opts
    assert (why := replace(o, batch_size=2).why_not(model.config, loose=True)) is None, why  # B = 1 too
    threshold = o.threshold_score()
    # the cache holds up to 2B rows: B in flight and up to B more passed, so that prompts take their pass B
    # at a time (as engine.generate's batches do), not one by one each time a row frees
    B = max(1, min(o.batch_size, len(prompts)))
    cache = KVCache(model, max(B, min(2 * B, len(prompts))), R, model.lm_head.weight.device,
                    model.lm_head.weight.dtype, o.kv_policy, o.kv_slots)
    req = Requests(prompts, cache.B, max_new_tokens, model.config.block_size)
    f, free, pending, calls, ran, passes = Flight(model, B), list(range(B)), [], 0, 0, 0
    run = FirstCalls(compiled(cache.loop_key.device.type)) if o.compile else step
    while max_new_tokens and (free or f.held):
        while len(req.ready) < len(free) and (req.waiting or req.queue):  # passed rows for the free places
            pending = fill_pending(model, cache, pending, R)  # before a pass writes over a done row's
            prompt_pass(model, cache, req, o, B, R)
            passes += 1
        req.ready = f.place(model, cache, free, req.ready)
        if not f.held:
            break
        f.h, f.loops, f.prev, logits, done = run(model, cache, f, R, threshold, o.exit_policy)
        calls, ran = calls + 1, ran + len(f.held)
        out = done.nonzero().squeeze(1)
        early, stale = out[f.loops[out] < R], bool(pending)  # a skipped slot is first read two calls on
        pending.append((f.rows[early], f.h[early], f.e[early], f.loops[early], f.pos[early]))
        pending = fill_pending(model, cache, pending, R) if stale else pending
        free, back = out.tolist(), []  # the places that exited; their rows that go on take them first
        new = pick(logits[out], o.temperature, o.top_k)[:, 0].tolist()
        for place, t, k in zip(free, new, f.loops[out].tolist()):
            if (pos := req.add(f.held[place], t, k)) is not None:
                back.append((f.held[place], t, pos))
        req.ready[:0] = back
    return req.tokens, req.used, dict(calls=calls, refills=req.refills, passes=passes,
                                      full=ran / max(1, B * calls), compiling=getattr(run, 'seconds', 0.0))
