"""
The training rows of lab/bench.py, each with the cells it puts in the table: looped vs untied (row 1), the
peak memory (2) and the step time (3) of per-loop supervision, torch.compile (6) and MFU (7) of row 1's model,
and train.py's default run against PlainLoopedGPT, the same model written plainly (8), in bf16 (9), against
the matmul ceiling of its dtype (10), per attention path (11) and profiled by op (12). A "training step" in
rows 1-7 is forward + backward; rows 8-12 time train.py's step as it runs (forward, backward, AdamW).
"""

import contextlib
import gc
import io
import json
import math
import os
import resource
import subprocess
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the core is one folder up
from compute.hardware import attention_path, auto_dtype, cpu_bf16_units, peak_flops
from compute.kernels import LinearCrossEntropy
from run.accounting import flops_per_token
from bench_timing import SHORT, batch, build, ceilings, dtypes, side_by_side, sync


# -----------------------------------------------------------------------------
# the training step of rows 1-7: forward + backward (rows 8-12 and 17 time train.py's: optimizer_steps)

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


# -----------------------------------------------------------------------------
# row 1: looped vs untied training step

def row_untied(run):
    spec = run.size['speed']
    K, R = spec['n_layer'], spec['n_loop']
    looped = build(run.device, **spec, supervision='terminal')
    untied = build(run.device, **dict(spec, n_layer=K * R, n_loop=1), supervision='terminal')
    X, Y = batch(spec, run.device)
    t = side_by_side({'looped': train_step(looped, X, Y, run.device),
                      'untied': train_step(untied, X, Y, run.device)}, run, run.warmup, run.repeats)
    run.looped, run.batch, run.looped_s = looped, (X, Y), t['looped']
    tokens = X.numel()
    ratio = t['untied'] / t['looped']  # tokens/s looped over tokens/s untied
    return {'untied_vs_looped': dict(
        ratio=ratio, target='>= 0.97', met=ratio >= 0.97, looped_tok_s=tokens / t['looped'],
        untied_tok_s=tokens / t['untied'], looped_s=t['looped'], untied_s=t['untied'],
        config=dict(spec, supervision='terminal'))}


def cells_untied(row):
    c = row['config']
    K, R = c['n_layer'], c['n_loop']
    return [(f"train tok/s K={K} x R={R} vs untied {K * R} layers",
             f"{row['ratio']:.3f} ({row['looped_tok_s']:,.0f}/{row['untied_tok_s']:,.0f})", row['target'],
             row['met'])]


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
    """peak_step_memory on CPU in a fresh Python process (its own RSS, nothing else's): lab/bench.py
    --mem_child, which calls it and prints its result."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_='65536', MALLOC_TRIM_THRESHOLD_='0', PYTHONUNBUFFERED='1')
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [sys.executable, os.path.join(here, 'bench.py'), f'--threads={torch.get_num_threads()}',
           '--mem_child', json.dumps(dict(spec=spec, loss=loss_kind))]
    repo = os.path.dirname(here)
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


def cells_memory(row):
    return [(f"peak step memory per-loop / terminal (V={row['config']['vocab_size']})",
             f"{row['ratio']:.3f} ({row['per_loop_mib']:.0f}/{row['terminal_mib']:.0f} MiB)", row['target'],
             row['met']),
            f"(naive per-loop, R logit tensors kept: {row['naive_per_loop_mib']:.0f} MiB = "
            f"{row['naive_ratio']:.2f}x terminal)"]


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
                      'head': head_step(terminal, X, Y, run.device)}, run, run.warmup, run.repeats)
    share = t['head'] / t['terminal']
    bound = 1 + (spec['n_loop'] - 1) * share
    ratio = t['per_loop'] / t['terminal']
    return {'step_time': dict(
        ratio=ratio, bound=bound, target='<= 1 + (R-1) * head share', met=ratio <= bound, head_share=share,
        terminal_s=t['terminal'], per_loop_s=t['per_loop'], head_s=t['head'], config=dict(spec))}


def cells_step_time(row):
    return [(f"step time per-loop / terminal (R={row['config']['n_loop']})", f"{row['ratio']:.2f}",
             f"<= {row['bound']:.2f} (share {row['head_share']:.2f})", row['met'])]


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
    t = side_by_side(steps, run, run.warmup, run.repeats)
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
        t = {k: v / n for k, v in side_by_side(steps, run, run.warmup, run.repeats).items()}
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
    t = {k: v / n for k, v in side_by_side(steps, run, run.warmup, run.repeats).items()}
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
    t = {k: v / n for k, v in side_by_side(steps, run, run.warmup, run.repeats).items()}
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


if __name__ == '__main__':  # a module the lab's commands import
    print("lab/bench_train.py: bench.py's training rows, not a command; see python lab/bench.py --help")
