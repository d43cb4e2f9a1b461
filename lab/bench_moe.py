"""
Row 17 of lab/bench.py, Looped-MoE (docs/papers.md §5) against the dense looped model of the same active
width: the training step per dtype (the grouped dispatch, kernels.moe, beside the per-expert loop,
kernels.moe_loop), the peak memory of a step, decoding tok/s with the cache, FLOPs per token and MFU; and its
cells of the table. It measures with the training rows' steps (bench_train.py) and the decoding rows'
generations (bench_decode.py).
"""

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the core is one folder up
from compute import kernels
from compute.hardware import peak_flops
from run.accounting import active_params, flops_per_token
from bench_timing import SHORT, ceilings, dtypes, side_by_side
from bench_train import default_model, memory_child, optimizer_steps, peak_step_memory
from bench_decode import decode_model, decoder, random_tokens

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
    t = {k: v / n for k, v in side_by_side(steps, run, run.warmup, run.repeats).items()}
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
    t = side_by_side(gens, run, 1, min(3, run.repeats))
    tok_s = {who: n_new / t[f'moe_decode_{who}'] for who in ('dense', 'grouped', 'loop')}
    dtype = str(next(moe.parameters()).dtype).replace('torch.', '')
    return dict(decode_tok_s_dense=tok_s['dense'], decode_tok_s_moe=tok_s['grouped'],
                decode_tok_s_loop=tok_s['loop'], decode_ratio=tok_s['grouped'] / tok_s['dense'],
                decode_grouped_mm=grouped_mm_used(moe, dtype, run.device), decode_dtype=dtype,
                decode_config=dict(spec, block_size=block_size, batch_size=1, **EXPERTS))


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


if __name__ == '__main__':  # a module the lab's commands import
    print("lab/bench_moe.py: bench.py's Looped-MoE row, not a command; see python lab/bench.py --help")
