"""
Depth batching end to end on a trained checkpoint (docs/decoding.md, "On a trained model"): a file of
prompts decoded at batch B by fixed-R engine.generate (the prompts in groups of B) and by batching.serve
at each kv policy and exit threshold, and with no threshold, taking turns in one process. Prompt passes
are included, as sample.py runs them. Prints, per path, the loops per token, the median seconds over the
repeats (and their range), the speed-up over fixed-R generate and its fraction of the ideal R / mean loops,
that fraction against serve with no threshold (sample.py's own fixed-depth path at --batch_size=B), and
how full serve's block calls ran (below 1 in the tail, when the last requests finish one by one).
generate's rows share a length, so prompts of other lengths go through it in groups of one length:
--prompt_chars cuts every line to one length.

    python lab/serve_bench.py out --prompts=prompts.txt --batch_size=8 --thresholds=0.15,0.25
    python lab/serve_bench.py out --prompts=p.txt --prompt_chars=14 --repeats=9 --threads=1

The bar of docs/decoding.md: >= 0.85 of the ideal at batch 8 with 1.3-3.2 loops per token. On a busy
machine use --threads=1 (the process clock then counts this process's CPU seconds only). It runs on the
CPU; on a GPU, `STEPS=depth bash lab/gpu_check.sh` times depth batching (lab/bench.py's row 18).
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the core is one folder up
import checkpoint
from batching import serve
from engine import Decoding, generate
from errors import Parser, die
from exits import EXIT_POLICIES, KV_POLICIES, score_threshold
from prepare import checkpoint_meta, get_tokenizer


FIXED = 'fixed-R, engine.generate in groups of B'  # the baseline
SERVED = 'fixed-R through serve'  # sample.py's fixed depth at --batch_size=B


def paths(model, prompts, n, B, policies, thresholds, exit_policy):
    """name -> a call that decodes every prompt greedily and returns the loops each new token used and
    how full its block calls ran (None: generate, every token all R loops, no calls of its own)."""
    def fixed():
        for i in range(0, len(prompts), B):  # a batch's rows share a length: one group per length
            group = prompts[i:i + B]
            for length in sorted({len(p) for p in group}):
                generate(model, torch.tensor([p for p in group if len(p) == length]), n,
                         Decoding(temperature=0))

    def served(policy, threshold):
        def run():
            _, used, stats = serve(model, prompts, n, Decoding(batch_size=B, temperature=0,
                                   exit_threshold=threshold, exit_policy=exit_policy, kv_policy=policy))
            return used, stats['full']
        return run

    calls = {FIXED: fixed, SERVED: served('recompute', None)}
    for policy in policies:
        for t in thresholds:
            calls[f"serve, {policy}, {exit_policy} >= {t:g}"] = served(policy, t)
    return calls


def measure(calls, repeats, clock):
    """Each call once to warm up, then `repeats` rounds in turn: name -> (seconds each round, mean loops,
    calls full)."""
    seconds, loops, full = {name: [] for name in calls}, {}, {}
    for f in calls.values():
        f()
    for _ in range(repeats):
        for name in calls:
            t0 = clock()
            out = calls[name]()
            seconds[name].append(clock() - t0)
            if out is not None:
                used, full[name] = out
                loops[name] = sum(map(sum, used)) / sum(map(len, used))
    return {name: (s, loops.get(name), full.get(name)) for name, s in seconds.items()}


def table(results, R):
    base, served = (statistics.median(results[k][0]) for k in (FIXED, SERVED))
    lines = ["| path | loops / token | seconds: median (min-max) | x fixed-R generate | of the ideal "
             "| of the ideal, against fixed-R through serve | calls full |", "|---|---|---|---|---|---|---|"]
    for name, (s, L, full) in results.items():
        m, L = statistics.median(s), L or R
        lines.append(f"| {name} | {L:.2f} | {m:.2f} ({min(s):.2f}-{max(s):.2f}) | {base / m:.2f}x "
                     f"| {base / m / (R / L):.2f} | {served / m / (R / L):.2f} "
                     f"| {'-' if full is None else f'{full:.2f}'} |")
    return '\n'.join(lines)


def main(argv=None):
    ap = Parser('lab/serve_bench.py', __doc__)
    ap.add_argument('out_dir', help='the folder holding ckpt.pt (or the file)')
    ap.add_argument('--prompts', required=True, help='a file of prompts, one a line (blank lines skipped)')
    ap.add_argument('--prompt_chars', type=int, default=0, help="each line's first characters (0 = all)")
    ap.add_argument('--batch_size', type=int, default=8, help='rows in flight, and generate\'s group size')
    ap.add_argument('--max_new_tokens', type=int, default=48, help='new tokens per prompt')
    ap.add_argument('--kv_policy', default='recompute,copy', help='comma list of kv policies')
    ap.add_argument('--exit_policy', default='maxprob', help=f"exit score: one of {', '.join(EXIT_POLICIES)}")
    ap.add_argument('--thresholds', default='0.15,0.25', help='comma list of exit thresholds')
    ap.add_argument('--repeats', type=int, default=5, help='timed rounds after one warm-up round')
    ap.add_argument('--threads', type=int, default=0, help='torch CPU threads (0 = torch default)')
    ap.add_argument('--timer', default='process', choices=('process', 'wall'), help='process: CPU seconds')
    args = ap.parse_args(argv)
    for name in ('batch_size', 'max_new_tokens', 'repeats'):
        if getattr(args, name) < 1:
            die(f"--{name}={getattr(args, name)}: must be >= 1")
    policies = [p for p in args.kv_policy.split(',') if p]
    if args.exit_policy not in EXIT_POLICIES or not policies or set(policies) - set(KV_POLICIES):
        die(f"--exit_policy one of {', '.join(EXIT_POLICIES)}; --kv_policy from {', '.join(KV_POLICIES)}")
    try:
        thresholds = [float(t) for t in args.thresholds.split(',') if t]
    except ValueError:
        die(f"--thresholds={args.thresholds}: give numbers separated by commas")
    if not thresholds:
        die("--thresholds: give at least one")
    for t in thresholds:
        try:
            score_threshold(args.exit_policy, t)
        except ValueError as e:
            die(f"--thresholds: {e}")
    try:
        lines = [line for line in open(args.prompts, encoding='utf-8').read().splitlines() if line]
    except (OSError, UnicodeDecodeError) as e:
        die(f"--prompts {args.prompts}: {e.strerror if isinstance(e, OSError) and e.strerror else e}")
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.out_dir if os.path.isfile(args.out_dir) else os.path.join(args.out_dir, 'ckpt.pt')
    ckpt = checkpoint.load(path)
    encode, _ = get_tokenizer(checkpoint_meta('', ckpt, path))
    try:
        prompts = [encode(line[:args.prompt_chars or None]) for line in lines]
    except ValueError as e:
        die(f"--prompts: {e}")
    if not prompts or not all(prompts):
        die(f"--prompts {args.prompts}: no prompts (one a line)")
    model = checkpoint.build_model(ckpt).eval()
    for p in policies:
        if why := Decoding(batch_size=2, kv_policy=p, exit_threshold=0.5).why_not(model.config):
            die(why)
    clock = time.process_time if args.timer == 'process' else time.perf_counter
    B, n = args.batch_size, args.max_new_tokens
    calls = paths(model, prompts, n, B, policies, thresholds, args.exit_policy)
    print(f"{len(prompts)} prompts, {n} new tokens each, batch {B}, greedy, "
          f"R {model.config.n_loop}, {torch.get_num_threads()} threads, {args.timer} clock, "
          f"medians of {args.repeats}")
    with torch.no_grad():
        results = measure(calls, args.repeats, clock)
    print(table(results, model.config.n_loop))


if __name__ == '__main__':
    main()
