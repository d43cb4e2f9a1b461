"""
Progress on the long lab commands: eval_depth.py shows a bar per phase and its numbers stay the same;
bench.py announces every row with an ETA and, on a CPU without bf16 units, plans no bf16 rows at its cpu
size (simulated here by making hardware.cpu_bf16_units say None, whatever this CPU has).
"""
import dataclasses
import json

import pytest
import torch

import bench
import bench_timing
import bench_train
from run import diagnostics
import eval_depth as ed
from compute import hardware
from conftest import tiny_gpt

QUICK = ['--n_seqs=12', '--batch_size=4', '--timing_repeats=1', '--n_grad_seqs=6']
TIMED = ('seconds', 'throughput')  # wall times: the only keys that may differ between two runs


def test_eval_depth_shows_every_phase_and_progress_does_not_change_the_results(tiny_ckpt, tiny_data, capsys):
    data = f'--data_dir={tiny_data}'
    ed.main([str(tiny_ckpt), data, f'--json={tiny_ckpt / "quiet.json"}', '--no-progress'] + QUICK)
    quiet = capsys.readouterr()
    ed.main([str(tiny_ckpt), data, f'--json={tiny_ckpt / "shown.json"}'] + QUICK)
    shown = capsys.readouterr()
    assert quiet.err == ''
    for phase in range(1, ed.PHASES + 1):
        assert f'[{phase}/{ed.PHASES}]' in shown.err
    for what in ('fixed-depth exits', 'calibrated halting', 'timed passes', 'radial gradient fraction'):
        assert what in shown.err
    assert 'windows x' in shown.err and '100%' in shown.err
    assert 'fixed depth' in shown.out and '%|' not in shown.out  # the report stays on stdout, bars off it
    a, b = (json.loads((tiny_ckpt / f).read_text()) for f in ('quiet.json', 'shown.json'))
    assert a.pop('checkpoint') == b.pop('checkpoint')
    for key in TIMED:
        a.pop(key), b.pop(key)
    assert a == b


def test_radial_gradient_batch_by_batch_is_the_same_numbers():
    model = tiny_gpt(0, training=False, vocab_size=11, n_layer=1)  # K 1, R 3, C 16, context 16
    X, Y = torch.randint(11, (7, 16)), torch.randint(11, (7, 16))
    with ed.progress_bar('test', 3, show=False) as bar:
        assert ed.grad_fractions(model, X, Y, 3, bar) == diagnostics.radial_gradient(model, X, Y, 3)


@pytest.fixture
def no_bf16_units(monkeypatch):
    # a laptop CPU without AVX512-BF16 or AMX: bench.py and bench_train.py import the name, auto_dtype asks
    # hardware's
    monkeypatch.setattr(hardware, 'cpu_bf16_units', lambda: None)
    monkeypatch.setattr(bench, 'cpu_bf16_units', lambda: None)
    monkeypatch.setattr(bench_train, 'cpu_bf16_units', lambda: None)


def planned(argv):
    run = bench.setup(bench.parse_args(argv))
    return run, [name for name, _, _ in bench.plan(run)]


def test_bench_plans_no_bf16_rows_on_a_cpu_without_bf16_units(no_bf16_units):
    run, rows = planned(['--device=cpu'])
    assert run.dtypes == ('float32',) and 'no bf16 units' in run.bf16_note
    assert rows == [row.name for row in bench.ROWS if row.measure]  # every row, bf16's as a skipped one
    assert bench_train.row_bf16(run)['bf16']['skipped'] == run.bf16_note
    one_size = bench.Run(dict(matmul=(64,)), run.device, 0, 1, False, dtypes=run.dtypes)
    assert bench_timing.ceilings(one_size).keys() == {'float32'}
    # the ETA's weights (seconds on a 2-core laptop): the bf16 rows cost extra, the default stays in 5 min
    cost = lambda run: sum(c for *_, c in bench.plan(run))
    assert cost(run) < cost(dataclasses.replace(run, dtypes=bench.DTYPES)) <= 300


def test_bench_bf16_on_request_or_at_toy_sizes_is_marked_emulated(no_bf16_units):
    for argv in (['--device=cpu', '--bf16'], ['--device=cpu', '--size=tiny']):
        run, _ = planned(argv)
        assert run.dtypes == bench.DTYPES and 'emulated' in run.bf16_note
    run, _ = planned(['--device=cpu', '--no-bf16', '--size=tiny'])
    assert run.dtypes == ('float32',)


def test_bench_with_bf16_units_keeps_both_dtypes(monkeypatch):
    monkeypatch.setattr(bench, 'cpu_bf16_units', lambda: 'AMX-BF16')
    run, _ = planned(['--device=cpu'])
    assert run.dtypes == bench.DTYPES and run.bf16_note is None


def test_bench_fp32_only_run_announces_rows_and_writes_a_marked_table(no_bf16_units, tmp_path, capsys):
    only = 'vs_plain,bf16,mfu_dtype,attention,profile'
    res = bench.main(['--size=tiny', '--device=cpu', '--no-compile', '--threads=1', '--repeats=1',
                      '--no-bf16', f'--only={only}', f'--out={tmp_path / "bench.json"}'])
    out = capsys.readouterr().out
    for i, name in enumerate(only.split(','), start=1):
        assert f'[{i}/5] {name}: ' in out and ' so far, ' in out
    assert 'ETA after it' in out and 'left' in out  # no ETA before the first row at the tiny size, then one
    saved = json.loads((tmp_path / 'bench.json').read_text())
    assert saved['dtypes'] == ['float32'] and 'fp32 only' in saved['table']
    rows = saved['rows']
    assert all('error' not in rows[name] for name in only.split(',')), rows
    assert rows['bf16']['skipped'] and 'skipped' in saved['table']
    assert 'ratio_bfloat16' not in rows['vs_plain'] and 'bfloat16' not in rows['profile']
    assert set(rows['mfu_dtype']['ceilings']) == {'float32'} and 'bf16 step' not in res['table']
