r"""
Sweeps: a preset's config arms x seeds -> one train.py run each (own out_dir) -> eval_depth.py -> a report
(markdown tables + PNG plots). The presets reproduce the papers' ablations (docs/papers.md §1, §2, §3):

    python ablate.py blindspot   # paper 1: 8 arms + inter-loop norm + 2 init=gpt2 arms; report in assets/
    python ablate.py deeploop    # paper 2: sandwich p in {0, 1/4, 1/2} vs pre-norm, R in {1, 4, 8}, 2 LRs
    python ablate.py recurrent   # the recurrent-depth family (§4): injection, random depth, Huginn, Ouro
    python ablate.py growing     # paper 1's "still growing": per-loop RMSNorm vs raw readout, 10,000 steps
    python ablate.py probes      # the radial-clamp cost vs length and LR, the inter-loop-norm arm vs init/LR
    python ablate.py kappa       # paper 2's visit alignment kappa_R over training, R in {1, 2, 4, 8}; gamma
    python ablate.py escape      # paper 2's p-sweep: runs that leave the unigram floor, R = 3, 5 seeds
    python ablate.py lr_transfer # loop-scaled residuals (§3): best LR per R with and without eps
    python ablate.py deeploop --report_only          # rebuild the report from the finished runs
    python ablate.py blindspot --only=loop_rmsnorm,loop_raw --seeds=1,2 --set max_iters=100

Without --base every run starts from the preset's laptop config, config/laptop_blindspot.py or
config/laptop_deeploop.py (shakespeare_char, d 128, K 2; on a 2-core CPU, one run per core). With --base the
same arms run on top of a GPU config file instead, unchanged:

    python ablate.py blindspot --base config/paper_44m.py \
        --launcher "torchrun --standalone --nproc_per_node=8"
    python ablate.py deeploop --base config/deeploop_small.py --set max_iters=2700 --workers=8 \
        --gpus_per_worker=1
    python ablate.py blindspot --base config/paper_44m.py --dry_run   # the commands and estimated GPU-hours

A run's train.py arguments are: the base config file(s), the arm's config files, the arm's --key=value
overrides, --seed and --out_dir, then every --set. train.py itself resolves them (--print_config=True), so
ablate.py holds no copy of the config schema. Runs go to <out>/<arm>-s<seed>/ (train.log, eval.log,
metrics.jsonl, eval_depth.json, status.json); a finished run (status.json says so) is skipped on the next
call, an interrupted one (a crash, or a signal that stopped train.py) is resumed. Each finished run prints
`[runs done/total, time so far, ETA]`. matplotlib is optional: without it the plots are skipped with a
message.
"""
import contextlib
import io
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
import torch

import configurator
from configurator import gpt_config, model_keys
from errors import Parser, die, duration
from hardware import auto_dtype
from model import GPT, GPTConfig

REPO = os.path.dirname(os.path.abspath(__file__))

# -----------------------------------------------------------------------------
# presets

def arm(name, *files, tags=None, **overrides):
    """One arm: config files (composed in order on top of the base) and --key=value overrides."""
    return dict(name=name, files=list(files), overrides=overrides, tags=tags or {})


DEEPLOOP_VARIANTS = [  # (name, block, depth_scaling): docs/papers.md §2's alpha = (2N)^p, beta = (8N)^-p
    ('preln', 'preln', 'none'),                  # the paper's baseline: pre-norm, no residual scaling
    ('sandwich_p0', 'sandwich', 'none'),         # p = 0: alpha = beta = 1
    ('sandwich_p0.25', 'sandwich', 'deepnorm'),  # p = 1/4 (DeepNorm's exponent)
    ('sandwich_p0.5', 'sandwich', 'deeploop'),   # p = 1/2 (DeepLoop)
]

DEEPLOOP_RS = (1, 4, 8)       # loop counts at fixed K
DEEPLOOP_LRS = (1e-3, 3e-3)   # post-norm blocks are far more LR-sensitive than pre-norm ones
KAPPA_RS = (1, 2, 4, 8)       # loop counts of the kappa_R and LR-transfer sweeps (gamma from kappa_R vs R)
KAPPA_LR = 3e-3               # the deeploop sweep's LR where sandwich p = 0 stays on the floor at R >= 4
LR_TRANSFER_LRS = (3e-4, 1e-3, 3e-3, 1e-2)   # Wang et al.'s claim (docs/papers.md §3): with eps, one best LR
ESCAPE_PS = (0, 0.25, 0.30, 0.40, 0.50, 0.60)  # docs/papers.md §2's p-sweep at R = 3 (p = 0, 1/4 added)
PAPER_ESCAPES = {0.30: '0/5', 0.40: '2/5', 0.50: '3/5', 0.60: '5/5'}  # docs/papers.md §2, GPT-2 small

PRESETS = {
    'blindspot': dict(
        title="Paper 1, the readout blind spot: eight arms + inter-loop norm + RMSNorm/raw under init=gpt2",
        laptop='config/laptop_blindspot.py', seeds=(1337,), eval_depth=True, report='blindspot',
        arms=[
            arm('terminal_rmsnorm', 'config/terminal_rmsnorm.py'),
            arm('terminal_raw', 'config/terminal_raw.py'),
            arm('loop_rmsnorm', 'config/loop_rmsnorm.py'),
            arm('loop_layernorm', 'config/loop_layernorm.py'),
            arm('loop_raw', 'config/loop_raw.py'),
            arm('loop_final_only', 'config/loop_final_only.py'),
            arm('terminal_penalty', 'config/terminal_penalty.py'),
            arm('loop_penalty', 'config/loop_penalty.py'),
            arm('loop_interloop_norm', 'config/loop_interloop_norm.py'),
            arm('loop_rmsnorm_gpt2', 'config/loop_rmsnorm.py', init='gpt2'),
            arm('loop_raw_gpt2', 'config/loop_raw.py', init='gpt2'),
        ]),
    'deeploop': dict(
        title="Paper 2, DeepLoop trainability: sandwich p in {0, 1/4, 1/2} vs pre-norm, R in {1, 4, 8}, "
              "two LRs",
        laptop='config/laptop_deeploop.py', seeds=(1, 2), eval_depth=False, report='deeploop',
        arms=[arm(f'{v}-R{R}-lr{lr:g}', block=block, depth_scaling=ds, n_loop=R, learning_rate=lr,
                  tags=dict(variant=v, R=R, lr=lr))
              for lr in DEEPLOOP_LRS for R in DEEPLOOP_RS for v, block, ds in DEEPLOOP_VARIANTS]),
    'kappa': dict(
        title="Visit alignment kappa_R over training: pre-norm and sandwich p in {0, 1/4, 1/2}, "
              "R in {1, 2, 4, 8}",
        laptop='config/laptop_deeploop.py', seeds=(1,), eval_depth=False, report='kappa',
        arms=[arm(f'{v}-R{R}', block=block, depth_scaling=ds, n_loop=R, learning_rate=KAPPA_LR,
                  log_kappa=True, tags=dict(variant=v, R=R))
              for R in KAPPA_RS for v, block, ds in DEEPLOOP_VARIANTS]),
    'lr_transfer': dict(
        title="Loop-scaled residuals and LR transfer: final val loss vs LR per R, pre-norm with and without "
              "eps = 1/(R sqrt K)",
        laptop='config/laptop_deeploop.py', seeds=(1, 2), eval_depth=False, report='lr_transfer',
        arms=[arm(f'preln{"_eps" if eps else ""}-R{R}-lr{lr:g}', *(['config/loop_eps.py'] if eps else []),
                  n_loop=R, learning_rate=lr, eval_interval=100, eval_iters=16,  # few evals, less noisy
                  tags=dict(eps=eps, R=R, lr=lr))
              for eps in (False, True) for lr in LR_TRANSFER_LRS for R in KAPPA_RS]),
    'escape': dict(
        title="DeepLoop's escape fractions at laptop size: sandwich R = 3, p in {0, 1/4, 0.3, 0.4, 0.5, "
              "0.6}, lr 3e-3",
        laptop='config/laptop_deeploop.py', seeds=(1, 2, 3, 4, 5), eval_depth=False, report='escape',
        arms=[arm(f'sandwich_p{p:g}', block='sandwich', depth_scaling=p, n_loop=3, learning_rate=KAPPA_LR,
                  tags=dict(p=p))
              for p in ESCAPE_PS]),
}

# the recurrent-depth family at the blind-spot sweep's size (docs/papers.md §4); each arm adds to the one
# before up to the random-depth arm; n_loop = 3 makes the sampled depth's mean 4 (n_loop + 1)
RANDOM_DEPTH = dict(loop_sampling='poisson_lognormal', n_loop=3, backprop_loops=2)
PRESETS['recurrent'] = dict(
    title="The recurrent-depth family: does the blind spot survive injection, random depth, a coda, a gate?",
    laptop='config/laptop_blindspot.py', seeds=(1337,), eval_depth=True, report='recurrent',
    eval_args=['--exits=16'],
    arms=[
        arm('loop_rmsnorm', 'config/loop_rmsnorm.py'),
        arm('inject_add', 'config/loop_rmsnorm.py', injection='add'),
        arm('random_depth', 'config/loop_rmsnorm.py', injection='add', **RANDOM_DEPTH),
        arm('huginn', 'config/loop_rmsnorm.py', 'config/huginn.py', n_loop=3),
        arm('ouro', 'config/loop_rmsnorm.py', 'config/ouro.py'),
    ])
TEST_LOOPS = (1, 2, 4, 8, 16)  # the recurrent report's test-time depths
HALT_POLICIES = ('margin', 'kl', 'gate')  # ... and its exits
GROWING = dict(max_iters=10_000, eval_interval=50)  # §1 "still growing": 16x the blind-spot sweep's length
PRESETS['growing'] = dict(
    title="Paper 1, \"still growing\": per-loop CE with an RMSNorm vs a raw readout, 10,000 steps",
    laptop='config/laptop_blindspot.py', seeds=(1337,), eval_depth=True, report='growing',
    arms=[arm('loop_rmsnorm', 'config/loop_rmsnorm.py', **GROWING),
          arm('loop_raw', 'config/loop_raw.py', **GROWING)])
LONG = dict(max_iters=2000, eval_interval=50)
PRESETS['probes'] = dict(  # cheap checks of two blind-spot findings (README, "Results at laptop scale")
    title="Probes: the radial-clamp cost vs training length and LR; the inter-loop-norm arm vs init and LR",
    laptop='config/laptop_blindspot.py', seeds=(1337,), eval_depth=True, report='blindspot',
    arms=[arm('loop_rmsnorm-2000', 'config/loop_rmsnorm.py', **LONG),
          arm('loop_rmsnorm-lr1e-3', 'config/loop_rmsnorm.py', learning_rate=1e-3),
          arm('loop_rmsnorm-2000-lr1e-3', 'config/loop_rmsnorm.py', learning_rate=1e-3, **LONG),
          arm('embedded_default', 'config/loop_rmsnorm.py', batch_size=8, learning_rate=1e-3, beta2=0.99,
              **LONG),  # train.py's own defaults: the laptop size with these four keys changed
          arm('loop_interloop_norm-gpt2', 'config/loop_interloop_norm.py', init='gpt2'),
          arm('loop_interloop_norm-lr1e-3', 'config/loop_interloop_norm.py', learning_rate=1e-3),
          arm('loop_interloop_norm-2000', 'config/loop_interloop_norm.py', **LONG)])
GROWING_STEPS = (150, 600, 1000, 2000, 3000, 5000, 7500, 10_000)  # the growing report's table rows

ESCAPE_MARGIN = 0.2  # nats: a run 'escaped' the unigram floor if its final val loss < floor - this

# -----------------------------------------------------------------------------
# planning: one job per (arm, seed), its config resolved by train.py itself

def repo_path(path):
    """A config file of this repo: as given if it exists from the working directory, else under the repo."""
    return path if os.path.isabs(path) or os.path.exists(path) else os.path.join(REPO, path)


def arg_value(v):
    return v if isinstance(v, str) else repr(v)


def run_args(base, a, seed, out_dir, sets):
    """train.py's arguments for arm a: the base files, the arm's files and overrides, the seed, the --sets."""
    overrides = dict(a['overrides'], seed=seed, out_dir=out_dir)
    files = base + [repo_path(p) for p in a['files']]
    return files + [f'--{k}={arg_value(v)}' for k, v in overrides.items()] + sets


def plan(args, preset):
    """The jobs of this call: name, arm, seed, out_dir and train.py arguments (no config yet: resolve())."""
    base = args.base or [repo_path(preset['laptop'])]
    jobs = []
    for a in preset['arms']:
        if args.only and a['name'] not in args.only:
            continue
        for seed in args.seeds:
            name = f"{a['name']}-s{seed}"
            out_dir = os.path.join(args.out, name)
            jobs.append(dict(name=name, arm=a, seed=seed, out_dir=out_dir,
                             args=run_args(base, a, seed, out_dir, args.set)))
    return jobs


def train_defaults():
    """train.py's defaults, every key: what `python train.py --print_config=True` prints with no overrides."""
    cmd = [sys.executable, os.path.join(REPO, 'train.py'), '--print_config=True']
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS='1'))
    if proc.returncode != 0:
        die(f"train.py --print_config=True failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(proc.stdout)


def resolve(jobs):
    """Set job['cfg'] to the config train.py resolves from job['args']: its defaults (asked of train.py once),
    then the same configurator that train.py applies to its command line."""
    defaults = train_defaults()
    for job in jobs:
        job['cfg'] = configurator.configure(defaults, job['args'])[0]
        configurator.check(job['cfg'])  # a bad value dies here, as it would in train.py

# -----------------------------------------------------------------------------
# running

def read_json(path, default=None):
    try:
        with open(path, encoding='utf-8') as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return default


def read_metrics(run_dir):
    rows = []
    try:
        with open(os.path.join(run_dir, 'metrics.jsonl'), encoding='utf-8') as fh:
            for line in fh:
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    pass
    except OSError:
        pass
    return rows


def read_status(run_dir):
    return read_json(os.path.join(run_dir, 'status.json'), {})


def write_status(run_dir, status):
    with open(os.path.join(run_dir, 'status.json'), 'w', encoding='utf-8') as fh:
        json.dump(status, fh)


def last_line(path):
    try:
        with open(path, encoding='utf-8', errors='replace') as fh:
            lines = [line.strip() for line in fh if line.strip()]
        return lines[-1] if lines else ''
    except OSError:
        return ''


def cpu_cores():
    """The CPU cores this process may run on."""
    if hasattr(os, 'sched_getaffinity'):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


class Slots:
    """Worker slots; each owns a share of the CPU cores (and optionally of the GPUs)."""

    def __init__(self, n, gpus_per_worker):
        cores = cpu_cores()
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


def call_logged(cmd, log_path, mode, popen_kwargs):
    """Run cmd with the command line and then its output written to log_path; returns the exit code."""
    with open(log_path, mode, encoding='utf-8') as log:
        log.write('$ ' + shlex.join(cmd) + '\n')
        log.flush()
        return subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, **popen_kwargs)


def train(job, launcher, popen_kwargs):
    """Train one run, resuming from its checkpoint if there is one (init_from=auto); returns its new status:
    done, failed, or stopped (a signal stopped train.py early with a checkpoint: the next call resumes it)."""
    run_dir = job['out_dir']
    os.makedirs(run_dir, exist_ok=True)
    cmd = launcher + [os.path.join(REPO, 'train.py')] + job['args'] + ['--init_from=auto']
    t0 = time.time()
    log_path = os.path.join(run_dir, 'train.log')
    rc = call_logged(cmd, log_path, 'a', popen_kwargs)
    rows = read_metrics(run_dir)
    finished = rc == 0 and bool(rows) and rows[-1].get('iter', -1) >= job['cfg']['max_iters']
    return dict(train='done' if finished else 'stopped' if rc == 0 else 'failed', rc=rc,
                train_seconds=round(time.time() - t0, 1), error=None if finished else last_line(log_path))


def evaluate(run_dir, eval_args, popen_kwargs):
    """eval_depth.py on a run's checkpoint; returns the status keys it sets."""
    t0 = time.time()
    cmd = [sys.executable, os.path.join(REPO, 'eval_depth.py'), run_dir] + eval_args
    rc = call_logged(cmd, os.path.join(run_dir, 'eval.log'), 'w', popen_kwargs)
    return dict(eval='done' if rc == 0 else 'failed', eval_seconds=round(time.time() - t0, 1))


def run_summary(job, status):
    rows = read_metrics(job['out_dir'])
    msg = f"{job['name']}: train {status.get('train')}"
    if rows:
        last = rows[-1]
        msg += (f", iter {last['iter']}, val {fmt(last['val_loss'], '.4f')}, "
                f"||h_R|| {fmt(last['norm'][-1], '.1f')}")
    if status.get('error'):
        msg += f" ({status['error'][:120]})"
    return msg


def run_one(job, slots, launcher, do_eval, eval_args, log, reeval=False):
    """Train one run (resuming an interrupted one), then evaluate it. Writes run_dir/status.json."""
    run_dir = job['out_dir']
    status = read_status(run_dir)
    slot = slots.free.get()
    t0, worked = time.time(), False
    try:
        popen_kwargs = slots.popen_kwargs(slot)
        if status.get('train') != 'done':
            status, worked = train(job, launcher, popen_kwargs), True
            write_status(run_dir, status)
        wants_eval = do_eval and status.get('train') != 'stopped' and (status.get('eval') != 'done' or reeval)
        if wants_eval and os.path.exists(os.path.join(run_dir, 'ckpt.pt')):
            status.update(evaluate(run_dir, eval_args, popen_kwargs))
            write_status(run_dir, status)
            worked = True
    finally:
        slots.free.put(slot)
    seconds = time.time() - t0
    log(job, run_summary(job, status) + f" [{seconds:.0f}s]", seconds if worked else None)
    return status


def cost(job):
    """A run's relative cost: loops x iterations (to order the runs and to estimate the time left)."""
    return job['cfg']['n_loop'] * job['cfg']['max_iters']


def progress_logger(jobs, n_workers, t0):
    """log(job, msg, seconds): one line per finished run, `[runs done/total, time so far, ETA]`, safe to
    call from the worker threads. seconds: what the run took, None if an earlier call had finished it. The
    ETA spreads the cost of the runs not finished over the workers, at the seconds per unit of cost that
    the runs of this call took (runs in progress count as not started, so it errs on the long side)."""
    lock, done, left = threading.Lock(), [0], [sum(cost(j) for j in jobs)]
    spent = [0.0, 0]  # seconds and cost of the runs this call ran

    def log(job, msg, seconds):
        with lock:
            done[0] += 1
            left[0] -= cost(job)
            if seconds is not None:
                spent[0], spent[1] = spent[0] + seconds, spent[1] + cost(job)
            eta = ''
            if spent[1] and left[0]:
                eta = f", ETA {duration(left[0] * spent[0] / spent[1] / n_workers)}"
            print(f"[{done[0]}/{len(jobs)} runs, {duration(time.time() - t0)}{eta}] {msg}", flush=True)
    return log


def default_workers(args):
    """One run per CPU core on a CPU; one at a time with a launcher (torchrun) or a GPU."""
    return len(cpu_cores()) if not args.launcher and not torch.cuda.is_available() else 1


def run_sweep(jobs, preset, launcher, args):
    """Train (and evaluate) every job not finished yet, n_workers at a time; writes <out>/sweep.json."""
    t0 = time.time()
    n_workers = args.workers or default_workers(args)
    slots = Slots(n_workers, args.gpus_per_worker)
    log = progress_logger(jobs, n_workers, t0)
    order = sorted(jobs, key=lambda j: -cost(j))  # the most expensive runs first: the workers finish together
    print(f"{args.preset}: {len(jobs)} runs, {n_workers} at a time, cores per run {len(slots.cores[0])}; "
          f"runs in {args.out}/", flush=True)
    eval_args = preset.get('eval_args', []) + shlex.split(args.eval_args)

    def run(job):
        return run_one(job, slots, launcher, preset['eval_depth'], eval_args, log, args.reeval)
    with ThreadPoolExecutor(n_workers) as pool:
        list(pool.map(run, order))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, 'sweep.json'), 'w', encoding='utf-8') as fh:
        json.dump(dict(command=args.command, wall_seconds=round(time.time() - t0, 1), workers=n_workers,
                       cores_per_run=len(slots.cores[0]), commit=code_version(),
                       dtype=resolved_dtype(jobs[0]['cfg'])), fh)


def code_version():
    """The commit the sweep ran (with '+local changes' if the tree differed from it), for the report."""
    def git(*a):
        proc = subprocess.run(['git', '-C', REPO, *a], capture_output=True, text=True)
        return proc.stdout.strip() if proc.returncode == 0 else ''
    commit = git('rev-parse', '--short=12', 'HEAD') or 'unknown'
    return commit + (' + local changes' if git('status', '--porcelain', '--untracked-files=no') else '')


def resolved_dtype(cfg):
    """The dtype the runs trained in: dtype='auto' resolved the way train.py resolves it."""
    if cfg['dtype'] != 'auto':
        return cfg['dtype']
    device = cfg['device'] if cfg['device'] != 'auto' else 'cuda' if torch.cuda.is_available() else 'cpu'
    dtype, why = auto_dtype(device.split(':')[0])
    return f"{dtype} (auto: {why})"

# -----------------------------------------------------------------------------
# data floor and compute estimates

def unigram_floor(data_dir):
    """Cross-entropy (nats/token) on val.bin of the unigram distribution of train.bin (add-1/2 smoothing):
    the loss of a model that predicts token frequencies and nothing else (docs/papers.md §2's 'unigram
    floor')."""
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


def run_vocab_size(cfg):
    """The vocabulary train.py will use: --print_config shows GPTConfig's default where no config set
    vocab_size, and then train.py takes data/<dataset>/meta.json's (if the data is not prepared here,
    assume GPT-2's BPE padded to 50304)."""
    if cfg['vocab_size'] != GPTConfig.vocab_size:
        return cfg['vocab_size']
    return read_json(os.path.join('data', cfg['dataset'], 'meta.json'), {}).get('vocab_size', 50304)


def estimate(cfg):
    """(tokens, training FLOPs) of a run: model.flops_per_token x tokens (eval passes not counted)."""
    model_args = {k: cfg[k] for k in model_keys()}
    model_args['vocab_size'] = run_vocab_size(cfg)
    with contextlib.redirect_stdout(io.StringIO()), torch.device('meta'):  # no weights, no parameter count
        model = GPT(gpt_config(model_args))
    tokens = cfg['max_iters'] * cfg['batch_size'] * cfg['gradient_accumulation_steps'] * cfg['block_size']
    return tokens, model.flops_per_token(cfg['block_size']) * tokens


def dry_run(jobs, launcher, args):
    """Print every run's train.py command and its estimated tokens, FLOPs and GPU-hours."""
    shown = ['python' if c == sys.executable else c for c in launcher]
    total = 0.0
    for j in jobs:
        tokens, flops = estimate(j['cfg'])
        hours = flops / (args.peak_tflops * 1e12 * args.mfu) / 3600
        total += hours
        print(f"{j['name']}: {tokens / 1e9:.2f}B tokens, {flops / 1e18:.2f} EFLOP, ~{hours:.2f} GPU-h")
        print('  ' + shlex.join(shown + ['train.py'] + j['args']))
    print(f"total: {len(jobs)} runs, ~{total:.1f} GPU-hours of training at {args.mfu:.0%} MFU of "
          f"{args.peak_tflops:g} TFLOP/s (evaluation not counted)")

# -----------------------------------------------------------------------------
# numbers for the reports: eval_depth.json holds null for every inf or nan (a calibrated threshold of
# +inf, 'never exit early', an overflowing PPL), metrics.jsonl may hold NaN

def mean(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else None


def fmt(x, spec='.3f'):
    """A number for a table: 'n/a' for None (missing, or JSON's null for inf/nan), inf and nan spelled out."""
    if x is None:
        return 'n/a'
    if isinstance(x, float) and (math.isinf(x) or math.isnan(x)):
        return str(x)
    if spec.endswith('f') and abs(x) >= 1e5:  # e.g. the PPL of an untrained early exit
        return format(x, spec[:-1].split('.')[0] + '.2e')
    return format(x, spec)


def vec(xs, spec):
    return ' / '.join(fmt(x, spec) for x in xs) if xs else 'n/a'


def mean_vec(vs):
    vs = [v for v in vs if v]
    return [mean(col) for col in zip(*vs)] if vs else []


def floats(xs):
    """A JSON list of numbers as a float array, null as nan (matplotlib leaves nan out)."""
    return np.asarray(xs, dtype=float)


def row_near(rows, it):
    return min(rows, key=lambda r: abs(r['iter'] - it)) if rows else None

# -----------------------------------------------------------------------------
# the blind-spot report: three tables and three plots

def runs_by_arm(jobs):
    out = {}
    for j in jobs:
        run = dict(j, rows=read_metrics(j['out_dir']), status=read_status(j['out_dir']),
                   depth=read_json(os.path.join(j['out_dir'], 'eval_depth.json')))
        out.setdefault(j['arm']['name'], []).append(run)
    return out


def depths(runs):
    return [r['depth'] for r in runs if r['depth']]


def scale_row(name, runs):
    ok = [r for r in runs if r['rows']]
    last = [r['rows'][-1] for r in ok]
    half = [row_near(r['rows'], r['rows'][-1]['iter'] / 2) for r in ok]
    hR_end, hR_half = mean([row['norm'][-1] for row in last]), mean([row['norm'][-1] for row in half])
    peaks = [max(r['rows'], key=lambda row: row['norm'][-1]) for r in ok]
    peak = 'n/a'
    if ok:
        peak_steps = '/'.join(str(p['iter']) for p in peaks)
        peak = f"{fmt(mean([p['norm'][-1] for p in peaks]), '.1f')} ({peak_steps})"
    fails = sum(r['status'].get('train') == 'failed' for r in runs)
    growth = hR_end / hR_half if hR_end and hR_half else None
    return (f"| {name} | {len(runs)}{f' ({fails} failed)' if fails else ''} | "
            f"{vec([row['iter'] for row in last[:1]], 'd')} | "
            f"{fmt(mean([row['val_loss'] for row in last]), '.4f')} | "
            f"{vec(mean_vec([row['norm'] for row in last]), '.1f')} | {peak} | "
            f"{fmt(hR_half, '.1f')} / {fmt(hR_end, '.1f')} | x{fmt(growth, '.2f')} |")


def scale_table(arms):
    return (["### Scale: ||h_k|| at the end of training (mean per-token L2 norm of each loop state, val, "
             "before readout and before any inter-loop norm)", "",
             "| arm | seeds | iters | val CE (exit R) | ‖h_k‖ k = 1..R | peak ‖h_R‖ (step) | "
             "‖h_R‖ at half / end | growth, 2nd half |", "|---|---|---|---|---|---|---|---|"]
            + [scale_row(name, runs) for name, runs in arms.items()])


def depth_row(name, d):
    if not d:
        return f"| {name} | n/a | n/a | n/a | n/a | n/a | n/a |"
    R = d[0]['n_loop']
    ce = mean_vec([x['fixed']['ce'] for x in d])
    cal = [x['calibrated'][x['calibrated']['policy']] for x in d]  # its threshold may be null: never exit
    return (f"| {name} | {vec(ce[:R], '.3f')} | {vec(ce[R:2 * R], '.3f')} | "
            f"{fmt(mean([x['dppl_1_to_R'] for x in d]), '+.3f')} | "
            f"{fmt(mean([c['held_avg_loops'] for c in cal]), '.2f')} | "
            f"{fmt(mean([c['held_ppl_ratio'] for c in cal]), '.4f')} | "
            f"x{fmt(mean([x['throughput']['speedup'] for x in d]), '.2f')} |")


def depth_table(arms):
    return (["### Depth: val CE at every exit (eval_depth, fixed depth) and what adaptive depth buys", "",
             "| arm | val CE exit 1..R | CE exits R+1..2R (extrapolation) | ΔPPL exit 1→R | "
             "calibrated avg loops (margin, held-out) | held-out PPL / fixed-R | "
             "dynamic batching tok/s vs fixed-R |",
             "|---|---|---|---|---|---|---|"]
            + [depth_row(name, depths(runs)) for name, runs in arms.items()])


def radial_row(name, d):
    if not d:
        return f"| {name} | n/a | n/a | n/a | n/a |"
    return (f"| {name} | {vec(mean_vec([x['radial_frac']['readout'] for x in d]), '.1e')} | "
            f"{vec(mean_vec([x['radial_frac']['total'] for x in d]), '.1e')} | "
            f"{fmt(mean([x['clamp']['radial']['dce'][-1] for x in d]), '+.4f')} | "
            f"{fmt(mean([x['clamp']['freeze']['dce'][-1] for x in d]), '+.4f')} |")


def radial_table(arms):
    title = "### Does the loss see the scale? Radial gradient fraction and the inference-time radial clamp"
    return ([title, "",
             "| arm | radial grad. fraction, exit-k CE via its readout (k = 1..R) | radial grad. fraction, "
             "training loss (k = 1..R) | ΔCE exit R, radial part of updates removed | ΔCE exit R, states "
             "rescaled to loop 1's RMS |", "|---|---|---|---|---|"]
            + [radial_row(name, depths(runs)) for name, runs in arms.items()])


def blindspot_report(arms, header, report_dir, prefix):
    lines = header + scale_table(arms) + [""] + depth_table(arms) + [""] + radial_table(arms)
    plt = plt_or_none()
    plots = [] if plt is None else [plot_norms(plt, arms, report_dir, prefix),
                                    plot_pareto(plt, arms, report_dir, prefix),
                                    plot_exit_ce(plt, arms, report_dir, prefix)]
    return lines + [""] + [f"![{p}]({p})" for p in plots]


def plt_or_none():
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print("matplotlib is not installed: skipping the plots (pip install matplotlib)")
        return None


def save(fig, plt, report_dir, name):
    fig.savefig(os.path.join(report_dir, name), dpi=90)
    plt.close(fig)
    return name


def plot_norms(plt, arms, report_dir, prefix):
    """||h_k|| vs step, one panel per arm, log y."""
    names = list(arms)
    ncol = min(5, len(names))
    nrow = math.ceil(len(names) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(3 * ncol, 2.6 * nrow), sharex=True, sharey=True,
                             squeeze=False)
    for ax, name in zip(axes.flat, names):
        for r in arms[name]:
            rows = r['rows']
            n_exits = len(rows[0]['norm']) if rows else 0
            for k in range(n_exits):
                ax.plot([x['iter'] for x in rows], [x['norm'][k] for x in rows],
                        color=plt.cm.viridis(k / max(1, n_exits - 1)), lw=1.2,
                        label=f'k={k + 1}' if r is arms[name][0] else None)
        ax.set_yscale('log')
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3, which='both')
    for ax in axes.flat[len(names):]:
        ax.axis('off')
    axes.flat[0].legend(fontsize=7, title='loop', title_fontsize=7)
    fig.supxlabel('training step')
    fig.supylabel('||h_k|| (mean per-token L2, val)')
    fig.tight_layout()
    return save(fig, plt, report_dir, f'{prefix}_norms.png')


def plot_pareto(plt, arms, report_dir, prefix):
    """PPL vs average loops: the adaptive-exit curve (margin policy) and the fixed exits."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ymax, ymin = [], []
    for i, name in enumerate(arms):
        d = depths(arms[name])
        if not d:
            continue
        x = d[0]
        R, color = x['n_loop'], plt.cm.tab10(i % 10)
        fixed_ppl = floats(x['fixed']['ppl'][:R])  # null (an overflowing PPL) -> nan, not drawn
        ax.plot(range(1, R + 1), fixed_ppl, 'o', color=color, ms=4)
        curve = x['adaptive'].get('margin')
        if curve:
            order = np.argsort(curve['avg_loops'])
            ax.plot(floats(curve['avg_loops'])[order], floats(curve['ppl'])[order], '-', color=color, lw=1.2,
                    label=name)
        ymax.append(fixed_ppl[-1])
        ymin.append(np.concatenate([fixed_ppl, floats(curve['ppl'] if curve else [])]))
    ax.set_yscale('log')
    lo, hi = np.concatenate(ymin or [[]]), np.array(ymax)
    if np.isfinite(lo).any() and np.isfinite(hi).any():
        ax.set_ylim(0.9 * np.nanmin(lo), 3 * np.nanmax(hi))
    ax.set_xlabel('average loops per sequence')
    ax.set_ylabel('val PPL')
    ax.set_title('adaptive exit (margin, lines) and fixed exits (dots): lower-left is better', fontsize=9)
    ax.grid(alpha=0.3, which='both')
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return save(fig, plt, report_dir, f'{prefix}_pareto.png')


def plot_exit_ce(plt, arms, report_dir, prefix):
    """Val CE at every exit eval_depth measured (1..4R by default), a dashed line after exit R."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    R = None
    for i, name in enumerate(arms):
        d = depths(arms[name])
        if not d:
            continue
        R = d[0]['n_loop']
        ce = floats(mean_vec([x['fixed']['ce'] for x in d]))
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
    return save(fig, plt, report_dir, f'{prefix}_exit_ce.png')

# -----------------------------------------------------------------------------
# the recurrent-depth report: test-time depth, scale over training, halting by margin / KL / gate

def extrapolation_row(name, runs):
    d = depths(runs)
    if not d:
        return f"| {name} | n/a |" + " n/a |" * (len(TEST_LOOPS) + 1)
    ce = mean_vec([x['fixed']['ce'] for x in d])
    at = [ce[n - 1] if n <= len(ce) else None for n in TEST_LOOPS]
    best = min(range(len(ce)), key=lambda i: ce[i] if ce[i] is not None else math.inf) + 1
    sampled = d[0]['model_args'].get('loop_sampling', 'fixed') != 'fixed'
    trained = f"{d[0]['n_loop'] + 1} (mean, sampled)" if sampled else str(d[0]['n_loop'])
    return f"| {name} | {trained} | " + " | ".join(fmt(c, '.3f') for c in at) + f" | {best} |"


def halting_row(name, runs):
    cal = [x['calibrated'] for x in depths(runs)]
    cells = []
    for p in HALT_POLICIES:
        got = [c[p] for c in cal if p in c]
        cells.append(f"{fmt(mean([g['held_avg_loops'] for g in got]), '.2f')} / "
                     f"{fmt(mean([g['held_ppl_ratio'] for g in got]), '.4f')}" if got else "n/a")
    return f"| {name} | " + " | ".join(cells) + " |"


def recurrent_report(arms, header, report_dir, prefix):
    lines = header + [
        "### Test-time depth: val CE (eval_depth, fixed depth) at loops "
        + ", ".join(map(str, TEST_LOOPS)), "",
        "| arm | trained loops | " + " | ".join(f"CE @ {n}" for n in TEST_LOOPS) + " | best loop |",
        "|---|---|" + "---|" * (len(TEST_LOOPS) + 1)] + [extrapolation_row(n, r) for n, r in arms.items()]
    lines += [""] + scale_table(arms) + ["", "### Calibrated halting (held-out half): average loops / PPL "
              "relative to fixed depth R, per exit policy", "",
              "| arm | " + " | ".join(HALT_POLICIES) + " |", "|---|" + "---|" * len(HALT_POLICIES)]
    lines += [halting_row(n, r) for n, r in arms.items()]
    plt = plt_or_none()
    plots = [] if plt is None else [plot_norms(plt, arms, report_dir, prefix),
                                    plot_exit_ce(plt, arms, report_dir, prefix)]
    return lines + [""] + [f"![{p}]({p})" for p in plots]

# -----------------------------------------------------------------------------
# the "still growing" report: ||h_R|| and CE at fixed steps of a long run, both over training in one plot

def growing_row(name, run, step):
    row = row_near(run['rows'], step)
    if row is None or abs(row['iter'] - step) > 25:
        return f"| {name} | {step} | n/a | n/a | n/a |"
    return (f"| {name} | {row['iter']} | {vec(row['norm'], '.1f')} | {vec(row['val_ce'], '.3f')} | "
            f"{vec(row['train_ce'], '.3f')} |")


def growing_table(arms):
    lines = ["### ||h_k|| and CE over training (first seed of each arm; train CE on its eval batches)", "",
             "| arm | step | ‖h_k‖ k = 1..R | val CE exit 1..R | train CE exit 1..R |",
             "|---|---|---|---|---|"]
    for name, runs in arms.items():
        for run in runs[:1]:
            last = run['rows'][-1]['iter'] if run['rows'] else -1
            lines += [growing_row(name, run, s) for s in GROWING_STEPS if s <= last]
    return lines


def plot_growing(plt, arms, report_dir, prefix):
    """Top: ||h_k|| vs step (log y), one color per arm, one shade per loop. Bottom: val CE at exit R."""
    fig, (ax_n, ax_ce) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    ces = [x[f'{split}_ce'][-1] for runs in arms.values() for r in runs[:1] for x in r['rows']
           for split in ('val', 'train')]
    for i, (name, runs) in enumerate(arms.items()):
        rows = runs[0]['rows'] if runs else []
        if not rows:
            continue
        steps, R = [x['iter'] for x in rows], len(rows[0]['norm'])
        cmap = (plt.cm.Reds, plt.cm.Blues, plt.cm.Greens)[i % 3]
        for k in range(R):
            ax_n.plot(steps, [x['norm'][k] for x in rows], color=cmap(0.4 + 0.6 * k / max(1, R - 1)), lw=1.1,
                      label=f'{name}, k={k + 1}')
        ax_ce.plot(steps, [x['val_ce'][-1] for x in rows], color=cmap(0.9), lw=1.2, label=f'{name}, val')
        ax_ce.plot(steps, [x['train_ce'][-1] for x in rows], color=cmap(0.9), lw=0.8, ls=':',
                   label=f'{name}, train')
    ax_n.set_yscale('log')
    ax_n.set_ylabel('||h_k|| (mean per-token L2, val)')
    ax_n.legend(fontsize=7, ncol=2)
    ax_ce.set_ylabel('CE at exit R (nats)')
    if ces:
        ax_ce.set_ylim(min(ces) - 0.1, min(4.0, max(ces)) + 0.1)  # the first evals' CE is off the scale
    ax_ce.set_xlabel('training step')
    ax_ce.legend(fontsize=7)
    for ax in (ax_n, ax_ce):
        ax.grid(alpha=0.3, which='both')
    fig.tight_layout()
    return save(fig, plt, report_dir, f'{prefix}.png')


def growing_report(arms, header, report_dir, prefix):
    lines = header + scale_table(arms) + [""] + growing_table(arms) + [""] + depth_table(arms) + [""] \
        + radial_table(arms)
    plt = plt_or_none()
    if plt is not None:
        name = plot_growing(plt, arms, report_dir, prefix)
        lines += ["", f"![{name}]({name})"]
    return lines

# -----------------------------------------------------------------------------
# the DeepLoop report: escaped runs per variant x (R, lr), and the loss curves

def floor_lines(floor):
    if floor is None:
        return ["(unigram floor unknown: the dataset's meta.json was not found)", ""]
    return [f"Unigram floor (cross-entropy on val of the train unigram distribution): **{floor:.4f} nats**. "
            f"A run *escaped* if its final val loss < floor - {ESCAPE_MARGIN} = "
            f"{floor - ESCAPE_MARGIN:.4f}.", ""]


def final_loss(run):
    return run['rows'][-1]['val_loss'] if run['rows'] and run['status'].get('train') == 'done' else None


def escaped(run, floor):
    v = final_loss(run)
    return v is not None and floor is not None and math.isfinite(v) and v < floor - ESCAPE_MARGIN


def runs_of(runs, **tags):
    # the runs of one cell of a report: those whose arm carries every given tag, e.g. variant=v, R=4
    return [r for r in runs if all(r['arm']['tags'].get(k) == v for k, v in tags.items())]


def loss_cell(rs, floor):
    if not rs:
        return ''
    vals = ' / '.join('failed' if r['status'].get('train') == 'failed' else fmt(final_loss(r), '.3f')
                      for r in rs)
    return f"{vals} ({sum(escaped(r, floor) for r in rs)}/{len(rs)})"


def loss_table(runs, variants, Rs, lrs, floor):
    lines = ["Final val loss (exit R) per seed, and escaped runs / seeds:", "",
             "| variant | " + " | ".join(f"R={R}, lr={lr:g}" for lr in lrs for R in Rs) + " |",
             "|---|" + "---|" * (len(Rs) * len(lrs))]
    for v in variants:
        cells = [loss_cell(runs_of(runs, variant=v, R=R, lr=lr), floor) for lr in lrs for R in Rs]
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    return lines + [""]


def plot_losses(plt, runs, variants, Rs, lrs, floor, report_dir, prefix):
    """Val loss vs step, one panel per (lr, R), one color per variant, the unigram floor dotted."""
    fig, axes = plt.subplots(len(lrs), len(Rs), figsize=(3.4 * len(Rs), 2.8 * len(lrs)), sharex=True,
                             sharey=True, squeeze=False)
    for i, lr in enumerate(lrs):
        for j, R in enumerate(Rs):
            ax = axes[i][j]
            for c, v in enumerate(variants):
                for s, r in enumerate(runs_of(runs, variant=v, R=R, lr=lr)):
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
    axes[0][-1].legend([Line2D([], [], color=plt.cm.tab10(c)) for c in range(len(variants))], variants,
                       fontsize=7)
    fig.supxlabel('training step (dotted: unigram floor; dashed: 2nd seed)')
    fig.supylabel('val loss (exit R)')
    fig.tight_layout()
    return save(fig, plt, report_dir, f'{prefix}_loss.png')


def deeploop_report(arms, header, report_dir, prefix, floor):
    runs = [r for rs in arms.values() for r in rs]
    variants = list(dict.fromkeys(r['arm']['tags']['variant'] for r in runs))
    Rs = sorted({r['arm']['tags']['R'] for r in runs})
    lrs = sorted({r['arm']['tags']['lr'] for r in runs})
    lines = header + floor_lines(floor) + loss_table(runs, variants, Rs, lrs, floor)
    plt = plt_or_none()
    if plt is not None:
        name = plot_losses(plt, runs, variants, Rs, lrs, floor, report_dir, prefix)
        lines.append(f"![{name}]({name})")
    return lines

# -----------------------------------------------------------------------------
# the kappa_R report: visit alignment vs R at a few points in training, and its exponent gamma

def kappa_series(run):
    """[(iter, kappa_R)] of a run's metrics rows that hold a kappa (train.py's log_kappa)."""
    return [(x['iter'], x['kappa']) for x in run['rows'] if x.get('kappa') is not None]


def kappa_at(runs, it):
    """kappa_R at the eval nearest step `it`, mean over the runs (seeds) that logged one."""
    series = [kappa_series(r) for r in runs]
    return mean([min(s, key=lambda p: abs(p[0] - it))[1] for s in series if s])


def kappa_late(runs):
    """kappa_R averaged over the evals of the second half of training (less noisy than one eval's batch),
    mean over the runs (seeds)."""
    series = [kappa_series(r) for r in runs]
    return mean([mean([k for it, k in s if it >= s[-1][0] / 2]) for s in series if s])


def fit_gamma(Rs, kappas, min_R=2):
    """gamma of kappa_R ~ c R^gamma: the least-squares slope of log kappa_R on log R over R >= min_R
    (docs/papers.md §2). None with fewer than two usable points (missing or kappa <= 0)."""
    pts = [(math.log(R), math.log(k)) for R, k in zip(Rs, kappas) if R >= min_R and k is not None and k > 0]
    if len(pts) < 2:
        return None
    x, y = np.array(pts).T
    return float(np.polyfit(x, y, 1)[0])


def kappa_steps(runs, n=4):
    """n training points: step 0, the last eval, and evenly spaced evals in between."""
    last = max((r['rows'][-1]['iter'] for r in runs if r['rows']), default=0)
    return sorted({round(last * i / (n - 1)) for i in range(n)})


def kappa_table(runs, variants, Rs, steps):
    by = {(v, R): runs_of(runs, variant=v, R=R) for v in variants for R in Rs}
    lines = ["kappa_R (mean over the shared matrices, one fixed training batch; R when the visits' gradients "
             "align, 1 when orthogonal), and gamma of kappa_R ~ c R^gamma fitted on log-log by least squares "
             "over R >= 2 (kappa_1 = 1 by definition) and over all R:", "",
             "| variant | step | " + " | ".join(f"κ R={R}" for R in Rs) + " | γ (R ≥ 2) | γ (all R) |",
             "|---|---|" + "---|" * (len(Rs) + 2)]
    for v in variants:
        for it in steps:
            ks = [kappa_at(by[v, R], it) for R in Rs]
            lines.append(f"| {v} | {it} | " + " | ".join(fmt(k, '.3f') for k in ks)
                         + f" | {fmt(fit_gamma(Rs, ks), '+.3f')} | {fmt(fit_gamma(Rs, ks, 1), '+.3f')} |")
        ks = [kappa_late(by[v, R]) for R in Rs]
        lines.append(f"| {v} | mean, 2nd half | " + " | ".join(fmt(k, '.3f') for k in ks)
                     + f" | {fmt(fit_gamma(Rs, ks), '+.3f')} | {fmt(fit_gamma(Rs, ks, 1), '+.3f')} |")
    return lines + [""]


def final_loss_table(runs, variants, Rs, floor):
    lines = ["Final val loss (exit R) per seed, and escaped runs / seeds (unigram floor rule):", "",
             "| variant | " + " | ".join(f"R={R}" for R in Rs) + " |", "|---|" + "---|" * len(Rs)]
    for v in variants:
        cells = [loss_cell(runs_of(runs, variant=v, R=R), floor) for R in Rs]
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    return lines + [""]


def plot_kappa(plt, runs, variants, Rs, report_dir, prefix):
    """kappa_R vs step, one panel per variant, one line per R (dashed: further seeds)."""
    fig, axes = plt.subplots(1, len(variants), figsize=(3.4 * len(variants), 3.2), sharey=True, squeeze=False)
    for ax, v in zip(axes[0], variants):
        for c, R in enumerate(Rs):
            for s, r in enumerate(runs_of(runs, variant=v, R=R)):
                pts = kappa_series(r)
                if pts:
                    ax.plot(*zip(*pts), color=plt.cm.viridis(c / max(1, len(Rs) - 1)), lw=1.2,
                            ls='-' if s == 0 else '--', label=f'R={R}' if s == 0 else None)
        ax.set_yscale('log', base=2)
        ax.set_title(v, fontsize=9)
        ax.grid(alpha=0.3, which='both')
    axes[0][0].legend(fontsize=7)
    fig.supxlabel('training step')
    fig.supylabel('κ_R (log2)')
    fig.suptitle('κ_R = ‖Σ_r G_r‖² / Σ_r ‖G_r‖²: 1 when the R visits are orthogonal, R when aligned',
                 fontsize=9)
    fig.tight_layout()
    return save(fig, plt, report_dir, f'{prefix}_over_training.png')


def plot_gamma(plt, runs, variants, Rs, report_dir, prefix):
    """gamma (fit over R >= 2) at every eval step, one line per variant; 0 and 1 dotted."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for c, v in enumerate(variants):
        vruns = runs_of(runs, variant=v)
        steps = sorted({it for r in vruns for it, _ in kappa_series(r)})
        gammas = [fit_gamma(Rs, [kappa_at(runs_of(vruns, R=R), it) for R in Rs])
                  for it in steps]
        ax.plot(steps, [np.nan if g is None else g for g in gammas], 'o-', ms=2.5, lw=1.2,
                color=plt.cm.tab10(c), label=v)
    for y in (0, 1):
        ax.axhline(y, color='k', lw=0.8, ls=':')
    ax.set_title('γ = 0: visits decorrelate (p = 1/4 suffices); γ = 1: visits align (p = 1/2)', fontsize=9)
    return finish_plot(fig, ax, plt, 'training step', 'γ of κ_R ≈ c R^γ (fit over R = 2, 4, 8)',
                       os.path.join(report_dir, f'{prefix}_gamma.png'))


def finish_plot(fig, ax, plt, xlabel, ylabel, path):
    """Axis labels, grid, legend and layout of a one-panel report plot, saved to path."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return save(fig, plt, *os.path.split(path))


def kappa_report(arms, header, report_dir, prefix, floor):
    runs = [r for rs in arms.values() for r in rs]
    variants = list(dict.fromkeys(r['arm']['tags']['variant'] for r in runs))
    Rs = sorted({r['arm']['tags']['R'] for r in runs})
    lines = (header + kappa_table(runs, variants, Rs, kappa_steps(runs)) + floor_lines(floor)
             + final_loss_table(runs, variants, Rs, floor))
    plt = plt_or_none()
    if plt is not None:
        for name in (plot_kappa(plt, runs, variants, Rs, report_dir, prefix),
                     plot_gamma(plt, runs, variants, Rs, report_dir, prefix)):
            lines.append(f"![{name}]({name})")
    return lines

# -----------------------------------------------------------------------------
# the LR-transfer report: final val loss vs LR, one curve per R, with and without loop-scaled residuals

def lr_losses(runs, eps, R, lr):
    """Final val losses of the finished seeds of one cell (nan where a run diverged)."""
    return [final_loss(r) for r in runs_of(runs, eps=eps, R=R, lr=lr) if final_loss(r) is not None]


def lr_mean(runs, eps, R, lr):
    vals = [v for v in lr_losses(runs, eps, R, lr) if math.isfinite(v)]
    return sum(vals) / len(vals) if vals else None


def best_lr(runs, eps, R, lrs):
    means = {lr: lr_mean(runs, eps, R, lr) for lr in lrs}
    means = {lr: m for lr, m in means.items() if m is not None}
    return min(means, key=means.get) if means else None


def lr_table(runs, eps, Rs, lrs):
    what = "with eps = 1/(R sqrt K) (config/loop_eps.py)" if eps else "without eps (plain pre-norm)"
    lines = [f"Final val loss (exit R), mean of seeds (each seed in brackets), {what}; best LR in bold:", "",
             "| R | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | best LR |",
             "|---|" + "---|" * (len(lrs) + 1)]
    for R in Rs:
        best, cells = best_lr(runs, eps, R, lrs), []
        for lr in lrs:
            m, seeds = lr_mean(runs, eps, R, lr), lr_losses(runs, eps, R, lr)
            cell = f"{fmt(m, '.3f')} ({' / '.join(fmt(v, '.3f') for v in seeds)})"
            cells.append(f"**{cell}**" if lr == best else cell)
        lines.append(f"| {R} | " + " | ".join(cells) + f" | {fmt(best, 'g')} |")
    return lines + [""]


def plot_lr_transfer(plt, runs, Rs, lrs, report_dir, prefix):
    """Final val loss vs LR (log x), one curve per R; left without eps, right with."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8), sharey=True)
    for ax, eps in zip(axes, (False, True)):
        for c, R in enumerate(Rs):
            ys = [lr_mean(runs, eps, R, lr) for lr in lrs]
            ax.plot(lrs, [np.nan if y is None else y for y in ys], 'o-', lw=1.2,
                    color=plt.cm.viridis(c / max(1, len(Rs) - 1)), label=f'R={R}')
        ax.set_xscale('log')
        ax.set_title('pre-norm + eps = 1/(R√K)' if eps else 'pre-norm, no eps', fontsize=9)
        ax.set_xlabel('learning rate')
        ax.grid(alpha=0.3, which='both')
    axes[0].set_ylabel('final val loss (exit R), mean of seeds')
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    return save(fig, plt, report_dir, f'{prefix}.png')


def lr_transfer_report(arms, header, report_dir, prefix):
    runs = [r for rs in arms.values() for r in rs]
    Rs = sorted({r['arm']['tags']['R'] for r in runs})
    lrs = sorted({r['arm']['tags']['lr'] for r in runs})
    lines = header + lr_table(runs, False, Rs, lrs) + lr_table(runs, True, Rs, lrs)
    plt = plt_or_none()
    if plt is not None:
        name = plot_lr_transfer(plt, runs, Rs, lrs, report_dir, prefix)
        lines.append(f"![{name}]({name})")
    return lines

# -----------------------------------------------------------------------------
# the escape report: runs that left the unigram floor per p, beside the paper's p-sweep

def escape_table(runs, ps, floor):
    lines = ["| p | escaped here | final val loss per seed | paper (GPT-2 small, R = 3, ~2,700 steps) |",
             "|---|---|---|---|"]
    for p in ps:
        rs = runs_of(runs, p=p)
        vals = ' / '.join('failed' if r['status'].get('train') == 'failed' else fmt(final_loss(r), '.3f')
                          for r in rs)
        lines.append(f"| {p:g} | {sum(escaped(r, floor) for r in rs)}/{len(rs)} | {vals} | "
                     f"{PAPER_ESCAPES.get(p, 'not run')} |")
    return lines + [""]


def plot_escape(plt, runs, ps, floor, report_dir, prefix):
    """Val loss vs step, one color per p (every seed drawn), the unigram floor dotted."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for c, p in enumerate(ps):
        for s, r in enumerate(runs_of(runs, p=p)):
            if r['rows']:
                ax.plot([x['iter'] for x in r['rows']], [x['val_loss'] for x in r['rows']], lw=1,
                        color=plt.cm.plasma(c / max(1, len(ps) - 1)), label=f'p={p:g}' if s == 0 else None)
    if floor is not None:
        ax.axhline(floor, color='k', lw=0.8, ls=':')
        ax.set_ylim(min([x['val_loss'] for r in runs for x in r['rows']] + [floor]) - 0.1, floor + 1.0)
    return finish_plot(fig, ax, plt, 'training step (dotted: unigram floor)', 'val loss (exit R)',
                       os.path.join(report_dir, f'{prefix}_loss.png'))


def escape_report(arms, header, report_dir, prefix, floor):
    runs = [r for rs in arms.values() for r in rs]
    ps = sorted({r['arm']['tags']['p'] for r in runs})
    lines = header + floor_lines(floor) + escape_table(runs, ps, floor)
    plt = plt_or_none()
    if plt is not None:
        name = plot_escape(plt, runs, ps, floor, report_dir, prefix)
        lines.append(f"![{name}]({name})")
    return lines

# -----------------------------------------------------------------------------
# writing the report

def report_header(preset, jobs, n_arms, args, sweep):
    cfg0 = jobs[0]['cfg']
    sizes = (f"{cfg0['dataset']}, d {cfg0['n_embd']}, K {cfg0['n_layer']}, block {cfg0['block_size']}, batch "
             f"{cfg0['batch_size']}x{cfg0['gradient_accumulation_steps']}, {cfg0['max_iters']} steps, "
             f"{cfg0['lr_schedule']} lr, init {cfg0['init']}")
    seeds = sorted({j['seed'] for j in jobs})
    command = sweep.get('command') or args.command.replace(' --report_only', '')
    train_minutes = sum(read_status(j['out_dir']).get('train_seconds', 0) for j in jobs) / 60
    return [f"## {preset['title']}", "",
            f"`{command}`: {n_arms} arms x {len(seeds)} seed(s) ({', '.join(map(str, seeds))}); {sizes}"
            + (f"; base {' '.join(args.base)}" if args.base else '') + ".",
            f"Wall time of the last sweep call: {fmt(sweep.get('wall_seconds', 0) / 60, '.1f')} min with "
            f"{sweep.get('workers', '?')} run(s) at a time, "
            f"{sweep.get('cores_per_run', '?')} CPU core(s) each; "
            f"train time summed over runs: {train_minutes:.1f} min.",
            f"Code: commit {sweep.get('commit', '?')}; dtype {sweep.get('dtype', '?')}.",
            ""]


def summary(arms):
    """<prefix>.json: per arm and seed, the status, the last metrics row and eval_depth's main results."""
    keys = ('fixed', 'dppl_1_to_R', 'calibrated', 'clamp', 'radial_frac', 'throughput')
    return {name: [dict(seed=r['seed'], status=r['status'], final=r['rows'][-1] if r['rows'] else None,
                        depth={k: r['depth'][k] for k in keys} if r['depth'] else None)
                   for r in runs] for name, runs in arms.items()}


def write_report(preset_name, preset, jobs, args, sweep):
    arms = runs_by_arm(jobs)
    os.makedirs(args.report_dir, exist_ok=True)
    header = report_header(preset, jobs, len(arms), args, sweep)
    prefix = preset_name
    floor = unigram_floor(os.path.join('data', jobs[0]['cfg']['dataset'])) \
        if preset['report'] in ('deeploop', 'kappa', 'escape') else None
    if preset['report'] == 'blindspot':
        lines = blindspot_report(arms, header, args.report_dir, prefix)
    elif preset['report'] == 'recurrent':
        lines = recurrent_report(arms, header, args.report_dir, prefix)
    elif preset['report'] == 'growing':
        lines = growing_report(arms, header, args.report_dir, prefix)
    elif preset['report'] == 'kappa':
        lines = kappa_report(arms, header, args.report_dir, prefix, floor)
    elif preset['report'] == 'lr_transfer':
        lines = lr_transfer_report(arms, header, args.report_dir, prefix)
    elif preset['report'] == 'escape':
        lines = escape_report(arms, header, args.report_dir, prefix, floor)
    else:
        lines = deeploop_report(arms, header, args.report_dir, prefix, floor)
    path = os.path.join(args.report_dir, f'{prefix}.md')
    with open(path, 'w', encoding='utf-8') as fh:
        fh.write('\n'.join(lines) + '\n')
    with open(os.path.join(args.report_dir, f'{prefix}.json'), 'w', encoding='utf-8') as fh:
        json.dump(summary(arms), fh, indent=1)
    print(f"report: {path}")
    return path

# -----------------------------------------------------------------------------
# command line

def parser():
    ap = Parser('ablate.py', __doc__.split('\n\n')[0])
    ap.add_argument('preset', choices=sorted(PRESETS))
    ap.add_argument('--base', action='append', default=[], help='config file(s) replacing the laptop config')
    ap.add_argument('--set', action='append', default=[], metavar='KEY=VALUE', help='override for every run')
    ap.add_argument('--only', default='', help='comma-separated arm names')
    ap.add_argument('--seeds', default='', help="comma-separated seeds (default: the preset's)")
    ap.add_argument('--out', default=None, help='runs go to <out>/<arm>-s<seed>; default out-ablate-<preset>')
    ap.add_argument('--report_dir', default=None, help='default: assets/ for the laptop sweep, else <out>')
    ap.add_argument('--workers', type=int, default=0,
                    help='runs at once (0: one per CPU core on a CPU, else 1)')
    ap.add_argument('--gpus_per_worker', type=int, default=0,
                    help='give each worker its own GPUs (CUDA_VISIBLE_DEVICES)')
    ap.add_argument('--launcher', default='',
                    help='e.g. "torchrun --standalone --nproc_per_node=8" (default: python)')
    ap.add_argument('--eval_args', default='', help='extra eval_depth.py arguments, e.g. "--n_seqs=256"')
    ap.add_argument('--report_only', action='store_true', help='only rebuild the report from finished runs')
    ap.add_argument('--reeval', action='store_true', help='run eval_depth.py again on finished runs')
    ap.add_argument('--dry_run', action='store_true',
                    help='print the commands and the estimated compute, run nothing')
    ap.add_argument('--mfu', type=float, default=0.4, help='assumed model flops utilisation for --dry_run')
    ap.add_argument('--peak_tflops', type=float, default=989.0, help='--dry_run: GPU bf16 peak (H100: 989)')
    return ap


def parse_args(argv):
    """The parsed flags, checked, with defaults filled in: --set as ['--key=value', ...], --only and --seeds
    as lists, --out and --report_dir set, and the command line itself (for the report)."""
    args = parser().parse_args(argv)
    args.command = 'python ablate.py ' + shlex.join(argv)
    args.out = args.out or f'out-ablate-{args.preset}'
    args.report_dir = args.report_dir or (args.out if args.base else 'assets')
    args.set = [s if s.startswith('--') else f'--{s}' for s in args.set]
    for s in args.set:
        if '=' not in s:
            die(f"--set {s[2:]}: expected KEY=VALUE")
    args.only = [a for a in args.only.split(',') if a]
    names = [a['name'] for a in PRESETS[args.preset]['arms']]
    for a in args.only:
        if a not in names:
            die(f"--only {a}: not an arm of {args.preset} ({', '.join(names)})")
    try:
        args.seeds = [int(s) for s in args.seeds.split(',') if s] or list(PRESETS[args.preset]['seeds'])
    except ValueError:
        die(f"--seeds {args.seeds}: expected comma-separated integers")
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    preset = PRESETS[args.preset]
    jobs = plan(args, preset)
    resolve(jobs[:1] if args.report_only else jobs)  # a report needs only the first run's config
    launcher = shlex.split(args.launcher) if args.launcher else [sys.executable]
    if args.dry_run:
        dry_run(jobs, launcher, args)
        return
    if not args.report_only:
        run_sweep(jobs, preset, launcher, args)
    write_report(args.preset, preset, jobs, args, read_json(os.path.join(args.out, 'sweep.json'), {}))


if __name__ == '__main__':
    main()
