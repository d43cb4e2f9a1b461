"""
Is looping free? Measure it, side by side in one run, and print one table of ratios (as nanoGPT's bench.py,
but every number here is a ratio of two things timed in the same process, interleaved, medians over repeats,
warm-up excluded).

    python lab/bench.py                               # CPU: 6.5 min on a busy 2-core CPU + 3 for row 17
    python lab/bench.py --only=untied_vs_looped,peak_memory,step_time,vs_plain   # quick: rows 1-3 and 8
    python lab/bench.py --size=tiny                   # seconds: every row at toy sizes (what the tests run)
    python lab/bench.py --compile                     # also time torch.compile (minutes on a CPU)
    python lab/bench.py --threads=1 --timer=process   # on a busy machine: CPU seconds, not wall time
    python lab/bench.py --device=cuda --out=bench_cuda.json   # GPU sizes (bf16 autocast)
    python lab/bench.py --only=vs_plain,bf16,mfu_dtype  # some rows only (names: see MEASUREMENTS)
    python lab/bench.py --size=cpu_large --only=past_block,speculative  # rows 15-16, larger: minutes
    python lab/bench.py --only=moe --threads=1 --timer=process  # row 17, Looped-MoE: 3 min on a busy CPU
    python lab/bench.py --only=depth_batching --threads=1 --timer=process  # row 18: about a minute

Rows and their targets:
  1 train tok/s   K layers x R loops vs an untied stack of K*R layers, same width, terminal loss   >= 0.97
  2 peak memory   one training step, per-loop vs terminal loss, GPT-2 vocabulary, R = 4          <= 1.25
  3 step time     per-loop vs terminal at that vocabulary                   <= 1 + (R-1) * head share
  4 decoding      tok/s with the KV cache vs without, 512 new tokens, fixed exit                  >= 5x
  5 early exit    adaptive-exit decoding: tok/s and mean loops per token vs fixed R              report
  6 compile       torch.compile vs eager training step; graph breaks of the looped forward       0 breaks
                  (CPU: also train.py's default run per dtype: compile seconds and when it pays)
  7 MFU           model flops / s of the looped step against the matmul ceiling of its dtype (best of
                  several sizes and repeats, measured here; CUDA: also hardware.peak_flops of the device)
  8 vs plain      train.py's default model, nanoloop vs PlainLoopedGPT (the same model written plainly:
                  explicit attention, full-logit CE per exit), tok/s at fp32 and at bf16 autocast    >= 1.2
  9 bf16          nanoloop's bf16-autocast step vs its fp32 step (>= 1.7 where the CPU has bf16 units)
 10 MFU by dtype  the default model's step against the ceiling of the dtype it runs in              >= 60%
 11 attention     the default model's step with every attention path, per dtype: is 'auto' the fastest?
 12 profile       where the default step goes, per dtype: torch.profiler's self CPU time by op     report
 13 policies      adaptive / fixed decode tok/s per kv_policy, d 128 and d 512, batch 1 and 8
                  >= 0.8 x (R / loops) at d >= 512 batch 8, 0.9 x for copy/shared at batch 1, 1.0x at d 128
 14 cache memory  the KV cache's bytes per kv_policy at R = 4, 8, 16     shared: independent of R
 15 past block    per-token time past the block size / inside it, 4 x block_size new tokens       <= 1.5
 16 speculative   self-speculative / fixed-R decode tok/s and acceptance, drafts from loops 1..R-1  report
                  (>= 1.0 where the weights exceed the CPU's cache: --size=cpu_large --only=speculative)
 17 Looped-MoE    the default run with E = 8 experts, top 2 (active width = dense) vs dense: train step
                  time per dtype <= 1.5x, peak step memory <= 1.3x; the per-expert loop (kernels.moe_loop)
                  beside the grouped dispatch (kernels.moe); decode tok/s with the cache; FLOPs/token, MFU
 18 depth batch   continuous depth batching (batching.serve) and today's batched adaptive decoding vs
                  fixed R, 4B prompts at batch B = 1, 8, 32, d 128 and d 512: tok/s against R / loops
                  >= 0.9 x (R / loops) for depth batching at d >= 512, batch >= 8
Each row is announced with the time so far and an ETA. On a CPU without bf16 units (hardware.cpu_bf16_units)
bf16 is emulated, ~60x slower than fp32, so rows 6 and 8-12 run in fp32 only and row 9 is skipped (--bf16
and the tiny size time bf16 anyway, marked as emulated; --no-bf16 leaves it out anywhere).
A "training step" in rows 1-7 is forward + backward (the optimizer update is left out: it is per parameter,
and a looped model has R times fewer parameters, which would flatter row 1); rows 8-12 time train.py's step
as it runs (forward, backward, AdamW), and so does row 17's.
"""

import argparse
import contextlib
import datetime
import gc
import io
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the core is one folder up
from configurator import Parser, die
from run.ops import duration
from compute.hardware import attention_path, auto_dtype, cpu_bf16_units, flush_denormals, peak_flops
from decoding import batching
from decoding.engine import Decoding, KVCache, generate
from decoding.exits import KV_POLICIES, exit_score
from compute import kernels
from compute.kernels import LinearCrossEntropy
from run.accounting import active_params, flops_per_token
from model import GPT, GPTConfig

# row 17 on a GPU: config/looped_moe_gpt2s.py's dense shape (the row adds its experts)
GPT2S_MOE = dict(n_embd=768, n_head=12, n_layer=8, n_loop=2, vocab_size=50304, pos='rope', mlp='swiglu')
# sizes: 'cpu' runs in a few minutes on a laptop-class CPU, 'tiny' in seconds (tests), 'gpu' for one GPU
SIZES = {
    'tiny': dict(
        speed=dict(n_embd=32, n_head=2, n_layer=2, n_loop=2, batch_size=2, block_size=32, vocab_size=65),
        head=dict(n_embd=32, n_head=2, n_layer=1, n_loop=4, batch_size=2, block_size=32, vocab_size=50257),
        decode=dict(n_embd=32, n_head=2, n_layer=1, n_loop=3, prompt=8, new_tokens=24, vocab_size=512),
        default=dict(n_embd=32, n_head=2, n_layer=2, n_loop=2, batch_size=2, block_size=32, vocab_size=65),
        matmul=(128, 256), repeats=3, warmup=1, decode_repeats=1, block_steps=1,
        policies=dict(widths=(32,), head_size=16, n_layer=1, n_loop=3, batches=(1, 2), prompt=4, new_tokens=6,
                      vocab_size=64),
        past_block=dict(n_embd=32, n_head=2, n_layer=1, n_loop=2, block_size=16, prompt=4, vocab_size=64),
        speculative=dict(widths=(32,), head_size=16, n_layer=1, n_loop=3, gamma=3, prompt=4, new_tokens=8,
                         vocab_size=64),
        depth=dict(widths=(32,), head_size=16, n_layer=1, n_loop=3, batches={1: (4, 1), 2: (4, 1)}, prompt=4,
                   vocab_size=64)),
    'cpu': dict(
        speed=dict(n_embd=192, n_head=4, n_layer=2, n_loop=4, batch_size=4, block_size=256, vocab_size=65),
        head=dict(n_embd=128, n_head=4, n_layer=2, n_loop=4, batch_size=2, block_size=256, vocab_size=50257),
        # decoding: train.py's default model (shakespeare_char). At GPT-2's vocabulary a d=128 model's head is
        # 3x its layers, and both modes spend most of a token in the head (3.6x measured on 2026-11-30)
        decode=dict(n_embd=128, n_head=4, n_layer=2, n_loop=4, prompt=16, new_tokens=512, vocab_size=65),
        # rows 8-12: train.py's default run (GPTConfig() and its batch of 8 x 64), timed in blocks of steps
        default=dict(n_embd=128, n_head=4, n_layer=2, n_loop=4, batch_size=8, block_size=64, vocab_size=65),
        matmul=(512, 1024, 2048), repeats=7, warmup=2, decode_repeats=2, block_steps=5,
        # rows 13-16: K 2, R 4 decoding; timings are short generations, medians of 3 after 1 warm-up
        # (row 13 at 12 new tokens: its 24 generations, 'active' at batch 8 one row at a time, take ~40 s)
        policies=dict(widths=(128, 512), head_size=64, n_layer=2, n_loop=4, batches=(1, 8), prompt=16,
                      new_tokens=12, vocab_size=65),
        past_block=dict(n_embd=128, n_head=4, n_layer=2, n_loop=4, block_size=64, prompt=16, vocab_size=65),
        speculative=dict(widths=(512,), head_size=64, n_layer=2, n_loop=4, gamma=4, prompt=16, new_tokens=16,
                         vocab_size=65),
        # row 18: batch B -> (new tokens per prompt, timed repeats), 4B prompts each. ~50 s in all: at batch
        # 32, the 128 prompts' passes (~4 ms a prompt at d 512) take a large part of a call
        depth=dict(widths=(128, 512), head_size=64, n_layer=2, n_loop=4,
                   batches={1: (12, 2), 8: (12, 3), 32: (8, 1)}, prompt=4, vocab_size=65)),
    'gpu': dict(
        speed=dict(n_embd=768, n_head=12, n_layer=4, n_loop=3, batch_size=8, block_size=1024,
                   vocab_size=50304),
        head=dict(n_embd=768, n_head=12, n_layer=2, n_loop=4, batch_size=8, block_size=1024,
                  vocab_size=50257),
        decode=dict(n_embd=768, n_head=12, n_layer=4, n_loop=3, prompt=16, new_tokens=512, vocab_size=50257),
        default=dict(n_embd=512, n_head=8, n_layer=8, n_loop=4, batch_size=16, block_size=256,
                     vocab_size=50257),  # paper_44m's model at a quarter of its batch
        matmul=(4096, 8192), repeats=10, warmup=3, decode_repeats=3, block_steps=3,
        policies=dict(widths=(128, 768), head_size=64, n_layer=2, n_loop=4, batches=(1, 8), prompt=16,
                      new_tokens=64, vocab_size=50257),
        past_block=dict(n_embd=768, n_head=12, n_layer=2, n_loop=4, block_size=256, prompt=16,
                        vocab_size=50257),
        speculative=dict(widths=(768,), head_size=64, n_layer=2, n_loop=4, gamma=4, prompt=16, new_tokens=64,
                         vocab_size=50257),
        # row 17: config/looped_moe_gpt2s.py's model (the row adds the experts) at its micro-batch; decoding
        moe=dict(GPT2S_MOE, batch_size=12, block_size=1024),
        moe_decode=dict(GPT2S_MOE, prompt=16, new_tokens=64),
        # row 18 (lab/gpu_check.sh's depth step, ~2 min): V 65 as on the CPU, since at GPT-2's vocabulary the
        # head every exit reads is 4x the K layers at d 512, and the row is about the batching
        depth=dict(widths=(512, 2048), head_size=64, n_layer=2, n_loop=4, batches={8: (24, 3), 32: (24, 3)},
                   prompt=4, vocab_size=65)),
}
# the cpu size with the long rows at full length: d 512 past a block of 256 (the width and block where
# cropping at every step cost 9.7x), and speculative decoding at d 2048 too, whose 513 MiB of fp32 weights
# exceed a 300 MiB L3 (d 1536's 288 MiB do not)
SIZES['cpu_large'] = dict(
    SIZES['cpu'],
    past_block=dict(n_embd=512, n_head=8, n_layer=2, n_loop=4, block_size=256, prompt=16, vocab_size=65),
    speculative=dict(SIZES['cpu']['speculative'], widths=(512, 2048)))

DTYPES = ('float32', 'bfloat16')  # what rows 6 and 8-12 time, where the machine runs bf16 usefully
SHORT = {'float32': 'fp32', 'bfloat16': 'bf16'}


@dataclass
class Run:
    """What every row is measured with, and what a row hands on to later rows."""
    size: dict                # one entry of SIZES
    device: torch.device
    warmup: int               # untimed calls before the timed ones
    repeats: int              # timed calls per measurement
    compile: bool             # row 6: time torch.compile (the graph-break count runs either way)
    dtypes: tuple = DTYPES    # rows 6 and 8-12: fp32 only on a CPU without bf16 units (see bf16_plan)
    bf16_note: str = None     # why bf16 is left out, or that it is emulated (the table says it)
    looped: GPT = None        # row 1's looped model, its batch and its step time: re-used by rows 6 and 7
    batch: tuple = None
    looped_s: float = None
    compiled_s: float = None  # row 6's compiled step time, for row 7 (None when not compiled)
    ceilings: dict = None     # matmul ceiling per dtype, measured once (rows 7 and 10)
    default_s: dict = None    # row 8's nanoloop step seconds per dtype, for rows 9 and 10
    default_compiled_s: dict = None  # row 6's compiled step seconds of the default run per dtype (CPU)


# -----------------------------------------------------------------------------
# helpers

def build(device, **kw):
    # a quiet GPT (GPT.__init__ prints its parameter count); keys that are not GPTConfig's are left out
    with contextlib.redirect_stdout(io.StringIO()):
        model = GPT(GPTConfig(**{k: v for k, v in kw.items() if k in GPTConfig.__dataclass_fields__}))
    return model.to(device)


def batch(spec, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, T, V = spec['batch_size'], spec['block_size'], spec['vocab_size']
    X = torch.randint(V, (B, T), generator=g)
    Y = torch.randint(V, (B, T), generator=g)
    return X.to(device), Y.to(device)


def random_tokens(vocab_size, T, seed, device):
    """One row (1, T) of random token ids."""
    return torch.randint(vocab_size, (1, T), generator=torch.Generator().manual_seed(seed)).to(device)


def sync(device):
    if device.type == 'cuda':
        torch.cuda.synchronize()


def autocast(device, dtype=None):
    # dtype None: bf16 autocast on CUDA as train.py does, plain float32 on CPU; else 'float32' | 'bfloat16'
    dtype = dtype or ('bfloat16' if device.type == 'cuda' else 'float32')
    if dtype == 'float32':
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def train_step(model, X, Y, device, loss_fn=None):
    """One forward + backward (what every training step costs; the optimizer update is left out).
    loss_fn(model, X, Y) replaces the model's own loss."""
    def step():
        with autocast(device):
            loss = model(X, Y)[1] if loss_fn is None else loss_fn(model, X, Y)
        loss.backward()
        model.zero_grad(set_to_none=True)
    return step


CLOCK = time.perf_counter  # --timer=process swaps in time.process_time (CPU seconds of this process)
SAMPLES = {}               # every timed sample, by measurement name (they go into the JSON)


def side_by_side(fns, device, warmup, repeats):
    """Median seconds of each fn in fns (a dict), timed interleaved: A B C, C B A, ... so that drift in the
    machine's load falls on all of them alike. Warm-up calls are not timed."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times = {name: [] for name in names}
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            sync(device)
            t0 = CLOCK()
            fns[name]()
            sync(device)
            times[name].append(CLOCK() - t0)
    SAMPLES.update({name: [round(t, 6) for t in ts] for name, ts in times.items()})
    return {name: statistics.median(t) for name, t in times.items()}


def cpu_name():
    try:
        with open('/proc/cpuinfo') as cpuinfo:
            return next(line.split(':', 1)[1].strip() for line in cpuinfo if line.startswith('model name'))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def machine(device):
    info = dict(torch=torch.__version__, python=platform.python_version(),
                date=datetime.datetime.now().strftime('%Y-%m-%d %H:%M'), device=device.type)
    info.update(cpu=cpu_name(), cpu_threads=torch.get_num_threads(), cpu_cores=os.cpu_count(),
                cpu_bf16=cpu_bf16_units(), load=os.getloadavg() if hasattr(os, 'getloadavg') else None)
    if device.type == 'cuda':
        info.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    return info


def where(m):
    """The machine of a result, in a few words: the GPU, or the CPU and its threads."""
    if m['device'] == 'cuda':
        return f"gpu: {m['gpu']}, cuda {m['cuda']}"
    load = f", load {m['load'][0]:.2f}" if m.get('load') else ''
    return f"cpu: {m['cpu']} ({m.get('cpu_bf16') or 'no bf16 units'}), {m['cpu_threads']} threads{load}"


def matmul_ceiling(device, n, warmup, repeats, dtype=None):
    """FLOP/s of an n x n matmul at its best of `repeats` (random data, not zeros); dtype: fp32 on CPU and
    bf16 on CUDA unless given. The best, not the median: a ceiling taken on a busy machine must not sink."""
    dtype = dtype or (torch.bfloat16 if device.type == 'cuda' else torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(warmup):
        a @ b
    best = math.inf
    for _ in range(repeats):
        sync(device)
        t0 = CLOCK()
        a @ b
        sync(device)
        best = min(best, CLOCK() - t0)
    return 2 * n ** 3 / best


def ceilings(run):
    """The matmul ceiling of each dtype: the best FLOP/s over the size's matmul sizes and repeats."""
    if run.ceilings is None:
        run.ceilings = {}
        for name in run.dtypes:
            by_size = {n: matmul_ceiling(run.device, n, run.warmup, run.repeats, getattr(torch, name))
                       for n in run.size['matmul']}
            n = max(by_size, key=by_size.get)
            run.ceilings[name] = dict(flops=by_size[n], n=n, by_size={str(k): v for k, v in by_size.items()})
    return run.ceilings


# -----------------------------------------------------------------------------
# row 1: looped vs untied training step

def row_untied(run):
    spec = run.size['speed']
    K, R = spec['n_layer'], spec['n_loop']
    looped = build(run.device, **spec, supervision='terminal')
    untied = build(run.device, **dict(spec, n_layer=K * R, n_loop=1), supervision='terminal')
    X, Y = batch(spec, run.device)
    t = side_by_side({'looped': train_step(looped, X, Y, run.device),
                      'untied': train_step(untied, X, Y, run.device)}, run.device, run.warmup, run.repeats)
    run.looped, run.batch, run.looped_s = looped, (X, Y), t['looped']
    tokens = X.numel()
    ratio = t['untied'] / t['looped']  # tokens/s looped over tokens/s untied
    return {'untied_vs_looped': dict(
        ratio=ratio, target='>= 0.97', met=ratio >= 0.97, looped_tok_s=tokens / t['looped'],
        untied_tok_s=tokens / t['untied'], looped_s=t['looped'], untied_s=t['untied'],
        config=dict(spec, supervision='terminal'))}


# -----------------------------------------------------------------------------
# row 2: peak memory of one training step

def naive_per_loop_loss(model, X, Y):
    # the textbook per-loop loss: R full (B, T, V) logit tensors, all kept alive for the backward pass
    states = model.run(X).states
    V = model.config.vocab_size
    return sum(F.cross_entropy(model.readout(h, k).float().view(-1, V), Y.view(-1), ignore_index=-1)
               for k, h in enumerate(states, start=1)) / len(states)


def proc_status(key):
    with open('/proc/self/status') as status:
        for line in status:
            if line.startswith(key + ':'):
                return int(line.split()[1]) * 1024  # kB -> bytes
    raise KeyError(key)


def cuda_step_bytes(step, device):
    sync(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    sync(device)
    return dict(peak_bytes=torch.cuda.max_memory_allocated(device) - base,
                method='torch.cuda.max_memory_allocated')


def cpu_step_bytes(step):
    try:
        with open('/proc/self/clear_refs', 'w') as clear_refs:
            clear_refs.write('5')  # resets VmHWM (Linux >= 4.0)
        base = proc_status('VmRSS')
        step()
        return dict(peak_bytes=proc_status('VmHWM') - base,
                    method='VmHWM after clear_refs, minus VmRSS before')
    except OSError:
        base = proc_status('VmRSS') if os.path.exists('/proc/self/status') else 0
        step()
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        maxrss *= 1 if sys.platform == 'darwin' else 1024  # bytes on macOS, KiB on Linux
        return dict(peak_bytes=maxrss - base, method='getrusage max RSS minus RSS before (upper bound)')


def peak_step_memory(spec, loss_kind, device_name='cpu'):
    """Bytes one training step needs above what is resident before it (model, batch, one warm-up step done).

    CPU: in this (fresh) process, the high-water RSS is reset through /proc/self/clear_refs and read from
    VmHWM; where that is not possible, resource.getrusage's max RSS minus the RSS before the step (then an
    upper bound). Run it in a child process with MALLOC_MMAP_THRESHOLD_ set (see memory_child) so that every
    large tensor is its own mmap and is handed back to the OS when freed.
    CUDA: torch.cuda.max_memory_allocated.
    """
    device = torch.device(device_name)
    model = build(device, **spec, supervision='terminal' if loss_kind == 'terminal' else 'per_loop')
    X, Y = batch(spec, device)
    step = train_step(model, X, Y, device, naive_per_loop_loss if loss_kind == 'naive' else None)
    step()  # warm-up: one-time buffers (thread pools, kernels) are not the step's
    gc.collect()
    return cuda_step_bytes(step, device) if device.type == 'cuda' else cpu_step_bytes(step)


def memory_child(spec, loss_kind):
    """peak_step_memory on CPU in a fresh Python process (its own RSS, nothing else's)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_='65536', MALLOC_TRIM_THRESHOLD_='0', PYTHONUNBUFFERED='1')
    here = os.path.abspath(__file__)
    cmd = [sys.executable, here, f'--threads={torch.get_num_threads()}',
           '--mem_child', json.dumps(dict(spec=spec, loss=loss_kind))]
    repo = os.path.dirname(os.path.dirname(here))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=repo)
    if out.returncode != 0:
        raise RuntimeError(f"memory child ({loss_kind}) failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def row_memory(run):
    spec = run.size['head']
    # terminal and per-loop as the model computes them, plus the naive per-loop loss for scale
    kinds = ('terminal', 'per_loop', 'naive')
    if run.device.type == 'cuda':
        res = {k: peak_step_memory(spec, k, str(run.device)) for k in kinds}
        torch.cuda.empty_cache()
    else:
        res = {k: memory_child(spec, k) for k in kinds}
    mib = {k: v['peak_bytes'] / 2 ** 20 for k, v in res.items()}
    B, T, V = spec['batch_size'], spec['block_size'], spec['vocab_size']
    ratio = mib['per_loop'] / mib['terminal']
    return {'peak_memory': dict(
        ratio=ratio, target='<= 1.25', met=ratio <= 1.25, terminal_mib=mib['terminal'],
        per_loop_mib=mib['per_loop'], naive_per_loop_mib=mib['naive'],
        naive_ratio=mib['naive'] / mib['terminal'], one_logits_tensor_mib=B * T * V * 4 / 2 ** 20,
        method=res['terminal']['method'], config=dict(spec))}


# -----------------------------------------------------------------------------
# row 3: step time of per-loop vs terminal supervision, against the share of the head

def head_step(model, X, Y, device):
    """The head alone: readout norm + linear + CE, forward and backward, for one exit (what each extra exit
    adds), on the model's own final state h_R (the data changes the cost of the softmax on a CPU)."""
    R = model.config.n_loop
    with torch.no_grad(), autocast(device):
        h = model.run(X).states[-1].float()
    h.requires_grad_(True)

    def step():
        with autocast(device):
            loss = LinearCrossEntropy.apply(model.lm_head.weight, Y, (1.0,), model.readout_norm(h, R)[None])
        loss.backward()
        h.grad = None
        model.zero_grad(set_to_none=True)
    return step


def row_step_time(run):
    spec = run.size['head']
    terminal = build(run.device, **spec, supervision='terminal')
    per_loop = build(run.device, **spec, supervision='per_loop')
    per_loop.load_state_dict(terminal.state_dict())
    X, Y = batch(spec, run.device)
    t = side_by_side({'terminal': train_step(terminal, X, Y, run.device),
                      'per_loop': train_step(per_loop, X, Y, run.device),
                      'head': head_step(terminal, X, Y, run.device)}, run.device, run.warmup, run.repeats)
    share = t['head'] / t['terminal']
    bound = 1 + (spec['n_loop'] - 1) * share
    ratio = t['per_loop'] / t['terminal']
    return {'step_time': dict(
        ratio=ratio, bound=bound, target='<= 1 + (R-1) * head share', met=ratio <= bound, head_share=share,
        terminal_s=t['terminal'], per_loop_s=t['per_loop'], head_s=t['head'], config=dict(spec))}


# -----------------------------------------------------------------------------
# rows 4, 5: decoding

EXIT_POLICY = 'maxprob'  # row 5's exit score (model.EXIT_POLICIES)

def decode_model(spec, block_size, device):
    # init='gpt2': under the reference init, wte ~ N(0, 1) and the tied head make exit 1 echo the input token
    # with probability ~1, and every token would leave after one loop
    model = build(device, **dict(spec, block_size=block_size), init='gpt2').eval()
    return model.to(torch.bfloat16) if device.type == 'cuda' else model


@torch.no_grad()
def median_first_exit_score(model, T, device):
    """The median exit score of exit 1 over T random tokens. On an untrained model the scores mean nothing;
    as a threshold this makes about half the tokens leave after the first loop."""
    probe = random_tokens(model.config.vocab_size, T, seed=1, device=device)
    h1 = model.run(probe, n_loop=1).states[0]
    return exit_score(model.readout(h1, 1), EXIT_POLICY).median().item()


def time_decoding(run, model, prompt, n_new, threshold):
    """Median seconds to sample n_new tokens: 'cached', 'uncached' (no KV cache) and 'adaptive' (cached,
    adaptive exit at threshold); and the mean loops per new token of the adaptive run."""
    def gen(use_cache, exit_threshold=None):
        def decode():
            torch.manual_seed(0)
            return generate(model, prompt, n_new, Decoding(temperature=1.0, use_cache=use_cache,
                            exit_threshold=exit_threshold, exit_policy=EXIT_POLICY))
        return decode
    t = side_by_side({'cached': gen(True), 'adaptive': gen(True, threshold)}, run.device, 1,
                     min(3, run.repeats))
    # the uncached run costs ~n_new full forwards: fewer repeats for it
    t.update(side_by_side({'uncached': gen(False)}, run.device, 0,
                          min(run.size['decode_repeats'], run.repeats)))
    _, used, _ = gen(True, threshold)()
    # the first new token comes off the full prompt pass, which runs all R loops: left out of the mean
    return t, used[:, 1:].float().mean().item()


def row_decode(run):
    spec = run.size['decode']
    n_new, R = spec['new_tokens'], spec['n_loop']
    block_size = spec['prompt'] + n_new  # holds prompt + every new token: no crop in either mode
    model = decode_model(spec, block_size, run.device)
    prompt = random_tokens(spec['vocab_size'], spec['prompt'], seed=0, device=run.device)
    threshold = median_first_exit_score(model, min(block_size, 256), run.device)
    t, loops = time_decoding(run, model, prompt, n_new, threshold)
    ratio = t['uncached'] / t['cached']
    kv = dict(ratio=ratio, target='>= 5x', met=ratio >= 5, cached_tok_s=n_new / t['cached'],
              uncached_tok_s=n_new / t['uncached'], config=dict(spec, block_size=block_size, batch_size=1))
    adaptive = dict(ratio=t['cached'] / t['adaptive'], target='report', met=None, threshold=threshold,
                    mean_loops=loops, fixed_loops=R, adaptive_tok_s=n_new / t['adaptive'],
                    fixed_tok_s=n_new / t['cached'], exit_policy=EXIT_POLICY)
    return {'kv_cache': kv, 'adaptive_exit': adaptive}


# -----------------------------------------------------------------------------
# rows 6, 7: torch.compile and MFU of row 1's looped model

def looped_of_row_1(run):
    if run.looped is None:
        raise RuntimeError("needs row 1's looped model, which was not measured")
    return run.looped, run.batch


def graph_breaks(model, X, Y):
    """Graph breaks of the training forward (loss included): dynamo's explain, no compilation."""
    import torch._dynamo
    torch._dynamo.reset()
    ex = torch._dynamo.explain(model)(X, Y)
    torch._dynamo.reset()
    reasons = [str(r.reason) for r in ex.break_reasons][:5]
    return dict(graph_breaks=ex.graph_break_count, graphs=ex.graph_count,
                target='0 graph breaks; report speed', break_reasons=reasons, met=ex.graph_break_count == 0)


def row_compile(run):
    looped, (X, Y) = looped_of_row_1(run)
    out = graph_breaks(looped, X, Y)
    if not run.compile:
        return {'compile': dict(out, ratio=None, skipped='not asked for (--compile)')}
    compiled = torch.compile(looped)
    t0 = time.perf_counter()
    train_step(compiled, X, Y, run.device)()  # compiles forward and backward
    sync(run.device)
    out['compile_s'] = time.perf_counter() - t0
    steps = {'eager': train_step(looped, X, Y, run.device),
             'compiled': train_step(compiled, X, Y, run.device)}
    t = side_by_side(steps, run.device, run.warmup, run.repeats)
    run.compiled_s = t['compiled']
    out.update(ratio=t['eager'] / t['compiled'], eager_s=t['eager'], compiled_s=t['compiled'],
               eager_tok_s=X.numel() / t['eager'], compiled_tok_s=X.numel() / t['compiled'])
    if run.device.type == 'cpu':  # on a GPU row 1's model is the one that matters
        out['default_config'] = compile_default(run)
    return {'compile': out}


def compile_default(run):
    """train.py's default run compiled (--compile=True), per dtype: the seconds its first step takes (the
    compilation), then the eager / compiled step time, AdamW included, and the steps after which the
    compilation has paid for itself. The plain model of row 8 is compiled too: does nanoloop's lead over
    it survive compilation, which fuses the small ops that the lead comes from?"""
    out = {}
    for dtype in run.dtypes:
        torch._dynamo.reset()
        model, opt, (X, Y) = default_model(run)
        plain, plain_opt = plain_model(model, run.device)
        compiled, compiled_plain = torch.compile(model), torch.compile(plain)
        t0 = time.perf_counter()
        optimizer_steps(compiled, opt, X, Y, run.device, dtype, 1)()
        sync(run.device)
        first = time.perf_counter() - t0
        optimizer_steps(compiled_plain, plain_opt, X, Y, run.device, dtype, 1)()
        n = run.size['block_steps']
        steps = {'eager': optimizer_steps(model, opt, X, Y, run.device, dtype, n),
                 'compiled': optimizer_steps(compiled, opt, X, Y, run.device, dtype, n),
                 'plain_compiled': optimizer_steps(compiled_plain, plain_opt, X, Y, run.device, dtype, n)}
        t = {k: v / n for k, v in side_by_side(steps, run.device, run.warmup, run.repeats).items()}
        eager, comp = t['eager'], t['compiled']
        out[dtype] = dict(compile_s=first - comp, ratio=eager / comp, eager_s=eager, compiled_s=comp,
                          pays_after_steps=(first - comp) / (eager - comp) if eager > comp else None,
                          plain_compiled_s=t['plain_compiled'], vs_plain_compiled=t['plain_compiled'] / comp)
    torch._dynamo.reset()
    run.default_compiled_s = {dtype: c['compiled_s'] for dtype, c in out.items()}
    return out


def utilisation(flops_per_step, ceiling, run, suffix):
    """Model flops / s over ceiling (FLOP/s) of the eager step, and of the compiled one where it was timed."""
    out = {f'mfu_vs_{suffix}': flops_per_step / run.looped_s / ceiling}
    if run.compiled_s is not None:
        out[f'compiled_mfu_vs_{suffix}'] = flops_per_step / run.compiled_s / ceiling
    return out


def row_mfu(run):
    looped, (X, _) = looped_of_row_1(run)
    flops = flops_per_token(looped, X.size(1)) * X.numel()  # forward + backward flops of one step
    dtype = 'bfloat16' if run.device.type == 'cuda' else 'float32'  # what row 1's step ran in
    best = ceilings(run)[dtype]
    ceiling = best['flops']
    out = dict(matmul_flops=ceiling, matmul_n=best['n'], matmul_dtype=dtype, matmul_by_size=best['by_size'],
               model_flops_per_step=flops, eager_flops=flops / run.looped_s, target='report')
    out.update(utilisation(flops, ceiling, run, 'matmul'))
    if run.device.type == 'cuda':
        peak = peak_flops(torch.cuda.get_device_name(run.device))  # None for a device not in the list
        out['peak_flops'] = peak
        if peak:
            out.update(utilisation(flops, peak, run, 'peak'))
    return {'mfu': out}


# -----------------------------------------------------------------------------
# rows 8-12: train.py's default run, against the same model written plainly

class PlainBlock(nn.Module):
    """A pre-norm block as one writes it from the textbook: fused qkv, explicit attention under a causal
    mask buffer, SwiGLU."""

    def __init__(self, C, n_head, block_size):
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.RMSNorm(C, eps=1e-6), nn.RMSNorm(C, eps=1e-6)
        self.qkv = nn.Linear(C, 3 * C, bias=False)
        self.proj = nn.Linear(C, C, bias=False)
        self.fc = nn.Linear(C, 8 * C, bias=False)  # SwiGLU's gate and up projections
        self.fc_proj = nn.Linear(4 * C, C, bias=False)
        self.register_buffer('mask', torch.ones(block_size, block_size, dtype=torch.bool).tril())

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in self.qkv(self.ln_1(x)).split(C, 2))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
        att = att.masked_fill(~self.mask[:T, :T], float('-inf')).softmax(dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(B, T, C))
        gate, up = self.fc(self.ln_2(x)).chunk(2, dim=-1)
        return x + self.fc_proj(F.silu(gate) * up)


class PlainLoopedGPT(nn.Module):
    """nanoloop's default model written plainly, the yardstick of row 8: what one writes without nanoloop
    (and what the papers' published code does): learned positions, the K blocks above run R times, and at
    every exit an RMSNorm readout, full (B, T, V) logits and F.cross_entropy. It takes a GPT's weights, so
    both start from the same init with the same parameter count. A second recurrence on purpose, outside
    nanoloop (`layers`, not `transformer.h`): nanoloop's own code runs through GPT.loops."""

    def __init__(self, gpt):
        super().__init__()
        cfg = gpt.config
        kind = (cfg.pos, cfg.mlp, cfg.norm, cfg.block, cfg.readout, cfg.supervision, cfg.inter_loop_norm)
        assert kind == ('learned', 'swiglu', 'rmsnorm', 'preln', 'rmsnorm', 'per_loop', 'none'), kind
        assert cfg.norm_penalty == 0 and cfg.loop_lambda == 0 and cfg.dropout == 0
        C, self.n_loop, self.vocab_size = cfg.n_embd, cfg.n_loop, cfg.vocab_size
        self.wte = nn.Embedding(cfg.vocab_size, C)
        self.wpe = nn.Embedding(cfg.block_size, C)
        self.layers = nn.ModuleList([PlainBlock(C, cfg.n_head, cfg.block_size) for _ in range(cfg.n_layer)])
        self.ln_out = nn.RMSNorm(C, eps=1e-6)
        self.lm_head = nn.Linear(C, cfg.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight
        t = gpt.transformer
        pairs = [(self.wte, t.wte), (self.wpe, t.wpe), (self.ln_out, t.ln_out)]
        for mine, theirs in zip(self.layers, t.h):
            pairs += [(mine.ln_1, theirs.ln_1), (mine.ln_2, theirs.ln_2), (mine.qkv, theirs.attn.c_attn),
                      (mine.proj, theirs.attn.c_proj), (mine.fc, theirs.mlp.c_fc),
                      (mine.fc_proj, theirs.mlp.c_proj)]
        with torch.no_grad():
            for mine, theirs in pairs:
                mine.weight.copy_(theirs.weight)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        loss = 0.0
        for _ in range(self.n_loop):
            for layer in self.layers:
                x = layer(x)
            logits = self.lm_head(self.ln_out(x))
            loss = loss + F.cross_entropy(logits.float().view(-1, self.vocab_size), targets.view(-1))
        return logits, loss / self.n_loop


def optimizer_steps(model, opt, X, Y, device, dtype, steps):
    """`steps` training steps as train.py runs them: forward under the dtype's autocast, backward, AdamW."""
    def block():
        for _ in range(steps):
            with autocast(device, dtype):
                loss = model(X, Y)[1]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return block


def default_model(run, spec=None, **kw):
    """Row 8's model (train.py's default, GPTConfig keys from the size's 'default', or spec), its AdamW and
    batch."""
    spec = spec or run.size['default']
    torch.manual_seed(0)
    model = build(run.device, **spec, **kw)
    with contextlib.redirect_stdout(io.StringIO()):
        opt = model.configure_optimizers(0.01, 1e-3, (0.9, 0.99), run.device.type)
    return model, opt, batch(spec, run.device)


def plain_model(model, device):
    """Row 8's yardstick: model written plainly (same weights), with torch's AdamW at default_model's
    hyperparameters."""
    plain = PlainLoopedGPT(model).to(device)
    return plain, torch.optim.AdamW(plain.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.01)


def row_plain(run):
    model, opt, (X, Y) = default_model(run)
    plain, plain_opt = plain_model(model, run.device)
    n = run.size['block_steps']
    steps = {}
    for dtype in run.dtypes:
        steps[f'nanoloop_{dtype}'] = optimizer_steps(model, opt, X, Y, run.device, dtype, n)
        steps[f'plain_{dtype}'] = optimizer_steps(plain, plain_opt, X, Y, run.device, dtype, n)
    t = {k: v / n for k, v in side_by_side(steps, run.device, run.warmup, run.repeats).items()}
    run.default_s = t
    out = dict(target=f">= 1.2 ({' and '.join(SHORT[d] for d in run.dtypes)})", steps_per_timing=n,
               config=dict(run.size['default']), dtypes=list(run.dtypes),
               params=model.get_num_params(False), plain_params=sum(p.numel() for p in plain.parameters()))
    for dtype in run.dtypes:
        out[f'ratio_{dtype}'] = t[f'plain_{dtype}'] / t[f'nanoloop_{dtype}']
        out[f'nanoloop_tok_s_{dtype}'] = X.numel() / t[f'nanoloop_{dtype}']
        out[f'plain_tok_s_{dtype}'] = X.numel() / t[f'plain_{dtype}']
    out['ratio'] = min(out[f'ratio_{dtype}'] for dtype in run.dtypes)
    out['met'] = out['ratio'] >= 1.2
    return {'vs_plain': out}


def default_times(run):
    if run.default_s is None:
        raise RuntimeError("needs row 8's step times, which were not measured")
    return run.default_s


def row_bf16(run):
    units = cpu_bf16_units() if run.device.type == 'cpu' else run.device.type
    if 'bfloat16' not in run.dtypes:
        return {'bf16': dict(skipped=run.bf16_note, bf16_units=units,
                             target='>= 1.7 with bf16 units', met=None)}
    t = default_times(run)
    ratio = t['nanoloop_float32'] / t['nanoloop_bfloat16']
    return {'bf16': dict(ratio=ratio, plain_ratio=t['plain_float32'] / t['plain_bfloat16'], bf16_units=units,
                         target='>= 1.7 with bf16 units', met=ratio >= 1.7 if units else None)}


def row_mfu_dtype(run):
    t = default_times(run)
    spec = run.size['default']
    flops = flops_per_token(build(torch.device('cpu'), **spec), spec['block_size'])
    flops *= spec['batch_size'] * spec['block_size']  # one step's forward + backward
    best = ceilings(run)
    out = dict(model_flops_per_step=flops, ceilings=best, target='>= 60% in the dtype of auto',
               dtypes=list(run.dtypes))
    for dtype in run.dtypes:
        out[f'mfu_{dtype}'] = flops / t[f'nanoloop_{dtype}'] / best[dtype]['flops']
        out[f'plain_mfu_{dtype}'] = flops / t[f'plain_{dtype}'] / best[dtype]['flops']
        if run.default_compiled_s:  # row 6 compiled the default run (--compile on a CPU)
            out[f'compiled_mfu_{dtype}'] = flops / run.default_compiled_s[dtype] / best[dtype]['flops']
    out['auto_dtype'] = auto_dtype(run.device.type)[0]
    mfu = out.get(f"mfu_{out['auto_dtype']}")
    out['met'] = None if mfu is None else mfu >= 0.6
    return {'mfu_dtype': out}


def row_attention(run):
    T = run.size['default']['block_size']
    base, _, (X, Y) = default_model(run)
    n = run.size['block_steps']
    steps = {}
    for impl in ('sdpa', 'math', 'explicit'):
        model, opt, _ = default_model(run, attn_impl=impl)
        model.load_state_dict(base.state_dict())
        for dtype in run.dtypes:
            steps[f'{impl}_{dtype}'] = optimizer_steps(model, opt, X, Y, run.device, dtype, n)
    t = {k: v / n for k, v in side_by_side(steps, run.device, run.warmup, run.repeats).items()}
    out = dict(step_s=t, target="auto <= 1.05x the fastest", config=dict(run.size['default']),
               dtypes=list(run.dtypes))
    for dtype in run.dtypes:
        times = {impl: t[f'{impl}_{dtype}'] for impl in ('sdpa', 'math', 'explicit')}
        out[f'auto_{dtype}'] = attention_path('auto', run.device.type, getattr(torch, dtype), T)
        out[f'fastest_{dtype}'] = min(times, key=times.get)
        out[f'auto_vs_fastest_{dtype}'] = times[out[f'auto_{dtype}']] / times[out[f'fastest_{dtype}']]
    out['met'] = all(out[f'auto_vs_fastest_{dtype}'] <= 1.05 for dtype in run.dtypes)
    return {'attention': out}


PROFILE_OPS = 12  # ops kept per dtype in row 12, by self time


def row_profile(run):
    """Where the default step goes: torch.profiler's self CPU time per step, by aten op, per dtype (the
    README's profile table). The profiler adds a few microseconds to every op, so its step is slower than
    row 8's; the shares are what to read."""
    if run.device.type != 'cpu':
        return {'profile': dict(target='report', skipped='CPU only (CPU-side op times say little on a GPU)')}
    from torch.profiler import ProfilerActivity, profile
    out = dict(target='report', config=dict(run.size['default']), dtypes=list(run.dtypes))
    for dtype in run.dtypes:
        model, opt, (X, Y) = default_model(run)
        step = optimizer_steps(model, opt, X, Y, run.device, dtype, 1)
        for _ in range(run.warmup + 1):
            step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(run.repeats):
                step()
        ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        total = sum(e.self_cpu_time_total for e in ops)  # microseconds over all profiled steps
        per_step = lambda us: us / run.repeats / 1e3      # -> ms per step
        top = [dict(op=e.key, ms=per_step(e.self_cpu_time_total), calls=e.count // run.repeats,
                    share=e.self_cpu_time_total / total) for e in ops[:PROFILE_OPS]]
        calls = sum(e.count for e in ops) // run.repeats
        out[dtype] = dict(step_ms=per_step(total), ops_per_step=calls, top=top)
    return {'profile': out}


# -----------------------------------------------------------------------------
# rows 13-16: adaptive decoding per kv_policy, cache memory, past the block size, self-speculative decoding
# Per-token times: each generation is timed beside the prompt pass alone (generate(..., 1): the prompt and
# the first new token, which comes off it), and the difference is split over the tokens after the first,
# so the start-up cancels.

POLICY_SLOTS = 2  # kv_slots of the shared policy in rows 13 and 14


def prompts(vocab_size, B, T, seed, device):
    """B rows (B, T) of random token ids."""
    return torch.randint(vocab_size, (B, T), generator=torch.Generator().manual_seed(seed)).to(device)


def decoder(model, prompt, n_new, last=None, name=None, stats=None, **kw):
    """A call that samples n_new tokens after prompt (seeded: the same tokens every call); the loops per
    token it used go into last[name], its counts (engine.generate's) add up in the Counter stats."""
    def decode():
        torch.manual_seed(0)
        _, used, counts = generate(model, prompt, n_new, Decoding(temperature=1.0, **kw))
        if last is not None:
            last[name] = used
        if stats is not None:
            stats.update(counts)
    return decode


def per_token(t, n_new, base):
    """Seconds per new token past the first of each timing in t, against the prompt pass t[base]."""
    return {name: (s - t[base]) / (n_new - 1) for name, s in t.items() if name != base}


def mean_loops(used):
    # the first new token comes off the prompt pass, which runs all R loops: left out of the mean
    return used[:, 1:].float().mean().item()


def width_model(spec, C, block_size, device):
    # a decode model of width C, heads of spec['head_size']; seeded: the same weights whichever rows ran
    torch.manual_seed(C)
    return decode_model(dict(spec, n_embd=C, n_head=max(1, C // spec['head_size'])), block_size, device)


def adaptive_target(C, B, policy, ideal):
    """(target text, the ratio to reach or None) of adaptive / fixed decoding at width C, batch B."""
    if C < 512:
        return '>= 1.0x', 1.0
    if B >= 8:
        return f'>= 0.8 x {ideal:.2f} = {0.8 * ideal:.2f}', 0.8 * ideal
    if policy in ('copy', 'shared'):
        return f'>= 0.9 x {ideal:.2f} = {0.9 * ideal:.2f}', 0.9 * ideal
    return 'report', None


def row_policies(run):
    """Adaptive-exit vs fixed-R decoding at each width and batch of the size, for every kv_policy (shared
    with POLICY_SLOTS slots), threshold set as row 5's (about half the tokens leave after loop 1). All the
    generations of one width and batch are timed interleaved."""
    spec = run.size['policies']
    R, n_new = spec['n_loop'], spec['new_tokens']
    block_size = spec['prompt'] + n_new
    cases = []
    for C in spec['widths']:
        model = width_model(spec, C, block_size, run.device)
        threshold = median_first_exit_score(model, min(block_size, 256), run.device)
        for B in spec['batches']:
            prompt = prompts(spec['vocab_size'], B, spec['prompt'], seed=0, device=run.device)
            tag, last = f'policies_d{C}_b{B}_', {}
            fns = {tag + 'prefill': decoder(model, prompt, 1), tag + 'fixed': decoder(model, prompt, n_new)}
            for p in KV_POLICIES:
                fns[tag + p] = decoder(model, prompt, n_new, last, p, exit_threshold=threshold,
                                       exit_policy=EXIT_POLICY, kv_policy=p,
                                       kv_slots=POLICY_SLOTS if p == 'shared' else None)
            # a narrow model's generations take ~0.1 s, where a busy machine's noise is largest: more repeats
            repeats = run.repeats if C < 512 else min(3, run.repeats)
            t = per_token(side_by_side(fns, run.device, 1, repeats), n_new, tag + 'prefill')
            fixed_s = t[tag + 'fixed']
            for p in KV_POLICIES:
                if p not in last:  # side_by_side did not call it (a test's stand-in timer)
                    fns[tag + p]()
                loops = mean_loops(last[p])
                ideal = R / loops
                ratio = fixed_s / t[tag + p]
                target, need = adaptive_target(C, B, p, ideal)
                cases.append(dict(n_embd=C, batch_size=B, policy=p, ratio=ratio, ideal=ideal,
                                  of_ideal=ratio / ideal, mean_loops=loops, adaptive_ms=t[tag + p] * 1e3,
                                  fixed_ms=fixed_s * 1e3, adaptive_tok_s=B / t[tag + p],
                                  fixed_tok_s=B / fixed_s,
                                  target=target, met=None if need is None else ratio >= need))
    checked = [c['met'] for c in cases if c['met'] is not None]
    return {'decode_policies': dict(cases=cases, target='see cells', met=all(checked), threshold=threshold,
                                    exit_policy=EXIT_POLICY, kv_slots=POLICY_SLOTS,
                                    config=dict(spec, block_size=block_size))}


def row_cache_memory(run):
    """The KV cache's bytes per policy at R = 4, 8, 16 for the widest model of row 13 (batch 1, its block
    size). Allocated on the meta device: sizes without memory."""
    spec = run.size['policies']
    C = max(spec['widths'])
    block_size = spec['prompt'] + spec['new_tokens']
    cfg = dict(spec, n_embd=C, n_head=max(1, C // spec['head_size']), block_size=block_size)
    mib = {}
    for p in KV_POLICIES:
        for R in (4, 8, 16):
            config = GPTConfig(**{k: v for k, v in dict(cfg, n_loop=R).items()
                                  if k in GPTConfig.__dataclass_fields__})
            cache = KVCache(argparse.Namespace(config=config), 1, R, torch.device('meta'), torch.float32, p,
                            POLICY_SLOTS if p == 'shared' else None)
            mib[f'{p}_r{R}'] = cache.nbytes() / 2 ** 20
    shared = [mib[f'shared_r{R}'] for R in (4, 8, 16)]
    return {'cache_memory': dict(mib=mib, ratio=shared[-1] / shared[0], target='shared: equal at every R',
                                 met=len(set(shared)) == 1, kv_slots=POLICY_SLOTS,
                                 config=dict(cfg, batch_size=1))}


def row_past_block(run):
    """Per-token time of the tokens generated past the block size against those inside it, in one
    generation of 4 x block_size new tokens (the window slides half a block at a time: engine.generate)."""
    spec = run.size['past_block']
    bs = spec['block_size']
    inside, n_new = bs - spec['prompt'], 4 * bs  # inside: the new tokens that fit in the first block
    torch.manual_seed(0)
    model = decode_model(spec, bs, run.device)
    prompt = prompts(spec['vocab_size'], 1, spec['prompt'], seed=0, device=run.device)
    t = side_by_side({'past_block_prefill': decoder(model, prompt, 1),
                      'past_block_inside': decoder(model, prompt, inside),
                      'past_block_all': decoder(model, prompt, n_new)}, run.device, 1, min(3, run.repeats))
    inside_s = (t['past_block_inside'] - t['past_block_prefill']) / (inside - 1)
    past_s = (t['past_block_all'] - t['past_block_inside']) / (n_new - inside)
    with torch.no_grad():
        stats = generate(model, prompt, n_new, Decoding(temperature=1.0))[2]
    ratio = past_s / inside_s
    return {'past_block': dict(ratio=ratio, target='<= 1.5', met=ratio <= 1.5, inside_ms=inside_s * 1e3,
                               past_ms=past_s * 1e3, new_tokens=n_new, inside_tokens=inside,
                               refills=stats['refills'], config=dict(spec))}


def cache_bytes():
    """The largest CPU cache (L3 where there is one) in bytes, from sysfs; None where unknown."""
    sizes = []
    for index in range(8):
        try:
            with open(f'/sys/devices/system/cpu/cpu0/cache/index{index}/size') as f:
                text = f.read().strip()
        except OSError:
            break
        unit = {'K': 2 ** 10, 'M': 2 ** 20}.get(text[-1], 1)
        sizes.append(int(text.rstrip('KM')) * unit)
    return max(sizes) if sizes else None


def row_speculative(run):
    """Self-speculative decoding (drafts from loops 1..k, verified by loops k+1..R, fixed-R's tokens) vs
    fixed-R decoding, for k = 1..R-1 at each width of the size, sampled at temperature 1. The acceptance
    rate is counted over every call, warm-up included. The weights are untrained (random, GPT-2 init):
    every exit's logits then echo the embedding, so the acceptance says nothing about a trained model."""
    spec = run.size['speculative']
    R, n_new = spec['n_loop'], spec['new_tokens']
    block_size = spec['prompt'] + n_new
    l3 = cache_bytes() if run.device.type == 'cpu' else None
    cases = []
    for C in spec['widths']:
        model = width_model(spec, C, block_size, run.device)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        prompt = prompts(spec['vocab_size'], 1, spec['prompt'], seed=0, device=run.device)
        tag = f'speculative_d{C}_'
        fns = {tag + 'prefill': decoder(model, prompt, 1), tag + 'fixed': decoder(model, prompt, n_new)}
        stats = {k: Counter() for k in range(1, R)}
        for k in range(1, R):
            fns[tag + f'k{k}'] = decoder(model, prompt, n_new, draft_loops=k, speculate=spec['gamma'],
                                         stats=stats[k])
        t = per_token(side_by_side(fns, run.device, 1, min(3, run.repeats)), n_new, tag + 'prefill')
        big = l3 is not None and weights > l3
        for k in range(1, R):
            if not stats[k]:  # side_by_side did not call it (a test's stand-in timer)
                fns[tag + f'k{k}']()
            ratio = t[tag + 'fixed'] / t[tag + f'k{k}']
            cases.append(dict(n_embd=C, draft_loops=k, ratio=ratio, acceptance=stats[k]['accepted']
                              / max(1, stats[k]['checked']), speculative_ms=t[tag + f'k{k}'] * 1e3,
                              fixed_ms=t[tag + 'fixed'] * 1e3, weight_bytes=weights, exceeds_cache=big,
                              target='>= 1.0x' if big else 'report', met=ratio >= 1.0 if big else None))
    checked = [c['met'] for c in cases if c['met'] is not None]
    return {'speculative': dict(cases=cases, target='>= 1.0x where the weights exceed the cache',
                                met=all(checked) if checked else None, cache_bytes=l3, gamma=spec['gamma'],
                                weights='untrained (random, GPT-2 init)', config=dict(spec))}


# -----------------------------------------------------------------------------
# row 17: Looped-MoE (docs/papers.md §5) against the dense looped model of the same active width

EXPERTS = dict(n_expert=8, top_k=2)  # the paper's top 2 of 8; an expert is 4C/k wide, so active = dense


def with_moe_kernel(fn, kernel):
    """fn with every MoE layer computing through `kernel` (kernels.moe_loop, the per-expert loop) during the
    call: model.py has no switch for it (one path is the model's), so kernels.moe is swapped and put back."""
    def call():
        saved, kernels.moe = kernels.moe, kernel
        try:
            return fn()
        finally:
            kernels.moe = saved
    return call


def grouped_mm_used(model, dtype, device):
    """Whether kernels.moe runs model's experts as one F.grouped_mm in dtype (else its loop of matmuls)."""
    layer, dt = model.transformer.h[0].mlp, getattr(torch, dtype)
    xs = torch.empty(0, model.config.n_embd, dtype=dt, device=device)
    return kernels.grouped_mm_runs(xs, layer.c_fc.detach().to(dt), layer.c_proj.detach().to(dt))


def step_peak_mib(spec, device):
    """Peak MiB of one training step of spec's model (per-loop loss) above what is resident before it: row
    2's measurement (a fresh child process on CPU)."""
    res = memory_child(spec, 'per_loop') if device.type == 'cpu' else \
        peak_step_memory(spec, 'per_loop', str(device))
    return res['peak_bytes'] / 2 ** 20, res['method']


def row_moe(run):
    """train.py's default run with E = 8 experts of top 2 in the K shared layers (config/looped_moe.py)
    against the dense default, the same active parameters per token (on a GPU: config/looped_moe_gpt2s.py's
    model at a micro-batch, with and without experts): the training step per dtype (forward,
    backward, AdamW; the MoE both through the grouped dispatch, kernels.moe, and through the per-expert
    loop, kernels.moe_loop), the peak memory of a step, decoding tok/s with the cache (row 4's model, batch
    1), and FLOPs per token and MFU, which count a token's k experts and the router."""
    spec, dec = run.size.get('moe', run.size['default']), run.size.get('moe_decode', run.size['decode'])
    dense, dense_opt, (X, Y) = default_model(run, spec)
    moe, moe_opt, _ = default_model(run, spec, **EXPERTS)
    loop, loop_opt, _ = default_model(run, spec, **EXPERTS)  # the same seed: moe's weights
    n = max(1, run.size['block_steps'] // 2)  # three models per dtype: half row 8's steps per timing
    steps = {}
    for dtype in run.dtypes:
        steps[f'moe_dense_{dtype}'] = optimizer_steps(dense, dense_opt, X, Y, run.device, dtype, n)
        steps[f'moe_grouped_{dtype}'] = optimizer_steps(moe, moe_opt, X, Y, run.device, dtype, n)
        steps[f'moe_loop_{dtype}'] = with_moe_kernel(
            optimizer_steps(loop, loop_opt, X, Y, run.device, dtype, n), kernels.moe_loop)
    t = {k: v / n for k, v in side_by_side(steps, run.device, run.warmup, run.repeats).items()}
    T, tokens = spec['block_size'], X.numel()
    flops = dict(dense=flops_per_token(dense, T), moe=flops_per_token(moe, T))
    best = ceilings(run)
    peak = peak_flops(torch.cuda.get_device_name(run.device)) if run.device.type == 'cuda' else None
    out = dict(target='step <= 1.5x, memory <= 1.3x', steps_per_timing=n, dtypes=list(run.dtypes),
               config=dict(spec, **EXPERTS), **EXPERTS, expert_hidden=moe.transformer.h[0].mlp.c_proj.size(1),
               params_dense=dense.get_num_params(False), params_moe=moe.get_num_params(False),
               active_params_moe=active_params(moe), flops_per_token_dense=flops['dense'],
               flops_per_token_moe=flops['moe'], peak_flops=peak)
    for d in run.dtypes:
        s = {who: t[f'moe_{who}_{d}'] for who in ('dense', 'grouped', 'loop')}
        out.update({f'{who}_s_{d}': v for who, v in s.items()})
        out.update({f'{who}_tok_s_{d}': tokens / v for who, v in s.items()})
        out[f'ratio_{d}'] = s['grouped'] / s['dense']              # MoE step time over dense: <= 1.5
        out[f'loop_ratio_{d}'] = s['loop'] / s['dense']            # the per-expert loop's
        out[f'grouped_speedup_{d}'] = s['loop'] / s['grouped']     # what the grouped dispatch buys
        out[f'grouped_mm_{d}'] = grouped_mm_used(moe, d, run.device)
        for who, f in (('dense', flops['dense']), ('moe', flops['moe'])):
            step_s = s['dense' if who == 'dense' else 'grouped']
            out[f'mfu_{who}_{d}'] = f * tokens / step_s / best[d]['flops']
            if peak and d == 'bfloat16':
                out[f'mfu_vs_peak_{who}_{d}'] = f * tokens / step_s / peak
    out['ratio'] = max(out[f'ratio_{d}'] for d in run.dtypes)  # the worst dtype
    # peak memory of one step (forward + backward), as row 2; the parameters, their gradients and AdamW's
    # two moments (4 x the fp32 weights) are resident before it, and an MoE has E/k times the MLP's weights
    (dense_mib, method), (moe_mib, _) = (step_peak_mib(dict(spec, **kw), run.device) for kw in ({}, EXPERTS))
    dense_mib, moe_mib = max(dense_mib, 0.0), max(moe_mib, 0.0)  # a CPU peak within the allocator's noise
    out.update(memory_ratio=moe_mib / dense_mib if dense_mib > 0 else math.nan, dense_mib=dense_mib,
               moe_mib=moe_mib, memory_method=method,
               **{f'state_mib_{who}': 16 * out[f'params_{who}'] / 2 ** 20 for who in ('dense', 'moe')})
    out['met'] = out['ratio'] <= 1.5 and out['memory_ratio'] <= 1.3
    out.update(moe_decoding(run, dec))
    return {'moe': out}


def moe_decoding(run, spec):
    """Decode tok/s with the KV cache (fixed exit, batch 1) of row 4's model, dense and with experts (grouped
    dispatch and per-expert loop), timed side by side."""
    n_new = spec['new_tokens']
    block_size = spec['prompt'] + n_new
    torch.manual_seed(0)
    dense = decode_model(spec, block_size, run.device)
    torch.manual_seed(0)
    moe = decode_model(dict(spec, **EXPERTS), block_size, run.device)
    prompt = random_tokens(spec['vocab_size'], spec['prompt'], seed=0, device=run.device)
    gens = {'moe_decode_dense': decoder(dense, prompt, n_new),
            'moe_decode_grouped': decoder(moe, prompt, n_new),
            'moe_decode_loop': with_moe_kernel(decoder(moe, prompt, n_new), kernels.moe_loop)}
    t = side_by_side(gens, run.device, 1, min(3, run.repeats))
    tok_s = {who: n_new / t[f'moe_decode_{who}'] for who in ('dense', 'grouped', 'loop')}
    dtype = str(next(moe.parameters()).dtype).replace('torch.', '')
    return dict(decode_tok_s_dense=tok_s['dense'], decode_tok_s_moe=tok_s['grouped'],
                decode_tok_s_loop=tok_s['loop'], decode_ratio=tok_s['grouped'] / tok_s['dense'],
                decode_grouped_mm=grouped_mm_used(moe, dtype, run.device), decode_dtype=dtype,
                decode_config=dict(spec, block_size=block_size, batch_size=1, **EXPERTS))


# -----------------------------------------------------------------------------
# row 18: continuous depth batching (batching.py) against today's batched decoding

DEPTH_REQUESTS = 4  # prompts per row: rows refill, and the tail (the last requests, fewer rows) weighs less
DEPTH_POLICIES = ('recompute', 'copy')


def group_decoder(model, groups, n_new, last=None, name=None, **kw):
    """A call that samples n_new tokens after each group (B, T) of prompts in turn with engine.generate,
    today's batched path (a group waits for its slowest row); the loops per token go into last[name]."""
    def decode():
        torch.manual_seed(0)
        used = [generate(model, g, n_new, Decoding(temperature=1.0, **kw))[1] for g in groups]
        if last is not None:
            last[name] = torch.cat(used)
    return decode


def depth_decoder(model, rows, n_new, B, last, name, **kw):
    """A call that serves the prompts `rows` (lists of ids), B rows in flight (batching.serve). Its prompt
    passes (batching.decode_step: up to B prompts at a time through every loop, between the calls that
    advance the others) are timed inside the call: batching.py has no switch for it, so its decode_step is
    swapped for a timed one and put back. Into last: name (the loops per token), name + '_full' (how full
    the block calls ran), name + '_prompt_s' (each call's seconds in prompt passes)."""
    def decode():
        plain, spent = batching.decode_step, []

        def timed(*args):
            sync(model.lm_head.weight.device)
            t0 = CLOCK()
            out = plain(*args)
            sync(model.lm_head.weight.device)
            spent.append(CLOCK() - t0)
            return out
        batching.decode_step = timed
        try:
            torch.manual_seed(0)
            _, used, stats = batching.serve(model, rows, n_new, Decoding(batch_size=B, temperature=1.0, **kw))
        finally:
            batching.decode_step = plain
        last[name], last[name + '_full'] = torch.tensor(used, dtype=torch.float), stats['full']
        last.setdefault(name + '_prompt_s', []).append(sum(spent))
    return decode


def row_depth(run):
    """Continuous depth batching against today's batched decoding, at each width and batch B of the size:
    DEPTH_REQUESTS x B prompts of one length, decoded (a) at fixed depth and (b) with adaptive exits by
    engine.generate in groups of B, and (c) by batching.serve with B rows in flight, at row 13's threshold
    (about half the tokens want to leave after loop 1), kv_policy recompute and copy. Each path's time less
    its prompt passes (generate's: generate(..., 1) per group, timed beside; serve's, rows waiting at once:
    timed inside the call) is split over the new tokens after each prompt's first. All of one width and
    batch are timed interleaved, the repeats the size gives each batch; one warm-up call each at the first
    width only (the wider one's generations take seconds on a CPU). The models are fp32 on every device,
    as row 13's are."""
    spec = run.size['depth']
    R = spec['n_loop']
    block_size = spec['prompt'] + max(n for n, _ in spec['batches'].values())  # no window slides
    cases = []
    for C in spec['widths']:
        torch.manual_seed(C)
        model = build(run.device, **dict(spec, n_embd=C, n_head=max(1, C // spec['head_size']),
                                         block_size=block_size), init='gpt2').eval()
        threshold = median_first_exit_score(model, min(block_size, 256), run.device)
        for B, (n_new, repeats) in spec['batches'].items():
            P = DEPTH_REQUESTS * B
            ids = prompts(spec['vocab_size'], P, spec['prompt'], seed=0, device=run.device)
            groups, rows = ids.split(B), ids.tolist()
            tag, last = f'depth_d{C}_b{B}_', {}
            fns = {tag + 'prefill': group_decoder(model, groups, 1),
                   tag + 'fixed': group_decoder(model, groups, n_new)}
            for p in DEPTH_POLICIES:
                kw = dict(exit_threshold=threshold, exit_policy=EXIT_POLICY, kv_policy=p)
                fns[tag + 'adaptive_' + p] = group_decoder(model, groups, n_new, last, 'adaptive_' + p, **kw)
                fns[tag + 'depth_' + p] = depth_decoder(model, rows, n_new, B, last, 'depth_' + p, **kw)
            warmup = 1 if C == spec['widths'][0] else 0
            t = side_by_side(fns, run.device, warmup, min(repeats, run.repeats))
            for p in DEPTH_POLICIES:
                if 'depth_' + p not in last:  # side_by_side did not call them (a test's stand-in timer)
                    fns[tag + 'adaptive_' + p]()
                    fns[tag + 'depth_' + p]()
            tokens = P * (n_new - 1)  # each prompt's first new token comes off its prompt pass
            fixed_s = (t[tag + 'fixed'] - t[tag + 'prefill']) / tokens
            for p in DEPTH_POLICIES:
                prompt_s = statistics.median(last[f'depth_{p}_prompt_s'])
                s = dict(adaptive=(t[tag + 'adaptive_' + p] - t[tag + 'prefill']) / tokens,
                         depth=(t[tag + 'depth_' + p] - prompt_s) / tokens)
                case = dict(n_embd=C, batch_size=B, policy=p, requests=P, new_tokens=n_new,
                            threshold=threshold, fixed_ms=fixed_s * 1e3, fixed_tok_s=1 / fixed_s,
                            prompt_ms=t[tag + 'prefill'] / P * 1e3, depth_prompt_ms=prompt_s / P * 1e3)
                for how in ('adaptive', 'depth'):
                    loops = mean_loops(last[f'{how}_{p}'])
                    ratio = fixed_s / s[how]
                    case.update({f'{how}_loops': loops, f'{how}_ideal': R / loops, f'{how}_ratio': ratio,
                                 f'{how}_of_ideal': ratio * loops / R, f'{how}_ms': s[how] * 1e3,
                                 f'{how}_tok_s': 1 / s[how]})
                case['occupancy'] = last[f'depth_{p}_full']  # below 1 in the tail
                need = 0.9 * case['depth_ideal'] if C >= 512 and B >= 8 else None
                case.update(target=f">= 0.9 x {case['depth_ideal']:.2f} = {need:.2f}" if need else 'report',
                            met=None if need is None else case['depth_ratio'] >= need)
                cases.append(case)
    checked = [c['met'] for c in cases if c['met'] is not None]
    return {'depth_batching': dict(cases=cases, target='>= 0.9 of the ideal at d >= 512, batch >= 8',
                                   met=all(checked) if checked else None, exit_policy=EXIT_POLICY,
                                   requests_per_row=DEPTH_REQUESTS, config=dict(spec, block_size=block_size))}


# seconds of each row at the cpu size on a 2-core laptop CPU, (fp32 part, bf16 part), from a run on a busy
# 2-core Xeon (5m26s there, load ~4) halved: only the ETA's weights, which it scales by the rows so far
COST = {'untied_vs_looped': (26, 0), 'peak_memory': (7, 0), 'step_time': (8, 0), 'kv_cache': (27, 0),
        'compile': (3, 0), 'mfu': (1, 1), 'vs_plain': (3, 3), 'bf16': (0, 0), 'mfu_dtype': (0, 0),
        'attention': (35, 35), 'profile': (8, 7), 'decode_policies': (18, 0), 'cache_memory': (0, 0),
        'past_block': (5, 0), 'speculative': (5, 0), 'moe': (45, 13), 'depth_batching': (30, 0)}
COMPILE_COST = (120, 60)  # row 6 with --compile

# (the row that records a failure, the function that measures it), in order: rows 6 and 7 use row 1's model,
# rows 9 and 10 row 8's step times
MEASUREMENTS = (('untied_vs_looped', row_untied), ('peak_memory', row_memory), ('step_time', row_step_time),
                ('kv_cache', row_decode), ('compile', row_compile), ('mfu', row_mfu), ('vs_plain', row_plain),
                ('bf16', row_bf16), ('mfu_dtype', row_mfu_dtype), ('attention', row_attention),
                ('profile', row_profile), ('decode_policies', row_policies),
                ('cache_memory', row_cache_memory),
                ('past_block', row_past_block), ('speculative', row_speculative), ('moe', row_moe),
                ('depth_batching', row_depth))


# -----------------------------------------------------------------------------
# the table: per row, its cells (measurement, value, target, met) and any note lines under it

def dtypes(row):
    """The dtypes a per-dtype row was measured in (a JSON from before the bf16 plan: both)."""
    return row.get('dtypes', DTYPES)


def cells_untied(row):
    c = row['config']
    K, R = c['n_layer'], c['n_loop']
    return [(f"train tok/s K={K} x R={R} vs untied {K * R} layers",
             f"{row['ratio']:.3f} ({row['looped_tok_s']:,.0f}/{row['untied_tok_s']:,.0f})", row['target'],
             row['met'])]


def cells_memory(row):
    return [(f"peak step memory per-loop / terminal (V={row['config']['vocab_size']})",
             f"{row['ratio']:.3f} ({row['per_loop_mib']:.0f}/{row['terminal_mib']:.0f} MiB)", row['target'],
             row['met']),
            f"(naive per-loop, R logit tensors kept: {row['naive_per_loop_mib']:.0f} MiB = "
            f"{row['naive_ratio']:.2f}x terminal)"]


def cells_step_time(row):
    return [(f"step time per-loop / terminal (R={row['config']['n_loop']})", f"{row['ratio']:.2f}",
             f"<= {row['bound']:.2f} (share {row['head_share']:.2f})", row['met'])]


def cells_kv_cache(row):
    return [(f"decode tok/s cached / uncached ({row['config']['new_tokens']} new)",
             f"{row['ratio']:.1f}x ({row['cached_tok_s']:.0f}/{row['uncached_tok_s']:.0f})", row['target'],
             row['met'])]


def cells_adaptive(row):
    return [("adaptive / fixed-R decode tok/s; loops/token",
             f"{row['ratio']:.2f}x; {row['mean_loops']:.2f}/{row['fixed_loops']}", 'report', None)]


def cells_compile(row):
    if row.get('ratio') is None:
        speed = 'skipped'
    else:
        speed = f"{row['ratio']:.2f}x (compile {row['compile_s']:.0f}s)"
    cells = [("compiled / eager train step speed; graph breaks", f"{speed}; {row['graph_breaks']} breaks",
              '0 breaks', row['met'])]
    for dtype, c in (row.get('default_config') or {}).items():
        pays = f"{c['pays_after_steps']:,.0f} steps" if c['pays_after_steps'] else 'never'
        cells.append(f"(default run, {SHORT[dtype]}: {c['ratio']:.2f}x after a {c['compile_s']:.0f}s "
                     f"compile; pays after {pays}; {c['vs_plain_compiled']:.2f}x the compiled plain model)")
    return cells


def percent(row, key):
    """'12.3%', followed by ' (45.6% compiled)' where the compiled step was timed."""
    text = f"{row[key] * 100:.1f}%"
    if row.get('compiled_' + key) is not None:
        text += f" ({row['compiled_' + key] * 100:.1f}% compiled)"
    return text


def cells_mfu(row):
    ceiling = f"{SHORT[row['matmul_dtype']]} matmul {row['matmul_flops'] / 1e9:,.0f} GFLOP/s"
    cells = [(f"MFU of the looped step vs {ceiling}",
              percent(row, 'mfu_vs_matmul'), 'report', None)]
    if row.get('mfu_vs_peak') is not None:
        cells.append((f"  vs datasheet peak {row['peak_flops'] / 1e12:.0f} TFLOP/s",
                      percent(row, 'mfu_vs_peak'), 'report', None))
    return cells


def cells_plain(row):
    tok = lambda who, d: f"{row[f'{who}_tok_s_{d}']:,.0f}"
    return [(f"train tok/s nanoloop / plain, {SHORT[d]}, AdamW included",
             f"{row[f'ratio_{d}']:.2f} ({tok('nanoloop', d)}/{tok('plain', d)})",
             row['target'] if i == 0 else '', row[f'ratio_{d}'] >= 1.2) for i, d in enumerate(dtypes(row))]


def cells_bf16(row):
    units = row['bf16_units'] or 'no bf16 units'
    if row.get('skipped'):
        return [(f"train step speed bf16 / fp32 ({units})", 'skipped', 'report', None), f"({row['skipped']})"]
    return [(f"train step speed bf16 / fp32 ({units})",
             f"{row['ratio']:.2f}x (plain {row['plain_ratio']:.2f}x)", row['target'], row['met'])]


def cells_mfu_dtype(row):
    return [(f"MFU, {SHORT[d]} step vs {SHORT[d]} matmul {row['ceilings'][d]['flops'] / 1e9:,.0f} GFLOP/s",
             f"{row[f'mfu_{d}'] * 100:.1f}% (plain {row[f'plain_mfu_{d}'] * 100:.1f}%)"
             + (f"; compiled {row[f'compiled_mfu_{d}'] * 100:.1f}%" if f'compiled_mfu_{d}' in row else ''),
             '>= 60%' + (' (the dtype of auto)' if d == row['auto_dtype'] else ''),
             row['met'] if d == row['auto_dtype'] else None) for d in dtypes(row)]


def cells_attention(row):
    return [(f"attention, {SHORT[d]}: auto = {row[f'auto_{d}']}, fastest = {row[f'fastest_{d}']}",
             f"{row[f'auto_vs_fastest_{d}']:.2f}x the fastest", row['target'] if i == 0 else '',
             row[f'auto_vs_fastest_{d}'] <= 1.05) for i, d in enumerate(dtypes(row))]


def cells_profile(row):
    if row.get('skipped'):
        return [('where the default step goes', 'skipped', 'report', None)]
    short = lambda op: op.replace('aten::', '')
    return [(f"{SHORT[d]} step, profiled: {row[d]['step_ms']:.0f} ms in {row[d]['ops_per_step']:,} ops",
             ', '.join(f"{short(o['op'])} {o['share'] * 100:.0f}%" for o in row[d]['top'][:3]),
             'report', None) for d in dtypes(row)]


def cells_policies(row):
    R = row['config']['n_loop']
    return [(f"adaptive / fixed tok/s d{c['n_embd']} B{c['batch_size']} {c['policy']}; loops",
             f"{c['ratio']:.2f}x={c['of_ideal']:.2f} ideal; {c['mean_loops']:.2f}/{R}", c['target'], c['met'])
            for c in row['cases']]


def cells_cache_memory(row):
    mib = row['mib']
    return [(f"KV cache MiB at R = 4/8/16, {p}" + (f" ({row['kv_slots']} slots)" if p == 'shared' else ''),
             '/'.join(f"{mib[f'{p}_r{R}']:.2f}" for R in (4, 8, 16)),
             row['target'] if p == 'shared' else 'report', row['met'] if p == 'shared' else None)
            for p in KV_POLICIES]


def cells_past_block(row):
    bs, n = row['config']['block_size'], row['new_tokens']
    return [(f"per-token time past / inside the block ({bs}, {n} new)",
             f"{row['ratio']:.2f} ({row['past_ms']:.1f}/{row['inside_ms']:.1f} ms)", row['target'],
             row['met']),
            f"({row['refills']} refills)"]


def cells_speculative(row):
    cells = [(f"speculative / fixed-R tok/s d{c['n_embd']} k {c['draft_loops']} g {row['gamma']}; accepted",
              f"{c['ratio']:.2f}x; {c['acceptance']:.2f}", c['target'], c['met']) for c in row['cases']]
    return cells + [f"(weights {row['weights']}: the acceptance says nothing of a trained model)"]


def cells_moe(row):
    E, k = row['n_expert'], row['top_k']
    how = lambda ok: 'grouped_mm' if ok else 'split loop'
    cells = [(f"train step MoE (E {E}, top {k}) / dense, {SHORT[d]}, {how(row[f'grouped_mm_{d}'])}",
              f"{row[f'ratio_{d}']:.2f}x (loop {row[f'loop_ratio_{d}']:.2f}x)", '<= 1.5' if i == 0 else '',
              row[f'ratio_{d}'] <= 1.5) for i, d in enumerate(dtypes(row))]
    cells.append(("peak step memory MoE / dense",
                  f"{row['memory_ratio']:.2f} ({row['moe_mib']:.1f}/{row['dense_mib']:.1f} MiB)", '<= 1.3',
                  row['memory_ratio'] <= 1.3))
    cells.append((f"decode tok/s cached MoE / dense, {how(row['decode_grouped_mm'])}",
                  f"{row['decode_ratio']:.2f}x ({row['decode_tok_s_moe']:.0f}/"
                  f"{row['decode_tok_s_dense']:.0f})",
                  'report', None))
    pct = lambda who, d: f"{row[f'mfu_{who}_{d}'] * 100:.1f}%"
    mfu = '; '.join(f"MFU {SHORT[d]} {pct('moe', d)} vs dense {pct('dense', d)}" for d in dtypes(row))
    cells.append(f"(per-expert loop decodes {row['decode_tok_s_loop']:.0f} tok/s; FLOPs/token "
                 f"{row['flops_per_token_moe'] / 1e6:.2f}M vs {row['flops_per_token_dense'] / 1e6:.2f}M, "
                 f"k experts and router; {mfu}; {row['active_params_moe'] / 1e6:.2f}M of "
                 f"{row['params_moe'] / 1e6:.2f}M params active)")
    return cells



def cells_depth(row):
    R = row['config']['n_loop']
    cells = []
    for c in row['cases']:  # depth batching's cell, and under it today's batched adaptive path
        cells += [(f"depth / fixed tok/s d{c['n_embd']} B{c['batch_size']} {c['policy']}; loops",
                   f"{c['depth_ratio']:.2f}x={c['depth_of_ideal']:.2f} ideal; {c['depth_loops']:.2f}/{R}",
                   c['target'], c['met']),
                  f"(adaptive / fixed {c['adaptive_ratio']:.2f}x={c['adaptive_of_ideal']:.2f} ideal, "
                  f"{c['adaptive_loops']:.2f}/{R} loops; depth's calls {c['occupancy']:.2f} full, prompt "
                  f"passes {c['depth_prompt_ms']:.1f} ms a prompt vs {c['prompt_ms']:.1f} batched)"]
    return cells + [f"({row['requests_per_row']}B prompts of {row['config']['prompt']} tokens at batch B; "
                    f"tok/s of the new tokens after each prompt's first; fp32, untrained weights)"]


TABLE = (('untied_vs_looped', cells_untied), ('peak_memory', cells_memory), ('step_time', cells_step_time),
         ('kv_cache', cells_kv_cache), ('adaptive_exit', cells_adaptive), ('compile', cells_compile),
         ('mfu', cells_mfu), ('vs_plain', cells_plain), ('bf16', cells_bf16), ('mfu_dtype', cells_mfu_dtype),
         ('attention', cells_attention), ('profile', cells_profile), ('decode_policies', cells_policies),
         ('cache_memory', cells_cache_memory), ('past_block', cells_past_block),
         ('speculative', cells_speculative), ('moe', cells_moe), ('depth_batching', cells_depth))


def table_line(i, what, value, target, met):
    ok = '-' if met is None else ('yes' if met else 'NO')
    return f"{i:<2} {what:<52} {value:>26}  {target:<26} {ok:<4}"


def fmt_table(res):
    m = res['machine']
    lines = [f"nanoloop bench ({res['size']}), {where(m)}, torch {m['torch']}, {res['timer']} clock, "
             f"{m['date']}",
             f"{'#':<2} {'measurement':<52} {'value':>26}  {'target':<26} {'ok':<4}"]
    if res.get('bf16_note'):
        lines.insert(1, res['bf16_note'])
    note = ' ' * 5  # indent of a note under its row
    for i, (name, cells) in enumerate(TABLE, start=1):
        row = res['rows'].get(name)
        if row is None and res.get('only'):
            continue  # not asked for (--only)
        if row is None or 'error' in row:
            lines.append(table_line(i, name, 'not measured', '', False))
            lines.append(note + (row['error'] if row else 'missing'))
            continue
        for j, cell in enumerate(cells(row)):
            lines.append(note + cell if isinstance(cell, str) else table_line(i if j == 0 else '', *cell))
    return '\n'.join(lines)


# -----------------------------------------------------------------------------

def parse_args(argv):
    p = Parser('lab/bench.py', __doc__)
    p.add_argument('--device', default='auto', choices=('auto', 'cpu', 'cuda'),
                   help='auto: cuda if available')
    p.add_argument('--size', default='auto', choices=('auto',) + tuple(SIZES),
                   help="auto: 'gpu' on cuda, else 'cpu'")
    p.add_argument('--compile', default=None, action=argparse.BooleanOptionalAction,
                   help='time torch.compile vs eager (row 6; default: on cuda only, it takes minutes on a '
                        'CPU); the graph-break count runs either way')
    p.add_argument('--bf16', default=None, action=argparse.BooleanOptionalAction,
                   help='time bf16 too in rows 6 and 8-12 (default: where the device has bf16 units, and at '
                        'the tiny size)')
    p.add_argument('--repeats', type=int, default=0, help="timed repeats per measurement (0 = the size's)")
    p.add_argument('--threads', type=int, default=0, help="CPU threads for torch (0 = torch's default)")
    p.add_argument('--timer', default='wall', choices=('wall', 'process'),
                   help="wall: perf_counter; process: CPU time of this process (CPU only, use with "
                        "--threads=1 on a busy machine: other processes' load then barely moves the numbers)")
    p.add_argument('--out', default='bench.json', help='the JSON file to write')
    p.add_argument('--only', default='', help='comma-separated row names to measure (default: all): '
                   + ', '.join(name for name, _ in MEASUREMENTS))
    p.add_argument('--mem_child', default=None, help=argparse.SUPPRESS)  # internal: row 2's child process
    args = p.parse_args(argv)
    for name in ('repeats', 'threads'):
        if getattr(args, name) < 0:
            die(f"--{name}={getattr(args, name)}: must be >= 0 (0 = the default)")
    known = [name for name, _ in MEASUREMENTS]
    args.only = [name for name in args.only.split(',') if name]
    for name in args.only:
        if name not in known:
            die(f"--only={name}: choose among {', '.join(known)}")
    return args


def choose_device(name):
    if name == 'auto':
        return torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    if name == 'cuda' and not torch.cuda.is_available():
        die("--device=cuda but torch.cuda.is_available() is False; use --device=cpu")
    return torch.device(name)


def bf16_plan(device, size, force=None):
    """(the dtypes of rows 6 and 8-12, a note or None). A CPU without bf16 units emulates a bf16 matmul,
    ~60x slower than fp32 on a 2-core laptop (0.6-0.7 against 39-62 GFLOP/s): at the cpu size its bf16
    rows would take most of an hour to say only that, so they are left out. The tiny size (toys, seconds)
    and --bf16 run them anyway, marked as emulated; --no-bf16 leaves them out anywhere."""
    if force is False:
        return ('float32',), 'fp32 only (--no-bf16)'
    if device.type == 'cuda' or cpu_bf16_units():
        return DTYPES, None
    if force or size == 'tiny':
        return DTYPES, 'bf16 is emulated on this CPU (no bf16 units): its bf16 numbers say little'
    return ('float32',), 'fp32 only: this CPU has no bf16 units, so bf16 is emulated (--bf16 times it anyway)'


def setup(args):
    """The Run that args ask for; sets the clock and CUDA's matmul precision."""
    global CLOCK
    device = choose_device(args.device)
    if args.timer == 'process':
        if device.type == 'cuda':
            die("--timer=process measures CPU time: use --timer=wall on cuda")
        CLOCK = time.process_time
    if device.type == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if args.size == 'auto':
        args.size = 'gpu' if device.type == 'cuda' else 'cpu'
    size = SIZES[args.size]
    compile_too = device.type == 'cuda' if args.compile is None else args.compile
    repeats = args.repeats or size['repeats']
    dtypes, note = bf16_plan(device, args.size, args.bf16)
    return Run(size, device, warmup=size['warmup'], repeats=repeats, compile=compile_too, dtypes=dtypes,
               bf16_note=note)


def write_json(res, path):
    with open(path, 'w') as out:
        json.dump(res, out, indent=1)


def plan(run, only=()):
    """The rows to measure, in order, as (name, measure, estimated seconds at the cpu size): every row of
    MEASUREMENTS, or those in only."""
    rows = []
    for name, measure in MEASUREMENTS:
        if only and name not in only:
            continue
        fp32, bf16 = COMPILE_COST if name == 'compile' and run.compile else COST[name]
        rows.append((name, measure, fp32 + (bf16 if 'bfloat16' in run.dtypes else 0)))
    return rows


def measure_all(run, res, out_path, only=()):
    """Every row in turn (or those in only), each announced with the time so far and an ETA; the JSON is
    written after each, so an interrupted run keeps what it measured. The ETA weighs the rows left by COST,
    scaled by how fast the rows so far went against it."""
    rows = plan(run, only)
    total, done = sum(cost for *_, cost in rows), 0
    t0 = time.perf_counter()
    for i, (name, measure, cost) in enumerate(rows, start=1):
        elapsed = time.perf_counter() - t0
        if done:
            eta = f"about {duration(elapsed / done * (total - done))} left"
        else:  # nothing timed yet: COST itself, which is a 2-core laptop at the cpu size
            laptop = res['size'] == 'cpu'
            eta = f"about {duration(total)} left on a 2-core laptop" if laptop else 'ETA after it'
        print(f"  [{i}/{len(rows)}] {name}: {duration(elapsed)} so far, {eta}", flush=True)
        try:
            res['rows'].update(measure(run))
        except Exception as e:  # one broken row should not cost the others: record it and go on
            res['rows'].setdefault(name, dict(error=f"{type(e).__name__}: {e}"[:500], met=False))
        done += cost
        write_json(res, out_path)
    res['seconds'] = time.perf_counter() - t0


def main(argv=None):
    args = parse_args(argv)
    # before torch's thread pool starts: an untrained head's softmax gradient at V = 50,257 (rows 2
    # and 3) is full of denormals, which took those rows over 20 minutes on a busy 2-core Intel CPU
    flush_denormals()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.mem_child is not None:  # row 2's child process: one measurement, printed as JSON
        job = json.loads(args.mem_child)
        print(json.dumps(peak_step_memory(job['spec'], job['loss'])))
        return None
    run = setup(args)
    torch.manual_seed(1337)
    res = dict(machine=machine(run.device), size=args.size, repeats=run.repeats, warmup=run.warmup,
               timer=args.timer, only=args.only, dtypes=list(run.dtypes), bf16_note=run.bf16_note, rows={},
               samples=SAMPLES)
    print(f"bench: {where(res['machine'])}, torch {torch.__version__}, size {args.size}, {args.timer} clock, "
          f"{run.repeats} repeats after {run.warmup} warm-up; "
          f"{run.bf16_note or ' and '.join(SHORT[d] for d in run.dtypes)}", flush=True)
    measure_all(run, res, args.out, args.only)
    res['table'] = fmt_table(res)
    print(res['table'])
    write_json(res, args.out)
    print(f"wrote {args.out} ({res['seconds']:.0f}s)")
    return res


if __name__ == '__main__':
    main()
