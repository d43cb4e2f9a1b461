"""
bench.py at its tiny size: it runs end to end, writes one JSON with every row of its table, and its helpers
(the peak-memory child process, the matmul ceiling) return sane numbers. Speed is bench.py's business, never
a test's: nothing here asserts a timing or a ratio against its target.
"""
import dataclasses
import itertools
import json
import math
import subprocess
import sys
import time

import pytest
import torch

import bench
import bench_decode
import bench_moe
import bench_timing
import bench_train

ROWS = ('untied_vs_looped', 'peak_memory', 'step_time', 'kv_cache', 'adaptive_exit', 'compile', 'mfu',
        'vs_plain', 'bf16', 'mfu_dtype', 'attention', 'profile', 'moe')


@pytest.fixture(scope='module')
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp('bench') / 'bench.json'
    res = bench.main(['--size=tiny', '--device=cpu', '--no-compile', '--threads=1', '--repeats=1',
                      f'--out={out}'])
    return res, out


def test_bench_writes_json_with_every_row(tiny_run):
    res, out = tiny_run
    saved = json.loads(out.read_text())
    assert set(ROWS) <= set(saved['rows'])
    for name in ROWS:
        assert 'error' not in saved['rows'][name], (name, saved['rows'][name])
        assert 'target' in saved['rows'][name]
    for key in ('cpu', 'cpu_threads', 'torch', 'date', 'device'):
        assert key in saved['machine']
    for key in ('size', 'repeats', 'warmup', 'timer', 'samples', 'seconds'):
        assert key in saved
    assert saved['table'].count('\n') >= 13  # header, column names, 12 rows (+ notes)
    assert saved['machine']['cpu_bf16'] in (None, 'AMX-BF16', 'AVX512-BF16')
    assert 'not measured' not in saved['table']


def test_bench_ratios_are_finite_and_positive(tiny_run):
    rows = tiny_run[0]['rows']
    for name in ('untied_vs_looped', 'peak_memory', 'step_time', 'kv_cache', 'adaptive_exit'):
        assert math.isfinite(rows[name]['ratio']) and rows[name]['ratio'] > 0, name
    s = rows['step_time']
    assert 0 < s['head_share']
    assert s['bound'] == pytest.approx(1 + (s['config']['n_loop'] - 1) * s['head_share'])
    a = rows['adaptive_exit']
    assert 1 <= a['mean_loops'] <= a['fixed_loops']
    assert 0 < rows['mfu']['mfu_vs_matmul'] < 10


def test_dtype_rows_report_both_dtypes_against_their_own_ceilings(tiny_run):
    rows = tiny_run[0]['rows']
    p = rows['vs_plain']
    assert p['params'] == p['plain_params']
    for dtype in ('float32', 'bfloat16'):
        assert math.isfinite(p[f'ratio_{dtype}']) and p[f'ratio_{dtype}'] > 0
        assert p[f'nanoloop_tok_s_{dtype}'] > 0 and p[f'plain_tok_s_{dtype}'] > 0
        c = rows['mfu_dtype']['ceilings'][dtype]
        assert set(c['by_size']) == {'128', '256'} and c['flops'] == max(c['by_size'].values())
        assert 0 < rows['mfu_dtype'][f'mfu_{dtype}'] < 10
        assert rows['attention'][f'auto_{dtype}'] in ('sdpa', 'math', 'explicit')
        assert rows['attention'][f'auto_vs_fastest_{dtype}'] >= 1
    assert rows['bf16']['ratio'] > 0 and rows['mfu_dtype']['auto_dtype'] in ('float32', 'bfloat16')
    # row 7 measures against the ceiling of the dtype its step ran in (fp32 on a CPU)
    assert rows['mfu']['matmul_dtype'] == 'float32'
    assert rows['mfu']['matmul_flops'] == rows['mfu_dtype']['ceilings']['float32']['flops']


def test_profile_row_splits_one_step_by_op(tiny_run):
    # row 12: the top ops of the default step per dtype, by self time; the shares are of the whole step
    prof = tiny_run[0]['rows']['profile']
    for dtype in bench.DTYPES:
        top = prof[dtype]['top']
        shares = [op['share'] for op in top]
        assert len(top) == bench_train.PROFILE_OPS and shares == sorted(shares, reverse=True)
        assert all(s > 0 for s in shares) and sum(shares) <= 1 + 1e-9
        assert sum(op['ms'] for op in top) <= prof[dtype]['step_ms'] * (1 + 1e-9)
        assert prof[dtype]['ops_per_step'] >= sum(op['calls'] for op in top)
        assert any(op['op'] in ('aten::mm', 'aten::addmm') for op in top)  # the matmuls are seen


def test_plain_model_is_the_default_model_written_plainly():
    # the yardstick of row 8 is the same model: same parameters, same loss, same gradients (fp32)
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=48, block_size=16, n_embd=32, n_head=4))
    plain = bench_train.PlainLoopedGPT(gpt)
    assert sum(p.numel() for p in plain.parameters()) == gpt.get_num_params(non_embedding=False)
    X, Y = bench_timing.batch(dict(batch_size=3, block_size=16, vocab_size=48), torch.device('cpu'))
    loss, plain_loss = gpt(X, Y)[1], plain(X, Y)[1]
    assert torch.allclose(loss, plain_loss, atol=1e-5)
    loss.backward()
    plain_loss.backward()
    assert torch.allclose(gpt.lm_head.weight.grad, plain.lm_head.weight.grad, atol=1e-5)
    for mine, theirs in zip(plain.layers, gpt.transformer.h):
        assert torch.allclose(mine.qkv.weight.grad, theirs.attn.c_attn.weight.grad, atol=1e-5)
        assert torch.allclose(mine.fc.weight.grad, theirs.mlp.c_fc.weight.grad, atol=1e-5)
        assert torch.allclose(mine.ln_1.weight.grad, theirs.ln_1.weight.grad, atol=1e-5)


def test_looped_training_forward_has_no_graph_breaks(tiny_run):
    c = tiny_run[0]['rows']['compile']
    assert c['graph_breaks'] == 0 and c['graphs'] == 1, c['break_reasons']
    assert 'skipped' in c and c['ratio'] is None


def test_peak_memory_child_sees_the_logits(tiny_run):
    # the naive per-loop loss keeps R (B, T, V) fp32 logit tensors (and their log-softmax) alive for the
    # backward pass; the child process must see at least those bytes, and the lean loss far fewer
    m = tiny_run[0]['rows']['peak_memory']
    R = m['config']['n_loop']
    assert m['terminal_mib'] > 0 and m['per_loop_mib'] > 0
    assert m['naive_per_loop_mib'] >= R * m['one_logits_tensor_mib']
    assert m['per_loop_mib'] < m['naive_per_loop_mib']


def test_matmul_ceiling_is_plausible():
    flops = bench_timing.matmul_ceiling(torch.device('cpu'), 128, warmup=1, repeats=3)
    assert 1e6 < flops < 1e14  # between a MFLOP/s and 100 TFLOP/s on any CPU


@pytest.mark.parametrize('flag, says', [('--bogus', 'unrecognized arguments: --bogus'),
                                        ('--repaets=2', 'did you mean --repeats?'),
                                        ('--repeats=-1', '--repeats=-1: must be >= 0'),
                                        ('--only=mfu,speed', '--only=speed: choose among')])
def test_a_bad_flag_is_one_error_line(repo_dir, flag, says):
    out = subprocess.run([sys.executable, 'lab/bench.py', flag], cwd=repo_dir, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == [out.stderr.strip()], out.stderr
    assert out.stderr.startswith('error: ') and says in out.stderr and 'Traceback' not in out.stderr
    assert out.stdout == ''


def test_bench_ratios_are_the_ratios_of_the_reported_times(tiny_run):
    # each row's ratio is what its name says, from the times (or sizes) it reports beside it, and the
    # table prints those numbers
    res = tiny_run[0]
    rows, table = res['rows'], res['table']
    kv = rows['kv_cache']
    assert kv['ratio'] == pytest.approx(kv['cached_tok_s'] / kv['uncached_tok_s'])  # speed-up of the cache
    assert f"{kv['ratio']:.1f}x ({kv['cached_tok_s']:.0f}/{kv['uncached_tok_s']:.0f})" in table
    a = rows['adaptive_exit']
    assert a['ratio'] == pytest.approx(a['adaptive_tok_s'] / a['fixed_tok_s'])
    assert a['fixed_tok_s'] == pytest.approx(kv['cached_tok_s'])  # fixed exit is the cached decode
    u = rows['untied_vs_looped']
    assert u['ratio'] == pytest.approx(u['looped_tok_s'] / u['untied_tok_s']) == \
        pytest.approx(u['untied_s'] / u['looped_s'])
    m = rows['peak_memory']
    assert m['ratio'] == pytest.approx(m['per_loop_mib'] / m['terminal_mib'])
    assert m['naive_ratio'] == pytest.approx(m['naive_per_loop_mib'] / m['terminal_mib'])
    s = rows['step_time']
    assert s['ratio'] == pytest.approx(s['per_loop_s'] / s['terminal_s'])
    assert s['head_share'] == pytest.approx(s['head_s'] / s['terminal_s'])


def test_kv_cache_row_is_uncached_time_over_cached_time(monkeypatch):
    # known times in, the row's numbers out: 24 new tokens in 0.5 s cached, 0.25 s adaptive, 6 s uncached
    times = {'cached': 0.5, 'adaptive': 0.25, 'uncached': 6.0}
    monkeypatch.setattr(bench_decode, 'side_by_side', lambda fns, *a: {name: times[name] for name in fns})
    run = bench.Run(size=bench.SIZES['tiny'], device=torch.device('cpu'), warmup=0, repeats=1, compile=False)
    rows = bench_decode.row_decode(run)
    kv, a = rows['kv_cache'], rows['adaptive_exit']
    assert kv['ratio'] == pytest.approx(12.0) and kv['met']
    assert (kv['cached_tok_s'], kv['uncached_tok_s']) == (pytest.approx(48.0), pytest.approx(4.0))
    assert a['ratio'] == pytest.approx(2.0) and a['adaptive_tok_s'] == pytest.approx(96.0)


def test_cached_decoding_is_faster_than_uncached_at_a_length_where_it_must_be():
    # 250 new tokens at C = 256: uncached decoding runs 250 full forwards over up to 258 positions, the cache
    # one position per token; measured ~4.5x on one thread, so 2x is far beyond timing noise
    spec = dict(n_embd=256, n_head=2, n_layer=1, n_loop=1, prompt=8, new_tokens=250, vocab_size=65)
    run = bench.Run(size=dict(bench.SIZES['tiny'], decode=spec), device=torch.device('cpu'), warmup=0,
                    repeats=1, compile=False)
    kv = bench_decode.row_decode(run)['kv_cache']
    assert kv['ratio'] > 2, kv


DECODING_ROWS = ('decode_policies', 'cache_memory', 'past_block', 'speculative')


def tiny(**size):
    return bench.Run(size=dict(bench.SIZES['tiny'], **size), device=torch.device('cpu'), warmup=0, repeats=1,
                     compile=False)


def test_decoding_rows_are_in_the_plan_and_the_table(tiny_run):
    res = tiny_run[0]
    # before rows 17 (moe) and 18 (depth_batching)
    assert [name for name, *_ in bench.plan(tiny())][-6:-2] == list(DECODING_ROWS)
    assert [row.name for row in bench.ROWS][12:16] == list(DECODING_ROWS)           # rows 13-16
    assert all(row.measure.__module__ == 'bench_decode' and len(row.cost) == 2 and min(row.cost) >= 0
               for row in bench.ROWS[12:16])
    for name in DECODING_ROWS:
        assert 'error' not in res['rows'][name], res['rows'][name]
    for says in ('adaptive / fixed tok/s', 'KV cache MiB at R = 4/8/16', 'past / inside the block',
                 'speculative / fixed-R tok/s'):
        assert says in res['table']
    policies = res['rows']['decode_policies']['cases']
    assert {c['policy'] for c in policies} == set(bench_decode.KV_POLICIES)
    assert {c['batch_size'] for c in policies} == set(bench.SIZES['tiny']['policies']['batches'])
    R = bench.SIZES['tiny']['speculative']['n_loop']
    assert [c['draft_loops'] for c in res['rows']['speculative']['cases']] == list(range(1, R))
    assert all(0 <= c['acceptance'] <= 1 for c in res['rows']['speculative']['cases'])


# stand-in medians by the last word of a timing's name: the prompt pass 0.1 s, fixed-R 1.1 s, ...
FAKE = dict(prefill=0.1, fixed=1.1, recompute=0.6, copy=0.5, shared=0.35, active=0.85, k1=0.6, k2=2.1)


def fake_side_by_side(fns, *args):
    # the past-block row: 0.01 s per token inside the block, 0.015 s past it
    spec = bench.SIZES['tiny']['past_block']
    inside = spec['block_size'] - spec['prompt']
    past = dict(inside=0.1 + (inside - 1) * 0.01)
    past['all'] = past['inside'] + (4 * spec['block_size'] - inside) * 0.015
    return {name: dict(FAKE, **past)[name.rsplit('_', 1)[-1]] for name in fns}


def test_decoding_rows_ratios_are_the_ratios_of_their_times(monkeypatch):
    monkeypatch.setattr(bench_decode, 'side_by_side', fake_side_by_side)
    run = tiny()
    n = run.size['policies']['new_tokens']
    row = bench_decode.row_policies(run)['decode_policies']
    for c in row['cases']:
        assert c['ratio'] == pytest.approx(c['fixed_ms'] / c['adaptive_ms'])
        assert c['ratio'] == pytest.approx((FAKE['fixed'] - 0.1) / (FAKE[c['policy']] - 0.1))
        assert c['fixed_ms'] == pytest.approx((FAKE['fixed'] - 0.1) / (n - 1) * 1e3)
        assert c['ideal'] == pytest.approx(row['config']['n_loop'] / c['mean_loops'])
        assert c['of_ideal'] == pytest.approx(c['ratio'] / c['ideal'])
        assert c['adaptive_tok_s'] == pytest.approx(c['batch_size'] * 1e3 / c['adaptive_ms'])
    p = bench_decode.row_past_block(run)['past_block']
    assert p['ratio'] == pytest.approx(p['past_ms'] / p['inside_ms']) == pytest.approx(1.5)
    assert p['inside_ms'] == pytest.approx(10.0) and p['refills'] >= 1
    s = bench_decode.row_speculative(run)['speculative']
    for c in s['cases']:
        assert c['ratio'] == pytest.approx(c['fixed_ms'] / c['speculative_ms'])
        assert c['ratio'] == pytest.approx(1.0 / (FAKE[f"k{c['draft_loops']}"] - 0.1))
        assert 0 <= c['acceptance'] <= 1


def test_shared_cache_memory_is_equal_across_R():
    for size in ('tiny', 'cpu'):
        row = bench_decode.row_cache_memory(tiny(policies=bench.SIZES[size]['policies']))['cache_memory']
        mib = row['mib']
        assert mib['shared_r4'] == mib['shared_r8'] == mib['shared_r16'] > 0 and row['met']
        for p in ('recompute', 'copy'):  # every loop its own slots: R x the loop slots
            assert mib[f'{p}_r16'] == pytest.approx(4 * mib[f'{p}_r4'])
        assert mib['active_r4'] > mib['recompute_r4']  # and the mask of who reached each visit
        assert row['ratio'] == 1.0


def test_moe_row_reports_step_memory_decoding_and_the_active_flops():
    # row 17 at the tiny size (fp32 and emulated bf16): every field, each ratio the ratio of the times beside
    # it, and FLOPs per token that count k of E experts and the router: an expert is 4C/k wide, so the MoE's
    # FLOPs are the dense model's plus the router's E x C weights at each of the K x R visits
    row = bench_moe.row_moe(tiny())['moe']
    c = row['config']
    E, C, K, R = row['n_expert'], c['n_embd'], c['n_layer'], c['n_loop']
    assert (E, row['top_k'], row['expert_hidden']) == (8, 2, 4 * C // 2)
    assert row['flops_per_token_moe'] - row['flops_per_token_dense'] == 6 * E * C * K * R
    assert row['params_dense'] < row['active_params_moe'] < row['params_moe']
    for d in bench.DTYPES:
        dense, grouped, loop = (row[f'{who}_s_{d}'] for who in ('dense', 'grouped', 'loop'))
        assert row[f'ratio_{d}'] == pytest.approx(grouped / dense)
        assert row[f'loop_ratio_{d}'] == pytest.approx(loop / dense)
        assert row[f'grouped_speedup_{d}'] == pytest.approx(loop / grouped)
        assert row[f'grouped_tok_s_{d}'] == pytest.approx(c['batch_size'] * c['block_size'] / grouped)
        assert row[f'grouped_mm_{d}'] in (True, False)
        assert 0 < row[f'mfu_moe_{d}'] < 10 and 0 < row[f'mfu_dense_{d}'] < 10
    assert row['ratio'] == max(row[f'ratio_{d}'] for d in bench.DTYPES)
    assert row['dense_mib'] >= 0 and row['moe_mib'] >= 0 and row['state_mib_moe'] > row['state_mib_dense']
    if row['dense_mib'] > 0:
        assert row['memory_ratio'] == pytest.approx(row['moe_mib'] / row['dense_mib'])
    assert row['decode_ratio'] == pytest.approx(row['decode_tok_s_moe'] / row['decode_tok_s_dense'])
    assert row['decode_tok_s_loop'] > 0 and row['decode_grouped_mm'] in (True, False)
    assert row['met'] in (True, False)
    cells = bench_moe.cells_moe(row)
    assert [cell[0].split(', ')[-2] for cell in cells[:2]] == ['fp32', 'bf16']  # one line per dtype
    assert f"{row['ratio_float32']:.2f}x (loop {row['loop_ratio_float32']:.2f}x)" == cells[0][1]
    assert 'FLOPs/token' in cells[-1]
    row_17 = bench.ROWS[16]
    assert (row_17.name, row_17.measure, row_17.cells) == ('moe', bench_moe.row_moe, bench_moe.cells_moe)
    assert [name for name, *_ in bench.plan(tiny())][-2] == 'moe'


def test_moe_loop_column_runs_the_per_expert_loop_and_puts_the_grouped_one_back():
    # the third column swaps kernels.moe (what model.py's MoE layers call) for kernels.moe_loop during the
    # call only: the same loss through either, and the grouped dispatch back afterwards
    from compute import kernels
    grouped, calls = kernels.moe, []

    def spy(*args):
        calls.append(1)
        return kernels.moe_loop(*args)
    model = bench_timing.build(torch.device('cpu'), **bench.SIZES['tiny']['default'], **bench_moe.EXPERTS)
    X, Y = bench_timing.batch(bench.SIZES['tiny']['default'], torch.device('cpu'))
    with torch.no_grad():
        loss = model(X, Y)[1]
        loop_loss = bench_moe.with_moe_kernel(lambda: model(X, Y)[1], spy)()
    K, R = model.config.n_layer, model.config.n_loop
    assert len(calls) == K * R and kernels.moe is grouped
    assert torch.allclose(loss, loop_loss, atol=1e-5)


def test_depth_batching_times_new_tokens_only_and_targets_0_9_of_ideal_at_wide_batches(monkeypatch):
    # row 18 with stand-in timings: a clock that ticks one second a reading (so each of serve's prompt passes,
    # timed inside its call, takes one second) and stand-in medians of whole calls. What is left after the
    # prompt passes, over the new tokens after each prompt's first, is each path's time per token
    spec = dict(widths=(32, 512), head_size=256, n_layer=1, n_loop=3, batches={1: (3, 1), 8: (3, 1)},
                prompt=2, vocab_size=64)
    fake = dict(prefill=0.1, fixed=1.1, adaptive_recompute=0.6, adaptive_copy=0.5)

    passes, plain = [], bench_decode.batching.decode_step

    def counted(*args):
        passes.append(1)
        return plain(*args)

    def side_by_side(fns, *args):
        # serve's calls run (their prompt passes are counted, one second each on the clock below); each
        # stand-in call takes its passes and 0.2 s (copy) or 2 s (recompute)
        out = {}
        for n, fn in fns.items():
            kind = n.split('_', 3)[-1]
            if kind.startswith('depth_'):
                before = len(passes)
                fn()
                out[n] = len(passes) - before + (0.2 if kind == 'depth_copy' else 2.0)
            else:
                if kind.startswith('adaptive_'):  # (the row reads their loops per token)
                    fn()
                out[n] = fake[kind]
        return out
    monkeypatch.setattr(bench_decode.batching, 'decode_step', counted)
    monkeypatch.setattr(bench_decode, 'side_by_side', side_by_side)
    run = dataclasses.replace(tiny(depth=spec), clock=itertools.count().__next__)
    row = bench_decode.row_depth(run)['depth_batching']
    R, cases = spec['n_loop'], row['cases']
    assert [(c['n_embd'], c['batch_size'], c['policy']) for c in cases] == \
        [(C, B, p) for C in (32, 512) for B in (1, 8) for p in ('recompute', 'copy')]
    for c in cases:
        P, tokens = c['requests'], c['requests'] * (c['new_tokens'] - 1)
        passes = c['depth_prompt_ms'] * P / 1e3  # serve's prompt passes, one second each on this clock
        assert P == bench_decode.DEPTH_REQUESTS * c['batch_size'] and 1 <= passes <= P
        assert passes == pytest.approx(round(passes))  # (the rows waiting at once share one pass)
        assert c['fixed_ms'] == pytest.approx((1.1 - 0.1) / tokens * 1e3)
        assert c['adaptive_ms'] == pytest.approx((fake['adaptive_' + c['policy']] - 0.1) / tokens * 1e3)
        assert c['depth_ms'] == pytest.approx((0.2 if c['policy'] == 'copy' else 2.0) / tokens * 1e3)
        for how in ('adaptive', 'depth'):
            assert 1 <= c[f'{how}_loops'] <= R and c[f'{how}_ideal'] == pytest.approx(R / c[f'{how}_loops'])
            assert c[f'{how}_ratio'] == pytest.approx(c['fixed_ms'] / c[f'{how}_ms'])
            assert c[f'{how}_of_ideal'] == pytest.approx(c[f'{how}_ratio'] / c[f'{how}_ideal'])
            assert c[f'{how}_tok_s'] == pytest.approx(1e3 / c[f'{how}_ms'])
        assert 0 < c['occupancy'] <= 1
        # the target: depth batching at 0.9 of its ideal, only at d >= 512 and batch >= 8 (copy runs 5x
        # fixed here, above any ideal of R = 3; recompute 0.5x, below any)
        if (c['n_embd'], c['batch_size']) == (512, 8):
            assert c['met'] is (c['policy'] == 'copy') and c['target'].startswith('>= 0.9 x')
        else:
            assert c['met'] is None and c['target'] == 'report'
    assert row['met'] is False and row['requests_per_row'] == bench_decode.DEPTH_REQUESTS
    cells = bench_decode.cells_depth(row)
    assert f"{cases[-1]['depth_ratio']:.2f}x={cases[-1]['depth_of_ideal']:.2f} ideal" in cells[-3][1]
    assert bench.plan(tiny())[-1][:2] == ('depth_batching', bench_decode.row_depth)
    assert bench.ROWS[-1].name == 'depth_batching' and len(bench.ROWS) == 18  # row 18
    assert len(bench.ROWS[-1].cost) == 2 and set(bench.SIZES['cpu']['depth']['widths']) == {128, 512}


def test_the_process_timer_times_every_row_in_cpu_seconds():
    # --timer=process: the Run's clock is this process's CPU time, and side_by_side reads that clock and keeps
    # every sample it takes in the Run (they go into the JSON)
    assert bench.setup(bench.parse_args(['--device=cpu', '--timer=process'])).clock is time.process_time
    run = bench.setup(bench.parse_args(['--device=cpu']))
    assert run.clock is time.perf_counter and run.samples == {}
    run.clock = itertools.count().__next__  # one second a reading
    t = bench_timing.side_by_side({'a': lambda: None, 'b': lambda: None}, run, 1, 3)
    assert t == {'a': 1, 'b': 1} and run.samples == {'a': [1, 1, 1], 'b': [1, 1, 1]}
