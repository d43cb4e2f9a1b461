"""
Sweeps: a preset's config arms x seeds -> one train.py run each (own out_dir) -> eval_depth.py -> a report
(markdown tables + PNG plots). The two presets reproduce the papers' ablations (papers.md §1, §2):

    python ablate.py blindspot     # paper 1: seven arms + inter-loop norm + two init=gpt2 arms; report in assets/
    python ablate.py deeploop      # paper 2: sandwich p in {0, 1/4, 1/2} vs pre-norm, R in {1, 4, 8}, 2 LRs, 2 seeds
    python ablate.py deeploop --report_only          # rebuild the report from the finished runs
    python ablate.py blindspot --only=loop_rmsnorm,loop_raw --seeds=1,2 --set max_iters=100

Without --base the laptop sizes below apply (shakespeare_char, d 128, K 2; on a 2-core CPU, one run per
core). With --base the same arms run on top of a GPU config file instead, unchanged:

    python ablate.py blindspot --base config/paper_44m.py --launcher "torchrun --standalone --nproc_per_node=8"
    python ablate.py deeploop --base config/deeploop_small.py --set max_iters=2700 --workers=8 --gpus_per_worker=1
    python ablate.py blindspot --base config/paper_44m.py --dry_run   # the commands and estimated GPU-hours

Runs go to <out>/<arm>-s<seed>/ (train.log, eval.log, metrics.jsonl, eval_depth.json, status.json); a finished
run (status.json says so) is skipped on the next call, an interrupted one is resumed. matplotlib is optional:
without it the plots are skipped with a message.
"""
import argparse
import json
import math
import os
import queue
import shlex
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import configurator
from common import die

REPO = os.path.dirname(os.path.abspath(__file__))

# -----------------------------------------------------------------------------
# presets

def arm(name, *files, tags=None, **overrides):
    """One arm: config files (composed in order on top of the base) and --key=value overrides."""
    return dict(name=name, files=list(files), overrides=overrides, tags=tags or {})

# paper 1 at laptop size (papers.md §1 "measured at laptop scale"): d 128, K 2, R 4, shakespeare_char, AdamW
# 3e-4 constant with no warmup, betas (0.9, 0.999), wd 0.01, clip 1.0, reference init (wte ~ N(0, 1))
BLINDSPOT_LAPTOP = dict(
    dataset='shakespeare_char', n_layer=2, n_loop=4, n_head=4, n_embd=128, block_size=64, batch_size=16,
    gradient_accumulation_steps=1, dropout=0.0, init='reference', learning_rate=3e-4, lr_schedule='constant',
    warmup_iters=0, beta1=0.9, beta2=0.999, weight_decay=0.01, grad_clip=1.0,
    max_iters=600, eval_interval=25, eval_iters=4, log_interval=100, device='cpu', compile=False)

# paper 2 at laptop size (papers.md §2 "measured at laptop scale"): char-level, d 128, K 2, GPT-2 init, RoPE,
# GELU MLP and terminal supervision as in config/deeploop_small.py, constant LR with no warmup (a warmup would
# hide exactly the early instability this sweep looks for)
DEEPLOOP_LAPTOP = dict(
    dataset='shakespeare_char', n_layer=2, n_head=4, n_embd=128, block_size=64, batch_size=8,
    gradient_accumulation_steps=1, dropout=0.0, init='gpt2', pos='rope', mlp='gelu', supervision='terminal',
    readout='rmsnorm', lr_schedule='constant', warmup_iters=0, beta1=0.9, beta2=0.99, weight_decay=0.01,
    grad_clip=1.0, max_iters=300, eval_interval=25, eval_iters=4, log_interval=100, device='cpu', compile=False)

DEEPLOOP_VARIANTS = [  # (name, block, depth_scaling): papers.md §2's family alpha = (2N)^p, beta = (8N)^-p
    ('preln', 'preln', 'none'),                  # the paper's baseline: pre-norm, no residual scaling
    ('sandwich_p0', 'sandwich', 'none'),         # p = 0: alpha = beta = 1
    ('sandwich_p0.25', 'sandwich', 'deepnorm'),  # p = 1/4 (DeepNorm's exponent)
    ('sandwich_p0.5', 'sandwich', 'deeploop'),   # p = 1/2 (DeepLoop)
]

DEEPLOOP_RS = (1, 4, 8)       # loop counts at fixed K
DEEPLOOP_LRS = (1e-3, 3e-3)   # two learning rates: post-norm blocks are far more LR-sensitive than pre-norm ones

PRESETS = {
    'blindspot': dict(
        title="Paper 1, the readout blind spot: seven arms + inter-loop norm + RMSNorm/raw under init=gpt2",
        laptop=BLINDSPOT_LAPTOP, seeds=(1337,), eval_depth=True, report='blindspot',
        arms=[
            arm('terminal_rmsnorm', 'config/terminal_rmsnorm.py'),
            arm('terminal_raw', 'config/terminal_raw.py'),
            arm('loop_rmsnorm', 'config/loop_rmsnorm.py'),
            arm('loop_raw', 'config/loop_raw.py'),
            arm('loop_final_only', 'config/loop_final_only.py'),
            arm('terminal_penalty', 'config/terminal_penalty.py'),
            arm('loop_penalty', 'config/loop_penalty.py'),
            arm('loop_interloop_norm', 'config/loop_interloop_norm.py'),
            arm('loop_rmsnorm_gpt2', 'config/loop_rmsnorm.py', init='gpt2'),
            arm('loop_raw_gpt2', 'config/loop_raw.py', init='gpt2'),
        ]),
    'deeploop': dict(
        title="Paper 2, DeepLoop trainability: sandwich p in {0, 1/4, 1/2} vs pre-norm, R in {1, 4, 8}, two LRs",
        laptop=DEEPLOOP_LAPTOP, seeds=(1, 2), eval_depth=False, report='deeploop',
        arms=[arm(f'{v}-R{R}-lr{lr:g}', block=block, depth_scaling=ds, n_loop=R, learning_rate=lr,
                  tags=dict(variant=v, R=R, lr=lr))
              for lr in DEEPLOOP_LRS for R in DEEPLOOP_RS for v, block, ds in DEEPLOOP_VARIANTS]),
}

ESCAPE_MARGIN = 0.2  # nats: a run 'escaped' the unigram floor if its final val loss < floor - this

# -----------------------------------------------------------------------------
# configs: resolved exactly as train.py resolves them

def fmt_value(v):
    return v if isinstance(v, str) else repr(v)


def run_args(preset, a, seed, out_dir, base, sets):
    """train.py's arguments for arm a: base files (or the laptop sizes), the arm's files and overrides, the seed."""
    files = list(base) + [os.path.join(REPO, f) if not os.path.isabs(f) and not os.path.exists(f) else f
                          for f in a['files']]
    kv = {} if base else dict(preset['laptop'])
    kv.update(a['overrides'])
    kv.update(seed=seed, out_dir=out_dir)
    return files + [f'--{k}={fmt_value(v)}' for k, v in kv.items()] + list(sets)


def resolve(args_list):
    return configurator.configure(configurator.train_defaults(), args_list)[0]

# -----------------------------------------------------------------------------
# running

def read_json(path, default=None):
    try:
        with open(path, encoding='utf-8') as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def read_metrics(run_dir):
    rows = []
    try:
        with open(os.path.join(run_dir, 'metrics.jsonl'), encoding='utf-8') as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    pass
    except OSError:
        pass
    return rows


def last_line(path):
    try:
        with open(path, encoding='utf-8', errors='replace') as f:
            lines = [l.strip() for l in f if l.strip()]
        return lines[-1] if lines else ''
    except OSError:
        return ''


class Slots:
    """Worker slots; each owns a share of the CPU cores (and optionally of the GPUs)."""

    def __init__(self, n, gpus_per_worker):
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else list(range(os.cpu_count() or 1))
        per = max(1, len(cores) // n)
        self.cores = [cores[i * per:(i + 1) * per] or cores for i in range(n)]
        self.gpus = [list(range(i * gpus_per_worker, (i + 1) * gpus_per_worker)) if gpus_per_worker else None
                     for i in range(n)]
        self.free = queue.Queue()
        for i in range(n):
            self.free.put(i)

    def popen_kwargs(self, slot):
        env = dict(os.environ, OMP_NUM_THREADS=str(len(self.cores[slot])), PYTHONUNBUFFERED='1')
        if self.gpus[slot] is not None:
            env['CUDA_VISIBLE_DEVICES'] = ','.join(map(str, self.gpus[slot]))
        kw = dict(env=env)
        if hasattr(os, 'sched_setaffinity'):
            cores = self.cores[slot]
            kw['preexec_fn'] = lambda: os.sched_setaffinity(0, cores)  # train.py sizes its threads from this
        return kw


def run_one(job, slots, launcher, do_eval, eval_args, log, reeval=False):
    """Train one run (resuming an interrupted one), then evaluate it. Writes run_dir/status.json."""
    d = job['out_dir']
    status = read_json(os.path.join(d, 'status.json'), {})
    slot = slots.free.get()
    try:
        kw = slots.popen_kwargs(slot)
        t0 = time.time()
        if status.get('train') != 'done':
            os.makedirs(d, exist_ok=True)
            cmd = launcher + [os.path.join(REPO, 'train.py')] + job['args']
            if os.path.exists(os.path.join(d, 'ckpt.pt')):
                cmd.append('--init_from=resume')
            with open(os.path.join(d, 'train.log'), 'a', encoding='utf-8') as f:
                f.write('$ ' + ' '.join(shlex.quote(c) for c in cmd) + '\n')
                f.flush()
                rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, **kw)
            status = dict(train='done' if rc == 0 else 'failed', rc=rc, train_seconds=round(time.time() - t0, 1),
                          error=None if rc == 0 else last_line(os.path.join(d, 'train.log')))
            write_status(d, status)
        if do_eval and (status.get('eval') != 'done' or reeval) and os.path.exists(os.path.join(d, 'ckpt.pt')):
            t1 = time.time()
            cmd = [sys.executable, os.path.join(REPO, 'eval_depth.py'), d] + eval_args
            with open(os.path.join(d, 'eval.log'), 'w', encoding='utf-8') as f:
                rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, **kw)
            status.update(eval='done' if rc == 0 else 'failed', eval_seconds=round(time.time() - t1, 1))
            write_status(d, status)
    finally:
        slots.free.put(slot)
    rows = read_metrics(d)
    msg = f"{job['name']}: train {status.get('train')}"
    if rows:
        msg += f", iter {rows[-1]['iter']}, val {rows[-1]['val_loss']:.4f}, ||h_R|| {rows[-1]['norm'][-1]:.1f}"
    if status.get('error'):
        msg += f" ({status['error'][:120]})"
    log(msg + f" [{time.time() - t0:.0f}s]")
    return status


def j_status(j):
    return read_json(os.path.join(j['out_dir'], 'status.json'), {})


def write_status(d, status):
    with open(os.path.join(d, 'status.json'), 'w', encoding='utf-8') as f:
        json.dump(status, f)

# -----------------------------------------------------------------------------
# data floor and compute estimates

def unigram_floor(data_dir):
    """Cross-entropy (nats/token) on val.bin of the unigram distribution of train.bin (add-1/2 smoothing):
    the loss of a model that predicts token frequencies and nothing else (papers.md §2's 'unigram floor')."""
    meta = read_json(os.path.join(data_dir, 'meta.json'))
    if meta is None:
        return None
    dt, V = np.dtype(meta['dtype']), meta['vocab_size']
    counts = {}
    for split in ('train', 'val'):
        data = np.memmap(os.path.join(data_dir, f'{split}.bin'), dtype=dt, mode='r')
        c = np.zeros(V, dtype=np.float64)
        for i in range(0, len(data), 1 << 24):
            c += np.bincount(data[i:i + (1 << 24)], minlength=V)[:V]
        counts[split] = c
    p = (counts['train'] + 0.5) / (counts['train'].sum() + 0.5 * V)
    return float(-(counts['val'] * np.log(p)).sum() / counts['val'].sum())


def estimate(cfg):
    """(tokens, training FLOPs) of a run: model.flops_per_token x tokens (eval passes not counted)."""
    from model import GPT
    from common import model_config
    from configurator import model_keys
    import contextlib, io
    vocab = cfg['vocab_size'] or read_json(os.path.join('data', cfg['dataset'], 'meta.json'), {}).get('vocab_size', 50304)
    margs = {k: cfg[k] for k in model_keys() if k in cfg}
    margs['vocab_size'] = vocab
    with contextlib.redirect_stdout(io.StringIO()):
        import torch
        with torch.device('meta'):
            model = GPT(model_config(margs))
    tokens = cfg['max_iters'] * cfg['batch_size'] * cfg['gradient_accumulation_steps'] * cfg['block_size']
    return tokens, model.flops_per_token(cfg['block_size']) * tokens

# -----------------------------------------------------------------------------
# reports

def runs_by_arm(jobs):
    out = {}
    for j in jobs:
        r = dict(j, rows=read_metrics(j['out_dir']), status=read_json(os.path.join(j['out_dir'], 'status.json'), {}),
                 depth=read_json(os.path.join(j['out_dir'], 'eval_depth.json')))
        out.setdefault(j['arm']['name'], []).append(r)
    return out


def mean(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else None


def f(x, fmt='.3f'):
    if x is None:
        return 'n/a'
    if isinstance(x, float) and (math.isinf(x) or math.isnan(x)):
        return str(x)
    if fmt.endswith('f') and abs(x) >= 1e5:  # e.g. the PPL of an untrained early exit
        return format(x, fmt[:-1].split('.')[0] + '.2e')
    return format(x, fmt)


def vec(xs, fmt):
    return ' / '.join(f(x, fmt) for x in xs) if xs else 'n/a'


def mean_vec(vs):
    vs = [v for v in vs if v]
    return [mean(col) for col in zip(*vs)] if vs else []


def row_near(rows, it):
    return min(rows, key=lambda r: abs(r['iter'] - it)) if rows else None


def plt_or_none():
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print("matplotlib is not installed: skipping the plots (pip install matplotlib)")
        return None


def blindspot_report(arms, header, report_dir, prefix):
    lines = header[:]
    lines += ["### Scale: ||h_k|| at the end of training (mean per-token L2 norm of each loop state, val, before "
              "readout and before any inter-loop norm)", "",
              "| arm | seeds | iters | val CE (exit R) | ‖h_k‖ k = 1..R | peak ‖h_R‖ (step) | ‖h_R‖ at half / end | "
              "growth, 2nd half |", "|---|---|---|---|---|---|---|---|"]
    for name, runs in arms.items():
        ok = [r for r in runs if r['rows']]
        last = [r['rows'][-1] for r in ok]
        half = [row_near(r['rows'], r['rows'][-1]['iter'] / 2) for r in ok]
        hR_end, hR_half = mean([l['norm'][-1] for l in last]), mean([h['norm'][-1] for h in half])
        peaks = [max(r['rows'], key=lambda x: x['norm'][-1]) for r in ok]
        peak = f"{f(mean([p['norm'][-1] for p in peaks]), '.1f')} ({'/'.join(str(p['iter']) for p in peaks)})" if ok else 'n/a'
        fails = [r for r in runs if r['status'].get('train') == 'failed']
        lines.append(f"| {name} | {len(runs)}{' (' + str(len(fails)) + ' failed)' if fails else ''} | "
                     f"{vec([l['iter'] for l in last[:1]], 'd')} | {f(mean([l['val_loss'] for l in last]), '.4f')} | "
                     f"{vec(mean_vec([l['norm'] for l in last]), '.1f')} | {peak} | {f(hR_half, '.1f')} / {f(hR_end, '.1f')} | "
                     f"x{f(hR_end / hR_half if hR_end and hR_half else None, '.2f')} |")
    lines += ["", "### Depth: val CE at every exit (eval_depth, fixed depth) and what adaptive depth buys", "",
              "| arm | val CE exit 1..R | CE exits R+1..2R (extrapolation) | ΔPPL exit 1→R | calibrated avg loops "
              "(margin, held-out) | held-out PPL / fixed-R | dynamic batching tok/s vs fixed-R |",
              "|---|---|---|---|---|---|---|"]
    for name, runs in arms.items():
        d = [r['depth'] for r in runs if r['depth']]
        if not d:
            lines.append(f"| {name} | n/a | n/a | n/a | n/a | n/a | n/a |")
            continue
        R = d[0]['n_loop']
        ce = mean_vec([x['fixed']['ce'] for x in d])
        cal = [x['calibrated'][x['calibrated']['policy']] for x in d]
        lines.append(f"| {name} | {vec(ce[:R], '.3f')} | {vec(ce[R:], '.3f')} | "
                     f"{f(mean([x['dppl_1_to_R'] for x in d]), '+.3f')} | "
                     f"{f(mean([c['held_avg_loops'] for c in cal]), '.2f')} | "
                     f"{f(mean([c['held_ppl_ratio'] for c in cal]), '.4f')} | "
                     f"x{f(mean([x['throughput']['speedup'] for x in d]), '.2f')} |")
    lines += ["", "### Does the loss see the scale? Radial gradient fraction and the inference-time radial clamp", "",
              "| arm | radial grad. fraction, exit-k CE via its readout (k = 1..R) | radial grad. fraction, "
              "training loss (k = 1..R) | ΔCE exit R, radial part of updates removed | ΔCE exit R, states rescaled to "
              "loop 1's RMS |", "|---|---|---|---|---|"]
    for name, runs in arms.items():
        d = [r['depth'] for r in runs if r['depth']]
        if not d:
            lines.append(f"| {name} | n/a | n/a | n/a | n/a |")
            continue
        lines.append(f"| {name} | {vec(mean_vec([x['radial_frac']['readout'] for x in d]), '.1e')} | "
                     f"{vec(mean_vec([x['radial_frac']['total'] for x in d]), '.1e')} | "
                     f"{f(mean([x['clamp']['radial']['dce'][-1] for x in d]), '+.4f')} | "
                     f"{f(mean([x['clamp']['freeze']['dce'][-1] for x in d]), '+.4f')} |")
    plots = []
    plt = plt_or_none()
    if plt is not None:
        plots = blindspot_plots(plt, arms, report_dir, prefix)
    lines += [""] + [f"![{p}]({p})" for p in plots]
    return lines


def blindspot_plots(plt, arms, report_dir, prefix):
    names = list(arms)
    out = []
    # 1) ||h_k|| vs step, one panel per arm, log y
    ncol = min(5, len(names))
    nrow = math.ceil(len(names) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(3 * ncol, 2.6 * nrow), sharex=True, sharey=True, squeeze=False)
    for ax, name in zip(axes.flat, names):
        for r in arms[name]:
            rows = r['rows']
            if not rows:
                continue
            for k in range(len(rows[0]['norm'])):
                ax.plot([x['iter'] for x in rows], [x['norm'][k] for x in rows], color=plt.cm.viridis(k / max(1, len(rows[0]['norm']) - 1)),
                        lw=1.2, label=f'k={k + 1}' if r is arms[name][0] else None)
        ax.set_yscale('log')
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3, which='both')
    for ax in axes.flat[len(names):]:
        ax.axis('off')
    axes.flat[0].legend(fontsize=7, title='loop', title_fontsize=7)
    fig.supxlabel('training step')
    fig.supylabel('||h_k|| (mean per-token L2, val)')
    fig.tight_layout()
    out.append(save(fig, plt, report_dir, f'{prefix}_norms.png'))
    # 2) PPL vs average loops: the adaptive-exit curve (margin policy) and the fixed exits
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ymax, ymin = [], []
    for i, name in enumerate(names):
        d = [r['depth'] for r in arms[name] if r['depth']]
        if not d:
            continue
        x = d[0]
        R, c = x['n_loop'], plt.cm.tab10(i % 10)
        ax.plot(range(1, R + 1), x['fixed']['ppl'][:R], 'o', color=c, ms=4)
        a = x['adaptive'].get('margin')
        if a:
            order = np.argsort(a['avg_loops'])
            ax.plot(np.array(a['avg_loops'])[order], np.array(a['ppl'])[order], '-', color=c, lw=1.2, label=name)
        ymax.append(x['fixed']['ppl'][R - 1])
        ymin.append(min(x['fixed']['ppl'][:R] + (a['ppl'] if a else [])))
    ax.set_yscale('log')
    if ymax:
        ax.set_ylim(0.9 * min(ymin), 3 * max(ymax))
    ax.set_xlabel('average loops per sequence')
    ax.set_ylabel('val PPL')
    ax.set_title('adaptive exit (margin, lines) and fixed exits (dots): lower-left is better', fontsize=9)
    ax.grid(alpha=0.3, which='both')
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    out.append(save(fig, plt, report_dir, f'{prefix}_pareto.png'))
    # 3) CE per exit, 1..2R
    fig, ax = plt.subplots(figsize=(7, 4.5))
    R = None
    for i, name in enumerate(names):
        d = [r['depth'] for r in arms[name] if r['depth']]
        if not d:
            continue
        R = d[0]['n_loop']
        ce = mean_vec([x['fixed']['ce'] for x in d])
        ax.plot(range(1, len(ce) + 1), ce, 'o-', ms=3, lw=1.2, color=plt.cm.tab10(i % 10), label=name)
    if R:
        ax.axvline(R + 0.5, color='k', ls='--', lw=0.8)
        ax.text(R + 0.6, ax.get_ylim()[1], 'more loops than trained', va='top', fontsize=7)
    ax.set_yscale('log')
    ax.set_xlabel('exit k')
    ax.set_ylabel('val CE (nats)')
    ax.grid(alpha=0.3, which='both')
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    out.append(save(fig, plt, report_dir, f'{prefix}_exit_ce.png'))
    return out


def save(fig, plt, report_dir, name):
    fig.savefig(os.path.join(report_dir, name), dpi=90)
    plt.close(fig)
    return name


def deeploop_report(arms, header, report_dir, prefix, floor):
    lines = header[:]
    if floor is None:
        lines += ["(unigram floor unknown: the dataset's meta.json was not found)", ""]
    else:
        lines += [f"Unigram floor (cross-entropy on val of the train unigram distribution): **{floor:.4f} nats**. "
                  f"A run *escaped* if its final val loss < floor - {ESCAPE_MARGIN} = {floor - ESCAPE_MARGIN:.4f}.", ""]
    runs = [r for rs in arms.values() for r in rs]
    variants = list(dict.fromkeys(r['arm']['tags']['variant'] for r in runs))
    Rs = sorted({r['arm']['tags']['R'] for r in runs})
    lrs = sorted({r['arm']['tags']['lr'] for r in runs})

    def final(r):
        return r['rows'][-1]['val_loss'] if r['rows'] and r['status'].get('train') == 'done' else None

    def escaped(r):
        v = final(r)
        return v is not None and floor is not None and math.isfinite(v) and v < floor - ESCAPE_MARGIN

    lines += ["Final val loss (exit R) per seed, and escaped runs / seeds:", "",
              "| variant | " + " | ".join(f"R={R}, lr={lr:g}" for lr in lrs for R in Rs) + " |",
              "|---|" + "---|" * (len(Rs) * len(lrs))]
    for v in variants:
        cells = []
        for lr in lrs:
            for R in Rs:
                rs = [r for r in runs if r['arm']['tags'] == dict(variant=v, R=R, lr=lr)]
                vals = ' / '.join('failed' if r['status'].get('train') == 'failed' else f(final(r), '.3f') for r in rs)
                cells.append(f"{vals} ({sum(map(escaped, rs))}/{len(rs)})" if rs else '')
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    lines.append("")
    plt = plt_or_none()
    if plt is not None:
        fig, axes = plt.subplots(len(lrs), len(Rs), figsize=(3.4 * len(Rs), 2.8 * len(lrs)), sharex=True,
                                 sharey=True, squeeze=False)
        for i, lr in enumerate(lrs):
            for j, R in enumerate(Rs):
                ax = axes[i][j]
                for c, v in enumerate(variants):
                    for s, r in enumerate(r for r in runs if r['arm']['tags'] == dict(variant=v, R=R, lr=lr)):
                        if r['rows']:
                            ax.plot([x['iter'] for x in r['rows']], [x['val_loss'] for x in r['rows']],
                                    color=plt.cm.tab10(c), lw=1.1, ls='-' if s == 0 else '--',
                                    label=v if s == 0 else None)
                if floor is not None:
                    ax.axhline(floor, color='k', lw=0.8, ls=':')
                ax.set_title(f'R={R}, lr={lr:g}', fontsize=9)
                ax.grid(alpha=0.3)
        top = max([r['rows'][0]['val_loss'] for r in runs if r['rows']] + [floor or 0])
        axes[0][0].set_ylim(max(0.0, min([x['val_loss'] for r in runs for x in r['rows']] + [top]) - 0.1),
                            min(top, (floor or top) + 1.5) + 0.1)
        from matplotlib.lines import Line2D
        axes[0][-1].legend([Line2D([], [], color=plt.cm.tab10(c)) for c in range(len(variants))], variants, fontsize=7)
        fig.supxlabel('training step (dotted: unigram floor; dashed: 2nd seed)')
        fig.supylabel('val loss (exit R)')
        fig.tight_layout()
        lines.append(f"![{prefix}_loss.png]({save(fig, plt, report_dir, f'{prefix}_loss.png')})")
    return lines


def write_report(preset_name, preset, jobs, args, sweep):
    arms = runs_by_arm(jobs)
    cfg0 = jobs[0]['cfg']
    os.makedirs(args.report_dir, exist_ok=True)
    sizes = (f"{cfg0['dataset']}, d {cfg0['n_embd']}, K {cfg0['n_layer']}, block {cfg0['block_size']}, batch "
             f"{cfg0['batch_size']}x{cfg0['gradient_accumulation_steps']}, {cfg0['max_iters']} steps, "
             f"{cfg0['lr_schedule']} lr, init {cfg0['init']}")
    seeds = sorted({j['seed'] for j in jobs})
    command = sweep.get('command') or args.command.replace(' --report_only', '')
    header = [f"## {preset['title']}", "",
              f"`{command}`: {len(arms)} arms x {len(seeds)} seed(s) ({', '.join(map(str, seeds))}); {sizes}"
              + (f"; base {' '.join(args.base)}" if args.base else '') + ".",
              f"Wall time of the last sweep call: {f(sweep.get('wall_seconds', 0) / 60, '.1f')} min with "
              f"{sweep.get('workers', '?')} run(s) at a time, {sweep.get('cores_per_run', '?')} CPU core(s) each; "
              f"train time summed over runs: {sum(j_status(j).get('train_seconds', 0) for j in jobs) / 60:.1f} min.",
              ""]
    prefix = preset_name
    if preset['report'] == 'blindspot':
        lines = blindspot_report(arms, header, args.report_dir, prefix)
    else:
        lines = deeploop_report(arms, header, args.report_dir, prefix, unigram_floor(os.path.join('data', cfg0['dataset'])))
    path = os.path.join(args.report_dir, f'{prefix}.md')
    with open(path, 'w', encoding='utf-8') as fh:
        fh.write('\n'.join(lines) + '\n')
    summary = {name: [dict(seed=r['seed'], status=r['status'], final=r['rows'][-1] if r['rows'] else None,
                           depth={k: r['depth'][k] for k in ('fixed', 'dppl_1_to_R', 'calibrated', 'clamp',
                                                              'radial_frac', 'throughput')} if r['depth'] else None)
                      for r in runs] for name, runs in arms.items()}
    with open(os.path.join(args.report_dir, f'{prefix}.json'), 'w', encoding='utf-8') as fh:
        json.dump(summary, fh, indent=1)
    print(f"report: {path}")
    return path

# -----------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(prog='ablate.py', description=__doc__.split('\n\n')[0])
    ap.add_argument('preset', choices=sorted(PRESETS))
    ap.add_argument('--base', action='append', default=[], help='config file(s) replacing the laptop sizes')
    ap.add_argument('--set', action='append', default=[], metavar='KEY=VALUE', help='override for every run')
    ap.add_argument('--only', default='', help='comma-separated arm names')
    ap.add_argument('--seeds', default='', help="comma-separated seeds (default: the preset's)")
    ap.add_argument('--out', default=None, help='runs go to <out>/<arm>-s<seed>; default out-ablate-<preset>')
    ap.add_argument('--report_dir', default=None, help='default: assets/ for the laptop sweep, else <out>')
    ap.add_argument('--workers', type=int, default=0, help='runs at once (0: one per CPU core on a CPU, else 1)')
    ap.add_argument('--gpus_per_worker', type=int, default=0, help='give each worker its own GPUs (CUDA_VISIBLE_DEVICES)')
    ap.add_argument('--launcher', default='', help='e.g. "torchrun --standalone --nproc_per_node=8" (default: python)')
    ap.add_argument('--eval_args', default='', help='extra eval_depth.py arguments, e.g. "--n_seqs=256"')
    ap.add_argument('--report_only', action='store_true', help='only rebuild the report from finished runs')
    ap.add_argument('--reeval', action='store_true', help='run eval_depth.py again on finished runs')
    ap.add_argument('--dry_run', action='store_true', help='print the commands and the estimated compute, run nothing')
    ap.add_argument('--mfu', type=float, default=0.4, help='assumed model flops utilisation for --dry_run')
    ap.add_argument('--peak_tflops', type=float, default=989.0, help='--dry_run: GPU bf16 peak (H100: 989)')
    args = ap.parse_args(argv)
    args.command = 'python ablate.py ' + ' '.join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    preset = PRESETS[args.preset]
    out_root = args.out or f'out-ablate-{args.preset}'
    args.report_dir = args.report_dir or (out_root if args.base else 'assets')
    sets = [f'--{s}' if not s.startswith('--') else s for s in args.set]
    for s in sets:
        if '=' not in s:
            die(f"--set {s[2:]}: expected KEY=VALUE")
    only = [a for a in args.only.split(',') if a]
    names = [a['name'] for a in preset['arms']]
    for a in only:
        if a not in names:
            die(f"--only {a}: not an arm of {args.preset} ({', '.join(names)})")
    seeds = [int(s) for s in args.seeds.split(',') if s] or list(preset['seeds'])
    jobs = []
    for a in preset['arms']:
        if only and a['name'] not in only:
            continue
        for s in seeds:
            d = os.path.join(out_root, f"{a['name']}-s{s}")
            targs = run_args(preset, a, s, d, args.base, sets)
            jobs.append(dict(name=f"{a['name']}-s{s}", arm=a, seed=s, out_dir=d, args=targs, cfg=resolve(targs)))
    launcher = shlex.split(args.launcher) if args.launcher else [sys.executable]

    if args.dry_run:
        total = 0.0
        for j in jobs:
            tokens, flops = estimate(j['cfg'])
            hours = flops / (args.peak_tflops * 1e12 * args.mfu) / 3600
            total += hours
            print(f"{j['name']}: {tokens / 1e9:.2f}B tokens, {flops / 1e18:.2f} EFLOP, ~{hours:.2f} GPU-h")
            shown = ['python' if c == sys.executable else c for c in launcher]
            print('  ' + ' '.join(shlex.quote(c) for c in shown + ['train.py'] + j['args']))
        print(f"total: {len(jobs)} runs, ~{total:.1f} GPU-hours of training at {args.mfu:.0%} MFU of "
              f"{args.peak_tflops:g} TFLOP/s (evaluation not counted)")
        return

    t0 = time.time()
    if not args.report_only:
        import torch
        n_workers = args.workers or ((len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else 1)
                                     if not args.launcher and not torch.cuda.is_available() else 1)
        slots = Slots(n_workers, args.gpus_per_worker)
        lock = threading.Lock()
        done = [0]

        def log(msg):
            with lock:
                done[0] += 1
                print(f"[{done[0]}/{len(jobs)} {time.time() - t0:6.0f}s] {msg}", flush=True)

        # the most expensive runs first, so that the workers finish together
        order = sorted(jobs, key=lambda j: -j['cfg']['n_loop'] * j['cfg']['max_iters'])
        print(f"{args.preset}: {len(jobs)} runs, {n_workers} at a time, cores per run "
              f"{len(slots.cores[0])}; runs in {out_root}/", flush=True)
        eval_args = shlex.split(args.eval_args)
        with ThreadPoolExecutor(n_workers) as ex:
            list(ex.map(lambda j: run_one(j, slots, launcher, preset['eval_depth'], eval_args, log, args.reeval), order))
        os.makedirs(out_root, exist_ok=True)
        with open(os.path.join(out_root, 'sweep.json'), 'w', encoding='utf-8') as fh:
            json.dump(dict(command=args.command, wall_seconds=round(time.time() - t0, 1), workers=n_workers,
                           cores_per_run=len(slots.cores[0])), fh)
    write_report(args.preset, preset, jobs, args, read_json(os.path.join(out_root, 'sweep.json'), {}))


if __name__ == '__main__':
    main()
