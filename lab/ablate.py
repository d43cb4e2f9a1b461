r"""
Sweeps: a preset's config arms x seeds -> one train.py run each (own out_dir) -> lab/eval_depth.py -> a
report (markdown tables + PNG plots, lab/reports.py). The presets reproduce the papers' ablations
(docs/papers.md §1, §2, §3):

    python lab/ablate.py blindspot   # paper 1: 8 arms + inter-loop norm + 2 init=gpt2 arms; report in assets/
    python lab/ablate.py matched     # paper 1's matched-depth claim: 4 per-loop arms, 1,000 steps, 3 seeds
    python lab/ablate.py matched_long  # the same at 1,000, 3,000 and 10,000 steps of one run, 3 seeds
    python lab/ablate.py init_split  # the blind-spot pair under each init's embedding and block matrices
    python lab/ablate.py init_gpt2   # the blind-spot pair under GPT-2's init, 3 seeds
    python lab/ablate.py init_untied # the split's std 1 and 0.02 embeddings with a head of its own
    python lab/ablate.py deeploop    # paper 2: sandwich p 0, 1/4, 1/2 vs pre-norm, R 1-7, 4-5 LRs a block
    python lab/ablate.py recurrent   # the recurrent-depth family (§4): injection, random depth, Huginn, Ouro
    python lab/ablate.py growing     # paper 1's "still growing": per-loop RMSNorm vs raw readout, 10k steps
    python lab/ablate.py probes      # the radial-clamp cost vs length and LR, the inter-loop-norm arm
    python lab/ablate.py kappa       # paper 2's visit alignment kappa_R over training, R in {1, 2, 4, 8}
    python lab/ablate.py escape      # paper 2's p-sweep: runs that leave the unigram floor, R = 3, 5 seeds
    python lab/ablate.py escape_r7   # the same at R = 7, where the laptop model's small exponents fail
    python lab/ablate.py lr_transfer # loop-scaled residuals (§3): best LR per R with and without eps
    python lab/ablate.py moe         # Looped-MoE (§5): dense/MoE x unique/looped + tied routing, 3 seeds
    python lab/ablate.py retrofit    # retrofitted recurrence (§6): loop a pretrained model, 3 seeds
    python lab/ablate.py retrofit_gpt2 --dry_run   # the same from GPT-2's weights, on a GPU: the GPU-hours
    python lab/ablate.py deeploop --report_only          # rebuild the report from the finished runs
    python lab/ablate.py blindspot --only=loop_rmsnorm,loop_raw --seeds=1,2 --max_iters=100

Every flag that is not one of ablate.py's own (see --help) is a config override for every run, written as
train.py takes it: --key=value (--max_iters=100 above).

Without --base every run starts from the preset's laptop config, config/laptop_blindspot.py or
config/laptop_deeploop.py (shakespeare_char, d 128, K 2; on a 2-core CPU, one run per core). With --base the
same arms run on top of a GPU config file instead, unchanged:

    python lab/ablate.py blindspot --base config/paper_44m.py \
        --launcher "torchrun --standalone --nproc_per_node=8"
    python lab/ablate.py deeploop --base config/deeploop_small.py --max_iters=2700 --workers=8 \
        --gpus_per_worker=1
    python lab/ablate.py blindspot --base config/paper_44m.py --dry_run   # the commands and GPU-hours
    python lab/ablate.py deeploop --base config/deeploop_small.py --max_iters=2700 --executor=slurm \
        --partition=gpu --gpus_per_run=1 --time=240   # a Slurm job per run, requeued (docs/long_runs.md)

A run's train.py arguments are: the base config file(s), the arm's config files, the arm's --key=value
overrides, --seed and --out_dir, then the overrides of the command line. train.py itself resolves them
(--print_config=True), so ablate.py holds no copy of the config schema. Runs go to <out>/<arm>-s<seed>/
(train.log, eval.log, metrics.jsonl, eval_depth.json, status.json); a finished run (status.json says so) is
skipped on the next call, an interrupted one (a crash, or a signal that stopped train.py) is resumed. Each
finished run prints `[runs done/total, time so far, ETA]`. Paths (--out, --report_dir, data/) are relative to
the working directory, as for train.py: run it from the repository root.
"""
import contextlib
import io
import json
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the core is one folder up
from compute.hardware import auto_dtype
import configurator
from configurator import Parser, die, gpt_config, model_keys
from model import GPT, GPTConfig
from prepare import HF_DATASETS, TEXT_DATASETS, WORD_VOCAB
from run.accounting import flops_per_token
from run.ops import duration
from presets import PRESETS, arm  # arm: lab/isodepth.py's arms are made with it too
from reports import fmt, read_json, read_metrics, read_status, write_report

LAB = os.path.dirname(os.path.abspath(__file__))  # this folder: eval_depth.py
REPO = os.path.dirname(LAB)                       # the repository: train.py, config/

# -----------------------------------------------------------------------------
# planning: one job per (arm, seed), its config resolved by train.py itself

def repo_path(path):
    """A config file of this repo: as given if it exists from the working directory, else under the repo."""
    return path if os.path.isabs(path) or os.path.exists(path) else os.path.join(REPO, path)


def arg_value(v):
    return v if isinstance(v, str) else repr(v)


def run_args(base, a, seed, out_dir, overrides_all):
    """train.py's arguments for arm a: the base files, the arm's files and overrides, the seed, then the
    overrides of the command line (overrides_all: ['--key=value', ...])."""
    overrides = dict(a['overrides'], seed=seed, out_dir=out_dir)
    files = base + [repo_path(p) for p in a['files']]
    return files + [f'--{k}={arg_value(v)}' for k, v in overrides.items()] + overrides_all


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
                             args=run_args(base, a, seed, out_dir, args.overrides),
                             lengths=preset.get('lengths', ())))  # evaluated at each (run_lengths)
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


RUNNING = set()  # the train.py and eval_depth.py processes running now (SubmittedRun.checkpoint stops them)


def call_logged(cmd, log_path, mode, popen_kwargs):
    """Run cmd with the command line and then its output written to log_path; returns the exit code."""
    with open(log_path, mode, encoding='utf-8') as log:
        log.write('$ ' + shlex.join(cmd) + '\n')
        log.flush()
        with subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, **popen_kwargs) as proc:
            RUNNING.add(proc)
            try:
                return proc.wait()
            finally:
                RUNNING.discard(proc)


def train(job, launcher, popen_kwargs, max_iters=None):
    """Train one run, resuming from its checkpoint if there is one (init_from=auto); returns its new status:
    done, failed, or stopped (a signal stopped train.py early with a checkpoint: the next call resumes it).
    max_iters: train only to this step (a run evaluated as it grows), else to the run's own max_iters."""
    run_dir = job['out_dir']
    os.makedirs(run_dir, exist_ok=True)
    upto = [f'--max_iters={max_iters}'] if max_iters else []
    cmd = launcher + [os.path.join(REPO, 'train.py')] + job['args'] + upto + ['--init_from=auto']
    t0 = time.time()
    log_path = os.path.join(run_dir, 'train.log')
    rc = call_logged(cmd, log_path, 'a', popen_kwargs)
    rows = read_metrics(run_dir)
    finished = rc == 0 and bool(rows) and rows[-1].get('iter', -1) >= (max_iters or job['cfg']['max_iters'])
    return dict(train='done' if finished else 'stopped' if rc == 0 else 'failed', rc=rc,
                train_seconds=round(time.time() - t0, 1), error=None if finished else last_line(log_path))


def evaluate(run_dir, eval_args, popen_kwargs, script=True):
    """eval_depth.py (or the preset's own evaluator, a script of lab/) on a run's checkpoint; returns the
    status keys it sets."""
    t0 = time.time()
    script = script if isinstance(script, str) else 'eval_depth.py'
    cmd = [sys.executable, os.path.join(LAB, script), run_dir] + eval_args
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


def wants_eval(run_dir, status, do_eval, reeval):
    """Whether a run still needs eval_depth.py: trained (or failed) with a checkpoint, not evaluated yet."""
    return (do_eval and status.get('train') != 'stopped' and (status.get('eval') != 'done' or reeval)
            and os.path.exists(os.path.join(run_dir, 'ckpt.pt')))


def run_lengths(job, launcher, eval_args, popen_kwargs, upto=None):
    """A run evaluated as it grows: trained to each of job['lengths'] (up to `upto`) in turn, each a resume
    of the last (at a constant LR, one run stopped and continued), with eval_depth.py on the checkpoint at
    each length (eval_depth-<L>.json). status.json notes each length done, so a sweep killed mid-way
    continues from the run's last checkpoint when it is called again. Returns the status and whether there
    was work."""
    run_dir = job['out_dir']
    status, worked = read_status(run_dir), False
    done = status.setdefault('lengths', {})
    for L in job['lengths']:
        if upto and L > upto:
            break
        if done.get(str(L)) == 'done':
            continue
        spent = status.get('train_seconds', 0.0)  # the lengths before this one
        status.update(train(job, launcher, popen_kwargs, max_iters=L), eval=None)
        status['train_seconds'] = round(spent + status['train_seconds'], 1)
        worked = True
        if status['train'] == 'done':
            status['train'] = 'done' if L == job['lengths'][-1] else 'growing'
            out = os.path.join(run_dir, f'eval_depth-{L}.json')
            status.update(evaluate(run_dir, eval_args + [f'--json={out}'], popen_kwargs))
            done[str(L)] = 'done' if status['eval'] == 'done' else 'eval failed'
        write_status(run_dir, status)
        if done.get(str(L)) != 'done':
            break
    return status, worked


def run_job(job, launcher, do_eval, eval_args, popen_kwargs, reeval=False, upto=None):
    """Train one run (resuming an interrupted one), then evaluate it; writes run_dir/status.json. Returns
    the status and whether there was work to do (a finished run is skipped). upto: see run_lengths."""
    if job.get('lengths'):
        return run_lengths(job, launcher, eval_args, popen_kwargs, upto)
    run_dir = job['out_dir']
    status, worked = read_status(run_dir), False
    if status.get('train') != 'done':
        status, worked = train(job, launcher, popen_kwargs), True
        write_status(run_dir, status)
    if wants_eval(run_dir, status, do_eval, reeval):
        status.update(evaluate(run_dir, eval_args, popen_kwargs, do_eval))
        write_status(run_dir, status)
        worked = True
    return status, worked


def run_one(job, slots, launcher, do_eval, eval_args, log, reeval=False, upto=None):
    """run_job in a free worker slot, then the run's progress line."""
    slot = slots.free.get()
    t0 = time.time()
    try:
        status, worked = run_job(job, launcher, do_eval, eval_args, slots.popen_kwargs(slot), reeval, upto)
    finally:
        slots.free.put(slot)
    seconds = time.time() - t0
    log(job, run_summary(job, status) + f" [{seconds:.0f}s]", seconds if worked else None)
    return worked


def cost(job):
    """A run's relative cost: layer visits x iterations (to order the runs and to estimate the time left)."""
    cfg = job['cfg']
    visits = cfg.get('n_prelude', 0) + cfg.get('n_layer', 1) * cfg['n_loop'] + cfg.get('n_coda', 0)
    return visits * cfg['max_iters']


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


def write_sweep(args, t0, n_workers, cores, jobs):
    """<out>/sweep.json: the call's command, its wall time so far, its workers, commit and dtype."""
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, 'sweep.json'), 'w', encoding='utf-8') as fh:
        json.dump(dict(command=args.command, wall_seconds=round(time.time() - t0, 1), workers=n_workers,
                       cores_per_run=cores, commit=code_version(), dtype=resolved_dtype(jobs[0]['cfg'])), fh)


def run_sweep(jobs, preset, launcher, args):
    """Train (and evaluate) every job not finished yet, here n_workers at a time, or each as a job of a
    scheduler (submit); writes <out>/sweep.json, unless every job was finished already (the last call
    that worked keeps its wall time)."""
    t0 = time.time()
    eval_args = preset.get('eval_args', []) + shlex.split(args.eval_args)
    if args.executor != 'local':
        n_workers = submit(jobs, preset, launcher, args, eval_args, t0)
        write_sweep(args, t0, n_workers, args.cpus_per_run or '?', jobs)
        return
    n_workers = args.workers or default_workers(args)
    slots = Slots(n_workers, args.gpus_per_worker)
    cores = len(slots.cores[0])
    order = sorted(jobs, key=lambda j: -cost(j))  # the most expensive first: the workers finish together
    print(f"{args.preset}: {len(jobs)} runs, {n_workers} at a time, cores per run {cores}; "
          f"runs in {args.out}/", flush=True)
    # runs evaluated as they grow go length by length: every run reaches 1,000 steps before any goes on to
    # 3,000, and sweep.json is written after each length, so a sweep cut short reports what it reached
    worked = False
    for upto in preset.get('lengths') or [None]:
        log = progress_logger(jobs, n_workers, time.time())

        def run(job):
            return run_one(job, slots, launcher, preset['eval_depth'], eval_args, log, args.reeval, upto)
        if upto:
            print(f"{args.preset}: every run to {upto} steps", flush=True)
        with ThreadPoolExecutor(n_workers) as pool:
            worked = any(list(pool.map(run, order))) or worked
        if worked:
            write_sweep(args, t0, n_workers, cores, jobs)
    if not worked:
        print(f"{args.preset}: every run was finished already; {args.out}/sweep.json kept", flush=True)

# -----------------------------------------------------------------------------
# running through a scheduler: a job per run, submitted with submitit (Slurm, or its local executor)

MAX_REQUEUES = 100  # time limits a run may reach, each followed by a requeue that resumes it (preemptions
                    # are not counted)


class SubmittedRun:
    """One run as a submitit job: run_job on the node it gets. Before a preemption or the time limit
    submitit's signal (SIGUSR2, 90 s ahead) calls checkpoint(): train.py stops with a checkpoint and the
    same call is requeued, which resumes the run (--init_from=auto)."""

    def __call__(self, job, launcher, do_eval, eval_args, reeval):
        t0 = time.time()
        # the scheduler may signal every process of the job: train.py ignores SIGUSR2, waits for SIGUSR1
        kw = dict(env=dict(os.environ, PYTHONUNBUFFERED='1'),
                  preexec_fn=lambda: signal.signal(signal.SIGUSR2, signal.SIG_IGN))
        status, worked = run_job(job, launcher, do_eval, eval_args, kw, reeval)
        return status, time.time() - t0 if worked else None

    def checkpoint(self, *args):
        for proc in list(RUNNING):
            proc.send_signal(signal.SIGUSR1)  # train.py saves and exits 0; eval_depth.py just ends (rerun)
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited; call_logged's wait reaps it
        import submitit
        return submitit.helpers.DelayedSubmission(self, *args)


def executor(args):
    """The submitit executor of --executor: a job per run with --gpus_per_run GPUs, --cpus_per_run cores,
    --time minutes each, on --partition, at most --workers at once."""
    try:
        import submitit
    except ImportError:
        die(f"--executor={args.executor} needs submitit: pip install submitit")
    try:  # <out>/submitit/ holds each job's pickles and logs
        ex = submitit.AutoExecutor(os.path.join(args.out, 'submitit'), cluster=args.executor.split('_')[-1],
                                   slurm_max_num_timeout=MAX_REQUEUES)
    except RuntimeError as e:  # no srun: not a Slurm login node
        die(f"--executor={args.executor}: {e}")
    ex.update_parameters(name=f'nanoloop-{args.preset}', timeout_min=args.time,
                         gpus_per_node=args.gpus_per_run or None, cpus_per_task=args.cpus_per_run or None,
                         slurm_partition=args.partition or None, slurm_array_parallelism=args.workers or None,
                         slurm_additional_parameters=args.slurm_args)
    return ex


def submit(jobs, preset, launcher, args, eval_args, t0):
    """Submit every run not finished yet as a job of its own, then wait for them, printing a progress line
    as each ends. Returns the runs at once asked for."""
    ex = executor(args)
    import submitit
    before = {j['name']: read_status(j['out_dir']) for j in jobs}
    todo = [j for j in jobs if before[j['name']].get('train') != 'done'
            or wants_eval(j['out_dir'], before[j['name']], preset['eval_depth'], args.reeval)]
    n_workers = args.workers or max(1, len(todo))
    log = progress_logger(jobs, n_workers, t0)
    print(f"{args.preset}: {len(jobs)} runs, {len(todo)} to submit ({args.executor}); runs in {args.out}/, "
          f"job logs in {os.path.join(args.out, 'submitit')}/", flush=True)
    for job in jobs:
        if job not in todo:
            log(job, run_summary(job, before[job['name']]), None)
    if not todo:
        return n_workers
    # a job unpickles SubmittedRun: it imports ablate.py's folder and the core one folder up
    path = [LAB, REPO] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]
    os.environ['PYTHONPATH'] = os.pathsep.join(path)
    with ex.batch():
        subs = [ex.submit(SubmittedRun(), j, launcher, preset['eval_depth'], eval_args, args.reeval)
                for j in todo]
    for sub in submitit.helpers.as_completed(subs, poll_frequency=1):
        job = todo[subs.index(sub)]
        try:
            status, seconds = sub.result()
        except Exception as e:  # the job died or was cancelled: status.json says how far the run got
            status = dict(read_status(job['out_dir']), error=(str(e).strip().splitlines() or ['?'])[-1])
            seconds = None
        log(job, run_summary(job, status) + f" [job {sub.job_id}]", seconds)
    return n_workers


def code_version():
    """The commit the sweep ran (with '+local changes' if the code differed from it), for the report. The
    reports in assets/ do not count: a sweep rewrites them."""
    def git(*a):
        proc = subprocess.run(['git', '-C', REPO, *a], capture_output=True, text=True)
        return proc.stdout.strip() if proc.returncode == 0 else ''
    commit = git('rev-parse', '--short=12', 'HEAD') or 'unknown'
    changed = git('status', '--porcelain', '--untracked-files=no', '--', '.', ':(exclude)assets')
    return commit + (' + local changes' if changed else '')


def resolved_dtype(cfg):
    """The dtype the runs trained in: dtype='auto' resolved the way train.py resolves it."""
    if cfg['dtype'] != 'auto':
        return cfg['dtype']
    device = cfg['device'] if cfg['device'] != 'auto' else 'cuda' if torch.cuda.is_available() else 'cpu'
    dtype, why = auto_dtype(device.split(':')[0])
    return f"{dtype} (auto: {why})"

# -----------------------------------------------------------------------------
# compute estimates

SHAKESPEARE_CHARS = 65  # tinyshakespeare's distinct characters: shakespeare_char's vocabulary (prepare.py)
# the training FLOP/s of one laptop run on one CPU core, evaluations and start-up included: the median of the
# 269 runs in assets/*.json, flops_per_token x tokens / train_seconds (quartiles 27 and 40, presets'
# medians 25-85; bf16 on AVX512-BF16 EPYC cores shared by 2 runs). Another CPU: --cpu_gflops
CPU_GFLOPS = 34


def run_vocab_size(cfg):
    """The vocabulary train.py will use: --print_config shows GPTConfig's default where no config set
    vocab_size, and then train.py takes data/<dataset>/meta.json's (if the data is not prepared here: the
    word tokenizer's 20,000 for a dataset prepare.py writes with it, else GPT-2's BPE padded to 50304)."""
    if cfg['vocab_size'] != GPTConfig.vocab_size:
        return cfg['vocab_size']
    unprepared = WORD_VOCAB if HF_DATASETS.get(cfg['dataset']) == 'word' else \
        SHAKESPEARE_CHARS if TEXT_DATASETS.get(cfg['dataset']) == 'char' else 50304
    return read_json(os.path.join('data', cfg['dataset'], 'meta.json'), {}).get('vocab_size', unprepared)


def meta_model(cfg):
    """The model of a run's resolved config on the meta device: its shapes and counts, no weights."""
    model_args = {k: cfg[k] for k in model_keys()}
    model_args['vocab_size'] = run_vocab_size(cfg)
    with contextlib.redirect_stdout(io.StringIO()), torch.device('meta'):  # no parameter count printed
        return GPT(gpt_config(model_args))


def estimate(cfg):
    """(tokens, training FLOPs) of a run: accounting.flops_per_token x tokens (eval passes not counted)."""
    model = meta_model(cfg)
    tokens = cfg['max_iters'] * cfg['batch_size'] * cfg['gradient_accumulation_steps'] * cfg['block_size']
    return tokens, flops_per_token(model, cfg['block_size']) * tokens


def dry_run(jobs, launcher, args):
    """Print every run's train.py command and its estimated tokens, FLOPs and compute time: for a CPU run
    (the laptop presets) core-minutes at --cpu_gflops, else GPU-hours at --mfu of --peak_tflops."""
    if not args.cpu_gflops > 0:
        die(f"--cpu_gflops={args.cpu_gflops:g}: must be > 0")
    shown = ['python' if c == sys.executable else c for c in launcher]
    cpu, gpu = [], []  # hours per run
    for j in jobs:
        tokens, flops = estimate(j['cfg'])
        if j['cfg']['device'] == 'cpu':
            cpu.append(flops / (args.cpu_gflops * 1e9) / 3600)
            size = (f"{tokens / 1e6:.2f}M tokens, {flops / 1e12:.1f} TFLOP, ~{duration(3600 * cpu[-1])} on "
                    f"a CPU core")
        else:
            gpu.append(flops / (args.peak_tflops * 1e12 * args.mfu) / 3600)
            size = f"{tokens / 1e9:.2f}B tokens, {flops / 1e18:.2f} EFLOP, ~{gpu[-1]:.2f} GPU-h"
        print(f"{j['name']}: {size}")
        print('  ' + shlex.join(shown + ['train.py'] + j['args']))
    if cpu:
        workers = min(args.workers or default_workers(args), len(cpu))
        rate = ("the median of the laptop runs in assets/*.json (FLOPs / train time; half of them 27-40 "
                "with the machine's load; --cpu_gflops to change)" if args.cpu_gflops == CPU_GFLOPS
                else "--cpu_gflops")
        print(f"total: {len(cpu)} CPU runs, ~{duration(3600 * sum(cpu))} of CPU-core time training, "
              f"~{duration(3600 * sum(cpu) / workers)} at {workers} run(s) at a time (train.py's evaluations "
              f"counted, eval_depth.py not), assuming {args.cpu_gflops:g} GFLOP/s per core: {rate}")
    if gpu or not cpu:
        print(f"total: {len(gpu)} runs, ~{sum(gpu):.1f} GPU-hours of training at {args.mfu:.0%} MFU of "
              f"{args.peak_tflops:g} TFLOP/s (evaluation not counted)")


# -----------------------------------------------------------------------------
# command line

def parser():
    ap = Parser('lab/ablate.py', __doc__.split('\n\n')[0])
    ap.epilog = "Any other flag is a config override for every run: --key=value, e.g. --max_iters=100."
    ap.add_argument('preset', choices=sorted(PRESETS) + ['retrofit'])
    ap.add_argument('--base', action='append', default=[], help='config file(s) replacing the laptop config')
    ap.add_argument('--only', default='', help='comma-separated arm names')
    ap.add_argument('--seeds', default='', help="comma-separated seeds (default: the preset's)")
    ap.add_argument('--out', default=None, help='runs go to <out>/<arm>-s<seed>; default out-ablate-<preset>')
    ap.add_argument('--report_dir', default=None, help='default: assets/ for the laptop sweep, else <out>')
    runner_flags(ap)
    ap.add_argument('--eval_args', default='', help='extra eval_depth.py arguments, e.g. "--n_seqs=256"')
    ap.add_argument('--report_only', action='store_true', help='only rebuild the report from finished runs')
    ap.add_argument('--reeval', action='store_true', help='run eval_depth.py again on finished runs')
    return ap


def runner_flags(ap):
    """The flags of the runners (local, submitit/Slurm) and of --dry_run, shared with lab/isodepth.py."""
    ap.add_argument('--workers', type=int, default=0,
                    help='runs at once (0: one per CPU core on a CPU, else 1)')
    ap.add_argument('--gpus_per_worker', type=int, default=0,
                    help='give each worker its own GPUs (CUDA_VISIBLE_DEVICES)')
    ap.add_argument('--launcher', default='',
                    help='e.g. "torchrun --standalone --nproc_per_node=8" (default: python)')
    ap.add_argument('--executor', default='local', choices=('local', 'slurm', 'submitit_local'),
                    help='local: runs here, --workers at a time; slurm: a Slurm job per run (submitit); '
                         "submitit_local: submitit's local executor, a job per run here, all at once")
    ap.add_argument('--partition', default='', help="--executor=slurm: partition (default: the cluster's)")
    ap.add_argument('--gpus_per_run', type=int, default=1, help='--executor=slurm: GPUs per job')
    ap.add_argument('--cpus_per_run', type=int, default=0,
                    help="--executor=slurm: CPU cores per job (0: the cluster's default)")
    ap.add_argument('--time', type=int, default=240,
                    help='--executor=slurm: time limit per job in minutes (then requeued: the run resumes)')
    ap.add_argument('--slurm_args', default='', help='more sbatch options, e.g. "account=lab qos=normal"')
    ap.add_argument('--dry_run', action='store_true',
                    help='print the commands and the estimated compute, run nothing')
    ap.add_argument('--mfu', type=float, default=0.4, help='assumed model flops utilisation for --dry_run')
    ap.add_argument('--peak_tflops', type=float, default=989.0, help='--dry_run: GPU bf16 peak (H100: 989)')
    ap.add_argument('--cpu_gflops', type=float, default=CPU_GFLOPS,
                    help='--dry_run: training FLOP/s of one CPU run per core, in GFLOP/s (measured: assets/)')


def slurm_options(text):
    """--slurm_args as a dict of sbatch options."""
    try:
        return dict(kv.split('=', 1) for kv in text.split())
    except ValueError:
        die(f"--slurm_args {text}: expected sbatch options key=value, e.g. 'account=lab qos=high'")


def parse_args(argv):
    """The parsed flags, checked, with defaults filled in: the config overrides (every flag not ablate.py's
    own) as ['--key=value', ...], --only and --seeds as lists, --out and --report_dir set, and the command
    line itself (for the report)."""
    args, overrides = parser().parse_known_args(argv)
    args.overrides = overrides
    args.command = 'python lab/ablate.py ' + shlex.join(argv)
    args.out = args.out or f'out-ablate-{args.preset}'
    args.report_dir = args.report_dir or (args.out if args.base else 'assets')
    for s in args.overrides:
        if not (s.startswith('--') and '=' in s):
            die(f"unrecognized arguments: {s}; a config override is written --key=value "
                f"(see python lab/ablate.py --help)")
    args.only = [a for a in args.only.split(',') if a]
    names = [a['name'] for a in PRESETS[args.preset]['arms']]
    for a in args.only:
        if a not in names:
            die(f"--only {a}: not an arm of {args.preset} ({', '.join(names)})")
    args.slurm_args = slurm_options(args.slurm_args)
    try:
        args.seeds = [int(s) for s in args.seeds.split(',') if s] or list(PRESETS[args.preset]['seeds'])
    except ValueError:
        die(f"--seeds {args.seeds}: expected comma-separated integers")
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ['retrofit']:  # runs that start from other runs' checkpoints: lab/retrofit_sweep.py
        from retrofit_sweep import main as retrofit_main
        return retrofit_main(argv[1:])
    args = parse_args(argv)
    preset = PRESETS[args.preset]
    jobs = plan(args, preset)
    finished = lambda st: st.get('train') == 'done' or 'done' in st.get('lengths', {}).values()
    if args.report_only and not any(finished(read_status(j['out_dir'])) for j in jobs):
        # an empty report would overwrite the committed one (the runs' folders are not committed)
        die(f"--report_only: no finished run of {args.preset} under {args.out}/; "
            f"{os.path.join(args.report_dir, args.preset + '.md')} is left as it is")
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
