"""
Training operations: the processes and devices a run uses, and what keeps a long run alive on a
laptop or a cluster, so that train.py can stay the training loop. train.py calls each of these with
a line or two.

    init_processes DDP from torchrun's environment, this rank's device and CPU threads
    resolve_dtype  what dtype='auto' trains in here (compute/hardware.py), and why
    StopSignals    Ctrl-C, SIGTERM or SIGUSR1: stop after the current step, save, exit 0
    loop_count     this step's loop count, under loop_schedule's curriculum (docs/papers.md §6)
    agree          the step's one all-reduce: the loss, a bad gradient, a stop signal, the loop count
    Saver          the checkpoint write, and what happens when it fails (a full disk)
    BadSteps       a non-finite loss or gradient: skip the update and say where it came from
    ETA            the time to max_iters, for the progress line
    mfu            the step's model FLOPs utilisation on CUDA (accounting.py), for the same line
    Metrics        out_dir/metrics.jsonl (one JSON object per eval), and wandb
    mean_kappa     kappa_R at an eval (log_kappa, docs/papers.md §2; diagnostics.py)
    gather, from_rank0, lost_a_rank, end_process_group: DDP helpers and fault handling
"""
import gc
import json
import math
import os
import signal
import sys
from collections import namedtuple
from datetime import timedelta

import torch
import torch.distributed as dist

from compute import hardware
import configurator
from configurator import die, first_line
from run import checkpoint
from run.accounting import estimate_mfu
from run.diagnostics import visit_alignment


def ddp():
    return dist.is_available() and dist.is_initialized()


def master():
    return not ddp() or dist.get_rank() == 0


def world_size():
    return dist.get_world_size() if ddp() else 1

# -----------------------------------------------------------------------------
# processes and devices

def init_processes(device, collective_timeout):
    """(ddp, rank, local_rank, world_size, device, device_type) of this process. Under torchrun
    (RANK set) it joins the process group: NCCL on GPUs, gloo on CPUs; a rank that dies or stalls
    makes the others' next collective fail after at most collective_timeout seconds."""
    hardware.flush_denormals()  # an underflowing softmax would slow CPU matmuls ~20x (compute/hardware.py)
    ddp = int(os.environ.get('RANK', -1)) != -1  # is this a torchrun run?
    rank, local_rank, world_size = (int(os.environ['RANK']), int(os.environ['LOCAL_RANK']),
                                    int(os.environ['WORLD_SIZE'])) if ddp else (0, 0, 1)
    device, device_type = configurator.pick_device(device)  # 'auto' resolved; one that is not here stops
    if ddp:
        if device_type == 'cuda':  # one GPU per rank
            device = f'cuda:{local_rank}'
            torch.cuda.set_device(device)
        dist.init_process_group(backend='nccl' if device_type == 'cuda' else 'gloo',
                                timeout=timedelta(seconds=collective_timeout))
    if device_type == 'cpu' and 'OMP_NUM_THREADS' not in os.environ:
        # torch starts one thread per core in every process: share the cores between the ranks
        # instead (torchrun sets OMP_NUM_THREADS=1 itself; set it to choose the thread count yourself)
        affinity = getattr(os, 'sched_getaffinity', None)
        cores = len(affinity(0)) if affinity else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores // world_size))
    return ddp, rank, local_rank, world_size, device, device_type


def resolve_dtype(dtype, device_type):
    """(dtype, a note for the log): 'auto' becomes what this chip runs fast (hardware.auto_dtype)."""
    if dtype == 'float16' and device_type == 'cpu':  # a 512x512 matmul took 38x fp32's time (2-core EPYC)
        return dtype, " (warning: float16 is far slower than float32 or bfloat16 on a CPU: use dtype='auto')"
    if dtype != 'auto':
        return dtype, ''
    dtype, why = hardware.auto_dtype(device_type)
    return dtype, f" (auto: {why})"

# -----------------------------------------------------------------------------
# stopping

class StopSignals:
    """Notes the first stop signal: SIGTERM, or SIGUSR1 some time before the kill (a scheduler sends
    them and allows a grace period), or SIGINT (Ctrl-C). The handler only takes a note. The training
    loop reads it in each step's all-reduce, so all ranks stop after the same step even if the signal
    reached them at different times; then rank 0 saves and the run exits 0 (stop_at_signal).

    A second SIGTERM or SIGUSR1 only notes again: it cannot interrupt the save, which is atomic
    anyway. A second Ctrl-C ends the process at once, as Ctrl-C does; the last checkpoint stays."""

    def __init__(self):
        self.name = None  # the name of the first stop signal this process received
        for name in ('SIGTERM', 'SIGUSR1', 'SIGINT'):
            if hasattr(signal, name):  # SIGUSR1 does not exist on Windows
                signal.signal(getattr(signal, name), self.note)

    def note(self, signum, frame):
        self.name = self.name or signal.Signals(signum).name
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)


def loop_count(cfg, generator, it, ramp_iters):
    """This step's loop count. A loop-count curriculum (retrofitted recurrence, docs/papers.md §6): over the
    first ramp_iters steps the mean loop count ramps linearly from 1 to n_loop (fixed depth: rounded; a
    sampled depth: the draw's mean ramps with it), then stays there. ramp_iters = 0: no curriculum. A
    function of the step alone (and of the depth stream), so a resumed run draws what it would have."""
    if it >= ramp_iters:
        return cfg.draw_n_loop(generator)
    return cfg.draw_n_loop(generator, 1 + (cfg.n_loop - 1) * it / ramp_iters)


Agreed = namedtuple('Agreed', 'loss grad_bad stop')


def agree(loss, grad_norm, stop, R):
    """What all ranks decide after a step, from one small all-reduce (and one sync): the mean loss
    (NaN if any rank's loss was), whether any rank's gradient norm was non-finite, and whether any
    rank got a stop signal."""
    # R and R^2 ride along to check that every rank drew the same loop count: only then do their sums
    # equal world_size * R and world_size * R^2
    flags = torch.cat([torch.stack([loss, (~torch.isfinite(grad_norm)).float()]),
                       torch.tensor([float(stop), R, R * R], device=loss.device)])
    if ddp():
        dist.all_reduce(flags)
    loss_sum, grad_bad, stops, r_sum, r2_sum = flags.tolist()
    n = world_size()
    assert (r_sum, r2_sum) == (n * R, n * R ** 2), "the ranks drew different loop counts R"
    return Agreed(loss_sum / n, grad_bad != 0, stops != 0)


def stop_at_signal(saver, state, it, signal_name, shutdown):
    """All ranks agreed to stop after this step (a stop signal reached at least one of them): save
    where the run is, say how to continue, exit 0."""
    why = f"stopped by {signal_name or 'a stop signal to another rank'} at iter {it}"
    saver.save(state, it, stopping=why)
    if master():
        print(f"{why}: checkpoint {saver.path}; continue with the same command and "
              f"--init_from=auto (or resume)", flush=True)
    if ddp():
        # leave at once: the work is saved, and a gloo thread still winding down while the
        # interpreter shuts down can abort the process (exit -6), which a scheduler reads as a failure
        shutdown()  # train.py's: drops its DDP wrapper, then ends the group
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    sys.exit(0)


def stop_all(msg):
    """Every rank stops here together, exit code 1; rank 0 says why in one line."""
    if master():
        die(msg)
    sys.exit(1)

# -----------------------------------------------------------------------------
# DDP

def gather(obj):
    """obj from every rank, as a list on rank 0 (None elsewhere); [obj] without DDP."""
    if not ddp():
        return [obj]
    out = [None] * world_size() if master() else None
    dist.gather_object(obj, out, dst=0)
    return out


def from_rank0(obj):
    """rank 0's obj on every rank; obj itself without DDP."""
    if not ddp():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def end_process_group():
    """On every way out (done, a stop signal, an error), once the caller dropped its DDP wrapper
    (which holds the process group): destroy the group while Python is still whole. A gloo thread
    left running into the interpreter's shutdown can abort the process ('terminate called without
    an active exception'). Without DDP there is nothing to end: no full collection, which would cost
    a second at every exit of a process that ran train.py many times (the tests)."""
    if ddp():
        gc.collect()
        dist.destroy_process_group()


def lost_a_rank(e, it, saver, collective_timeout):
    """Under DDP, a rank that died (or stalled past collective_timeout) shows up in the others' next
    collective as a RuntimeError from gloo or NCCL: each surviving rank stops with one line.
    Anything else is a bug to see in full, so it is raised again."""
    text = str(e).lower()
    if not (ddp() and (isinstance(e, dist.DistError) or 'gloo' in text or 'nccl' in text)):
        raise e
    kept = (f"{saver.path} (iter {saver.saved_iter}) is intact" if saver.saved_iter is not None
            else "no checkpoint yet")
    die(f"rank {dist.get_rank()}: a collective failed at iter {it} ({first_line(e)}); another "
        f"process died or stalled (collective_timeout={collective_timeout}s); {kept}: rerun with "
        f"--init_from=auto")

# -----------------------------------------------------------------------------
# checkpoints

class Saver:
    """Rank 0 writes the checkpoint; every rank learns whether the write worked.

    A write that fails (a full disk, an unwritable out_dir) leaves the previous checkpoint as it
    was and says so in one line. Training goes on and retries at the next eval: space is often freed
    meanwhile, and a run that stopped would lose the steps since the last save anyway. The run
    stops, exit code 1, after max_failed_saves failures in a row, at the final save, or when it was
    stopping anyway."""

    def __init__(self, path, max_iters, max_failed_saves, saved_iter=None):
        self.path, self.max_iters, self.max_failed_saves = path, max_iters, max_failed_saves
        self.saved_iter = saved_iter  # the iteration the file holds; None: no checkpoint yet
        self.failed = 0  # failed saves in a row

    def save(self, state, it, stopping=None):
        """Write state (rank 0's; None elsewhere) as iteration it. `stopping` says why the run stops
        after this save, if it does."""
        error = None
        if master():
            print(f"saving checkpoint to {self.path}")
            try:
                checkpoint.save(state, self.path)
            except OSError as e:  # an atomic save: the old file is untouched, the partial one gone
                error = first_line(e)
        error = from_rank0(error)
        if stopping is None:
            self.failed = 0 if error is None else self.failed + 1
        if error is None:
            self.saved_iter = it
            return
        kept = "no checkpoint yet"
        if self.saved_iter is not None:
            kept = f"{self.path} still holds iter {self.saved_iter}"
        msg = f"iter {it}: could not save {self.path} ({error}); {kept}"
        if self.failed >= self.max_failed_saves:
            stopping = f"{self.failed} failed saves in a row (max_failed_saves={self.max_failed_saves})"
        elif it >= self.max_iters:
            stopping = "this was the final save"
        if stopping:
            stop_all(f"{msg}; stopping: {stopping}; free space or fix out_dir, then rerun with "
                     f"--init_from=auto")
        if master():
            print(f"{msg}; training goes on and retries at the next eval ({self.failed} of "
                  f"max_failed_saves={self.max_failed_saves} in a row)")

# -----------------------------------------------------------------------------
# non-finite steps

class BadSteps:
    """Steps whose loss or gradient was not finite: the update is skipped, one line says which exit
    or loop went bad on each rank, and max_bad_steps of them in a row stop the run."""

    def __init__(self, model, ctx, max_bad_steps, ckpt_path, total=0):
        self.model, self.ctx, self.ckpt_path = model, ctx, ckpt_path
        self.max_bad_steps, self.in_a_row, self.total = max_bad_steps, 0, total

    def check_weights(self, it):
        """Skipping keeps non-finite updates out; if the weights broke anyway, the checkpoint on disk
        stays the last good one."""
        if not all(torch.isfinite(p).all() for p in self.model.parameters()):
            die(f"non-finite weights at iter {it}: not saving; {self.ckpt_path} (last good "
                f"checkpoint) is untouched")

    def count(self, ok, it, loss, grad_norm, X, Y):
        self.in_a_row = 0 if ok else self.in_a_row + 1
        if ok:
            return
        self.total += 1
        reports = gather(self.report(X, Y))
        if master():
            where = '; '.join(f"rank {r}: {s}" for r, s in enumerate(reports)) if ddp() else reports[0]
            print(f"iter {it}: non-finite loss ({loss:.4g}) or grad norm ({grad_norm.item():.4g}), "
                  f"update skipped ({self.in_a_row} in a row, {self.total} total); {where}")
        if self.in_a_row >= self.max_bad_steps:
            die(f"stopping at iter {it}: {self.in_a_row} consecutive steps with a non-finite loss or "
                f"gradient (max_bad_steps={self.max_bad_steps}); {self.ckpt_path} holds the last "
                f"good state: lower learning_rate or check the data, then resume")

    @torch.no_grad()
    def report(self, X, Y):
        """Which exit's CE or which loop's state went non-finite on batch (X, Y), in a few words.
        exit_metrics runs the same loop as the loss: a NaN that starts at loop k shows from exit k on."""
        with self.ctx:
            ce, norms, _ = self.model.exit_metrics(X, Y)
        bad = lambda v: ', '.join(str(k) for k, x in enumerate(v.tolist(), 1) if not math.isfinite(x))
        parts = [f"CE at exit {bad(ce)}"] * bool(bad(ce))
        parts += [f"||h_k|| at loop {bad(norms)}"] * bool(bad(norms))
        if parts:
            return "non-finite " + " and ".join(parts)
        finite = "every exit CE and loop norm is finite"
        if self.model.config.norm_penalty > 0:  # lambda * mean(h^2) can overflow all the same
            return f"{finite}: the norm penalty term or the backward pass overflowed"
        return f"{finite} on this batch: the backward pass (or another rank) broke"

# -----------------------------------------------------------------------------
# progress and metrics
def duration(seconds):
    """Seconds as a short duration for progress lines: 42s, 4m10s, 3h05m."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class ETA:
    """Seconds to max_iters: the steps left at the running step time (an exponential average that
    leaves out the evals and the run's first step, warm-up and compilation) plus the evals left at
    the last one's duration."""

    def __init__(self, start_iter, max_iters, eval_interval):
        self.start_iter, self.max_iters, self.eval_interval = start_iter, max_iters, eval_interval
        self.step_time = self.eval_time = 0.0  # seconds

    def step(self, it, dt):
        self.step_time = dt if it <= self.start_iter + 1 else 0.9 * self.step_time + 0.1 * dt

    def text(self, it):
        """left(it) as a short duration: 42s, 4m10s, 3h05m."""
        return duration(self.left(it))

    def left(self, it):
        """Seconds from the end of step it to the end of the run."""
        n, every = self.max_iters, self.eval_interval
        evals_left = n // every - it // every + (n % every != 0)
        return (n - it - 1) * self.step_time + evals_left * self.eval_time


def mfu(model, seqs_per_iter, dt, device_type):
    # a fraction of the chip's bf16 peak (compute/hardware.py); off CUDA there is no peak to hold a step to
    return estimate_mfu(model, seqs_per_iter, dt) if device_type == 'cuda' else None


class Metrics:
    """out_dir/metrics.jsonl, one JSON object per eval, and wandb if it is on (rank 0 only).

    A resumed run keeps the rows up to its checkpoint's iteration (resume_iter) and drops the rest:
    they came from work the checkpoint does not hold, and will be redone. A new run starts a new
    file. An unwritable out_dir stops the run here, before any training."""

    def __init__(self, out_dir, resume_iter=None, write=True, wandb_init=None):
        self.path, self.write, self.wandb = os.path.join(out_dir, 'metrics.jsonl'), write, None
        rows = []
        try:
            os.makedirs(out_dir, exist_ok=True)
            if resume_iter is not None and os.path.exists(self.path):
                with open(self.path, encoding='utf-8') as f:
                    for line in f:
                        try:
                            if json.loads(line)['iter'] <= resume_iter:
                                rows.append(line if line.endswith('\n') else line + '\n')
                        except (ValueError, KeyError, TypeError):
                            pass  # a line torn by a crash mid-write
            if write:
                with open(self.path + '.tmp', 'w', encoding='utf-8') as f:
                    f.writelines(rows)
                os.replace(self.path + '.tmp', self.path)
        except OSError as e:
            die(f"cannot write to out_dir={out_dir!r}: {first_line(e)}")
        if wandb_init is not None:
            try:
                import wandb  # only when wandb_log is on
            except ImportError:
                die("wandb_log=True but wandb is not installed: pip install wandb")
            wandb.init(**wandb_init)
            self.wandb = wandb

    def log(self, row):
        if self.write:
            try:
                with open(self.path, 'a', encoding='utf-8') as f:
                    f.write(json.dumps(row) + '\n')
            except OSError as e:  # a full disk: the row is in the log, the next save decides the rest
                print(f"could not append to {self.path} ({first_line(e)})")
        if self.wandb is not None:
            self.wandb.log({'iter': row['iter'], 'lr': row['lr'], 'train/loss': row['train_loss'],
                            'val/loss': row['val_loss'],
                            **{f'val/ce_exit{k}': v for k, v in enumerate(row['val_ce'], 1)},
                            **{f'norm/h{k}': v for k, v in enumerate(row['norm'], 1)}})

# -----------------------------------------------------------------------------
# diagnostics at an eval

def mean_kappa(model, X, Y, ctx):
    """kappa_R of the loss on batch (X, Y), the mean over the shared matrices (docs/papers.md §2)."""
    model.eval()
    with ctx:
        kappa = visit_alignment(model, X, Y)['mean']
    model.train()
    return kappa
