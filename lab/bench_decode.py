"""
The decoding rows of lab/bench.py, each with the cells it puts in the table: the KV cache (row 4) and adaptive
exits (5) against fixed-R decoding; adaptive decoding per kv_policy (13), the cache's memory (14), decoding
past the block size (15), self-speculative decoding (16), and continuous depth batching against today's
batched decoding (18). The models are untrained (GPT-2 init): the rows time decoding, they say nothing of
what a trained model would emit.
"""

import argparse
import os
import statistics
import sys
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the core is one folder up
from decoding import batching
from decoding.engine import Decoding, KVCache, generate
from decoding.exits import KV_POLICIES, exit_score
from model import GPTConfig
from bench_timing import build, side_by_side, sync


# -----------------------------------------------------------------------------
# rows 4, 5: decoding

EXIT_POLICY = 'maxprob'  # row 5's exit score (one of decoding.exits.EXIT_POLICIES)


def random_tokens(vocab_size, T, seed, device):
    """One row (1, T) of random token ids."""
    return torch.randint(vocab_size, (1, T), generator=torch.Generator().manual_seed(seed)).to(device)


def decode_model(spec, block_size, device):
    # init='gpt2': under the reference init, wte ~ N(0, 1) and the tied head make exit 1 echo the input token
    # with probability ~1, and every token would leave after one loop
    model = build(device, **dict(spec, block_size=block_size), init='gpt2').eval()
    return model.to(torch.bfloat16) if device.type == 'cuda' else model


@torch.no_grad()
def median_first_exit_score(model, T, device):
    """The median exit score of exit 1 over T random tokens. On an untrained model the scores mean nothing;
    as a threshold this makes about half the tokens leave after the first loop."""
    probe = random_tokens(model.config.vocab_size, T, seed=1, device=device)
    h1 = model.run(probe, n_loop=1).states[0]
    return exit_score(model.readout(h1, 1), EXIT_POLICY).median().item()


def time_decoding(run, model, prompt, n_new, threshold):
    """Median seconds to sample n_new tokens: 'cached', 'uncached' (no KV cache) and 'adaptive' (cached,
    adaptive exit at threshold); and the mean loops per new token of the adaptive run."""
    def gen(use_cache, exit_threshold=None):
        def decode():
            torch.manual_seed(0)
            return generate(model, prompt, n_new, Decoding(temperature=1.0, use_cache=use_cache,
                            exit_threshold=exit_threshold, exit_policy=EXIT_POLICY))
        return decode
    t = side_by_side({'cached': gen(True), 'adaptive': gen(True, threshold)}, run, 1,
                     min(3, run.repeats))
    # the uncached run costs ~n_new full forwards: fewer repeats for it
    t.update(side_by_side({'uncached': gen(False)}, run, 0,
                          min(run.size['decode_repeats'], run.repeats)))
    _, used, _ = gen(True, threshold)()
    # the first new token comes off the full prompt pass, which runs all R loops: left out of the mean
    return t, used[:, 1:].float().mean().item()


def row_decode(run):
    spec = run.size['decode']
    n_new, R = spec['new_tokens'], spec['n_loop']
    block_size = spec['prompt'] + n_new  # holds prompt + every new token: no crop in either mode
    model = decode_model(spec, block_size, run.device)
    prompt = random_tokens(spec['vocab_size'], spec['prompt'], seed=0, device=run.device)
    threshold = median_first_exit_score(model, min(block_size, 256), run.device)
    t, loops = time_decoding(run, model, prompt, n_new, threshold)
    ratio = t['uncached'] / t['cached']
    kv = dict(ratio=ratio, target='>= 5x', met=ratio >= 5, cached_tok_s=n_new / t['cached'],
              uncached_tok_s=n_new / t['uncached'], config=dict(spec, block_size=block_size, batch_size=1))
    adaptive = dict(ratio=t['cached'] / t['adaptive'], target='report', met=None, threshold=threshold,
                    mean_loops=loops, fixed_loops=R, adaptive_tok_s=n_new / t['adaptive'],
                    fixed_tok_s=n_new / t['cached'], exit_policy=EXIT_POLICY)
    return {'kv_cache': kv, 'adaptive_exit': adaptive}


def cells_kv_cache(row):
    return [(f"decode tok/s cached / uncached ({row['config']['new_tokens']} new)",
             f"{row['ratio']:.1f}x ({row['cached_tok_s']:.0f}/{row['uncached_tok_s']:.0f})", row['target'],
             row['met'])]


def cells_adaptive(row):
    return [("adaptive / fixed-R decode tok/s; loops/token",
             f"{row['ratio']:.2f}x; {row['mean_loops']:.2f}/{row['fixed_loops']}", 'report', None)]


# -----------------------------------------------------------------------------
# rows 13-16: adaptive decoding per kv_policy, cache memory, past the block size, self-speculative decoding
# Per-token times: each generation is timed beside the prompt pass alone (generate(..., 1): the prompt and
# the first new token, which comes off it), and the difference is split over the tokens after the first,
# so the start-up cancels.

POLICY_SLOTS = 2  # kv_slots of the shared policy in rows 13 and 14


def prompts(vocab_size, B, T, seed, device):
    """B rows (B, T) of random token ids."""
    return torch.randint(vocab_size, (B, T), generator=torch.Generator().manual_seed(seed)).to(device)


def decoder(model, prompt, n_new, last=None, name=None, stats=None, **kw):
    """A call that samples n_new tokens after prompt (seeded: the same tokens every call); the loops per
    token it used go into last[name], its counts (engine.generate's) add up in the Counter stats."""
    def decode():
        torch.manual_seed(0)
        _, used, counts = generate(model, prompt, n_new, Decoding(temperature=1.0, **kw))
        if last is not None:
            last[name] = used
        if stats is not None:
            stats.update(counts)
    return decode


def per_token(t, n_new, base):
    """Seconds per new token past the first of each timing in t, against the prompt pass t[base]."""
    return {name: (s - t[base]) / (n_new - 1) for name, s in t.items() if name != base}


def mean_loops(used):
    # the first new token comes off the prompt pass, which runs all R loops: left out of the mean
    return used[:, 1:].float().mean().item()


def width_model(spec, C, block_size, device):
    # a decode model of width C, heads of spec['head_size']; seeded: the same weights whichever rows ran
    torch.manual_seed(C)
    return decode_model(dict(spec, n_embd=C, n_head=max(1, C // spec['head_size'])), block_size, device)


def adaptive_target(C, B, policy, ideal):
    """(target text, the ratio to reach or None) of adaptive / fixed decoding at width C, batch B."""
    if C < 512:
        return '>= 1.0x', 1.0
    if B >= 8:
        return f'>= 0.8 x {ideal:.2f} = {0.8 * ideal:.2f}', 0.8 * ideal
    if policy in ('copy', 'shared'):
        return f'>= 0.9 x {ideal:.2f} = {0.9 * ideal:.2f}', 0.9 * ideal
    return 'report', None


def row_policies(run):
    """Adaptive-exit vs fixed-R decoding at each width and batch of the size, for every kv_policy (shared
    with POLICY_SLOTS slots), threshold set as row 5's (about half the tokens leave after loop 1). All the
    generations of one width and batch are timed interleaved."""
    spec = run.size['policies']
    R, n_new = spec['n_loop'], spec['new_tokens']
    block_size = spec['prompt'] + n_new
    cases = []
    for C in spec['widths']:
        model = width_model(spec, C, block_size, run.device)
        threshold = median_first_exit_score(model, min(block_size, 256), run.device)
        for B in spec['batches']:
            prompt = prompts(spec['vocab_size'], B, spec['prompt'], seed=0, device=run.device)
            tag, last = f'policies_d{C}_b{B}_', {}
            fns = {tag + 'prefill': decoder(model, prompt, 1), tag + 'fixed': decoder(model, prompt, n_new)}
            for p in KV_POLICIES:
                fns[tag + p] = decoder(model, prompt, n_new, last, p, exit_threshold=threshold,
                                       exit_policy=EXIT_POLICY, kv_policy=p,
                                       kv_slots=POLICY_SLOTS if p == 'shared' else None)
            # a narrow model's generations take ~0.1 s, where a busy machine's noise is largest: more repeats
            repeats = run.repeats if C < 512 else min(3, run.repeats)
            t = per_token(side_by_side(fns, run, 1, repeats), n_new, tag + 'prefill')
            fixed_s = t[tag + 'fixed']
            for p in KV_POLICIES:
                if p not in last:  # side_by_side did not call it (a test's stand-in timer)
                    fns[tag + p]()
                loops = mean_loops(last[p])
                ideal = R / loops
                ratio = fixed_s / t[tag + p]
                target, need = adaptive_target(C, B, p, ideal)
                cases.append(dict(n_embd=C, batch_size=B, policy=p, ratio=ratio, ideal=ideal,
                                  of_ideal=ratio / ideal, mean_loops=loops, adaptive_ms=t[tag + p] * 1e3,
                                  fixed_ms=fixed_s * 1e3, adaptive_tok_s=B / t[tag + p],
                                  fixed_tok_s=B / fixed_s,
                                  target=target, met=None if need is None else ratio >= need))
    checked = [c['met'] for c in cases if c['met'] is not None]
    return {'decode_policies': dict(cases=cases, target='see cells', met=all(checked), threshold=threshold,
                                    exit_policy=EXIT_POLICY, kv_slots=POLICY_SLOTS,
                                    config=dict(spec, block_size=block_size))}


def row_cache_memory(run):
    """The KV cache's bytes per policy at R = 4, 8, 16 for the widest model of row 13 (batch 1, its block
    size). Allocated on the meta device: sizes without memory."""
    spec = run.size['policies']
    C = max(spec['widths'])
    block_size = spec['prompt'] + spec['new_tokens']
    cfg = dict(spec, n_embd=C, n_head=max(1, C // spec['head_size']), block_size=block_size)
    mib = {}
    for p in KV_POLICIES:
        for R in (4, 8, 16):
            config = GPTConfig(**{k: v for k, v in dict(cfg, n_loop=R).items()
                                  if k in GPTConfig.__dataclass_fields__})
            cache = KVCache(argparse.Namespace(config=config), 1, R, torch.device('meta'), torch.float32, p,
                            POLICY_SLOTS if p == 'shared' else None)
            mib[f'{p}_r{R}'] = cache.nbytes() / 2 ** 20
    shared = [mib[f'shared_r{R}'] for R in (4, 8, 16)]
    return {'cache_memory': dict(mib=mib, ratio=shared[-1] / shared[0], target='shared: equal at every R',
                                 met=len(set(shared)) == 1, kv_slots=POLICY_SLOTS,
                                 config=dict(cfg, batch_size=1))}


def row_past_block(run):
    """Per-token time of the tokens generated past the block size against those inside it, in one
    generation of 4 x block_size new tokens (the window slides half a block at a time: engine.generate)."""
    spec = run.size['past_block']
    bs = spec['block_size']
    inside, n_new = bs - spec['prompt'], 4 * bs  # inside: the new tokens that fit in the first block
    torch.manual_seed(0)
    model = decode_model(spec, bs, run.device)
    prompt = prompts(spec['vocab_size'], 1, spec['prompt'], seed=0, device=run.device)
    t = side_by_side({'past_block_prefill': decoder(model, prompt, 1),
                      'past_block_inside': decoder(model, prompt, inside),
                      'past_block_all': decoder(model, prompt, n_new)}, run, 1, min(3, run.repeats))
    inside_s = (t['past_block_inside'] - t['past_block_prefill']) / (inside - 1)
    past_s = (t['past_block_all'] - t['past_block_inside']) / (n_new - inside)
    with torch.no_grad():
        stats = generate(model, prompt, n_new, Decoding(temperature=1.0))[2]
    ratio = past_s / inside_s
    return {'past_block': dict(ratio=ratio, target='<= 1.5', met=ratio <= 1.5, inside_ms=inside_s * 1e3,
                               past_ms=past_s * 1e3, new_tokens=n_new, inside_tokens=inside,
                               refills=stats['refills'], config=dict(spec))}


def cache_bytes():
    """The largest CPU cache (L3 where there is one) in bytes, from sysfs; None where unknown."""
    sizes = []
    for index in range(8):
        try:
            with open(f'/sys/devices/system/cpu/cpu0/cache/index{index}/size') as f:
                text = f.read().strip()
        except OSError:
            break
        unit = {'K': 2 ** 10, 'M': 2 ** 20}.get(text[-1], 1)
        sizes.append(int(text.rstrip('KM')) * unit)
    return max(sizes) if sizes else None


def row_speculative(run):
    """Self-speculative decoding (drafts from loops 1..k, verified by loops k+1..R, fixed-R's tokens) vs
    fixed-R decoding, for k = 1..R-1 at each width of the size, sampled at temperature 1. The acceptance
    rate is counted over every call, warm-up included. The weights are untrained (random, GPT-2 init):
    every exit's logits then echo the embedding, so the acceptance says nothing about a trained model."""
    spec = run.size['speculative']
    R, n_new = spec['n_loop'], spec['new_tokens']
    block_size = spec['prompt'] + n_new
    l3 = cache_bytes() if run.device.type == 'cpu' else None
    cases = []
    for C in spec['widths']:
        model = width_model(spec, C, block_size, run.device)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        prompt = prompts(spec['vocab_size'], 1, spec['prompt'], seed=0, device=run.device)
        tag = f'speculative_d{C}_'
        fns = {tag + 'prefill': decoder(model, prompt, 1), tag + 'fixed': decoder(model, prompt, n_new)}
        stats = {k: Counter() for k in range(1, R)}
        for k in range(1, R):
            fns[tag + f'k{k}'] = decoder(model, prompt, n_new, draft_loops=k, speculate=spec['gamma'],
                                         stats=stats[k])
        t = per_token(side_by_side(fns, run, 1, min(3, run.repeats)), n_new, tag + 'prefill')
        big = l3 is not None and weights > l3
        for k in range(1, R):
            if not stats[k]:  # side_by_side did not call it (a test's stand-in timer)
                fns[tag + f'k{k}']()
            ratio = t[tag + 'fixed'] / t[tag + f'k{k}']
            cases.append(dict(n_embd=C, draft_loops=k, ratio=ratio, acceptance=stats[k]['accepted']
                              / max(1, stats[k]['checked']), speculative_ms=t[tag + f'k{k}'] * 1e3,
                              fixed_ms=t[tag + 'fixed'] * 1e3, weight_bytes=weights, exceeds_cache=big,
                              target='>= 1.0x' if big else 'report', met=ratio >= 1.0 if big else None))
    checked = [c['met'] for c in cases if c['met'] is not None]
    return {'speculative': dict(cases=cases, target='>= 1.0x where the weights exceed the cache',
                                met=all(checked) if checked else None, cache_bytes=l3, gamma=spec['gamma'],
                                weights='untrained (random, GPT-2 init)', config=dict(spec))}


def cells_policies(row):
    R = row['config']['n_loop']
    return [(f"adaptive / fixed tok/s d{c['n_embd']} B{c['batch_size']} {c['policy']}; loops",
             f"{c['ratio']:.2f}x={c['of_ideal']:.2f} ideal; {c['mean_loops']:.2f}/{R}", c['target'], c['met'])
            for c in row['cases']]


def cells_cache_memory(row):
    mib = row['mib']
    return [(f"KV cache MiB at R = 4/8/16, {p}" + (f" ({row['kv_slots']} slots)" if p == 'shared' else ''),
             '/'.join(f"{mib[f'{p}_r{R}']:.2f}" for R in (4, 8, 16)),
             row['target'] if p == 'shared' else 'report', row['met'] if p == 'shared' else None)
            for p in KV_POLICIES]


def cells_past_block(row):
    bs, n = row['config']['block_size'], row['new_tokens']
    return [(f"per-token time past / inside the block ({bs}, {n} new)",
             f"{row['ratio']:.2f} ({row['past_ms']:.1f}/{row['inside_ms']:.1f} ms)", row['target'],
             row['met']),
            f"({row['refills']} refills)"]


def cells_speculative(row):
    cells = [(f"speculative / fixed-R tok/s d{c['n_embd']} k {c['draft_loops']} g {row['gamma']}; accepted",
              f"{c['ratio']:.2f}x; {c['acceptance']:.2f}", c['target'], c['met']) for c in row['cases']]
    return cells + [f"(weights {row['weights']}: the acceptance says nothing of a trained model)"]


# -----------------------------------------------------------------------------
# row 18: continuous depth batching (batching.py) against today's batched decoding

DEPTH_REQUESTS = 4  # prompts per row: rows refill, and the tail (the last requests, fewer rows) weighs less
DEPTH_POLICIES = ('recompute', 'copy')


def group_decoder(model, groups, n_new, last=None, name=None, **kw):
    """A call that samples n_new tokens after each group (B, T) of prompts in turn with engine.generate,
    today's batched path (a group waits for its slowest row); the loops per token go into last[name]."""
    def decode():
        torch.manual_seed(0)
        used = [generate(model, g, n_new, Decoding(temperature=1.0, **kw))[1] for g in groups]
        if last is not None:
            last[name] = torch.cat(used)
    return decode


def depth_decoder(model, rows, n_new, B, last, name, clock, **kw):
    """A call that serves the prompts `rows` (lists of ids), B rows in flight (batching.serve). Its prompt
    passes (batching.decode_step: up to B prompts at a time through every loop, between the calls that
    advance the others) are timed inside the call, on clock: batching.py has no switch for it, so its
    decode_step is swapped for a timed one and put back. Into last: name (the loops per token), name +
    '_full' (how full the block calls ran), name + '_prompt_s' (each call's seconds in prompt passes)."""
    def decode():
        plain, spent = batching.decode_step, []

        def timed(*args):
            sync(model.lm_head.weight.device)
            t0 = clock()
            out = plain(*args)
            sync(model.lm_head.weight.device)
            spent.append(clock() - t0)
            return out
        batching.decode_step = timed
        try:
            torch.manual_seed(0)
            _, used, stats = batching.serve(model, rows, n_new, Decoding(batch_size=B, temperature=1.0, **kw))
        finally:
            batching.decode_step = plain
        last[name], last[name + '_full'] = torch.tensor(used, dtype=torch.float), stats['full']
        last.setdefault(name + '_prompt_s', []).append(sum(spent))
    return decode


def row_depth(run):
    """Continuous depth batching against today's batched decoding, at each width and batch B of the size:
    DEPTH_REQUESTS x B prompts of one length, decoded (a) at fixed depth and (b) with adaptive exits by
    engine.generate in groups of B, and (c) by batching.serve with B rows in flight, at row 13's threshold
    (about half the tokens want to leave after loop 1), kv_policy recompute and copy. Each path's time less
    its prompt passes (generate's: generate(..., 1) per group, timed beside; serve's, rows waiting at once:
    timed inside the call) is split over the new tokens after each prompt's first. All of one width and
    batch are timed interleaved, the repeats the size gives each batch; one warm-up call each at the first
    width only (the wider one's generations take seconds on a CPU). The models are fp32 on every device,
    as row 13's are."""
    spec = run.size['depth']
    R = spec['n_loop']
    block_size = spec['prompt'] + max(n for n, _ in spec['batches'].values())  # no window slides
    cases = []
    for C in spec['widths']:
        torch.manual_seed(C)
        model = build(run.device, **dict(spec, n_embd=C, n_head=max(1, C // spec['head_size']),
                                         block_size=block_size), init='gpt2').eval()
        threshold = median_first_exit_score(model, min(block_size, 256), run.device)
        for B, (n_new, repeats) in spec['batches'].items():
            P = DEPTH_REQUESTS * B
            ids = prompts(spec['vocab_size'], P, spec['prompt'], seed=0, device=run.device)
            groups, rows = ids.split(B), ids.tolist()
            tag, last = f'depth_d{C}_b{B}_', {}
            fns = {tag + 'prefill': group_decoder(model, groups, 1),
                   tag + 'fixed': group_decoder(model, groups, n_new)}
            for p in DEPTH_POLICIES:
                kw = dict(exit_threshold=threshold, exit_policy=EXIT_POLICY, kv_policy=p)
                fns[tag + 'adaptive_' + p] = group_decoder(model, groups, n_new, last, 'adaptive_' + p, **kw)
                fns[tag + 'depth_' + p] = depth_decoder(model, rows, n_new, B, last, 'depth_' + p, run.clock,
                                                        **kw)
            warmup = 1 if C == spec['widths'][0] else 0
            t = side_by_side(fns, run, warmup, min(repeats, run.repeats))
            for p in DEPTH_POLICIES:
                if 'depth_' + p not in last:  # side_by_side did not call them (a test's stand-in timer)
                    fns[tag + 'adaptive_' + p]()
                    fns[tag + 'depth_' + p]()
            tokens = P * (n_new - 1)  # each prompt's first new token comes off its prompt pass
            fixed_s = (t[tag + 'fixed'] - t[tag + 'prefill']) / tokens
            for p in DEPTH_POLICIES:
                prompt_s = statistics.median(last[f'depth_{p}_prompt_s'])
                s = dict(adaptive=(t[tag + 'adaptive_' + p] - t[tag + 'prefill']) / tokens,
                         depth=(t[tag + 'depth_' + p] - prompt_s) / tokens)
                case = dict(n_embd=C, batch_size=B, policy=p, requests=P, new_tokens=n_new,
                            threshold=threshold, fixed_ms=fixed_s * 1e3, fixed_tok_s=1 / fixed_s,
                            prompt_ms=t[tag + 'prefill'] / P * 1e3, depth_prompt_ms=prompt_s / P * 1e3)
                for how in ('adaptive', 'depth'):
                    loops = mean_loops(last[f'{how}_{p}'])
                    ratio = fixed_s / s[how]
                    case.update({f'{how}_loops': loops, f'{how}_ideal': R / loops, f'{how}_ratio': ratio,
                                 f'{how}_of_ideal': ratio * loops / R, f'{how}_ms': s[how] * 1e3,
                                 f'{how}_tok_s': 1 / s[how]})
                case['occupancy'] = last[f'depth_{p}_full']  # below 1 in the tail
                need = 0.9 * case['depth_ideal'] if C >= 512 and B >= 8 else None
                case.update(target=f">= 0.9 x {case['depth_ideal']:.2f} = {need:.2f}" if need else 'report',
                            met=None if need is None else case['depth_ratio'] >= need)
                cases.append(case)
    checked = [c['met'] for c in cases if c['met'] is not None]
    return {'depth_batching': dict(cases=cases, target='>= 0.9 of the ideal at d >= 512, batch >= 8',
                                   met=all(checked) if checked else None, exit_policy=EXIT_POLICY,
                                   requests_per_row=DEPTH_REQUESTS, config=dict(spec, block_size=block_size))}


def cells_depth(row):
    R = row['config']['n_loop']
    cells = []
    for c in row['cases']:  # depth batching's cell, and under it today's batched adaptive path
        cells += [(f"depth / fixed tok/s d{c['n_embd']} B{c['batch_size']} {c['policy']}; loops",
                   f"{c['depth_ratio']:.2f}x={c['depth_of_ideal']:.2f} ideal; {c['depth_loops']:.2f}/{R}",
                   c['target'], c['met']),
                  f"(adaptive / fixed {c['adaptive_ratio']:.2f}x={c['adaptive_of_ideal']:.2f} ideal, "
                  f"{c['adaptive_loops']:.2f}/{R} loops; depth's calls {c['occupancy']:.2f} full, prompt "
                  f"passes {c['depth_prompt_ms']:.1f} ms a prompt vs {c['prompt_ms']:.1f} batched)"]
    return cells + [f"({row['requests_per_row']}B prompts of {row['config']['prompt']} tokens at batch B; "
                    f"tok/s of the new tokens after each prompt's first; fp32, untrained weights)"]


if __name__ == '__main__':  # a module the lab's commands import
    print("lab/bench_decode.py: bench.py's decoding rows, not a command; see python lab/bench.py --help")
