"""
Is looping free? Measure it, side by side in one run, and print one table of ratios (as nanoGPT's bench.py,
but every number here is a ratio of two things timed in the same process, interleaved, medians over repeats,
warm-up excluded).

    python bench.py                                   # CPU, a few minutes; writes bench.json
    python bench.py --compile                         # also time torch.compile (minutes on a CPU)
    python bench.py --threads=1 --timer=process       # on a busy machine: CPU seconds, not wall time
    python bench.py --device=cuda --out=bench_cuda.json   # GPU sizes (bf16 autocast)

Rows (issue 5's targets):
  1 train tok/s   K layers x R loops vs an untied stack of K*R layers, same width, terminal loss   >= 0.97
  2 peak memory   one training step, per-loop vs terminal loss, GPT-2 vocabulary, R = 4          <= 1.25
  3 step time     per-loop vs terminal at that vocabulary                   <= 1 + (R-1) * head share
  4 decoding      tok/s with the KV cache vs without, 512 new tokens, fixed exit                  >= 5x
  5 early exit    adaptive-exit decoding: tok/s and mean loops per token vs fixed R              report
  6 compile       torch.compile vs eager training step; graph breaks of the looped forward       0 breaks
  7 MFU           model flops / s of the looped step against the matmul ceiling (CPU: measured here;
                  CUDA: GPT.peak_flops of the device, and the measured bf16 matmul rate)
A "training step" is forward + backward (the optimizer update is left out: it is per parameter, and a
looped model has R times fewer parameters, which would flatter row 1).
"""

import argparse
import contextlib
import datetime
import gc
import io
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import torch
from torch.nn import functional as F

from model import GPT, GPTConfig, LinearCrossEntropy

# sizes: 'cpu' runs in a few minutes on a laptop-class CPU, 'tiny' in seconds (tests), 'gpu' for one GPU
SIZES = {
    'tiny': dict(
        speed=dict(n_embd=32, n_head=2, n_layer=2, n_loop=2, batch_size=2, block_size=32, vocab_size=65),
        head=dict(n_embd=32, n_head=2, n_layer=1, n_loop=4, batch_size=2, block_size=32, vocab_size=50257),
        decode=dict(n_embd=32, n_head=2, n_layer=1, n_loop=3, prompt=8, new_tokens=24, vocab_size=512),
        matmul=256, repeats=3, warmup=1, decode_repeats=1),
    'cpu': dict(
        speed=dict(n_embd=192, n_head=4, n_layer=2, n_loop=4, batch_size=4, block_size=256, vocab_size=65),
        head=dict(n_embd=128, n_head=4, n_layer=2, n_loop=4, batch_size=2, block_size=256, vocab_size=50257),
        # decoding: train.py's default model (shakespeare_char). At GPT-2's vocabulary a d=128 model's head is
        # 3x its layers, and both modes spend most of a token in the head (3.6x measured on 2026-11-30)
        decode=dict(n_embd=128, n_head=4, n_layer=2, n_loop=4, prompt=16, new_tokens=512, vocab_size=65),
        matmul=2048, repeats=7, warmup=2, decode_repeats=2),
    'gpu': dict(
        speed=dict(n_embd=768, n_head=12, n_layer=4, n_loop=3, batch_size=8, block_size=1024, vocab_size=50304),
        head=dict(n_embd=768, n_head=12, n_layer=2, n_loop=4, batch_size=8, block_size=1024, vocab_size=50257),
        decode=dict(n_embd=768, n_head=12, n_layer=4, n_loop=3, prompt=16, new_tokens=512, vocab_size=50257),
        matmul=8192, repeats=10, warmup=3, decode_repeats=3),
}
MODEL_KEYS = ('n_embd', 'n_head', 'n_layer', 'n_loop', 'block_size', 'vocab_size')


# -----------------------------------------------------------------------------
# helpers

def build(device, dtype=torch.float32, **kw):
    # a quiet GPT (GPT.__init__ prints its parameter count)
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


def autocast(device):
    # CUDA: bf16 autocast as train.py does; CPU: plain float32
    return torch.autocast('cuda', dtype=torch.bfloat16) if device.type == 'cuda' else contextlib.nullcontext()


def train_step(model, X, Y, device):
    """One forward + backward (what every training step costs; the optimizer update is left out)."""
    def step():
        with autocast(device):
            _, loss = model(X, Y)
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


def machine(device):
    info = dict(torch=torch.__version__, python=platform.python_version(),
                date=datetime.datetime.now().strftime('%Y-%m-%d %H:%M'), device=device.type)
    cpu = platform.processor() or platform.machine()
    try:
        with open('/proc/cpuinfo') as f:
            cpu = next(line.split(':', 1)[1].strip() for line in f if line.startswith('model name'))
    except (OSError, StopIteration):
        pass
    info.update(cpu=cpu, cpu_threads=torch.get_num_threads(), cpu_cores=os.cpu_count())
    if device.type == 'cuda':
        info.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    return info


def matmul_ceiling(device, n, warmup, repeats):
    """FLOP/s of a large square matmul: fp32 on CPU, bf16 on CUDA (random data, not zeros)."""
    dtype = torch.bfloat16 if device.type == 'cuda' else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    dt = side_by_side({'mm': lambda: a @ b}, device, warmup, repeats)['mm']
    return 2 * n ** 3 / dt


# -----------------------------------------------------------------------------
# row 2: peak memory of one training step

def naive_per_loop_loss(model, X, Y):
    # the textbook per-loop loss: R full (B, T, V) logit tensors, all kept alive for the backward pass
    states = model.loop_states(X)
    R = len(states)
    return sum(F.cross_entropy(model.readout(h, k).float().view(-1, model.config.vocab_size), Y.view(-1),
                               ignore_index=-1) for k, h in enumerate(states, start=1)) / R


def step_for(model, X, Y, loss_kind, device):
    def step():
        with autocast(device):
            loss = naive_per_loop_loss(model, X, Y) if loss_kind == 'naive' else model(X, Y)[1]
        loss.backward()
        model.zero_grad(set_to_none=True)
    return step


def proc_status(key):
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith(key + ':'):
                return int(line.split()[1]) * 1024  # kB -> bytes
    raise KeyError(key)


def peak_step_memory(spec, loss_kind, device_name='cpu'):
    """Bytes one training step needs above what is resident before it (model, batch, one warm-up step done).

    CPU: in this (fresh) process, the high-water RSS is reset through /proc/self/clear_refs and read from
    VmHWM; where that is not possible, resource.getrusage's max RSS minus the RSS before the step (then an
    upper bound). Run it in a child process with MALLOC_MMAP_THRESHOLD_ set (see memory_child) so that every
    large tensor is its own mmap and is handed back to the OS when freed. CUDA: torch.cuda.max_memory_allocated.
    """
    device = torch.device(device_name)
    supervision = 'terminal' if loss_kind == 'terminal' else 'per_loop'
    model = build(device, **spec, supervision=supervision)
    X, Y = batch(spec, device)
    step = step_for(model, X, Y, loss_kind, device)
    step()  # warm-up: one-time buffers (thread pools, kernels) are not the step's
    gc.collect()
    if device.type == 'cuda':
        sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        sync(device)
        return dict(peak_bytes=torch.cuda.max_memory_allocated(device) - base, method='torch.cuda.max_memory_allocated')
    try:
        with open('/proc/self/clear_refs', 'w') as f:
            f.write('5')  # resets VmHWM (Linux >= 4.0)
        base = proc_status('VmRSS')
        step()
        return dict(peak_bytes=proc_status('VmHWM') - base, method='VmHWM after clear_refs, minus VmRSS before')
    except OSError:
        base = proc_status('VmRSS') if os.path.exists('/proc/self/status') else 0
        step()
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        maxrss *= 1 if sys.platform == 'darwin' else 1024  # bytes on macOS, KiB on Linux
        return dict(peak_bytes=maxrss - base, method='getrusage max RSS minus RSS before (upper bound)')


def memory_child(spec, loss_kind):
    """peak_step_memory on CPU in a fresh Python process (its own RSS, nothing else's)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_='65536', MALLOC_TRIM_THRESHOLD_='0', PYTHONUNBUFFERED='1')
    cmd = [sys.executable, os.path.abspath(__file__), f'--threads={torch.get_num_threads()}', '--mem_child', json.dumps(dict(spec=spec, loss=loss_kind))]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(os.path.abspath(__file__)))
    if out.returncode != 0:
        raise RuntimeError(f"memory child ({loss_kind}) failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def row_memory(size, device):
    spec = size['head']
    # terminal and per-loop as the model computes them, plus the naive per-loop loss for scale
    kinds = ('terminal', 'per_loop', 'naive')
    if device.type == 'cuda':
        res = {k: peak_step_memory(spec, k, str(device)) for k in kinds}
        torch.cuda.empty_cache()
    else:
        res = {k: memory_child(spec, k) for k in kinds}
    mib = {k: v['peak_bytes'] / 2 ** 20 for k, v in res.items()}
    B, T, V = spec['batch_size'], spec['block_size'], spec['vocab_size']
    return dict(ratio=mib['per_loop'] / mib['terminal'], target='<= 1.25', met=mib['per_loop'] / mib['terminal'] <= 1.25,
                terminal_mib=mib['terminal'], per_loop_mib=mib['per_loop'], naive_per_loop_mib=mib['naive'],
                naive_ratio=mib['naive'] / mib['terminal'], one_logits_tensor_mib=B * T * V * 4 / 2 ** 20,
                method=res['terminal']['method'], config={k: spec[k] for k in spec})


# -----------------------------------------------------------------------------
# rows 1, 3, 6, 7: training steps

def row_untied(size, device, warmup, repeats):
    spec = size['speed']
    K, R = spec['n_layer'], spec['n_loop']
    looped = build(device, **spec, supervision='terminal')
    untied = build(device, **dict(spec, n_layer=K * R, n_loop=1), supervision='terminal')
    X, Y = batch(spec, device)
    t = side_by_side({'looped': train_step(looped, X, Y, device), 'untied': train_step(untied, X, Y, device)},
                     device, warmup, repeats)
    tokens = X.numel()
    ratio = t['untied'] / t['looped']  # tokens/s looped over tokens/s untied
    return dict(ratio=ratio, target='>= 0.97', met=ratio >= 0.97, looped_tok_s=tokens / t['looped'],
                untied_tok_s=tokens / t['untied'], looped_s=t['looped'], untied_s=t['untied'],
                config=dict(spec, supervision='terminal')), looped, (X, Y)


def row_step_time(size, device, warmup, repeats):
    spec = size['head']
    R = spec['n_loop']
    terminal = build(device, **spec, supervision='terminal')
    per_loop = build(device, **spec, supervision='per_loop')
    per_loop.load_state_dict(terminal.state_dict())
    X, Y = batch(spec, device)
    # the head alone: readout norm + linear + CE, forward and backward, for one exit (what each extra exit adds)
    # timed on the model's own final state h_R (the data changes the cost of the softmax on a CPU)
    with torch.no_grad(), autocast(device):
        h = terminal.loop_states(X)[-1].float()
    h.requires_grad_(True)

    def head():
        with autocast(device):
            loss = LinearCrossEntropy.apply(terminal.lm_head.weight, Y, (1.0,), terminal.readout_norm(h, R)[None])
        loss.backward()
        h.grad = None
        terminal.zero_grad(set_to_none=True)
    t = side_by_side({'terminal': train_step(terminal, X, Y, device), 'per_loop': train_step(per_loop, X, Y, device),
                      'head': head}, device, warmup, repeats)
    share = t['head'] / t['terminal']
    bound = 1 + (R - 1) * share
    ratio = t['per_loop'] / t['terminal']
    return dict(ratio=ratio, bound=bound, target='<= 1 + (R-1) * head share', met=ratio <= bound,
                head_share=share, terminal_s=t['terminal'], per_loop_s=t['per_loop'], head_s=t['head'],
                config=dict(spec))


def row_compile(looped, XY, size, device, warmup, repeats, do_compile):
    import torch._dynamo
    X, Y = XY
    # graph breaks of the looped training forward (loss included): dynamo's explain, no compilation
    torch._dynamo.reset()
    ex = torch._dynamo.explain(looped)(X, Y)
    out = dict(graph_breaks=ex.graph_break_count, graphs=ex.graph_count, target='0 graph breaks; report speed',
               break_reasons=[str(r.reason) for r in ex.break_reasons][:5])
    out['met'] = ex.graph_break_count == 0
    torch._dynamo.reset()
    if not do_compile:
        out.update(ratio=None, skipped='not asked for (--compile)')
        return out, None
    compiled = torch.compile(looped)
    t0 = time.perf_counter()
    train_step(compiled, X, Y, device)()  # compiles forward and backward
    sync(device)
    out['compile_s'] = time.perf_counter() - t0
    t = side_by_side({'eager': train_step(looped, X, Y, device), 'compiled': train_step(compiled, X, Y, device)},
                     device, warmup, repeats)
    out.update(ratio=t['eager'] / t['compiled'], eager_s=t['eager'], compiled_s=t['compiled'],
               eager_tok_s=X.numel() / t['eager'], compiled_tok_s=X.numel() / t['compiled'])
    return out, t['compiled']


def row_mfu(looped, size, device, untied, compiled_s, warmup, repeats):
    T = size['speed']['block_size']
    tokens = size['speed']['batch_size'] * T
    flops = looped.flops_per_token(T) * tokens  # forward + backward flops of one step
    ceiling = matmul_ceiling(device, size['matmul'], warmup, repeats)
    out = dict(matmul_flops=ceiling, matmul_n=size['matmul'], model_flops_per_step=flops,
               eager_flops=flops / untied['looped_s'], mfu_vs_matmul=flops / untied['looped_s'] / ceiling,
               target='report')
    if compiled_s is not None:
        out['compiled_mfu_vs_matmul'] = flops / compiled_s / ceiling
    if device.type == 'cuda':
        peak = GPT.peak_flops(torch.cuda.get_device_name(device))
        out['peak_flops'] = peak
        if peak:
            out['mfu_vs_peak'] = flops / untied['looped_s'] / peak
            if compiled_s is not None:
                out['compiled_mfu_vs_peak'] = flops / compiled_s / peak
    return out


# -----------------------------------------------------------------------------
# rows 4, 5: decoding

def row_decode(size, device, warmup, repeats):
    spec = size['decode']
    n_new, R = spec['new_tokens'], spec['n_loop']
    block_size = spec['prompt'] + n_new  # holds prompt + every new token: no crop in either mode
    # init='gpt2': under the reference init, wte ~ N(0, 1) and the tied head make exit 1 echo the input token
    # with probability ~1, and every token would leave after one loop
    model = build(device, **dict(spec, block_size=block_size), init='gpt2').eval()
    if device.type == 'cuda':
        model = model.to(torch.bfloat16)
    prompt = torch.randint(spec['vocab_size'], (1, spec['prompt']), generator=torch.Generator().manual_seed(0)).to(device)
    # adaptive exit: on an untrained model the confidences mean nothing, so the threshold is set at the median
    # max-prob of exit 1 over random tokens: about half the tokens should leave after the first loop
    with torch.no_grad():
        probe = torch.randint(spec['vocab_size'], (1, min(block_size, 256)), generator=torch.Generator().manual_seed(1)).to(device)
        h1 = model.loop_states(probe, n_loop=1)[0]
        threshold = model.readout(h1, 1).float().softmax(-1).amax(-1).median().item()

    def gen(use_cache, exit_threshold=None):
        def run():
            torch.manual_seed(0)
            model.generate(prompt, n_new, temperature=1.0, use_cache=use_cache, exit_threshold=exit_threshold)
        return run
    # the uncached run costs ~n_new full forwards: fewer repeats for it
    t = side_by_side({'cached': gen(True), 'adaptive': gen(True, threshold)}, device, 1, min(3, repeats))
    t.update(side_by_side({'uncached': gen(False)}, device, 0, min(size['decode_repeats'], repeats)))
    gen(True, threshold)()
    loops = model.last_loops_used[:, 1:].float().mean().item()  # the first token comes off the full prompt pass
    kv = dict(ratio=t['uncached'] / t['cached'], target='>= 5x', met=t['uncached'] / t['cached'] >= 5,
              cached_tok_s=n_new / t['cached'], uncached_tok_s=n_new / t['uncached'],
              config=dict(spec, block_size=block_size, batch_size=1))
    adaptive = dict(ratio=t['cached'] / t['adaptive'], target='report', met=None, threshold=threshold,
                    mean_loops=loops, fixed_loops=R, adaptive_tok_s=n_new / t['adaptive'],
                    fixed_tok_s=n_new / t['cached'], exit_policy='maxprob')
    return kv, adaptive


# -----------------------------------------------------------------------------

def fmt_table(res):
    m = res['machine']
    where = f"gpu: {m['gpu']}, cuda {m['cuda']}" if m['device'] == 'cuda' else f"cpu: {m['cpu']}, {m['cpu_threads']} threads"
    lines = [f"nanoloop bench ({res['size']}), {where}, torch {m['torch']}, {res['timer']} clock, {m['date']}",
             f"{'#':<2} {'measurement':<46} {'value':>26}  {'target':<24} {'ok':<4}"]

    def line(i, what, value, target, met):
        ok = '-' if met is None else ('yes' if met else 'NO')
        lines.append(f"{i:<2} {what:<46} {value:>26}  {target:<24} {ok:<4}")

    def untied(u):
        c = u['config']
        line(1, f"train tok/s K={c['n_layer']} x R={c['n_loop']} vs untied {c['n_layer'] * c['n_loop']} layers",
             f"{u['ratio']:.3f} ({u['looped_tok_s']:,.0f}/{u['untied_tok_s']:,.0f})", '>= 0.97', u['met'])

    def memory(mm):
        line(2, f"peak step memory per-loop / terminal (V={mm['config']['vocab_size']})",
             f"{mm['ratio']:.3f} ({mm['per_loop_mib']:.0f}/{mm['terminal_mib']:.0f} MiB)", '<= 1.25', mm['met'])
        lines.append(f"{'':<2}   (naive per-loop, R logit tensors kept: {mm['naive_per_loop_mib']:.0f} MiB = "
                     f"{mm['naive_ratio']:.2f}x terminal)")

    def step_time(s):
        line(3, f"step time per-loop / terminal (R={s['config']['n_loop']})", f"{s['ratio']:.2f}",
             f"<= {s['bound']:.2f} (share {s['head_share']:.2f})", s['met'])

    def kv(k):
        line(4, f"decode tok/s cached / uncached ({k['config']['new_tokens']} new)",
             f"{k['ratio']:.1f}x ({k['cached_tok_s']:.0f}/{k['uncached_tok_s']:.0f})", '>= 5x', k['met'])

    def adaptive(a):
        line(5, "adaptive / fixed-R decode tok/s; loops/token",
             f"{a['ratio']:.2f}x; {a['mean_loops']:.2f}/{a['fixed_loops']}", 'report', None)

    def compiled(c):
        cval = 'skipped' if c.get('ratio') is None else f"{c['ratio']:.2f}x (compile {c['compile_s']:.0f}s)"
        line(6, "compiled / eager train step speed; graph breaks", f"{cval}; {c['graph_breaks']} breaks",
             '0 breaks', c['met'])

    def mfu(f):
        val = f"{f['mfu_vs_matmul'] * 100:.1f}%"
        if f.get('compiled_mfu_vs_matmul') is not None:
            val += f" ({f['compiled_mfu_vs_matmul'] * 100:.1f}% compiled)"
        line(7, f"MFU of the looped step vs matmul {f['matmul_flops'] / 1e9:,.0f} GFLOP/s", val, 'report', None)
        if f.get('mfu_vs_peak') is not None:
            v = f"{f['mfu_vs_peak'] * 100:.1f}%" + (f" ({f['compiled_mfu_vs_peak'] * 100:.1f}% compiled)"
                                                   if f.get('compiled_mfu_vs_peak') is not None else '')
            line('', f"  vs datasheet peak {f['peak_flops'] / 1e12:.0f} TFLOP/s", v, 'report', None)
    for i, (name, show) in enumerate([('untied_vs_looped', untied), ('peak_memory', memory), ('step_time', step_time),
                                      ('kv_cache', kv), ('adaptive_exit', adaptive), ('compile', compiled),
                                      ('mfu', mfu)], start=1):
        row = res['rows'].get(name)
        if row is None or 'error' in row:
            line(i, name, 'not measured', '', False)
            lines.append(f"{'':<2}   {row['error'] if row else 'missing'}")
        else:
            show(row)
    return '\n'.join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--device', default='auto', choices=('auto', 'cpu', 'cuda'), help='auto: cuda if available')
    p.add_argument('--size', default='auto', choices=('auto',) + tuple(SIZES), help="auto: 'gpu' on cuda, else 'cpu'")
    p.add_argument('--compile', default=None, action=argparse.BooleanOptionalAction,
                   help='time torch.compile vs eager (row 6; default: on cuda only, it takes minutes on a CPU); '
                        'the graph-break count runs either way')
    p.add_argument('--repeats', type=int, default=0, help="timed repeats per measurement (0 = the size's)")
    p.add_argument('--threads', type=int, default=0, help="CPU threads for torch (0 = torch's default)")
    p.add_argument('--timer', default='wall', choices=('wall', 'process'),
                   help="wall: perf_counter; process: CPU time of this process (CPU only, use with --threads=1 "
                        "on a busy machine: other processes' load then barely moves the numbers)")
    p.add_argument('--out', default='bench.json', help='the JSON file to write')
    p.add_argument('--mem_child', default=None, help=argparse.SUPPRESS)  # internal: row 2's child process
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.mem_child is not None:
        job = json.loads(args.mem_child)
        print(json.dumps(peak_step_memory(job['spec'], job['loss'])))
        return None

    if args.device == 'auto':
        args.device = 'cuda' if torch.cuda.is_available() else 'cpu'
    if args.device == 'cuda' and not torch.cuda.is_available():
        sys.exit("error: --device=cuda but torch.cuda.is_available() is False; use --device=cpu")
    device = torch.device(args.device)
    if args.compile is None:
        args.compile = device.type == 'cuda'
    global CLOCK
    if args.timer == 'process':
        if device.type == 'cuda':
            sys.exit("error: --timer=process measures CPU time: use --timer=wall on cuda")
        CLOCK = time.process_time
    size_name = ('gpu' if device.type == 'cuda' else 'cpu') if args.size == 'auto' else args.size
    size = SIZES[size_name]
    warmup, repeats = size['warmup'], args.repeats or size['repeats']
    if device.type == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(1337)
    res = dict(machine=machine(device), size=size_name, repeats=repeats, warmup=warmup, timer=args.timer, rows={},
               samples=SAMPLES)
    m = res['machine']
    print(f"bench: {m['device']}, " + (f"{m['gpu']}" if device.type == 'cuda' else f"{m['cpu']}, {m['cpu_threads']} threads")
          + f", torch {m['torch']}, size {size_name}, {args.timer} clock, {repeats} repeats after {warmup} warm-up",
          flush=True)
    rows, t0, keep = res['rows'], time.perf_counter(), {}

    def untied():
        rows['untied_vs_looped'], keep['looped'], keep['XY'] = row_untied(size, device, warmup, repeats)

    def decode():
        rows['kv_cache'], rows['adaptive_exit'] = row_decode(size, device, warmup, repeats)

    def compiled():
        rows['compile'], keep['compiled_s'] = row_compile(keep['looped'], keep['XY'], size, device, warmup, repeats,
                                                          args.compile)
    steps = [
        ('untied_vs_looped', untied),
        ('peak_memory', lambda: rows.update(peak_memory=row_memory(size, device))),
        ('step_time', lambda: rows.update(step_time=row_step_time(size, device, warmup, repeats))),
        ('kv_cache', decode),
        ('compile', compiled),
        ('mfu', lambda: rows.update(mfu=row_mfu(keep['looped'], size, device, rows['untied_vs_looped'],
                                                keep.get('compiled_s'), warmup, repeats))),
    ]
    for name, fn in steps:
        try:
            fn()
        except Exception as e:  # one broken row should not cost the others: record it and go on
            rows.setdefault(name, dict(error=f"{type(e).__name__}: {e}"[:500], met=False))
        print(f"  {name} done ({time.perf_counter() - t0:.0f}s)", flush=True)
        with open(args.out, 'w') as f:  # after every row, so an interrupted run keeps what it measured
            json.dump(res, f, indent=1)
    res['seconds'] = time.perf_counter() - t0
    table = fmt_table(res)
    res['table'] = table
    print(table)
    with open(args.out, 'w') as f:
        json.dump(res, f, indent=1)
    print(f"wrote {args.out} ({res['seconds']:.0f}s)")
    return res


if __name__ == '__main__':
    main()
