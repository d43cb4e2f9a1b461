"""
bench.py at its tiny size: it runs end to end, writes one JSON with every row of issue 5's table, and its
helpers (the peak-memory child process, the matmul ceiling) return sane numbers. Speed is bench.py's business,
never a test's: nothing here asserts a timing or a ratio against its target.
"""
import json
import math

import pytest
import torch

import bench

ROWS = ('untied_vs_looped', 'peak_memory', 'step_time', 'kv_cache', 'adaptive_exit', 'compile', 'mfu')


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
    assert saved['table'].count('\n') >= 8  # header, column names, 7 rows (+ notes)


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
    flops = bench.matmul_ceiling(torch.device('cpu'), 128, warmup=1, repeats=3)
    assert 1e6 < flops < 1e14  # between a MFLOP/s and 100 TFLOP/s on any CPU
