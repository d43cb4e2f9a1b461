r"""
Retrofitted recurrence at laptop scale (docs/papers.md §6): does looping a pretrained model's layers beat
training the looped model from scratch at equal total FLOPs, and beat training the unique model on?

    python lab/ablate.py retrofit                       # 3 seeds; report in assets/retrofit.md
    python lab/ablate.py retrofit --dry_run             # the runs, their steps, FLOPs and CPU time
    python lab/ablate.py retrofit --seeds=1 --pretrain_iters=200 --retrofit_iters=100   # a quick look
    python lab/ablate.py retrofit --report_only         # rebuild the report from the finished runs
    python lab/ablate.py retrofit --retrofit_iters=2000 --out=out-ablate-retrofit-long --name=retrofit_long

Per seed, on config/laptop_retrofit.py (shakespeare_char, d 128, GPT-2's layout):
    unique-s       a unique 6-layer model (n_loop 1), pretrain_iters steps
    retrofit_R*    its layers 0 | 3-4 | 5 as prelude | loop | coda (1 + 2 x R + 1), the concat adapter at
                   identity, the loop count ramped 1 -> R over the first half (loop_schedule), retrofit_iters
    scratch_R*     the same looped shape from scratch, as many steps as the pretraining plus the retrofit
                   cost in FLOPs (accounting.flops_per_token, the ramp's loop counts step by step)
    unique_more_R* the unique model trained on from its checkpoint for the retrofit's FLOPs
Each run is scored on one fixed validation set (the same windows for every arm and seed): val CE at every
exit of a 2R-loop pass, i.e. at every test-time loop count 1..2R (a pass's exit k is a k-loop pass's
output). A run's folder holds status.json once done, so a call skips what is finished and resumes the rest.
"""
import json
import math
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the core is one folder up
from configurator import Parser, die, gpt_config, model_keys
from run import checkpoint
from run import ops
from run.accounting import flops_per_token
from eval_depth import val_windows
from model import GPT
from prepare import open_data
from reports import fmt
from verdict import mean_ci, verdict

LAB = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(LAB)
BASE = 'config/laptop_retrofit.py'
UNIQUE = dict(n_layer=6, n_loop=1)
LOOPED = dict(n_prelude=1, n_layer=2, n_coda=1, injection='concat')  # 1 + 2 x R + 1 of the 6 layers
SCHEDULE = 0.5     # the retrofit ramps its mean loop count 1 -> R over this share of its steps
VAL_SEQS = 512     # fixed validation windows of 64 tokens (32k tokens), spread over the whole split
TOKENS = 16 * 64   # tokens per step (the base config's batch_size x block_size)
# s per GFLOP of one run, start-up and evaluation included, on one core of an Intel Xeon (AMX-BF16, bf16
# autocast; the other core busy): the 3-seed sweep computed 157.9 TFLOP in 1,972 s (assets/retrofit.md)
CPU_S_PER_GFLOP = 0.0125


def parser():
    ap = Parser('lab/ablate.py retrofit', __doc__.split('\n\n')[0])
    ap.add_argument('--seeds', default='1,2,3', help='comma-separated seeds')
    ap.add_argument('--loops', default='2,4', help='comma-separated R of the looped models')
    ap.add_argument('--pretrain_iters', type=int, default=1000, help="the unique model's pretraining steps")
    ap.add_argument('--retrofit_iters', type=int, default=500, help="the retrofit's steps")
    ap.add_argument('--out', default='out-ablate-retrofit', help='runs go to <out>/<arm>-s<seed>')
    ap.add_argument('--report_dir', default='assets', help='<name>.md and <name>.json go here')
    ap.add_argument('--name', default='retrofit', help="the report's name (retrofit_long for a longer run)")
    ap.add_argument('--dry_run', action='store_true', help='print the runs and their cost, run nothing')
    ap.add_argument('--report_only', action='store_true', help='only rebuild the report')
    return ap


def ints(text, flag):
    try:
        out = [int(s) for s in text.split(',') if s]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        die(f"--{flag}={text}: expected comma-separated integers >= 1")
    return out


def base_model():
    """The base config's model keys, as train.py resolves them (shakespeare_char's 65 characters)."""
    cmd = [sys.executable, os.path.join(REPO, 'train.py'), os.path.join(REPO, BASE), '--print_config=True']
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS='1'))
    if out.returncode != 0:
        die(f"train.py {BASE} --print_config=True failed: {(out.stderr.strip().splitlines() or ['?'])[-1]}")
    return {k: v for k, v in json.loads(out.stdout).items() if k in model_keys()} | {'vocab_size': 65}


BASE_MODEL = {}  # base_model(), filled in by main()


def model_flops(args, n_loop=None):
    """Training FLOPs per token of a model with these model keys (on top of the base config)."""
    return flops_per_token(GPT(gpt_config({**BASE_MODEL, **args})), n_loop=n_loop)


def retrofit_flops(R, iters):
    """The FLOPs of a retrofit run: step by step at the loop count the curriculum gives (ops.loop_count)."""
    cfg = gpt_config({**BASE_MODEL, **LOOPED, 'n_loop': R})
    per_R = {r: model_flops({**LOOPED, 'n_loop': R}, n_loop=r) for r in range(1, R + 1)}
    return TOKENS * sum(per_R[ops.loop_count(cfg, None, it, SCHEDULE * iters)] for it in range(iters))


def plan(a):
    """The runs of every seed, in the order they can run: name, out_dir, train.py flags, FLOPs."""
    pre = TOKENS * a.pretrain_iters * model_flops(UNIQUE)
    runs = []
    for seed in a.seeds:
        uniq = os.path.join(a.out, f'unique-s{seed}')
        runs.append(dict(name=f'unique-s{seed}', arm='unique', R=1, seed=seed, out_dir=uniq, flops=pre,
                         cost=pre, flags=dict(UNIQUE, max_iters=a.pretrain_iters)))
        for R in a.loops:
            extra = retrofit_flops(R, a.retrofit_iters)
            steps = round((pre + extra) / (TOKENS * model_flops({**LOOPED, 'n_loop': R})))
            step = TOKENS * model_flops(UNIQUE)  # one step of the unique model
            more = round(extra / step)
            runs += [
                dict(name=f'retrofit_R{R}-s{seed}', arm=f'retrofit_R{R}', R=R, seed=seed, flops=pre + extra,
                     cost=extra, flags=dict(LOOPED, n_loop=R, init_from=uniq, loop_schedule=SCHEDULE,
                                max_iters=a.retrofit_iters)),
                dict(name=f'scratch_R{R}-s{seed}', arm=f'scratch_R{R}', R=R, seed=seed, flops=pre + extra,
                     cost=pre + extra, flags=dict(LOOPED, n_loop=R, max_iters=steps)),
                dict(name=f'unique_more_R{R}-s{seed}', arm=f'unique_more_R{R}', R=1, seed=seed,
                     flops=pre + more * step, cost=more * step,
                     start=uniq,
                     flags=dict(UNIQUE, init_from='resume', max_iters=a.pretrain_iters + more))]
    for r in runs:
        r.setdefault('out_dir', os.path.join(a.out, r['name']))
    return runs


def train_cmd(run, resume):
    flags = dict(run['flags'], seed=run['seed'], out_dir=run['out_dir'], eval_interval=100)
    if resume:
        flags['init_from'] = 'resume'
    return [sys.executable, os.path.join(REPO, 'train.py'), os.path.join(REPO, BASE)] + \
        [f'--{k}={v}' for k, v in flags.items()]


@torch.no_grad()
def evaluate(run, X, Y):
    """Val CE at every exit 1..2R of one pass (R the run's), on the fixed windows; float32."""
    model = checkpoint.build_model(checkpoint.load(os.path.join(run['out_dir'], 'ckpt.pt'))).eval()
    R = model.config.n_loop
    n = 2 * R if R > 1 else 1
    ce = torch.zeros(n, dtype=torch.float64)
    for i in range(0, X.size(0), 64):
        ce += model.exit_metrics(X[i:i + 64], Y[i:i + 64], n_loop=n)[0].double() * X[i:i + 64].size(0)
    return (ce / X.size(0)).tolist()


def run_all(runs, X, Y):
    env = dict(os.environ, OMP_NUM_THREADS='1', MKL_NUM_THREADS='1')
    t0 = time.time()
    for i, run in enumerate(runs):
        status = os.path.join(run['out_dir'], 'status.json')
        if os.path.isfile(status):
            continue
        os.makedirs(run['out_dir'], exist_ok=True)
        ckpt = os.path.join(run['out_dir'], 'ckpt.pt')
        if run.get('start') and not os.path.isfile(ckpt):  # training on: from the pretrained checkpoint
            shutil.copy(os.path.join(run['start'], 'ckpt.pt'), ckpt)
        with open(os.path.join(run['out_dir'], 'train.log'), 'a') as log:  # resumed if interrupted
            code = subprocess.call(train_cmd(run, os.path.isfile(ckpt)), stdout=log,
                                   stderr=subprocess.STDOUT, env=env, cwd=os.getcwd())
        if code != 0:
            die(f"{run['name']}: train.py exited {code}; see {run['out_dir']}/train.log, then call again")
        ce = evaluate(run, X, Y)
        with open(status, 'w') as f:
            json.dump(dict(run, val_ce=ce, done=True), f)
        print(f"[{i + 1}/{len(runs)} {run['name']}: val CE {ce[run['R'] - 1]:.4f} at R={run['R']}, "
              f"{time.time() - t0:.0f}s so far]", flush=True)


def dry_run(runs):
    total = sum(r['cost'] for r in runs)
    print(f"{len(runs)} runs on {BASE} (one CPU core each, one at a time):")
    for r in runs:
        print(f"  {r['name']:<22} {r['flags']['max_iters']:>6} steps, {r['flops'] / 1e12:7.2f} TFLOP in all "
              f"(pretraining counted), flags {r['flags']}")
    print(f"about {total / 1e9 * CPU_S_PER_GFLOP / 60:.0f} CPU-minutes at {CPU_S_PER_GFLOP} s/GFLOP "
          f"(one core of the Xeon the committed sweep ran on; finished runs are skipped)")


def arms(runs):
    out = {}
    for r in runs:
        out.setdefault(r['arm'], []).append(r)
    return out


def paired(a, b, at=None):
    """Per seed (both finished): arm a's val CE minus arm b's, each at its trained R (or at exit `at`)."""
    ce = lambda r: r['val_ce'][(at or r['R']) - 1]
    bs = {r['seed']: r for r in b}
    return [ce(r) - ce(bs[r['seed']]) for r in a if r['seed'] in bs]


def claims(by, loops):
    """(key, word, n, why) per claim, by the one verdict rule (lab/verdict.py): each effect is a paired
    difference per seed in val CE (nats), claimed negative (lower is better); the paper gives no size at
    this scale (it scores GSM8K), so a CI that excludes 0 on the claimed side reproduces."""
    out = []
    def claim(key, diffs):
        m, lo, hi = mean_ci(diffs)
        if m is None:
            return
        word, why = verdict(m, lo, hi, sign=-1, n=len(diffs))
        out.append((key, word, len(diffs), why))
    for R in loops:
        rf = by.get(f'retrofit_R{R}', [])
        # retrofit_R minus scratch_R, minus unique_more_R; CE at exit R minus exit 1, exit 2R minus exit R
        claim(f'beats scratch at equal total FLOPs, R = {R}', paired(rf, by.get(f'scratch_R{R}', [])))
        claim(f'beats the unique model trained on, R = {R}', paired(rf, by.get(f'unique_more_R{R}', [])))
        per_seed = lambda k, j: [r['val_ce'][k - 1] - r['val_ce'][j - 1] for r in rf]
        claim(f'gains from more test-time loops, R = {R}', per_seed(R, 1))
        claim(f'gains past the trained R, R = {R}', per_seed(2 * R, R))
    return out


def mean_sd(xs):
    m = sum(xs) / len(xs)
    return m, (float(np.std(xs, ddof=1)) if len(xs) > 1 else float('nan'))


def report(runs, a, lines_head):
    by = arms([r for r in runs if r.get('done')])
    os.makedirs(a.report_dir, exist_ok=True)
    lines = lines_head + ["| arm | seeds | steps | total TFLOP (pretraining counted) | val CE at its R "
                          "(mean ± sd) |", "|---|---|---|---|---|"]
    for arm, rs in by.items():
        m, sd = mean_sd([r['val_ce'][r['R'] - 1] for r in rs])
        lines.append(f"| {arm} | {len(rs)} | {rs[0]['flags']['max_iters']} | {rs[0]['flops'] / 1e12:.2f} "
                     f"| {fmt(m, '.4f')} ± {fmt(sd, '.4f')} |")
    lines += ["", "Val CE at every test-time loop count k (exit k of a 2R-loop pass), mean over seeds; "
              "the trained R in bold:", ""]
    for arm, rs in by.items():
        if rs[0]['R'] == 1:
            continue
        n = len(rs[0]['val_ce'])
        cells = [sum(r['val_ce'][k] for r in rs) / len(rs) for k in range(n)]
        row = ' | '.join(f"**{c:.4f}**" if k + 1 == rs[0]['R'] else f"{c:.4f}" for k, c in enumerate(cells))
        lines += [f"| {arm} | " + ' | '.join(f'k={k + 1}' for k in range(n)) + " |",
                  "|---|" + "---|" * n, f"| val CE | {row} |", ""]
    lines += plot(by, a)
    lines += ["### Verdicts", ""] + [f"- {key}: {word} ({n} seed{'s' if n != 1 else ''}); {why}"
                                     for key, word, n, why in claims(by, a.loops)] + [""]
    with open(os.path.join(a.report_dir, f'{a.name}.md'), 'w', encoding='utf-8') as f:
        f.write('\n'.join(lines) + '\n')
    with open(os.path.join(a.report_dir, f'{a.name}.json'), 'w', encoding='utf-8') as f:
        json.dump([{k: v for k, v in r.items() if k != 'out_dir'} for rs in by.values() for r in rs], f,
                  indent=1)
    print(f"wrote {os.path.join(a.report_dir, a.name + '.md')}")


def plot(by, a):
    """<name>.png: val CE against the test-time loop count, each looped arm's seed mean; the markdown line."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return []
    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, rs in by.items():
        if rs[0]['R'] > 1:
            ce = np.mean([r['val_ce'] for r in rs], axis=0)
            ax.plot(range(1, len(ce) + 1), ce, marker='o', ls='-' if arm.startswith('retrofit') else '--',
                    label=f"{arm} (trained R = {rs[0]['R']})")
    ax.set(xlabel='test-time loops k', ylabel='val CE (nats)', title='Retrofitted vs from scratch')
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(a.report_dir, f'{a.name}.png'), dpi=100)
    plt.close(fig)
    return [f"![val CE against test-time loops]({a.name}.png)", ""]


def header(a):
    return ["# Retrofitted recurrence at laptop scale (docs/papers.md §6)", "",
            f"`{a.command}`: config/laptop_retrofit.py (shakespeare_char, d 128, 4 heads, 64 tokens, batch "
            f"16, AdamW 1e-3 constant), seeds {', '.join(map(str, a.seeds))}. The unique model: 6 layers, "
            f"{a.pretrain_iters} steps. The retrofit: its layers 0 | 3-4 | 5 as prelude | loop x R | coda "
            f"(layers 1-2 dropped), the concat adapter at identity, {a.retrofit_iters} steps with the mean "
            f"loop count ramped 1 -> R over the first {SCHEDULE:.0%}. Scratch: the same looped shape from "
            f"scratch at the retrofit's total FLOPs (pretraining counted), fixed R. unique_more: the unique "
            f"model trained on from its checkpoint for the retrofit's FLOPs. Each run scored on one fixed "
            f"set of {VAL_SEQS} validation windows (the same for every arm and seed), in float32; the "
            f"runs trained in bf16 autocast on one core of an Intel Xeon (AMX-BF16), one at a time, the "
            f"other core busy with other work.", ""]


def main(argv):
    a = parser().parse_args(argv)
    a.command = ' '.join(['python lab/ablate.py retrofit'] + [x for x in argv if x != '--report_only'])
    a.seeds, a.loops = ints(a.seeds, 'seeds'), ints(a.loops, 'loops')
    if min(a.pretrain_iters, a.retrofit_iters) < 1:
        die("--pretrain_iters and --retrofit_iters must be >= 1")
    BASE_MODEL.update(base_model())
    runs = plan(a)
    if a.dry_run:
        return dry_run(runs)
    done = lambda r: os.path.join(r['out_dir'], 'status.json')
    if not a.report_only:
        meta = open_data(os.path.join('data', 'shakespeare_char'), 64)
        X, Y = val_windows(os.path.join('data', 'shakespeare_char'), meta, 64, VAL_SEQS)
        run_all(runs, X, Y)
    runs = [json.load(open(done(r))) if os.path.isfile(done(r)) else r for r in runs]
    if not any(r.get('done') for r in runs):
        die(f"no finished run under {a.out}/: run the sweep first (python lab/ablate.py retrofit)")
    report(runs, a, header(a))


if __name__ == '__main__':  # a module the lab's commands import
    print("lab/retrofit_sweep.py: a preset's sweep, not a command; see python lab/ablate.py retrofit --help")
