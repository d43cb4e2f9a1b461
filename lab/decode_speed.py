"""
Batch-1 decoding speed of engine.generate, per token: fixed depth and adaptive exit, on a randomly initialised
model, for one or more source trees (this one, or a checkout of an older commit) taking turns round by round.
Each (tree, round) runs in a fresh process; the per-token time is the slope between two generation lengths
(the prefill and the call's overhead cancel), the median of --repeats calls each; rounds then give medians,
and each tree's ratio to the first tree's, paired by round. Greedy tokens: every tree decodes the same text.

    python lab/decode_speed.py                                       # this tree, d 512, 3 rounds
    python lab/decode_speed.py --trees=/tmp/old,. --rounds=5         # a commit against this tree, interleaved
    taskset -c 0 python lab/decode_speed.py --threads=1              # on a busy machine: one pinned core

A tree older than the Decoding options (commit 6b2ffb3) is called with generate's keyword arguments.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(args):
    # in a child process whose sys.path starts at the tree: {path: ms/token}, the slope between the lengths
    import torch
    torch.set_num_threads(args.threads)
    from model import GPT, GPTConfig
    try:
        from decoding import engine
    except ImportError:  # before the decoding/ folder
        import engine
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=args.n_layer, n_loop=args.n_loop, n_head=args.n_head, n_embd=args.n_embd,
                          block_size=args.block_size, vocab_size=args.vocab_size,
                          init='gpt2')).eval()  # (the reference init's N(0, 1) wte: all exit at loop 1)
    prompt = torch.randint(args.vocab_size, (1, args.prompt_len))
    paths = dict(fixed={}, adaptive=dict(exit_threshold=args.exit_threshold, kv_policy=args.kv_policy))

    def run(n, kw):
        if hasattr(engine, 'Decoding'):
            return engine.generate(model, prompt, n, engine.Decoding(temperature=0, **kw))
        return engine.generate(model, prompt, n, temperature=0, **kw)

    clock, out = dict(process=time.process_time, wall=time.perf_counter)[args.timer], {}
    for name, kw in paths.items():
        times = {n: [] for n in args.lengths}
        run(args.lengths[0], kw)  # warm-up
        for _ in range(args.repeats):
            for n in args.lengths:  # the two lengths take turns
                t0 = clock()
                _, used, _ = run(n, kw)
                times[n].append(clock() - t0)
        short, long = (statistics.median(times[n]) for n in args.lengths)
        out[name] = 1e3 * (long - short) / (args.lengths[1] - args.lengths[0])
        out[name + ' loops'] = used.float().mean().item()
    return out


def main(argv=None):
    sys.path.insert(0, ROOT)
    from configurator import Parser, die  # here, not above: a child imports the model of its own tree
    from bench import cpu_name
    ap = Parser('lab/decode_speed.py', __doc__)
    ap.add_argument('--trees', default=ROOT, help='source trees to time, comma-separated (default: this one)')
    ap.add_argument('--rounds', type=int, default=3, help='rounds; each times every tree once, in turn')
    ap.add_argument('--repeats', type=int, default=5, help='generate calls per length in one round')
    ap.add_argument('--lengths', default='32,160', help='the two generation lengths (new tokens)')
    ap.add_argument('--n_layer', type=int, default=2)
    ap.add_argument('--n_loop', type=int, default=4)
    ap.add_argument('--n_head', type=int, default=8)
    ap.add_argument('--n_embd', type=int, default=512)
    ap.add_argument('--block_size', type=int, default=256)
    ap.add_argument('--vocab_size', type=int, default=65)
    ap.add_argument('--prompt_len', type=int, default=16)
    ap.add_argument('--exit_threshold', type=float, default=0.06, help='adaptive: maxprob threshold')
    ap.add_argument('--kv_policy', default='copy', help='adaptive: what exits leave in skipped slots')
    ap.add_argument('--threads', type=int, default=1, help='torch threads')
    ap.add_argument('--timer', default='process', choices=('process', 'wall'),
                    help="process: this process's CPU seconds (a busy machine's other work left out)")
    args = ap.parse_args(argv)
    args.lengths = [int(n) for n in args.lengths.split(',')]
    trees = [os.path.abspath(t) for t in args.trees.split(',')]
    if missing := [t for t in trees if not os.path.isfile(os.path.join(t, 'model.py'))]:
        die(f"--trees: {missing[0]} is no source tree (it holds no model.py)")
    rows = {t: [] for t in trees}
    for _ in range(args.rounds):
        for t in trees:
            child = [sys.executable, os.path.abspath(__file__), '--child', t, json.dumps(vars(args))]
            r = subprocess.run(child, capture_output=True, text=True, cwd=t)
            if r.returncode:
                die(f"--trees {t}: {(r.stderr.strip().splitlines() or [f'exit code {r.returncode}'])[-1]}")
            rows[t].append(json.loads(r.stdout.splitlines()[-1]))
    print(f"batch 1, d {args.n_embd}, K {args.n_layer} x R {args.n_loop}, {cpu_name()}, {args.threads} "
          f"thread(s), {args.timer} time: ms/token, median of {args.rounds} rounds [each], x the first tree")
    for t, rs in rows.items():
        cells = []
        for name in ('fixed', 'adaptive'):
            ratio = statistics.median(r[name] / f[name] for r, f in zip(rs, rows[trees[0]]))  # by round
            each = ', '.join(f'{r[name]:.2f}' for r in rs)
            cells.append(f"{name} {statistics.median(r[name] for r in rs):.3f} [{each}] x{ratio:.3f}")
        print(f"{t}: {'; '.join(cells)}; adaptive loops/token {rs[0]['adaptive loops']:.2f} of {args.n_loop}")
    return rows


if __name__ == '__main__':
    if sys.argv[1:2] == ['--child']:  # one (tree, round): its own process, its own tree's modules
        sys.path.insert(0, sys.argv[2])
        print(json.dumps(measure(argparse.Namespace(**json.loads(sys.argv[3])))))
    else:
        main()
