"""
Decoding a looped GPT, in gpt-fast's order: the options, sampling, the KV cache, one fixed-depth decode
step, self-speculative decoding, then generate (docs/decoding.md). Early exits are in exits.py. The model
knows nothing of this file: it asks the cache for a visit's slot (cache.slot) and hands it the visit's key
and value (slot.update); this file asks the model for the steps of decoding (model.begin, model.exit).

    cache = KVCache(model, B, R, device, dtype)
    logits = decode_step(model, idx, cache, pos, R)            # all rows, all R loops
    idx, used, stats = generate(model, idx, max_new_tokens, Decoding(temperature=0.8))
    idx, used, stats = generate(model, idx, max_new_tokens, Decoding(exit_threshold=0.9))        # exits.py
    idx, used, stats = generate(model, idx, max_new_tokens, Decoding(draft_loops=2, speculate=4))  # fixed-R's
"""
import copy
from collections import Counter
from dataclasses import dataclass, fields

import torch
from torch.nn import functional as F

from decoding import exits

# -----------------------------------------------------------------------------
# the options

@dataclass
class Decoding:
    """How generate and serve decode; why_not holds every rule of which options go together."""
    temperature: float = 1.0      # 1 = as trained, < 1 sharper, 0 = greedy
    top_k: int = None             # keep the top_k most likely tokens (None = all)
    n_loop: int = None            # loops per token (None = the trained R)
    exit_threshold: float = None  # an early exit at the first loop whose score reaches it (exits.py)
    exit_policy: str = 'maxprob'  # the score (exits.EXIT_POLICIES)
    kv_policy: str = 'recompute'  # what an exit leaves in the slots it skips (exits.KV_POLICIES)
    kv_slots: int = None          # kv_policy='shared': the slots per layer
    draft_loops: int = 0          # self-speculative decoding: drafts from this many loops (0 = off)
    speculate: int = None         # tokens per draft (None = 4)
    batch_size: int = 1           # serve: rows in flight (continuous depth batching, batching.py)
    use_cache: bool = True        # False: recompute the window at every token (the reference)
    compile: bool = False         # serve: its step compiled as one graph (batching.compiled)

    @classmethod
    def from_flags(cls, flags, explicit=()):
        """The options of sample.py's flags (a dict holding them): a flag's "off" value (-1 for
        exit_threshold, 0 for top_k, n_loop and kv_slots) is None here, and speculate counts only where
        given (explicit)."""
        opts = {f.name: flags[f.name] for f in fields(cls) if f.name in flags}
        for key, off in dict(top_k=0, n_loop=0, exit_threshold=-1, kv_slots=0).items():
            if opts.get(key) == off:
                opts[key] = None
        if 'speculate' not in explicit:  # the flag's default 4 is not a choice: why_not tells them apart
            opts['speculate'] = None
        return cls(**opts)

    def why_not(self, cfg, loose=False):
        """Why these options cannot decode a model of config cfg, in sample.py's flags, or None. loose (a
        library call): only what would decode wrong, not the options that would do nothing."""
        R, adaptive, draft, n, gamma = self.n_loop or cfg.n_loop, self.exit_threshold is not None, \
            self.draft_loops, self.kv_slots, self.speculate
        shared, kv, rows = self.kv_policy == 'shared', self.kv_policy, self.batch_size > 1 or self.compile
        features = cfg.loop_features  # what loop k reads besides h_{k-1}, e and its slots (model.LoopFeature)
        carried = next((f.why for f in features if f.carried), None)
        rules = [
            (not adaptive or self.exit_policy != 'gate' or cfg.exit_gate == 'learned', "--exit_policy=gate "
             "reads the learned exit gate, and this model has none: use maxprob, margin, entropy or kl"),
            (loose or not n or shared, f"--kv_slots={n} sets the slots of --kv_policy=shared: add it"),
            (not shared or n, f"--kv_policy=shared needs --kv_slots=N, the slots per layer (1..{R})"),
            (loose or not n or n <= R, f"--kv_slots={n}: a token runs only {R} loops, so at most {R} slots"),
            (loose or kv not in ('copy', 'active') or adaptive or draft,
             f"--kv_policy={kv} decides what exited tokens leave in the cache: add --exit_threshold"),
            (loose or draft or gamma is None, f"--speculate={gamma} is the draft length: add --draft_loops"),
            (draft < R, f"--draft_loops={draft}: drafts must use fewer loops than the {R} each token runs "
                        f"(1..{R - 1})"),
            (loose or not (draft and adaptive), "--draft_loops gives fixed-depth tokens: drop "
             "--exit_threshold"),
            (loose or not (draft and shared), "--draft_loops verifies with every loop's own slots: drop "
             "--kv_policy=shared"),
            (not (cfg.tied_routing and adaptive), "--exit_threshold drops exited rows between loops, and "
             "this model's tied_routing=True needs loop 1's experts for every row: drop --exit_threshold"),
            (not (cfg.tied_routing and draft), "--draft_loops verifies loops k+1.. in another pass, and "
             "this model's tied_routing=True needs loop 1's experts from the same pass: drop --draft_loops"),
            (not (carried and (adaptive or draft)), f"--exit_threshold and --draft_loops run loop k apart "
             f"from loops 1..k-1, and this model's {carried} within one pass: drop them"),
            (not (rows and draft), "--draft_loops verifies a batch of rows in step: drop it or use "
             "--batch_size=1, no --compile"),
            (not (rows and features), "--batch_size > 1 and --compile run rows at different loops in one "
             f"call, and this model's {features[0].why if features else ''}: use --batch_size=1, no "
             "--compile"),
            (not (rows and kv == 'active'), "--kv_policy=active masks visits per history, one row at a time: "
             "use --batch_size=1, no --compile, or another kv_policy"),
            (self.use_cache or not rows, "use_cache=False recomputes each window: batch_size=1, no compile")]
        why = next((msg for ok, msg in rules if not ok), None)
        if why is None and adaptive:
            try:
                exits.score_threshold(self.exit_policy, self.exit_threshold)  # within the policy's range
            except ValueError as e:
                why = f"--{e}"
        return why

    def threshold_score(self):
        # the score an exit must reach (exits.score_threshold), or None: every token runs all its loops
        return None if self.exit_threshold is None else exits.score_threshold(self.exit_policy,
                                                                               self.exit_threshold)

# -----------------------------------------------------------------------------
# sampling

def probs(logits, temperature, top_k):
    # the distribution a token is sampled from: logits / temperature, only the top_k kept
    logits = logits / temperature
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits[logits < v[:, [-1]]] = -float('Inf')
    return F.softmax(logits, dim=-1)


def pick(logits, temperature, top_k):
    # the next token (B, 1) from logits (B, V); temperature 0 = greedy
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    return torch.multinomial(probs(logits, temperature, top_k), num_samples=1)

# -----------------------------------------------------------------------------
# the cache

class Slot:
    """The keys and values of one visit, key and value (n, nh, block_size, hs), seen through `rows` (a slice,
    or a LongTensor: the entries the model runs on now, cache rows or, in the tensor of every loop's slots,
    each row's own visit). Under kv_policy 'active' also which positions reached this visit, reach
    (B, block_size): attention sees only those."""

    def __init__(self, key, value, reach=None, rows=slice(None)):
        self.key, self.value, self.reach, self.rows = key, value, reach, rows

    def write(self, key, value, pos):
        # key, value (B', nh, T, hs) at positions pos..pos+T-1, or (T = 1) at each row's own pos (B',), in
        # the cache's dtype (AMP computes in bf16)
        if torch.is_tensor(pos):
            key, value, at = key[:, :, 0], value[:, :, 0], pos
        else:
            at = slice(pos, pos + key.size(2))
        self.key[self.rows, :, at] = key.to(self.key.dtype)
        self.value[self.rows, :, at] = value.to(self.value.dtype)

    def update(self, key, value, pos):
        # write key, value, then return the history the queries see: (keys, values, key mask or None)
        T, r = key.size(2), self.rows
        self.write(key, value, pos)
        if torch.is_tensor(pos):  # rows at their own positions: every position, masked past each row's own
            n = self.key.size(2)  # (no host read of pos: a compiled step has no sync)
            keys, values = (t.index_select(0, r) for t in (self.key, self.value))  # (B', nh, n, hs)
            mask = torch.arange(n, device=pos.device) <= pos[:, None]              # (B', n)
            return keys, values, mask[:, None, None, :]
        if self.reach is None:  # every row has the whole history 0..pos+T-1
            return self.key[r, :, :pos + T], self.value[r, :, :pos + T], None
        # 'active': hand attention only the positions that reached this visit. That is a key mask
        # without one in the model, but it must be the same for every row in the step: exits.py
        # runs rows whose earlier tokens exited at other loops one at a time
        self.reach[r, pos:pos + T] = True
        seen = self.reach[r, :pos + T]
        if bool(seen.all()):
            return self.key[r, :, :pos + T], self.value[r, :, :pos + T], None
        assert bool((seen == seen[:1]).all()), "'active' rows with other histories go one at a time"
        cols = seen[0].nonzero().squeeze(1)
        return self.key[r][:, :, cols], self.value[r][:, :, cols], None

    def hide(self, pos):
        # 'active': these rows' token at pos never reached this visit, so attention will not see it
        self.reach[self.rows, pos] = False


class KVCache:
    """One slot per (loop, layer) visit: loop k re-uses layer j's weights but sees other inputs, so it has
    its own keys and values. The prelude and the coda (run once per token) have one slot per block.
    policy and kv_slots: what a token that exits early leaves in the slots it skips (exits.KV_POLICIES);
    'shared' keeps kv_slots slots per layer, loop k in slot (k-1) mod kv_slots, whatever R."""

    def __init__(self, model, B, R, device, dtype, policy='recompute', kv_slots=None):
        cfg = model.config
        n = kv_slots if policy == 'shared' else R
        shape = (B, cfg.n_head, cfg.block_size, cfg.n_embd // cfg.n_head)
        zeros = lambda *size, dtype=dtype: torch.zeros(size, device=device, dtype=dtype)
        untied = lambda n: [Slot(zeros(*shape), zeros(*shape)) for _ in range(n)]
        # the loop's slots are views of one tensor of keys, one of values, (n K B, nh, T, hs): rows at other
        # loops gather from it in one index, and a compiled step writes it in place (batching.py)
        self.loop_key, self.loop_value = (zeros(n * cfg.n_layer * B, *shape[1:]) for _ in range(2))
        reach = lambda: zeros(B, cfg.block_size, dtype=torch.bool) if policy == 'active' else None
        visit = lambda t, s, j: t.view(n, cfg.n_layer, *shape)[s, j]  # (B, nh, T, hs)
        loop = [Slot(visit(self.loop_key, s, j), visit(self.loop_value, s, j), reach())
                for s in range(n) for j in range(cfg.n_layer)]
        self.slots = dict(prelude=untied(cfg.n_prelude), loop=loop, coda=untied(cfg.n_coda))
        self.K, self.n, self.B, self.policy = cfg.n_layer, n, B, policy
        self.rows, self.entries = None, None  # a view's (see view)

    def view(self, rows=None, loops=None):
        # the cache seen through cache rows `rows` (B',) (None: all), for the model run on those rows only;
        # loops (B',): each row's own loop, whose slots its loop visits then use (depth batching)
        view = copy.copy(self)
        view.rows, view.entries = rows, None if loops is None else self.entry(loops, rows)  # once a view
        return view

    def slot(self, part, j, k=1):
        # the slot of part's layer j (at loop k), seen through this view's rows
        if part == 'loop' and self.entries is not None:  # each row's own loop's, in the one tensor of all
            return Slot(self.loop_key, self.loop_value, None, self.entries + j * self.B)
        s = self.slots[part][(k - 1) % self.n * self.K + j if part == 'loop' else j]
        return s if self.rows is None else Slot(s.key, s.value, s.reach, self.rows)

    def entry(self, k, rows):
        # where cache rows `rows` keep loop k's keys of layer 0 in loop_key (layer j: j B further on)
        return (k - 1) % self.n * self.K * self.B + rows

    def fill(self, rows, pos, exit_k, R, key=None, value=None):
        """Cache rows `rows` (P,) whose tokens at positions pos (P,) exit at loops exit_k (P,) < R: write in
        the slots of the loops they skip key and value (P, K, nh, hs), or (None) those of their exit loop,
        in one write for every row, loop and layer (a row may come twice, at two positions). The loops a
        row ran keep their slots, written back as they are: no host read of which. 'shared': loops 1..k
        filled slots 1..min(k, n) at pos; only the slots past them hold nothing of it."""
        last = min(R, self.n)
        if not torch.is_tensor(exit_k):  # eager decoding: one exit loop and position, rows None or (P,):
            return self.fill_slice(rows, pos, exit_k, last, key, value)
        loops = torch.arange(1, last + 1, device=rows.device)
        layers = torch.arange(self.K, device=rows.device)
        entry = lambda k: self.entry(k, rows[:, None])[..., None] + layers * self.B  # (P, L, K) in loop_key
        to, at, skip = entry(loops), pos[:, None, None], (loops > exit_k[:, None])[..., None, None, None]
        for t, new in ((self.loop_key, key), (self.loop_value, value)):
            new = t[entry(exit_k[:, None]), :, at] if new is None else new[:, None].to(t.dtype)  # (P, 1, K..)
            t[to, :, at] = torch.where(skip, new, t[to, :, at])                               # (P, L, K..)

    def fill_slice(self, rows, pos, exit_k, last, key, value):
        # fill's write when every row exits at one loop and position: the skipped slots are one slice,
        # copied in place (15 us at batch 1, d 512, against 80 for the gathered write)
        if exit_k >= last:  # ('shared': loops past the n slots left nothing to fill)
            return
        r = slice(None) if rows is None else rows
        for t, new in ((self.loop_key, key), (self.loop_value, value)):
            t = t.view(self.n, self.K, self.B, *t.shape[1:])  # (n, K, B, nh, T, hs): loop k in slot k - 1
            new = t[exit_k - 1, :, r, :, pos] if new is None else new.transpose(0, 1).to(t.dtype)
            t[exit_k:last, :, r, :, pos] = new                 # (L, K, P, nh, hs)

    def nbytes(self):
        slots = sum(self.slots.values(), [])
        tensors = [t for s in slots for t in (s.key, s.value, s.reach) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

# -----------------------------------------------------------------------------
# fixed-depth decoding

@torch.no_grad()
def decode_step(model, idx, cache, pos, R, last=None):
    """Tokens idx (B, T) at pos..pos+T-1 through every loop, writing their slots: the logits (B, V) at exit R
    of the last position, or of each row's in last (B,) (rows padded past their tokens: batching.py)."""
    e = model.begin(idx, cache, pos)
    h = model.loops(e, e, range(1, R + 1), cache, pos).states[-1]
    return model.exit(h, R, cache, pos, last)[1]  # the coda sees every position: it writes their slots

# -----------------------------------------------------------------------------
# self-speculative decoding: the first k loops draft, the rest verify; no second model

def draft(model, idx, cache, pos, k):
    """Loops 1..k of the tokens idx (B, 1) at pos, writing their slots: exit k's logits (B, V) and the
    state (h_k, e) (B, 1, C) each that verify goes on from."""
    e = model.begin(idx, cache, pos)
    h = model.loops(e, e, range(1, k + 1), cache, pos).states[-1]
    return model.exit(h, k, cache, pos)[1], (h, e)  # (its coda slot is rewritten by verify)


def verify(model, state, cache, pos, k, R):
    """Loops k+1..R and the coda of the T drafted positions pos.. in one multi-token pass from their states
    (h_k, e) (B, T, C): exit R's logits (B, T, V), fixed-R's numbers (loops 1..k are the draft's own)."""
    h, e = state
    h = model.loops(h, e, range(k + 1, R + 1), cache, pos).states[-1]
    return model.readout(h, R, cache, pos).float()


def speculate_round(model, idx, cache, pos, R, k, gamma, temperature, top_k):
    """One round after idx (B, T), its last token (at pos) not run yet: gamma drafts from loops 1..k,
    verified by loops k+1..R in one pass. Returns the 1..gamma tokens (B, n) kept, fixed-R's own (sampled:
    accept x with probability min(1, p_R(x) / p_k(x)), else resample from max(0, p_R - p_k)), up to the
    first position some row rejects, and the counts; slots past them are rewritten before any read."""
    tok, drafts, states = idx[:, -1:], [], []
    for i in range(gamma):
        draft_logits, state = draft(model, tok, cache, pos + i, k)
        tok = pick(draft_logits, temperature, top_k)
        drafts.append((draft_logits, tok))
        states.append(state)
    h, e = (torch.cat(s, dim=1) for s in zip(*states))   # (B, gamma, C) each
    verified = verify(model, (h, e), cache, pos, k, R)    # (B, gamma, V)
    out, counts = [], Counter(drafted=gamma * idx.size(0))
    for i, (draft_logits, tok) in enumerate(drafts):
        if temperature == 0:
            fix = verified[:, i].argmax(dim=-1, keepdim=True)
            ok = fix == tok
        else:
            p_R, p_k = probs(verified[:, i], temperature, top_k), probs(draft_logits, temperature, top_k)
            px_R, px_k = p_R.gather(1, tok), p_k.gather(1, tok)
            ok = torch.rand_like(px_R) * px_k < px_R       # u < p_R(x) / p_k(x), u ~ U[0, 1)
            rest = (p_R - p_k).clamp(min=0)
            rest = torch.where(rest.sum(-1, keepdim=True) > 0, rest, p_R)  # (rows that accept anyway)
            fix = torch.multinomial(rest, num_samples=1)
        counts.update(checked=ok.numel(), accepted=int(ok.sum()))
        out.append(torch.where(ok, tok, fix))
        if not bool(ok.all()):
            break
    return torch.cat(out, dim=1), counts

# -----------------------------------------------------------------------------
# generate

def slide(n, start, block_size):
    # where the window of n tokens from start begins: past the block size it slides to its last half
    return n - max(1, block_size // 2) if n - start > block_size else start


@torch.no_grad()
def generate(model, idx, max_new_tokens, opts=Decoding()):
    """Sample max_new_tokens after idx (B, T) as opts say. Returns idx with them, the loops each new token
    used (B, new), and counts: refills (the window slid), drafted, checked, accepted drafts. The prompt and
    the first new token run all loops. Past the block size the window slides to its last half and the
    cache is refilled from it, as the uncached path crops (docs/decoding.md: O(1) per token)."""
    why = opts.why_not(model.config, loose=True)
    assert why is None, why
    o, R, bs = opts, opts.n_loop or model.config.n_loop, model.config.block_size
    threshold = o.threshold_score()
    start, cache, used = max(0, idx.size(1) - bs), None, []  # the context window is idx[:, start:]
    stats = Counter(refills=0, drafted=0, checked=0, accepted=0)
    while len(used) < max_new_tokens:
        if (s := slide(idx.size(1), start, bs)) != start:
            start, cache = s, None
            stats['refills'] += 1
        pos = idx.size(1) - 1 - start  # the last token's position in the window (once cached)
        loops = torch.full((idx.size(0),), float(R), device=idx.device)
        if not o.use_cache:
            logits = model(idx[:, start:], n_loop=R)[0][:, -1, :].float()
        elif cache is None:  # the prefill: the window's every token, every loop
            dtype = model.lm_head.weight.dtype
            cache = KVCache(model, idx.size(0), R, idx.device, dtype, o.kv_policy, o.kv_slots)
            logits = decode_step(model, idx[:, start:], cache, 0, R)
        elif o.draft_loops:  # the drafts stay inside the window and the tokens asked for
            gamma = min(o.speculate or 4, bs - pos, max_new_tokens - len(used))
            new, counts = speculate_round(model, idx, cache, pos, R, o.draft_loops, gamma, o.temperature,
                                          o.top_k)
            idx, used = torch.cat((idx, new), dim=1), used + [loops] * new.size(1)
            stats.update(counts)
            continue
        elif threshold is not None:
            logits, loops = exits.adaptive_step(model, idx[:, -1:], cache, pos, R, threshold, o.exit_policy)
        else:
            logits = decode_step(model, idx[:, -1:], cache, pos, R)
        idx = torch.cat((idx, pick(logits, o.temperature, o.top_k)), dim=1)
        used.append(loops)
    return idx, torch.stack(used, dim=1) if used else torch.zeros(idx.size(0), 0), dict(stats)
