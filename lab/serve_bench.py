"""
Depth batching end to end on a trained checkpoint (docs/decoding.md, "On a trained model"): a file of
prompts decoded at batch B by fixed-R engine.generate (the prompts in groups of B) and by batching.serve
at each kv policy and exit threshold, and with no threshold, taking turns in one process. Prompt passes
are included, as sample.py runs them. Prints, per path, the loops per token, the median seconds over the
repeats (and their range), the speed-up over fixed-R generate and its fraction of the ideal R / mean loops,
that fraction against serve with no threshold (sample.py's own fixed-depth path at --batch_size=B: the
prefill-adjusted bound), how full serve's block calls ran (below 1 in the tail, when the last requests
finish one by one), and the steady state's new tokens / s and fraction (Noted). --compile adds each serve
path with its step compiled, held against fixed-R through serve compiled, and the compiled / eager speed
of fixed-R serve paired by round, with its CI (--fixed_only: those fixed-R paths alone).
generate's rows share a length, so prompts of other lengths go through it in groups of one length:
--prompt_chars cuts every line to one length.

    python lab/serve_bench.py out --prompts=prompts.txt --batch_size=8 --thresholds=0.15,0.25
    python lab/serve_bench.py out --prompts=p.txt --prompt_chars=14 --repeats=9 --threads=1

The bar of docs/decoding.md: >= 0.85 of the ideal at batch 8 with 1.3-3.2 loops per token. On a busy
machine use --threads=1 (the process clock then counts this process's CPU seconds only). It runs on the
CPU by default (--device=cuda and --timer=wall on a GPU: `STEPS=depth bash lab/gpu_check.sh` runs it on two
checkpoints it trains, beside lab/bench.py's row 18). At --batch_size=1 it also prints the bytes fixed-R
decoding reads a token and, on a GPU it knows, the fraction of the memory bandwidth that is.
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the core is one folder up
from compute.hardware import peak_bandwidth
from configurator import Parser, die, pick_device
from decoding import batching
from decoding.batching import serve
from decoding.engine import Decoding, generate
from decoding.exits import EXIT_POLICIES, KV_POLICIES, score_threshold
from prepare import checkpoint_meta, get_tokenizer
from run import checkpoint
from verdict import mean_ci


FIXED = 'fixed-R, engine.generate in groups of B'  # the baseline
SERVED = 'fixed-R through serve'  # sample.py's fixed depth at --batch_size=B
COMPILED = ', compiled'  # the same path with its step compiled (sample.py --compile=True)


class Noted(batching.Requests):
    """serve's requests, noting (clock, new tokens so far) when a request finishes and when a prompt takes a
    place: the steady state of continuous depth batching (Schwethelm et al.) runs from the 2B-th finish to
    the last admission, after the first rows' start and before the tail of the last requests."""
    clock, last = time.process_time, None

    def __init__(self, *args):
        super().__init__(*args)
        self.made, self.finished, self.admitted = 0, [], []
        Noted.last = self

    def add(self, c, token, loops):
        r, q = self.row[c], super().add(c, token, loops)
        self.made += 1
        if len(self.used[r]) == self.n:
            self.finished.append((Noted.clock(), self.made))
        return q

    def admit(self, B):
        queued, passing = len(self.queue), super().admit(B)
        if len(self.queue) < queued:
            self.admitted.append((Noted.clock(), self.made))
        return passing

    def steady(self, B):
        # new tokens / s over the steady state, or None where the prompts are too few to have one
        if len(self.finished) < 2 * B or not self.admitted or self.admitted[-1] <= self.finished[2 * B - 1]:
            return None
        (t0, n0), (t1, n1) = self.finished[2 * B - 1], self.admitted[-1]
        return (n1 - n0) / (t1 - t0)


def paths(model, prompts, n, B, policies, thresholds, exit_policy, compiled=False):
    """name -> a call that decodes every prompt greedily and returns the loops each new token used, how
    full its block calls ran and its steady state's new tokens / s (None: generate, every token all R
    loops, no calls of its own). compiled: each serve path also with its step compiled
    (Decoding(compile=True)), named with COMPILED after it."""
    device = model.lm_head.weight.device

    def fixed():
        for i in range(0, len(prompts), B):  # a batch's rows share a length: one group per length
            group = prompts[i:i + B]
            for length in sorted({len(p) for p in group}):
                rows = [p for p in group if len(p) == length]
                generate(model, torch.tensor(rows, device=device), n, Decoding(temperature=0))

    def served(policy, threshold, compile=False):
        def run():
            batching.Requests = Noted
            try:
                opts = Decoding(batch_size=B, temperature=0, compile=compile, exit_threshold=threshold,
                                exit_policy=exit_policy, kv_policy=policy)
                _, used, stats = serve(model, prompts, n, opts)
            finally:
                batching.Requests = Noted.__base__
            return used, stats['full'], Noted.last.steady(B)
        return run

    calls, kinds = {FIXED: fixed}, [False, True] if compiled else [False]
    for c in kinds:
        calls[SERVED + COMPILED * c] = served('recompute', None, c)
    for policy in policies:
        for t in thresholds:
            for c in kinds:
                calls[f"serve, {policy}, {exit_policy} >= {t:g}" + COMPILED * c] = served(policy, t, c)
    return calls


def measure(calls, repeats, clock):
    """Each call once to warm up (a compiled path compiles then), then `repeats` rounds in turn: name ->
    (seconds each round, mean loops, calls full, steady-state new tokens / s each round)."""
    seconds, loops, full, steady = {name: [] for name in calls}, {}, {}, {name: [] for name in calls}
    for name, f in calls.items():
        t0 = time.perf_counter()
        f()
        if name.endswith(COMPILED):
            print(f"{name}: warm-up (compiling) {time.perf_counter() - t0:.1f} s wall")
    for _ in range(repeats):
        for name in calls:
            t0 = clock()
            out = calls[name]()
            seconds[name].append(clock() - t0)
            if out is not None:
                used, full[name], tok_s = out
                loops[name] = sum(map(sum, used)) / sum(map(len, used))
                steady[name] += [] if tok_s is None else [tok_s]
    return {name: (s, loops.get(name), full.get(name), steady[name]) for name, s in seconds.items()}


def table(results, R, tokens):
    """The paths' medians against fixed-R generate, and against the prefill-adjusted bound: fixed-R through
    serve (the same prompt passes, the same engine; a compiled path against the compiled one) times
    R / loops per token."""
    base = statistics.median(results[FIXED][0])
    lines = ["| path | loops / token | seconds: median (min-max) | new tokens / s | x fixed-R generate "
             "| of the ideal | of the ideal, against fixed-R through serve | calls full "
             "| steady state: new tokens / s | steady state: of the ideal |", "|---" * 10 + "|"]
    for name, (s, L, full, steady) in results.items():
        m, L = statistics.median(s), L or R
        own = results[SERVED + COMPILED * name.endswith(COMPILED)]
        ss = statistics.median(steady) if steady else None
        ss_of = ss / statistics.median(own[3]) / (R / L) if ss and own[3] else None
        cells = [f"{L:.2f}", f"{m:.2f} ({min(s):.2f}-{max(s):.2f})", f"{tokens / m:.1f}",
                 f"{base / m:.2f}x",
                 f"{base / m / (R / L):.2f}", f"{statistics.median(own[0]) / m / (R / L):.2f}",
                 '-' if full is None else f'{full:.2f}', '-' if ss is None else f"{ss:.1f}",
                 '-' if ss_of is None else f"{ss_of:.2f}"]
        lines.append(f"| {name} | " + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


def paired(results):
    """Fixed-R through serve, compiled against eager, paired by round: the rounds take turns, so a slow
    spell of the machine slows both paths of its round. The mean speed ratio and its 95 % t-interval over
    the rounds, the unit the claim "compiled >= eager" is judged by (one median is not)."""
    eager, comp = results[SERVED][0], results[SERVED + COMPILED][0]
    r = [a / b for a, b in zip(eager, comp)]
    m, lo, hi = mean_ci(r)
    ci = '' if lo is None else f", 95 % CI [{lo:.3f}, {hi:.3f}]"
    return (f"fixed-R through serve, compiled / eager speed, paired by round: "
            f"{' '.join(f'{x:.3f}' for x in r)}; mean {m:.3f}{ci} over {len(r)} rounds")


def bytes_per_token(model, pos):
    """What fixed-R decoding of one row reads for a token at position pos, in bytes: every weight once, the
    K shared blocks' R times (a loop re-reads them), the position table's one row, and each visit's keys
    and values up to pos (R K loop visits, the prelude's and the coda's blocks)."""
    cfg, t = model.config, model.transformer
    count = lambda m: sum(p.numel() for p in m.parameters())
    weights = count(model) + (cfg.n_loop - 1) * count(t.h) - count(t.wpe)  # (an Identity: 0)
    visits = cfg.n_loop * cfg.n_layer + cfg.n_prelude + cfg.n_coda
    return (weights + visits * 2 * pos * cfg.n_embd) * model.lm_head.weight.element_size()


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
    ap.add_argument('--compile', action='store_true', help='each serve path also with its step compiled')
    ap.add_argument('--fixed_only', action='store_true', help='only the fixed-R paths (no thresholds)')
    ap.add_argument('--device', default='cpu', help='cpu | cuda | cuda:N (on a GPU: --timer=wall)')
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
    dev, device_type = pick_device(args.device)
    if device_type == 'cuda' and args.timer == 'process':
        die("--timer=process counts this process's CPU seconds, not the GPU's: use --timer=wall on a GPU")
    path = checkpoint.path_of(args.out_dir)
    ckpt = checkpoint.load(path)
    encode, _ = get_tokenizer(checkpoint_meta('', ckpt, path))
    try:
        prompts = [encode(line[:args.prompt_chars or None]) for line in lines]
    except ValueError as e:
        die(f"--prompts: {e}")
    if not prompts or not all(prompts):
        die(f"--prompts {args.prompts}: no prompts (one a line)")
    model = checkpoint.build_model(ckpt).eval().to(dev)
    for p in policies:
        if why := Decoding(batch_size=2, kv_policy=p, exit_threshold=0.5).why_not(model.config):
            die(why)
    base = time.process_time if args.timer == 'process' else time.perf_counter
    sync = torch.cuda.synchronize if device_type == 'cuda' else lambda: None
    clock = Noted.clock = lambda: sync() or base()  # a GPU's queued kernels finish before the clock is read
    B, n = args.batch_size, args.max_new_tokens
    policies = [] if args.fixed_only else policies  # (a bad --kv_policy is refused all the same)
    calls = paths(model, prompts, n, B, policies, thresholds, args.exit_policy, args.compile)
    name = torch.cuda.get_device_name(dev) if device_type == 'cuda' else 'cpu'
    print(f"{len(prompts)} prompts, {n} new tokens each, batch {B}, greedy, "
          f"R {model.config.n_loop}, {name}, {torch.get_num_threads()} threads, {args.timer} clock, "
          f"medians of {args.repeats}")
    with torch.no_grad():
        results = measure(calls, args.repeats, clock)
    print(table(results, model.config.n_loop, len(prompts) * n))
    if args.compile:
        print(paired(results))
    if B == 1:  # decoding one row reads every weight a token: how near the memory's bandwidth it runs
        pos = sum(map(len, prompts)) / len(prompts) + n / 2  # the mean position of a new token
        gbs = bytes_per_token(model, pos) * len(prompts) * n / statistics.median(results[FIXED][0]) / 1e9
        peak = peak_bandwidth(name) if device_type == 'cuda' else None
        print(f"fixed-R generate at batch 1 reads {bytes_per_token(model, pos) / 1e6:.1f} MB a token: "
              f"{gbs:.1f} GB/s (prompt passes included)"
              + (f", {gbs * 1e9 / peak:.1%} of the {name}'s {peak / 1e12:.2f} TB/s" if peak else ""))


if __name__ == '__main__':
    main()
