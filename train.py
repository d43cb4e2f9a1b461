"""
Train a looped GPT. Runs on one CPU, one GPU, or several GPUs (or CPU processes) with DDP.

With no arguments it trains a small looped GPT on shakespeare_char in about five minutes on a laptop CPU:
per-loop cross-entropy through an RMSNorm readout with the reference init, the setting where paper 1's
readout blind spot appears (docs/papers.md §1): watch ||h_k|| grow in the eval blocks.

    python train.py                                            # the embedded default
    python train.py config/loop_raw.py                         # one ablation arm
    python train.py config/paper_44m.py config/loop_raw.py     # a GPU preset + an arm (files apply in order)
    python train.py config/loop_raw.py --max_iters=500 --lr_schedule=cosine
    python train.py --init_from=resume --max_iters=6000        # continue out/ckpt.pt where it stopped
    python train.py config/paper_44m.py --init_from=auto       # resume if out/ckpt.pt exists, else start
    python train.py config/deeploop.py --print_config=True     # the resolved config as JSON, then exit

DDP, e.g. 4 GPUs on one node (CPU processes work too, with the gloo backend):
    torchrun --standalone --nproc_per_node=4 train.py config/paper_44m.py

Every eval_interval it prints train/val cross-entropy at every exit 1..R and the mean per-token norm
||h_k|| of every loop state, and appends them to out_dir/metrics.jsonl (one JSON object per eval).

On a cluster: SIGTERM or SIGUSR1 stops the run after the current step with a checkpoint and exit code 0
(rerun the same command with --init_from=auto to continue bit for bit); a failed checkpoint write is retried
at the next eval; under DDP a dead or stalled rank ends the job after at most collective_timeout seconds.
"""

import atexit
import gc
import json
import math
import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import checkpoint
import configurator
from errors import die, duration, first_line
from diagnostics import visit_alignment
from hardware import auto_dtype
from model import GPT, GPTConfig
from prepare import open_data

# -----------------------------------------------------------------------------
# default config values: a small looped GPT on shakespeare_char, per-loop CE + RMSNorm readout (§1)
# I/O
out_dir = 'out'                  # ckpt.pt and metrics.jsonl go here
eval_interval = 250              # evaluate (and checkpoint) every this many iterations
log_interval = 50                # print the training loss every this many iterations
eval_iters = 10                  # batches per split per evaluation (the same batches every time)
eval_only = False                # evaluate once and exit
log_kappa = False                # also log kappa_R at each eval (docs/papers.md §2: mean visit alignment of
                                 # the shared matrices on one train batch); costs one extra backward pass
always_save_checkpoint = True    # save at every eval, not only when the val loss improves
init_from = 'scratch'            # 'scratch', 'resume' (from out_dir/ckpt.pt), or 'auto': resume if out_dir
                                 # holds ckpt.pt, else scratch (a requeued job reruns the same command)
print_config = False             # print the resolved config as one JSON line and exit (what ablate.py reads)
# wandb logging
wandb_log = False                # wandb is imported only when this is on
wandb_project = 'nanoloop'
wandb_run_name = 'run'
# data
dataset = 'shakespeare_char'     # data/<dataset>/{train,val}.bin + meta.json (python prepare.py <dataset>)
gradient_accumulation_steps = 1  # micro-batches per optimizer step in all, shared out over the DDP ranks
batch_size = 8                   # sequences per micro-batch
# model: every field of model.GPTConfig is a config key too (n_layer, n_loop, readout, block, ...); their
# defaults, allowed values and meanings are there, in one place. The embedded default is GPTConfig().
# AdamW optimizer
learning_rate = 1e-3             # max learning rate (paper 1: 3e-4, slow for a 5-minute run)
max_iters = 2000                 # total number of training iterations
weight_decay = 0.01
beta1 = 0.9
beta2 = 0.99
grad_clip = 1.0                  # clip gradients at this norm; 0 = no clipping
# learning rate schedule (paper 1 trains at a constant LR with no warmup)
lr_schedule = 'constant'         # constant | cosine (linear warmup, then cosine decay to min_lr)
warmup_iters = 0                 # linear warmup steps (both schedules)
lr_decay_iters = 2000            # cosine: reaches min_lr here, ~= max_iters per Chinchilla
min_lr = 1e-4                    # cosine: final learning rate, ~= learning_rate/10 per Chinchilla
# reliability
max_bad_steps = 10               # stop after this many consecutive steps with a non-finite loss or gradient
max_failed_saves = 3             # a failed checkpoint write (full disk) is retried at the next eval; stop
                                 # after this many failures in a row
collective_timeout = 600         # DDP: seconds a collective waits for a dead or stalled rank before the run
                                 # stops (longer than a checkpoint write, which the others wait for)
# system
device = 'auto'                  # auto (cuda, then mps, then cpu) | cpu | cuda | cuda:N | mps
dtype = 'auto'                   # float32 | bfloat16 | float16 | auto: bf16 on CUDA (fp16 without bf16) and
                                 # on CPUs with bf16 units, else fp32 (hardware.auto_dtype)
compile = False                  # torch.compile the model (PyTorch 2.0+; worth it on GPUs)
seed = 1337
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items()
               if not k.startswith('_') and isinstance(v, (bool, int, float, str))]
defaults = {**{k: globals()[k] for k in config_keys}, **asdict(GPTConfig())}
config, explicit = configurator.configure(defaults, sys.argv[1:])  # config files, then --key=value
ckpt_path = os.path.join(config['out_dir'], 'ckpt.pt')
ckpt, resume_changes = None, []
auto_scratch = config['init_from'] == 'auto' and not os.path.exists(ckpt_path)
if config['init_from'] == 'auto':  # a requeued job: continue if an earlier attempt left a checkpoint
    config['init_from'] = 'scratch' if auto_scratch else 'resume'
if config['init_from'] == 'resume':
    # the checkpoint's config is the base; only what this command sets explicitly overrides it
    ckpt = checkpoint.load(ckpt_path)
    missing = [k for k in ('optimizer', 'iter_num', 'config') if k not in ckpt]
    if missing or not isinstance(ckpt['iter_num'], int) or not isinstance(ckpt['config'], dict):
        die(f"{ckpt_path} cannot be resumed: it lacks {', '.join(missing) or 'a valid iter_num/config'}")
    config, resume_changes = configurator.resume_config(config, explicit, ckpt, ckpt_path)
    explicit.add('vocab_size')  # the checkpoint's, not meta.json's
configurator.check(config)  # choices and ranges, GPTConfig's own validation
if config['print_config']:
    print(json.dumps(config))
    sys.exit(0)
globals().update(config)
# -----------------------------------------------------------------------------
# processes and devices

ddp = int(os.environ.get('RANK', -1)) != -1  # is this a torchrun run?
rank, local_rank, world_size = (int(os.environ['RANK']), int(os.environ['LOCAL_RANK']),
                                int(os.environ['WORLD_SIZE'])) if ddp else (0, 0, 1)
master_process = rank == 0  # this process logs and writes checkpoints
if device == 'auto':
    device = 'cuda' if torch.cuda.is_available() else 'mps' if torch.backends.mps.is_available() else 'cpu'
device_type = 'cuda' if device.startswith('cuda') else device
if device_type == 'cuda' and not torch.cuda.is_available():
    die(f"device={device!r} but torch.cuda.is_available() is False; use --device=cpu")
if device_type == 'mps' and not torch.backends.mps.is_available():
    die("device='mps' but torch.backends.mps.is_available() is False; use --device=cpu")
if ddp:
    if device_type == 'cuda':
        device = f'cuda:{local_rank}'
        torch.cuda.set_device(device)
    # a rank that dies or stalls makes the others' next collective fail after at most this timeout
    dist.init_process_group(backend='nccl' if device_type == 'cuda' else 'gloo',
                            timeout=timedelta(seconds=collective_timeout))

    @atexit.register
    def end_process_group():
        """On every way out (done, a stop signal, an error): drop the DDP wrapper, which holds the process
        group, and destroy the group while Python is still whole. A gloo thread left running into the
        interpreter's shutdown can abort the process ('terminate called without an active exception')."""
        globals().pop('model', None)
        gc.collect()
        dist.destroy_process_group()

# nanoGPT's convention: gradient_accumulation_steps counts the micro-batches of one optimizer step over all
# ranks, so the global batch does not depend on the process count; each rank runs its share, rounded up
micro_steps = math.ceil(gradient_accumulation_steps / world_size)  # micro-batches per rank per step
tokens_per_iter = micro_steps * world_size * batch_size * block_size
if device_type == 'cpu' and 'OMP_NUM_THREADS' not in os.environ:
    # torch starts one thread per core in every process: share the cores between the ranks instead
    # (torchrun sets OMP_NUM_THREADS=1 itself; set it to choose the thread count yourself)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores // world_size))
dtype_note = ''
if dtype == 'auto':
    dtype, why = auto_dtype(device_type)
    dtype_note = f" (auto: {why})"
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
if device_type == 'cuda':
    torch.backends.cuda.matmul.allow_tf32 = True  # allow tf32 on matmul
    torch.backends.cudnn.allow_tf32 = True        # allow tf32 on cudnn
# the forward pass runs under autocast in bf16/fp16; weights, optimizer and loss stay float32
ctx = nullcontext() if ptdtype == torch.float32 else torch.autocast(device_type=device_type, dtype=ptdtype)
# fp16 needs loss scaling to keep small gradients from flushing to zero; bf16 has float32's range
scaler = torch.amp.GradScaler(device_type, enabled=(dtype == 'float16'))
torch.manual_seed(seed + rank)  # dropout differs between ranks; DDP broadcasts rank 0's initial weights
if master_process:
    threads = f", {torch.get_num_threads()} threads" if device_type == 'cpu' else ''
    print(f"device: {device}{threads}, {dtype}{dtype_note}, {world_size} process(es); tokens per iteration: "
          f"{tokens_per_iter:,} ({micro_steps * world_size} x {batch_size} x {block_size})")
    if micro_steps * world_size != gradient_accumulation_steps:
        print(f"gradient_accumulation_steps={gradient_accumulation_steps} rounded up to "
              f"{micro_steps * world_size}: {micro_steps} per process on {world_size} processes")
    for change in resume_changes:
        print(f"resume: {change}")
    if auto_scratch:
        print(f"init_from=auto: no {ckpt_path} yet, starting from scratch")

# -----------------------------------------------------------------------------
# preemption: a scheduler sends SIGTERM (or SIGUSR1 some time before the kill) and allows a grace period.
# The handler only notes the signal. The training loop reads the note after each step, inside the step's
# all-reduce, so all ranks stop after the same step even if the signal reached them at different times;
# then rank 0 saves and the run exits 0 (stop_at_signal). A second signal only notes again: it cannot
# interrupt the save, which is atomic anyway.

stop_signal = None  # the name of the first stop signal this process received

def on_stop_signal(signum, frame):
    global stop_signal
    stop_signal = stop_signal or signal.Signals(signum).name

for name in ('SIGTERM', 'SIGUSR1'):
    if hasattr(signal, name):  # SIGUSR1 does not exist on Windows
        signal.signal(getattr(signal, name), on_stop_signal)

# -----------------------------------------------------------------------------
# data

data_dir = os.path.join('data', dataset)
if not os.path.exists(os.path.join(data_dir, 'meta.json')) and dataset in ('shakespeare_char', 'shakespeare'):
    if master_process:  # the other ranks wait at the barrier (torchrun ends them if this one fails)
        print(f"{data_dir} not found: preparing it (python prepare.py {dataset})")
        import prepare  # downloads tinyshakespeare once; offline, it dies naming the command to run instead
        prepare.prepare(dataset)
    if ddp:
        dist.barrier()
meta = open_data(data_dir, block_size)  # checks files, token ids < vocab_size, and block_size vs. the splits
meta_id = {k: meta.get(k) for k in ('tokenizer', 'vocab_size', 'itos')}  # what a checkpoint's tokens mean
if ckpt is not None:
    differ = [k for k in meta_id if k in (ckpt.get('meta') or {}) and ckpt['meta'][k] != meta_id[k]]
    if differ or vocab_size < meta['vocab_size']:
        die(f"{data_dir}/meta.json disagrees with {ckpt_path} ({', '.join(differ) or 'vocab_size'}: the "
            f"checkpoint was trained on other tokens); resume with its dataset {ckpt.get('dataset')!r}")
if 'vocab_size' not in explicit:
    vocab_size = meta['vocab_size']
elif vocab_size < meta['vocab_size']:
    die(f"vocab_size={vocab_size} is smaller than {data_dir}/meta.json's {meta['vocab_size']}")
token_dtype = np.dtype(meta['dtype'])

def get_batch(split, generator):
    """(X, Y) of shape (B, T): random windows of the split and the same windows shifted by one token.
    Offsets come from `generator`, a torch.Generator private to this data stream, so the data order is
    independent of everything else that draws random numbers and its state can go into the checkpoint."""
    # a fresh memmap per batch, as nanoGPT does: a long-lived one keeps growing the process's memory
    data = np.memmap(os.path.join(data_dir, f'{split}.bin'), dtype=token_dtype, mode='r')
    ix = torch.randint(len(data) - block_size, (batch_size,), generator=generator).tolist()
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    if device_type == 'cuda':
        # pinned memory lets the copy to the GPU run asynchronously (non_blocking)
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)

if init_from == 'scratch' and os.path.exists(ckpt_path) and not eval_only:
    # a forgotten --init_from=resume would overwrite a run at its first checkpoint: refuse instead
    die(f"{ckpt_path} already exists: continue it with --init_from=resume, or start over with another "
        f"--out_dir (or delete {out_dir})")

# -----------------------------------------------------------------------------
# model, optimizer, and the state a resumed run continues from

model_args = {k: globals()[k] for k in configurator.model_keys()}
model = GPT(GPTConfig(**model_args))
if ckpt is not None:
    checkpoint.load_weights(model, ckpt['model'], ckpt_path)
model.to(device)
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
iter_num, best_val_loss, bad_total = 0, float('inf'), 0
saved_iter, skip_eval_at = None, None  # the iteration out_dir/ckpt.pt holds; one not to evaluate again
train_gen = torch.Generator().manual_seed(seed + 1000 * (rank + 1))  # this rank's training batches
depth_gen = torch.Generator().manual_seed(seed)  # loop counts (loop_sampling): seeded alike on every rank
if ckpt is not None:
    # AdamW moments come from the checkpoint; hyperparameters (betas, weight decay) from this run's config
    hyper = [{k: v for k, v in g.items() if k != 'params'} for g in optimizer.param_groups]
    try:
        optimizer.load_state_dict(ckpt['optimizer'])
        if scaler.is_enabled() and ckpt.get('scaler'):
            scaler.load_state_dict(ckpt['scaler'])
    except (ValueError, KeyError, RuntimeError, TypeError) as e:
        die(f"{ckpt_path}: optimizer state does not fit this model ({first_line(e)})")
    for g, h in zip(optimizer.param_groups, hyper):
        g.update(h)
    iter_num, best_val_loss = ckpt['iter_num'], float(ckpt.get('best_val_loss', float('inf')))
    bad_total = int(ckpt.get('bad_steps', 0))
    saved_iter = iter_num
    # a checkpoint written at an eval was evaluated and logged there; one written when a signal stopped the
    # run was not, so this run evaluates that iteration if it is an eval iteration, as an uninterrupted one
    if ckpt.get('evaluated', True) and not eval_only:
        skip_eval_at = iter_num
    # every rank continues its own random streams (dropout, data order) exactly where the checkpoint left them
    rngs, data_rngs = ckpt.get('rng'), ckpt.get('data_rng')
    if ckpt.get('world_size') == world_size and isinstance(rngs, list) and isinstance(data_rngs, list):
        checkpoint.set_rng_state(rngs[rank])
        train_gen.set_state(data_rngs[rank])
        if 'depth_rng' in ckpt:  # checkpoints from before loop_sampling have none (and needed none)
            depth_gen.set_state(ckpt['depth_rng'])
    elif master_process:
        why = (f"was written by {ckpt.get('world_size')} process(es), this run has {world_size}"
               if ckpt.get('world_size') != world_size else "holds no random-stream states")
        print(f"resume: the checkpoint {why}: random streams are reseeded (not bit for bit from here)")
    if master_process:
        print(f"resuming from {ckpt_path} at iter {iter_num}")
    del ckpt  # free the memory
raw_model = model  # the plain GPT: its state_dict has no '_orig_mod.' / 'module.' prefixes
if compile:
    if master_process:
        print("compiling the model... (takes a ~minute)")
    if loop_sampling != 'fixed':
        # one graph per loop count drawn (the loop unrolls): at most max_loop of them, so let dynamo keep that
        # many instead of falling back to eager after its default limit of 8
        cap = raw_model.config.loop_cap + 1
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, cap)
    # static shapes: a new loop count is a new graph, not a symbolic one (the loop's python range unrolls)
    model = torch.compile(model, dynamic=False)
if ddp:
    model = DDP(model, device_ids=[local_rank] if device_type == 'cuda' else None)

def gather(obj):
    """obj from every rank, as a list on rank 0 (None elsewhere); [obj] without DDP."""
    if not ddp:
        return [obj]
    out = [None] * world_size if master_process else None
    dist.gather_object(obj, out, dst=0)
    return out

def from_rank0(obj):
    """rank 0's obj on every rank; obj itself without DDP."""
    if not ddp:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]

@torch.no_grad()
def estimate_loss():
    """CE at every exit and mean ||h_k|| per loop on eval_iters batches of each split, averaged over ranks.

    Each rank draws its batches from a generator seeded the same way at every eval, so successive evals
    compare the model on the same data, and training's own data stream is left alone.
    """
    out = {}
    raw_model.eval()
    for i, split in enumerate(('train', 'val')):
        gen = torch.Generator().manual_seed(seed + 1000 * (rank + 1) + 1 + i)
        stats = torch.zeros(2, n_loop, device=device)  # CE per exit, ||h_k|| per loop
        for _ in range(eval_iters):
            X, Y = get_batch(split, gen)
            with ctx:
                ce, norms = raw_model.exit_losses(X, Y)
            stats += torch.stack([ce.float(), norms.float()])
        stats /= eval_iters
        if ddp:
            dist.all_reduce(stats)  # every rank's batches count, not only rank 0's
            stats /= world_size
        out[split + '_ce'], out[split + '_norm'] = stats.tolist()
    raw_model.train()
    return out

def get_lr(it):
    # 1) linear warmup for warmup_iters steps (paper 1: none)
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if lr_schedule == 'constant':  # paper 1's schedule
        return learning_rate
    # 2) cosine: past lr_decay_iters, min_lr; in between, cosine decay down to min_lr
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # coeff ranges 0..1
    return min_lr + coeff * (learning_rate - min_lr)

def mean_kappa():
    """kappa_R of the training loss on one fixed training batch, averaged over the shared matrices (§2)."""
    X, Y = get_batch('train', torch.Generator().manual_seed(seed + 1))
    raw_model.eval()
    with ctx:
        kappa = visit_alignment(raw_model, X, Y)['mean']
    raw_model.train()
    return kappa

def log_eval(it, losses, lr):
    """The eval block on stdout, one row of metrics.jsonl, and wandb if on (rank 0 only)."""
    row = lambda name, vals, fmt: f"  {name:<10}" + ''.join(format(v, fmt).rjust(11) for v in vals)
    print(f"step {it}: train loss {losses['train_ce'][-1]:.4f}, val loss {losses['val_ce'][-1]:.4f} "
          f"(final exit), lr {lr:.2e}")
    print(row('exit k', range(1, n_loop + 1), 'd'))
    print(row('train CE', losses['train_ce'], '.4f'))
    print(row('val CE', losses['val_ce'], '.4f'))
    print(row('||h_k||', losses['val_norm'], '.1f') + "   (mean per-token L2 norm, val, before readout)")
    kappa = mean_kappa() if log_kappa else None
    if kappa is not None:
        print(f"  kappa_R {kappa:9.3f}   (visit alignment in [0, R = {n_loop}], mean over the shared "
              f"matrices, one train batch)")
    metrics = {'iter': it, 'train_ce': losses['train_ce'], 'val_ce': losses['val_ce'],
               'norm': losses['val_norm'], 'train_norm': losses['train_norm'],
               'train_loss': losses['train_ce'][-1], 'val_loss': losses['val_ce'][-1], 'lr': lr,
               'tokens': it * tokens_per_iter, 'bad_steps': bad_total,
               'time': round(time.time() - t_start, 3), **({'kappa': kappa} if log_kappa else {})}
    if not eval_only:
        try:
            with open(metrics_path, 'a', encoding='utf-8') as f:
                f.write(json.dumps(metrics) + '\n')
        except OSError as e:  # a full disk: the row is in the log above; the checkpoint save decides the rest
            print(f"could not append to {metrics_path} ({first_line(e)})")
    if wandb_log:
        wandb.log({'iter': it, 'lr': lr, 'train/loss': metrics['train_loss'], 'val/loss': metrics['val_loss'],
                   **{f'val/ce_exit{k}': v for k, v in enumerate(losses['val_ce'], 1)},
                   **{f'norm/h{k}': v for k, v in enumerate(losses['val_norm'], 1)}})

def save_checkpoint(evaluated=True):
    """Rank 0 writes out_dir/ckpt.pt. Returns None, or, on every rank, the error (one line) if the write
    failed: a full disk or an unwritable out_dir leaves the previous checkpoint as it was."""
    global saved_iter
    # every rank's random streams go into the checkpoint, so each rank resumes exactly where it was
    rngs, data_rngs = gather(checkpoint.rng_state()), gather(train_gen.get_state())
    error = None
    if master_process:
        print(f"saving checkpoint to {ckpt_path}")
        try:
            checkpoint.save({
                'model': raw_model.state_dict(), 'model_args': asdict(raw_model.config),
                'optimizer': optimizer.state_dict(), 'scaler': scaler.state_dict(),
                'iter_num': iter_num, 'best_val_loss': best_val_loss, 'config': config, 'dataset': dataset,
                'meta': meta_id, 'rng': rngs, 'data_rng': data_rngs, 'depth_rng': depth_gen.get_state(),
                'world_size': world_size,
                'bad_steps': bad_total, 'evaluated': evaluated,
            }, ckpt_path)
        except OSError as e:  # checkpoint.save is atomic: the old file is untouched, the partial one removed
            error = first_line(e)
    error = from_rank0(error)
    if error is None:
        saved_iter = iter_num
    return error

def stop_all(msg):
    """Every rank stops here together, exit code 1; rank 0 says why in one line."""
    if master_process:
        die(msg)
    sys.exit(1)

def save_failed(error, stopping=None):
    """The policy for a checkpoint that could not be written (full disk, unwritable out_dir): one line with
    the path and the error; the previous checkpoint stays as it was. Training goes on and retries at the
    next eval (space is often freed meanwhile, and a run that stopped would lose the steps since the last
    save anyway); it stops, exit code 1, after max_failed_saves failures in a row, at the final save, or
    when it was stopping anyway (`stopping` says why)."""
    kept = f"{ckpt_path} still holds iter {saved_iter}" if saved_iter is not None else "no checkpoint yet"
    msg = f"iter {iter_num}: could not save {ckpt_path} ({error}); {kept}"
    if failed_saves >= max_failed_saves:
        stopping = f"{failed_saves} failed saves in a row (max_failed_saves={max_failed_saves})"
    elif iter_num >= max_iters:
        stopping = "this was the final save"
    if stopping:
        stop_all(f"{msg}; stopping: {stopping}; free space or fix out_dir, then rerun with --init_from=auto")
    if master_process:
        print(f"{msg}; training goes on and retries at the next eval ({failed_saves} of "
              f"max_failed_saves={max_failed_saves} in a row)")

def stop_at_signal():
    """All ranks agreed to stop after this step (a stop signal reached at least one of them): save where the
    run is, say how to continue, exit 0."""
    why = f"stopped by {stop_signal or 'a stop signal to another rank'} at iter {iter_num}"
    error = save_checkpoint(evaluated=False)
    if error:
        save_failed(error, stopping=why)
    if master_process:
        print(f"{why}: checkpoint {ckpt_path}; continue with the same command and --init_from=auto "
              f"(or resume)", flush=True)
    if ddp:
        # leave at once: the work is saved, and a gloo thread still winding down while the interpreter
        # shuts down can abort the process (exit -6), which a scheduler would read as a failure
        end_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    sys.exit(0)

def lost_a_rank(e):
    """Under DDP, a rank that died (or stalled past collective_timeout) shows up in the others' next
    collective as a RuntimeError from gloo or NCCL: each surviving rank stops with one line. Anything else
    is a bug to see in full, so it is raised again."""
    text = str(e).lower()
    if not (ddp and (isinstance(e, dist.DistError) or 'gloo' in text or 'nccl' in text)):
        raise e
    kept = f"{ckpt_path} (iter {saved_iter}) is intact" if saved_iter is not None else "no checkpoint yet"
    die(f"rank {rank}: a collective failed at iter {iter_num} ({first_line(e)}); another process died or "
        f"stalled (collective_timeout={collective_timeout}s); {kept}: rerun with --init_from=auto")

def eta(it):
    """Seconds to max_iters after step `it`: the steps left at the running step time (an exponential
    average that leaves evals out) plus the evals left at the last one's duration."""
    evals_left = max_iters // eval_interval - it // eval_interval + (max_iters % eval_interval != 0)
    return (max_iters - it - 1) * step_time + evals_left * eval_time

@torch.no_grad()
def nonfinite_report(X, Y):
    """Which exit's CE or which loop's state went non-finite on batch (X, Y), as one short phrase.
    exit_losses runs the same loop as the loss, so a NaN that starts at loop k shows up from exit k on."""
    with ctx:
        ce, norms = raw_model.exit_losses(X, Y)
    bad = lambda vals: ', '.join(str(k) for k, v in enumerate(vals.tolist(), start=1) if not math.isfinite(v))
    parts = [f"CE at exit {bad(ce)}"] * bool(bad(ce)) + [f"||h_k|| at loop {bad(norms)}"] * bool(bad(norms))
    if parts:
        return "non-finite " + " and ".join(parts)
    if norm_penalty > 0:  # every exit is finite but lambda * mean(h^2) can still overflow
        return "every exit CE and loop norm is finite: the norm penalty term or the backward pass overflowed"
    return "every exit CE and loop norm is finite on this batch: the backward pass (or another rank) broke"

def skip_bad_step(X, Y, lossf, grad_norm):
    """The update was skipped: say where the non-finite value came from, and stop if it keeps happening."""
    reports = gather(nonfinite_report(X, Y))
    if master_process:
        where = '; '.join(f"rank {r}: {s}" for r, s in enumerate(reports)) if ddp else reports[0]
        print(f"iter {iter_num}: non-finite loss ({lossf:.4g}) or grad norm ({grad_norm.item():.4g}), "
              f"update skipped ({bad_in_a_row} in a row, {bad_total} total); {where}")
    if bad_in_a_row >= max_bad_steps:
        die(f"stopping at iter {iter_num}: {bad_in_a_row} consecutive steps with a non-finite loss or "
            f"gradient (max_bad_steps={max_bad_steps}); {ckpt_path} holds the last good state: lower "
            f"learning_rate or check the data, then resume")

# metrics.jsonl: one JSON object per eval. A resumed run drops rows past the checkpoint's iteration (they
# came from work the checkpoint does not hold, and will be redone); a new run starts a new file.
metrics_path = os.path.join(out_dir, 'metrics.jsonl')
if master_process:
    rows = []
    try:  # an unwritable out_dir stops the run here, before any training
        os.makedirs(out_dir, exist_ok=True)
        if init_from == 'resume' and os.path.exists(metrics_path):
            with open(metrics_path, encoding='utf-8') as f:
                for line in f:
                    try:
                        if json.loads(line)['iter'] <= iter_num:
                            rows.append(line if line.endswith('\n') else line + '\n')
                    except (ValueError, KeyError, TypeError):
                        pass  # a line torn by a crash mid-write
        if not eval_only:
            with open(metrics_path + '.tmp', 'w', encoding='utf-8') as f:
                f.writelines(rows)
            os.replace(metrics_path + '.tmp', metrics_path)
    except OSError as e:
        die(f"cannot write to out_dir={out_dir!r}: {first_line(e)}")
    if wandb_log:
        try:
            import wandb
        except ImportError:
            die("wandb_log=True but wandb is not installed: pip install wandb")
        wandb.init(project=wandb_project, name=wandb_run_name, config=config)

# -----------------------------------------------------------------------------
# training loop

bad_in_a_row, failed_saves, stop = 0, 0, False
step_time = eval_time = 0.0  # seconds: running average of a training step, the last eval (for the ETA)
start_iter = iter_num
t_start = t0 = time.time()
try:  # under DDP, a collective that fails because another rank died ends up in lost_a_rank
    while True:

        # set the learning rate for this iteration
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group['lr'] = lr

        # evaluate, log and checkpoint (all ranks take part: the eval is averaged over them)
        if (iter_num % eval_interval == 0 or iter_num == max_iters) and iter_num != skip_eval_at:
            if not all(torch.isfinite(p).all() for p in raw_model.parameters()):
                # the guard below keeps non-finite updates out; if the weights broke anyway, keep the last one
                die(f"non-finite weights at iter {iter_num}: not saving; {ckpt_path} (last good checkpoint) "
                    f"is untouched")
            losses = estimate_loss()
            if master_process:
                log_eval(iter_num, losses, lr)
            val_loss = losses['val_ce'][-1]
            if iter_num > 0 and not eval_only and (val_loss < best_val_loss or always_save_checkpoint):
                best_val_loss = min(best_val_loss, val_loss)
                error = save_checkpoint()
                failed_saves = 0 if error is None else failed_saves + 1
                if error:
                    save_failed(error)
            eval_time, t0 = time.time() - t0, time.time()  # the step time below leaves the eval out
        if iter_num >= max_iters or eval_only:
            break

        # this step's loop count: n_loop, or a draw when loop_sampling is on (docs/papers.md §4)
        R = raw_model.draw_n_loop(depth_gen)
        # forward and backward over the micro-batches; the loss is divided by their number so the gradients
        # add up to the mean over micro-batches, and DDP averages over ranks: the mean over the global batch
        loss_sum = torch.zeros((), device=device)
        for micro_step in range(micro_steps):
            X, Y = get_batch('train', train_gen)
            # under DDP, all-reduce the gradients only on the last micro-step (the others just accumulate)
            with model.no_sync() if ddp and micro_step < micro_steps - 1 else nullcontext():
                with ctx:
                    _, loss = model(X, Y, n_loop=R)
                    loss = loss / micro_steps
                scaler.scale(loss).backward()
            loss_sum += loss.detach().float()
        scaler.unscale_(optimizer)  # no-op unless fp16: gradients back to their true scale before clipping
        grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), grad_clip or math.inf)

        # the non-finite guard and the stop signal: one small all-reduce (and one sync) per step. The summed
        # loss turns NaN if any rank's loss did, and the summed stop flag is nonzero if any rank got a stop
        # signal, so every rank takes the same decisions. Under fp16 an inf gradient with a finite loss is
        # the GradScaler's business (it skips the step and lowers the scale), not a bad step.
        # R and R^2 ride along: their sums equal world_size * R and world_size * R^2 only if every rank drew R
        flags = torch.cat([torch.stack([loss_sum, (~torch.isfinite(grad_norm)).float()]),
                           torch.tensor([float(stop_signal is not None), R, R * R], device=device)])
        if ddp:
            dist.all_reduce(flags)
        lossf, grad_bad, stop, r_sum, r2_sum = flags.tolist()
        assert (r_sum, r2_sum) == (world_size * R, world_size * R ** 2), f"ranks drew other R at {iter_num}"
        lossf /= world_size
        ok = math.isfinite(lossf) and (grad_bad == 0 or scaler.is_enabled())
        if ok:
            scaler.step(optimizer)  # optimizer.step() unless fp16
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        bad_in_a_row = 0 if ok else bad_in_a_row + 1
        if not ok:
            bad_total += 1
            skip_bad_step(X, Y, lossf, grad_norm)

        # timing and logging; the first step of a run (warm-up, compilation) does not count for the ETA
        t1 = time.time()
        dt, t0 = t1 - t0, t1
        step_time = dt if iter_num <= start_iter + 1 else 0.9 * step_time + 0.1 * dt
        if iter_num % log_interval == 0 and master_process:
            mfu = raw_model.estimate_mfu(micro_steps * batch_size, dt) if device_type == 'cuda' else None
            print(f"iter {iter_num}: loss {lossf:.4f}" + (f" (R {R})" if loop_sampling != 'fixed' else '')
                  + f", lr {lr:.2e}, time {dt * 1000:.1f}ms, "
                  f"{tokens_per_iter / dt / 1e3:.1f}k tok/s" + (f", mfu {mfu * 100:.1f}%" if mfu else '')
                  + f", ETA {duration(eta(iter_num))}")
        iter_num += 1
        if stop:
            break
    if stop:
        stop_at_signal()
except RuntimeError as e:
    lost_a_rank(e)

if master_process and not eval_only:
    print(f"done: {iter_num} iterations, {time.time() - t_start:.1f}s this run, {bad_total} skipped steps; "
          f"checkpoint {ckpt_path}, metrics {metrics_path}")
