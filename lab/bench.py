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
    python lab/bench.py --only=vs_plain,bf16,mfu_dtype  # some rows only (names: see --only)
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
import datetime
import json
import os
import platform
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the core is one folder up
from compute.hardware import cpu_bf16_units, flush_denormals
from configurator import Parser, die
from run.ops import duration
# the rows: bench_train.py (rows 1-3, 6-12), bench_decode.py (4-5, 13-16, 18) and bench_moe.py (17), all
# measured with bench_timing.py's Run and interleaved timer
import bench_decode
import bench_moe
import bench_train
from bench_timing import DTYPES, SHORT, Run

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

# -----------------------------------------------------------------------------
# the rows of the table, in order: rows 6 and 7 use row 1's model, rows 9 and 10 row 8's step times

@dataclass(frozen=True)
class Row:
    name: str        # its key in the JSON's rows (and its --only name, where it is measured on its own)
    measure: object  # run -> {name: result, ...}; None: measured by the row before it (row 5 by row 4's)
    cells: object    # result -> its lines of the table: (measurement, value, target, met) or a note string
    cost: tuple      # (fp32 part, bf16 part): seconds at the cpu size on a 2-core laptop (the ETA's weights)


# costs from a run on a busy 2-core Xeon (5m26s there, load ~4) halved: only the ETA's weights, which it
# scales by the rows so far
ROWS = (Row('untied_vs_looped', bench_train.row_untied, bench_train.cells_untied, (26, 0)),
        Row('peak_memory', bench_train.row_memory, bench_train.cells_memory, (7, 0)),
        Row('step_time', bench_train.row_step_time, bench_train.cells_step_time, (8, 0)),
        Row('kv_cache', bench_decode.row_decode, bench_decode.cells_kv_cache, (27, 0)),
        Row('adaptive_exit', None, bench_decode.cells_adaptive, (0, 0)),
        Row('compile', bench_train.row_compile, bench_train.cells_compile, (3, 0)),
        Row('mfu', bench_train.row_mfu, bench_train.cells_mfu, (1, 1)),
        Row('vs_plain', bench_train.row_plain, bench_train.cells_plain, (3, 3)),
        Row('bf16', bench_train.row_bf16, bench_train.cells_bf16, (0, 0)),
        Row('mfu_dtype', bench_train.row_mfu_dtype, bench_train.cells_mfu_dtype, (0, 0)),
        Row('attention', bench_train.row_attention, bench_train.cells_attention, (35, 35)),
        Row('profile', bench_train.row_profile, bench_train.cells_profile, (8, 7)),
        Row('decode_policies', bench_decode.row_policies, bench_decode.cells_policies, (18, 0)),
        Row('cache_memory', bench_decode.row_cache_memory, bench_decode.cells_cache_memory, (0, 0)),
        Row('past_block', bench_decode.row_past_block, bench_decode.cells_past_block, (5, 0)),
        Row('speculative', bench_decode.row_speculative, bench_decode.cells_speculative, (5, 0)),
        Row('moe', bench_moe.row_moe, bench_moe.cells_moe, (45, 13)),
        Row('depth_batching', bench_decode.row_depth, bench_decode.cells_depth, (30, 0)))
COMPILE_COST = (120, 60)  # row 6 with --compile
MEASURED = tuple(row.name for row in ROWS if row.measure)  # what --only chooses among


# -----------------------------------------------------------------------------
# the table: per row, its cells (measurement, value, target, met) and any note lines under it

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
    for i, spec in enumerate(ROWS, start=1):
        name, row = spec.name, res['rows'].get(spec.name)
        if row is None and res.get('only'):
            continue  # not asked for (--only)
        if row is None or 'error' in row:
            lines.append(table_line(i, name, 'not measured', '', False))
            lines.append(note + (row['error'] if row else 'missing'))
            continue
        for j, cell in enumerate(spec.cells(row)):
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
                   + ', '.join(MEASURED))
    p.add_argument('--mem_child', default=None, help=argparse.SUPPRESS)  # internal: row 2's child process
    args = p.parse_args(argv)
    for name in ('repeats', 'threads'):
        if getattr(args, name) < 0:
            die(f"--{name}={getattr(args, name)}: must be >= 0 (0 = the default)")
    args.only = [name for name in args.only.split(',') if name]
    for name in args.only:
        if name not in MEASURED:
            die(f"--only={name}: choose among {', '.join(MEASURED)}")
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
    """The Run that args ask for, on the clock of --timer; sets CUDA's matmul precision."""
    device = choose_device(args.device)
    if args.timer == 'process' and device.type == 'cuda':
        die("--timer=process measures CPU time: use --timer=wall on cuda")
    if device.type == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if args.size == 'auto':
        args.size = 'gpu' if device.type == 'cuda' else 'cpu'
    size = SIZES[args.size]
    compile_too = device.type == 'cuda' if args.compile is None else args.compile
    repeats = args.repeats or size['repeats']
    dtypes, note = bf16_plan(device, args.size, args.bf16)
    clock = time.process_time if args.timer == 'process' else time.perf_counter
    return Run(size, device, warmup=size['warmup'], repeats=repeats, compile=compile_too, dtypes=dtypes,
               bf16_note=note, clock=clock)


def write_json(res, path):
    with open(path, 'w') as out:
        json.dump(res, out, indent=1)


def plan(run, only=()):
    """The rows to measure, in order, as (name, measure, estimated seconds at the cpu size): every row of
    ROWS that is measured on its own, or those in only."""
    rows = []
    for row in ROWS:
        if row.measure is None or (only and row.name not in only):
            continue
        fp32, bf16 = COMPILE_COST if row.name == 'compile' and run.compile else row.cost
        rows.append((row.name, row.measure, fp32 + (bf16 if 'bfloat16' in run.dtypes else 0)))
    return rows


def measure_all(run, res, out_path, only=()):
    """Every row in turn (or those in only), each announced with the time so far and an ETA; the JSON is
    written after each, so an interrupted run keeps what it measured. The ETA weighs the rows left by cost,
    scaled by how fast the rows so far went against it."""
    rows = plan(run, only)
    total, done = sum(cost for *_, cost in rows), 0
    t0 = time.perf_counter()
    for i, (name, measure, cost) in enumerate(rows, start=1):
        elapsed = time.perf_counter() - t0
        if done:
            eta = f"about {duration(elapsed / done * (total - done))} left"
        else:  # nothing timed yet: the costs themselves, which are a 2-core laptop at the cpu size
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
        print(json.dumps(bench_train.peak_step_memory(job['spec'], job['loss'])))
        return None
    run = setup(args)
    torch.manual_seed(1337)
    res = dict(machine=machine(run.device), size=args.size, repeats=run.repeats, warmup=run.warmup,
               timer=args.timer, only=args.only, dtypes=list(run.dtypes), bf16_note=run.bf16_note, rows={},
               samples=run.samples)
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
