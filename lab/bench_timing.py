"""
What every row of lab/bench.py is measured with: the Run (the device, the repeats, the clock, and what one row
hands on to later rows), a quiet model builder, and side_by_side, the interleaved timer whose medians every
ratio of the table is made of. The training rows (bench_train.py), the decoding rows (bench_decode.py) and
Looped-MoE's row (bench_moe.py) import this; it imports none of them, nor bench.py.
"""

import contextlib
import io
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the core is one folder up
from model import GPT, GPTConfig

DTYPES = ('float32', 'bfloat16')  # what rows 6 and 8-12 time, where the machine runs bf16 usefully
SHORT = {'float32': 'fp32', 'bfloat16': 'bf16'}


@dataclass
class Run:
    """What every row is measured with, and what a row hands on to later rows."""
    size: dict                # one entry of bench.py's SIZES
    device: torch.device
    warmup: int               # untimed calls before the timed ones
    repeats: int              # timed calls per measurement
    compile: bool             # row 6: time torch.compile (the graph-break count runs either way)
    dtypes: tuple = DTYPES    # rows 6 and 8-12: fp32 only on a CPU without bf16 units (see bf16_plan)
    bf16_note: str = None     # why bf16 is left out, or that it is emulated (the table says it)
    clock: object = time.perf_counter  # --timer=process: time.process_time (CPU seconds of this process)
    samples: dict = field(default_factory=dict)  # every timed sample, by measurement name (into the JSON)
    looped: GPT = None        # row 1's looped model, its batch and its step time: re-used by rows 6 and 7
    batch: tuple = None
    looped_s: float = None
    compiled_s: float = None  # row 6's compiled step time, for row 7 (None when not compiled)
    ceilings: dict = None     # matmul ceiling per dtype, measured once (rows 7 and 10)
    default_s: dict = None    # row 8's nanoloop step seconds per dtype, for rows 9 and 10
    default_compiled_s: dict = None  # row 6's compiled step seconds of the default run per dtype (CPU)


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


def sync(device):
    if device.type == 'cuda':
        torch.cuda.synchronize()


def side_by_side(fns, run, warmup, repeats):
    """Median seconds of each fn in fns (a dict), timed interleaved on run's device and clock: A B C, C B A,
    ... so that drift in the machine's load falls on all of them alike. Warm-up calls are not timed. Every
    timed sample goes into run.samples under its fn's name."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times = {name: [] for name in names}
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            sync(run.device)
            t0 = run.clock()
            fns[name]()
            sync(run.device)
            times[name].append(run.clock() - t0)
    run.samples.update({name: [round(t, 6) for t in ts] for name, ts in times.items()})
    return {name: statistics.median(t) for name, t in times.items()}


def matmul_ceiling(device, n, warmup, repeats, dtype=None, clock=time.perf_counter):
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
        t0 = clock()
        a @ b
        sync(device)
        best = min(best, clock() - t0)
    return 2 * n ** 3 / best


def ceilings(run):
    """The matmul ceiling of each dtype: the best FLOP/s over the size's matmul sizes and repeats."""
    if run.ceilings is None:
        run.ceilings = {}
        for name in run.dtypes:
            dtype = getattr(torch, name)
            by_size = {n: matmul_ceiling(run.device, n, run.warmup, run.repeats, dtype, run.clock)
                       for n in run.size['matmul']}
            n = max(by_size, key=by_size.get)
            run.ceilings[name] = dict(flops=by_size[n], n=n, by_size={str(k): v for k, v in by_size.items()})
    return run.ceilings


def dtypes(row):
    """The dtypes a per-dtype row was measured in (a JSON from before the bf16 plan: both)."""
    return row.get('dtypes', DTYPES)


if __name__ == '__main__':  # a module the lab's commands import
    print("lab/bench_timing.py: bench.py's timer, not a command; see python lab/bench.py --help")
