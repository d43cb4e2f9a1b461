"""
Train a looped GPT on one CPU, one GPU, or several GPUs (or CPU processes) with DDP.

With no arguments it trains a small looped GPT on shakespeare_char in about five minutes on a
laptop CPU, in the setting where paper 1's readout blind spot appears (docs/papers.md §1): watch
||h_k|| grow in the eval blocks.

    python train.py                                            # the embedded default
    python train.py config/loop_raw.py --out_dir=out-raw       # one ablation arm
    python train.py config/paper_44m.py config/loop_raw.py     # a GPU preset, then an arm
    python train.py config/loop_raw.py --max_iters=500 --lr_schedule=cosine
    python train.py --init_from=resume --max_iters=6000        # continue out/ckpt.pt
    python train.py config/paper_44m.py --init_from=auto       # resume if out/ckpt.pt exists
    python train.py config/deeploop.py --print_config=True     # the resolved config, as JSON
    torchrun --standalone --nproc_per_node=4 train.py config/paper_44m.py    # DDP on 4 GPUs

Ctrl-C, SIGTERM or SIGUSR1 stops a run after the current step with a checkpoint (exit code 0);
the same command with --init_from=auto continues it bit for bit. run/ops.py holds the rest of what
keeps a long run alive: the devices and processes, failed saves, non-finite steps, a dead rank.
"""

import atexit
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import configurator
from model import GPT, GPTConfig
import prepare
from run import checkpoint
from run import ops

# -----------------------------------------------------------------------------
# default config values: a small looped GPT on shakespeare_char, per-loop CE + RMSNorm readout
# (§1). The model's keys are the fields of model.GPTConfig (n_layer, n_loop, readout, ...): their
# defaults, allowed values and meanings are there, in one place.
# I/O
out_dir = 'out'                  # ckpt.pt and metrics.jsonl go here
eval_interval = 250              # evaluate (and checkpoint) every this many iterations
log_interval = 50                # print the training loss every this many iterations
eval_iters = 10                  # batches per split per eval (the same batches every time)
eval_only = False                # evaluate once and exit
log_kappa = False                # also log kappa_R (docs/papers.md §2), one more backward pass
always_save_checkpoint = True    # save at every eval, not only when the val loss improves
init_from = 'scratch'            # scratch | resume | auto (resume if out_dir has one) | gpt2* | a folder
print_config = False             # print the resolved config as JSON and exit (lab/ablate.py reads it)
# wandb logging
wandb_log = False                # wandb is imported only when this is on
wandb_project = 'nanoloop'       # the wandb project
wandb_run_name = 'run'           # the wandb run's name
# data
dataset = 'shakespeare_char'     # data/<dataset>/, written by python prepare.py <dataset>
gradient_accumulation_steps = 1  # micro-batches per optimizer step, shared out over the DDP ranks
batch_size = 8                   # sequences per micro-batch
# AdamW optimizer
learning_rate = 1e-3             # max learning rate (paper 1: 3e-4, slow for a 5-minute run)
max_iters = 2000                 # total number of training iterations
weight_decay = 0.01              # AdamW's decoupled weight decay, on matrices and embeddings
beta1 = 0.9                      # AdamW's first-moment decay
beta2 = 0.99                     # AdamW's second-moment decay
grad_clip = 1.0                  # clip gradients at this norm; 0 = no clipping
# learning rate schedule (paper 1 trains at a constant LR with no warmup)
lr_schedule = 'constant'         # constant | cosine (linear warmup, then cosine decay to min_lr)
warmup_iters = 0                 # linear warmup steps (both schedules)
lr_decay_iters = 2000            # cosine: reaches min_lr here, ~= max_iters per Chinchilla
min_lr = 1e-4                    # cosine: final learning rate, ~= learning_rate/10 per Chinchilla
# reliability
max_bad_steps = 10               # stop after this many non-finite steps in a row (each is skipped)
max_failed_saves = 3             # stop after this many failed saves in a row (each is retried)
collective_timeout = 600         # DDP: seconds to wait for a dead or stalled rank (> one save)
# system
device = 'auto'                  # auto (cuda, then mps, then cpu) | cpu | cuda | cuda:N | mps
dtype = 'auto'                   # float32 | bfloat16 | float16 | auto: bf16 where the chip has it,
                                 # else fp16 on CUDA and fp32 elsewhere (hardware.auto_dtype)
compile = False                  # torch.compile the model (PyTorch 2.0+; worth it on GPUs)
seed = 1337                      # weights, dropout, data order and sampled depths follow from it
loop_schedule = 0.0              # the mean loop count ramps 1 -> n_loop over this share of max_iters
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, str))]
defaults = {**{k: globals()[k] for k in config_keys}, **asdict(GPTConfig())}  # + the model's keys
config, explicit = configurator.configure(defaults, sys.argv[1:])  # config files, --key=value; --help
config, ckpt, notes = checkpoint.resume(config, explicit)  # a resumed run: its saved config underneath
configurator.check(config)  # every key's range, and the combinations model.py builds
if config['print_config']:
    print(json.dumps(config))
    sys.exit(0)
globals().update({k: config[k] for k in config_keys})  # the training keys, as nanoGPT does
model_args = {k: config[k] for k in configurator.model_keys()}  # the model keys, for GPTConfig
ckpt_path = os.path.join(out_dir, 'ckpt.pt')
# -----------------------------------------------------------------------------
# processes and devices
# torchrun's environment -> DDP over NCCL (GPUs) or gloo (CPUs); this rank's device and threads
ddp, rank, local_rank, world_size, device, device_type = ops.init_processes(device, collective_timeout)
master_process = rank == 0  # this process logs and writes checkpoints

def shutdown():
    # on every way out: drop the DDP wrapper (it holds the process group), then end the group
    globals().pop('model', None)
    ops.end_process_group()
atexit.register(shutdown)  # before the interpreter shuts down
stop_signals = ops.StopSignals()  # from here on, Ctrl-C stops the run after a step, with a save

# nanoGPT's convention: gradient_accumulation_steps counts the micro-batches of one optimizer step over
# all ranks, so the global batch does not depend on the process count; each rank runs its share
micro_steps = math.ceil(gradient_accumulation_steps / world_size)  # per rank and step
block_size = model_args['block_size']  # the context length T, as the model sees it
tokens_per_iter = micro_steps * world_size * batch_size * block_size
dtype, dtype_note = ops.resolve_dtype(dtype, device_type)  # 'auto' -> what this chip runs fast
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
if device_type == 'cuda' and dtype != 'float32':  # tf32 matmuls, unless float32 was asked for
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
# the forward pass runs under autocast in bf16/fp16; weights, optimizer and loss stay float32
ctx = nullcontext() if dtype == 'float32' else torch.autocast(device_type=device_type, dtype=ptdtype)
# fp16 needs loss scaling to keep small gradients from flushing to zero; bf16 has float32's range
scaler = torch.amp.GradScaler(device_type, enabled=(dtype == 'float16'))
torch.manual_seed(seed + rank)  # dropout differs between ranks; DDP broadcasts rank 0's weights
data_seed = seed + 1000 * (rank + 1)  # this rank's training batches (its eval batches: estimate_loss)
if master_process:
    threads = f", {torch.get_num_threads()} threads" if device_type == 'cpu' else ''
    print(f"device: {device}{threads}, {dtype}{dtype_note}, {world_size} process(es); "
          f"tokens per iteration: {tokens_per_iter:,} ({micro_steps * world_size} x {batch_size} x "
          f"{block_size})")
    if micro_steps * world_size != gradient_accumulation_steps:
        print(f"gradient_accumulation_steps={gradient_accumulation_steps} rounded up to "
              f"{micro_steps * world_size}: {micro_steps} per process on {world_size} processes")
    for note in notes:
        print(note)

# -----------------------------------------------------------------------------
# data
data_dir = os.path.join('data', dataset)
if master_process and dataset in prepare.TEXT_DATASETS and not os.path.exists(f'{data_dir}/meta.json'):
    print(f"{data_dir} not found: preparing it (python prepare.py {dataset})")
    prepare.prepare(dataset)  # downloads tinyshakespeare once; offline, it says what to run instead
if ddp:
    dist.barrier()  # the other ranks wait for it (torchrun ends them if it fails)
meta = prepare.open_data(data_dir, block_size)  # checks the files, the token ids and the split sizes
meta_id = {k: meta.get(k) for k in ('tokenizer', 'vocab_size', 'itos')}  # what the tokens mean
if ckpt is not None:
    checkpoint.check_tokens(ckpt, meta_id, ckpt_path, data_dir)  # a resume keeps its tokens
model_args['vocab_size'] = configurator.vocab_size(config, explicit, meta, data_dir)
token_dtype = np.dtype(meta['dtype'])

def get_batch(split, generator):
    """(X, Y) of shape (B, T): random windows of the split, and the same windows one token later.
    The offsets come from `generator`, private to this data stream, so that the data order depends
    on nothing else that draws random numbers and its state can go into the checkpoint."""
    # a fresh memmap per batch, as nanoGPT does: a long-lived one keeps growing the process's memory
    data = np.memmap(os.path.join(data_dir, f'{split}.bin'), dtype=token_dtype, mode='r')
    ix = torch.randint(len(data) - block_size, (batch_size,), generator=generator).tolist()
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    if device_type == 'cuda':
        # pinned memory lets the copy to the GPU run asynchronously (non_blocking)
        x, y = x.pin_memory(), y.pin_memory()
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    return x.to(device), y.to(device)

checkpoint.refuse_overwrite(ckpt_path, init_from, eval_only)  # a forgotten --init_from=resume
# -----------------------------------------------------------------------------
# model, optimizer, and the state a resumed run continues from
model = GPT(GPTConfig(**model_args))
if ckpt is not None:  # this run's own, or a trained model's layers to loop (init_from, run/retrofit.py)
    checkpoint.load_weights(model, ckpt.pop('model'), ckpt_path)
model.to(device)
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
if master_process:  # once, not once per rank
    print(f"number of parameters: {model.get_num_params() / 1e6:.2f}M (K={model.config.n_layer} layers "
          f"looped R={model.config.n_loop} times, N={model.config.n_unrolled} unrolled)")
iter_num, best_val_loss, bad_total = 0, float('inf'), 0
evaluated_at = None  # the iteration a resumed checkpoint was evaluated and logged at: not again
train_gen = torch.Generator().manual_seed(data_seed)  # this rank's training batches
depth_gen = torch.Generator().manual_seed(seed)  # loop counts: the same stream on every rank
if init_from == 'resume':
    iter_num, best_val_loss, bad_total, evaluated_at = checkpoint.restore(
        ckpt, ckpt_path, optimizer, scaler, rank, world_size, train_gen, depth_gen, eval_only)
    del ckpt  # free the memory
raw_model = model  # the plain GPT: its state_dict has no '_orig_mod.' / 'module.' prefixes
if compile:
    if master_process:
        print("compiling the model... (takes a ~minute)")
    # static shapes: the python loop unrolls, so each loop count drawn is a graph of its own (at most
    # max_loop of them: dynamo keeps that many instead of falling back to eager after its default 8)
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = max(limit, raw_model.config.loop_cap + 1)
    model = torch.compile(model, dynamic=False)
if ddp:
    model = DDP(model, device_ids=[local_rank] if device_type == 'cuda' else None)

saved_iter = iter_num if init_from == 'resume' else None  # what out_dir/ckpt.pt holds
saver = ops.Saver(ckpt_path, max_iters, max_failed_saves, saved_iter)
bad_steps = ops.BadSteps(raw_model, ctx, max_bad_steps, ckpt_path, bad_total)  # non-finite steps
if master_process:  # out_dir/metrics.jsonl, and wandb if on
    wandb_init = dict(project=wandb_project, name=wandb_run_name, config=config) if wandb_log else None
    metrics = ops.Metrics(out_dir, saved_iter, not eval_only, wandb_init)
eta = ops.ETA(iter_num, max_iters, eval_interval)  # the time left, for the progress line
t_start = time.time()  # the metrics' 'time': seconds since training began

@torch.no_grad()
def estimate_loss():
    """CE at every exit and mean ||h_k|| per loop on eval_iters batches of each split, averaged
    over the ranks. Each rank's batches come from a generator seeded alike at every eval and for every
    seed (one fixed validation set for all arms and seeds); training's data stream is left alone."""
    out = {}
    raw_model.eval()
    for i, split in enumerate(('train', 'val')):
        gen = torch.Generator().manual_seed(1000 * (rank + 1) + 1 + i)  # not `seed`'s
        stats = torch.zeros(2, raw_model.config.n_loop, device=device)  # CE, ||h_k|| per loop
        moe = torch.zeros(2, device=device)  # Looped-MoE's balance and z-loss terms (§5), if any
        for _ in range(eval_iters):
            X, Y = get_batch(split, gen)
            with ctx:
                ce, norms, router = raw_model.exit_metrics(X, Y)
                if router is not None:  # the experts' balance and z-loss in that pass
                    moe += router.float()
            stats += torch.stack([ce.float(), norms.float()])
        stats, moe = stats / eval_iters, moe / eval_iters
        if ddp:  # every rank's batches count, not only rank 0's
            for t in (stats, moe):
                dist.all_reduce(t)
                t /= world_size
        out[split + '_ce'], out[split + '_norm'] = stats.tolist()
        out[split + '_moe'] = moe.tolist()
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

def log_eval(it, losses, lr):
    """The eval block on stdout, one row of metrics.jsonl, and wandb if on (rank 0 only)."""
    R = raw_model.config.n_loop
    line = lambda name, vals, fmt: f"  {name:<10}" + ''.join(format(v, fmt).rjust(11) for v in vals)
    print(f"step {it}: train loss {losses['train_ce'][-1]:.4f}, val loss {losses['val_ce'][-1]:.4f} "
          f"(final exit), lr {lr:.2e}")
    print(line('exit k', range(1, R + 1), 'd'))
    print(line('train CE', losses['train_ce'], '.4f'))
    print(line('val CE', losses['val_ce'], '.4f'))
    print(line('||h_k||', losses['val_norm'], '.1f') + "   (mean per-token L2 norm, val, before readout)")
    row = dict(iter=it, train_ce=losses['train_ce'], val_ce=losses['val_ce'], norm=losses['val_norm'],
               train_norm=losses['train_norm'], train_loss=losses['train_ce'][-1],
               val_loss=losses['val_ce'][-1], lr=lr, tokens=it * tokens_per_iter,
               bad_steps=bad_steps.total, time=round(time.time() - t_start, 3))
    if raw_model.config.n_expert:
        row['moe_balance'], row['moe_z'] = losses['val_moe']
        print(f"  MoE        balance {row['moe_balance']:.4f}, z-loss {row['moe_z']:.3f}   (val, mean over "
              f"layers and visits; balance 1 = uniform load)")
    if log_kappa:  # kappa_R of the loss on one fixed training batch, mean over the shared matrices
        X, Y = get_batch('train', torch.Generator().manual_seed(seed + 1))
        row['kappa'] = ops.mean_kappa(raw_model, X, Y, ctx)
        print(f"  kappa_R {row['kappa']:9.3f}   (visit alignment in [0, R = {R}], mean over the shared "
              f"matrices, one train batch)")
    metrics.log(row)

def checkpoint_state(evaluated=True):
    """What out_dir/ckpt.pt holds, on rank 0 (None elsewhere). Every rank's random streams go
    in, so that each rank resumes exactly where it was."""
    rngs, data_rngs = ops.gather(checkpoint.rng_state()), ops.gather(train_gen.get_state())
    if not master_process:
        return None
    return {'model': raw_model.state_dict(), 'model_args': asdict(raw_model.config),
            'optimizer': optimizer.state_dict(), 'scaler': scaler.state_dict(),
            'iter_num': iter_num, 'best_val_loss': best_val_loss, 'config': config, 'dataset': dataset,
            'meta': meta_id, 'rng': rngs, 'data_rng': data_rngs, 'depth_rng': depth_gen.get_state(),
            'world_size': world_size, 'bad_steps': bad_steps.total, 'evaluated': evaluated}

# -----------------------------------------------------------------------------
# training loop

t0 = time.time()
try:  # under DDP, a collective that fails because another rank died ends up in lost_a_rank
    while True:

        # set the learning rate for this iteration
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group['lr'] = lr

        # evaluate, log and checkpoint (all ranks take part: the eval is averaged over them)
        if (iter_num % eval_interval == 0 or iter_num == max_iters) and iter_num != evaluated_at:
            bad_steps.check_weights(iter_num)  # broken weights are never saved
            losses = estimate_loss()
            if master_process:
                log_eval(iter_num, losses, lr)
            val_loss = losses['val_ce'][-1]
            saving = not eval_only and (val_loss < best_val_loss or always_save_checkpoint)
            if saving and (iter_num > 0 or max_iters == 0):  # max_iters=0: init_from's conversion, saved
                best_val_loss = min(best_val_loss, val_loss)
                saver.save(checkpoint_state(), iter_num)  # a failed write is retried next time
            eta.eval_time, t0 = time.time() - t0, time.time()  # the step time leaves the eval out
        if iter_num >= max_iters or eval_only:
            break

        # this step's loop count: n_loop, or a draw (loop_sampling, docs/papers.md §4); loop_schedule (§6)
        R = ops.loop_count(raw_model.config, depth_gen, iter_num, loop_schedule * max_iters)
        # forward and backward over the micro-batches; the loss is divided by their number so that
        # the gradients add up to their mean, and DDP averages over ranks: the global batch's mean
        loss_sum = torch.zeros((), device=device)
        for micro_step in range(micro_steps):
            X, Y = get_batch('train', train_gen)
            # under DDP, all-reduce the gradients only on the last micro-step (the others accumulate)
            with model.no_sync() if ddp and micro_step < micro_steps - 1 else nullcontext():
                with ctx:
                    logits, loss = model(X, Y, n_loop=R)
                    loss = loss / micro_steps
                scaler.scale(loss).backward()
            loss_sum += loss.detach().float()
        scaler.unscale_(optimizer)  # fp16 only: the gradients' true scale, before clipping
        grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), grad_clip or math.inf)

        # every rank takes the same decisions: a NaN loss or gradient on any rank skips the update
        # everywhere, and a stop signal to any rank stops them all after this step
        agreed = ops.agree(loss_sum, grad_norm, stop_signals.name is not None, R)
        # under fp16 an inf gradient with a finite loss is the GradScaler's business (it skips the
        # step and lowers the scale), not a bad step
        ok = math.isfinite(agreed.loss) and (not agreed.grad_bad or scaler.is_enabled())
        if ok:
            scaler.step(optimizer)  # optimizer.step() unless fp16
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        bad_steps.count(ok, iter_num, agreed.loss, grad_norm, X, Y)  # says why; stops if it repeats

        # timing and logging; the ETA leaves out the run's first step (warm-up, compilation)
        dt, t0 = time.time() - t0, time.time()
        eta.step(iter_num, dt)
        if iter_num % log_interval == 0 and master_process:
            mfu = ops.mfu(raw_model, micro_steps * batch_size, dt, device_type)
            drawn = f" (R {R})" if raw_model.config.loop_sampling != 'fixed' else ''
            print(f"iter {iter_num}: loss {agreed.loss:.4f}{drawn}, lr {lr:.2e}, time {dt * 1000:.1f}ms, "
                  f"{tokens_per_iter / dt / 1e3:.1f}k tok/s" + (f", mfu {mfu * 100:.1f}%" if mfu else '')
                  + f", ETA {eta.text(iter_num)}")
        iter_num += 1
        if agreed.stop:  # save where the run is and exit 0
            ops.stop_at_signal(saver, checkpoint_state(evaluated=False), iter_num, stop_signals.name,
                               shutdown)
except RuntimeError as e:
    ops.lost_a_rank(e, iter_num, saver, collective_timeout)

if master_process and not eval_only:
    print(f"done: {iter_num} iterations, {time.time() - t_start:.1f}s this run, "
          f"{bad_steps.total} skipped steps; checkpoint {ckpt_path}, metrics {metrics.path}")
