"""
The iso-depth scaling law (docs/isodepth.md): the parameter and FLOP counts it is fitted on, and the fitter
lab/isodepth.py, which is tested on losses drawn from the law with a known phi before it is trusted with
real runs. Fits here use fewer starts and resamples than the command's defaults, to run in seconds.
"""
import csv
import functools
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from test_model import V, T, tiny
from test_reliability import assert_clean_error

import isodepth
from model import GPT, GPTConfig, flops_per_token, param_counts

C = 16
BLOCK = 2 * C + 16 * C * C  # swiglu: two norm gains, 4 C^2 attention, 12 C^2 MLP

# -----------------------------------------------------------------------------
# counting as the paper counts


def test_param_counts_split_the_blocks_run_once_from_the_looped_ones():
    # N_once: 1 prelude + 2 coda blocks and the readout norm's gain; N_rec: the K = 2 shared blocks and the
    # concat adapter W (C x 2C). Neither holds the (tied) embedding and head or the positions
    m = tiny(n_layer=2, n_loop=3, n_prelude=1, n_coda=2, injection='concat')
    assert param_counts(m) == (3 * BLOCK + C, 2 * BLOCK + 2 * C * C)
    assert sum(param_counts(m)) + V * C + T * C == sum(p.numel() for p in m.parameters())
    # the r = 1 baseline of the iso-depth sweep: unique blocks, no injection
    assert param_counts(tiny(n_layer=4, n_loop=1, n_prelude=2, n_coda=2)) == (4 * BLOCK + C, 4 * BLOCK)
    # a norm between loops runs every loop: looped; Ouro's 'readout' reuses the readout norm, counted once
    assert param_counts(tiny(inter_loop_norm='rmsnorm'))[1] == 2 * BLOCK + C
    assert param_counts(tiny(inter_loop_norm='readout')) == (C, 2 * BLOCK)


def test_truncated_backprop_loops_cost_the_forward_pass_only():
    # K = 2, R = 4, gradients through the last loop: loops 1-3 cost 2 flops per weight use and attention
    # 4 C T per visit, loop 4, the prelude and the coda + head of the one exit 6 and 12 C T
    kw = dict(n_layer=2, n_loop=4, n_prelude=1, n_coda=1, injection='concat', supervision='terminal')
    W = 2 * C * C  # the adapter, before loops 2..R
    graph = 6 * (2 * BLOCK + W + BLOCK + BLOCK + V * C) + 12 * (2 + 1 + 1) * C * T
    free = 2 * (3 * 2 * BLOCK + 2 * W) + 4 * (3 * 2) * C * T
    assert flops_per_token(tiny(backprop_loops=1, **kw), T) == graph + free
    # every loop with a graph (b = 0, or b >= R) is the full count: 6 per weight, 12 C T per visit
    full = 6 * (8 * BLOCK + 3 * W + BLOCK + BLOCK + V * C) + 12 * (8 + 1 + 1) * C * T
    assert flops_per_token(tiny(**kw), T) == flops_per_token(tiny(backprop_loops=4, **kw), T) == full

# -----------------------------------------------------------------------------
# synthetic runs drawn from the law

WIDTHS = (256, 384, 512, 640)  # d = 64 s, heads of 64
RS = (1, 2, 4, 8)
BUDGETS = (3e16, 1e17, 3e17)   # FLOPs, ~3.3x apart as the paper's 2.15x
# the law's constants for the draws: alpha, beta, E near the paper's, A and B such that both terms are
# worth about one nat at these sizes
TRUE = dict(A=30.0, alpha=0.2, B=1000.0, beta=0.37, E=math.exp(0.45))


def iso_depth(width, r):
    # the paper's family at a smaller size: effective depth 20 = 2 prelude + (16 / r) blocks x r + 2 coda;
    # the r = 1 baseline is 20 unique blocks without injection
    cfg = GPTConfig(n_embd=width, n_head=width // 64, n_prelude=2, n_coda=2, n_layer=16 // r, n_loop=r,
                    injection='none' if r == 1 else 'concat', supervision='terminal', vocab_size=8192,
                    block_size=512)
    with torch.device('meta'):  # counts only, no weights
        return GPT(cfg)


@functools.lru_cache(maxsize=None)
def grid():
    # every (width, r) at every budget: D = budget / flops_per_token, so the runs of a budget are one
    # iso-FLOP curve, as in a real sweep
    rows = []
    for width in WIDTHS:
        for r in RS:
            m = iso_depth(width, r)
            rows += [(*param_counts(m), r, budget / flops_per_token(m), budget) for budget in BUDGETS]
    return np.array(rows, dtype=float)


def draw(phi, noise=0.01, seed=1, keep=None):
    # losses from the law with this phi plus Gaussian noise in nats, as read_runs returns a table
    n_once, n_rec, r, tokens, budget = (grid() if keep is None else grid()[keep(grid())]).T
    loss = TRUE['E'] + TRUE['A'] * (n_once + r ** phi * n_rec) ** -TRUE['alpha'] + \
        TRUE['B'] * tokens ** -TRUE['beta']
    loss += noise * np.random.default_rng(seed).standard_normal(len(loss))
    return dict(n_once=n_once, n_rec=n_rec, r=r, tokens=tokens, budget=budget, loss=loss)


QUICK = dict(starts=30, resamples=60, boot_starts=2)


@functools.lru_cache(maxsize=None)
def fitted(phi):
    return isodepth.fit(draw(phi), **QUICK)


def write_csv(path, runs, columns=(*isodepth.COLUMNS, 'budget')):
    with open(path, 'w', newline='', encoding='utf-8') as f:
        w = csv.writer(f)
        w.writerow(columns)
        w.writerows(zip(*(runs[c] for c in columns)))
    return str(path)

# -----------------------------------------------------------------------------
# the fit


@pytest.mark.parametrize('phi', [0.2, 0.46, 0.8])
def test_48_runs_at_a_hundredth_of_a_nat_recover_phi_inside_its_ci(phi):
    # 4 widths x 3 budgets x 4 r, noise 0.01 nats: the paper's simulations give a 95 % CI of about +-0.05.
    # One draw (seed 1); a 95 % CI misses the truth in about 1 draw of 20 (11 of 12 seeds covered 0.46)
    res = fitted(phi)
    lo, hi = res['phi_ci']
    assert res['identified'] and res['n_runs'] == 48 and res['n_cells'] == 12
    assert lo <= phi <= hi and abs(res['phi'] - phi) < 0.1, res
    assert hi - lo < 0.2, res
    assert res['fits']['free']['rmse'] < 0.012  # the noise, 0.01 nats, and little more


def test_fixing_phi_at_0_or_1_fits_worse_when_a_loop_is_worth_half_a_block():
    fits = fitted(0.46)['fits']
    assert fits['phi=0']['r2'] < fits['free']['r2'] and fits['phi=1']['r2'] < fits['free']['r2'], fits
    assert fits['phi=0']['phi'] == 0 and fits['phi=1']['phi'] == 1


def test_24_runs_at_two_budgets_are_reported_not_identified():
    # 4 widths x 2 budgets x r in {1, 2, 8}: 6 cells, and about 3 % of resamples hold one budget's cells
    # only, whose phi is arbitrary: the CI is wider than PHI_CI_WIDTH, and phi is withheld. (Not every draw:
    # over 5 seeds, 2 were. 24 runs at three budgets were identified, +-0.05 to +-0.1, in this family)
    keep = lambda g: np.isin(g[:, 4], BUDGETS[:2]) & np.isin(g[:, 2], (1, 2, 8))
    res = isodepth.fit(draw(0.46, seed=0, keep=keep), **QUICK)
    lo, hi = res['phi_ci']
    assert res['n_runs'] == 24 and hi - lo > isodepth.PHI_CI_WIDTH, res
    assert not res['identified'] and res['phi'] is None and res['degenerate_resamples'] > 0


UNIDENTIFIED = {  # a part of the grid -> why it cannot identify phi
    'one_budget': (lambda g: g[:, 4] == BUDGETS[0], 'every run is at one FLOP budget'),
    'one_r': (lambda g: g[:, 2] == 4, 'every run has r = 4'),
    'eight_runs': (lambda g: (g[:, 4] != BUDGETS[1]) & np.isin(g[:, 2], (1, 8)) & (g[:, 0] < 1e7), '8 runs'),
    'four_cells': (lambda g: (g[:, 4] != BUDGETS[1]) & np.isin(g[:, 2], (1, 8)), '4 (budget, r) cells'),
}


@pytest.mark.parametrize('keep,why', UNIDENTIFIED.values(), ids=UNIDENTIFIED.keys())
def test_designs_that_cannot_identify_phi_stop_with_one_line(keep, why, capsys):
    runs = draw(0.46, keep=keep)
    assert why in isodepth.not_identified(runs)
    with pytest.raises(SystemExit):
        isodepth.fit(runs, **QUICK)
    assert_clean_error(1, capsys.readouterr().err, 'phi is not identified', why)


def test_each_model_at_one_token_count_is_not_identified():
    # two budgets, but each model trained at one of them only: D moves with width
    runs = draw(0.46, keep=lambda g: g[:, 4] == np.where(g[:, 0] < 2e7, BUDGETS[0], BUDGETS[2]))
    assert 'each model (n_once, n_rec) trained on one token count' in isodepth.not_identified(runs)


def test_without_a_budget_column_runs_of_one_6ND_budget_share_a_cell():
    runs = draw(0.46)
    runs['tokens'] = runs['budget'] / (6 * (runs['n_once'] + runs['r'] * runs['n_rec']))
    with_column, budgets, rs = isodepth.cells(runs)
    del runs['budget']
    without, _, _ = isodepth.cells(runs)
    assert len(rs) == 12 and budgets.max() == 2 and (with_column == without).all()

# -----------------------------------------------------------------------------
# the command line


def cli(*args, cwd):
    r = subprocess.run([sys.executable, str(isodepth.__file__), *args], cwd=cwd, capture_output=True,
                       text=True)
    return r.returncode, r.stdout, r.stderr


def main_error(capsys, *args):
    # the command in this process (no interpreter start): its exit code and stderr
    with pytest.raises(SystemExit) as stop:
        isodepth.main(list(args))
    return stop.value.code, capsys.readouterr().err


def test_fit_cli_prints_phi_and_writes_it_with_its_ci_as_json(tmp_path):
    path = write_csv(tmp_path / 'runs.csv', draw(0.46))
    code, out, err = cli('--fit', path, '--json', 'fit.json', '--starts=10', '--resamples=10',
                         '--boot_starts=1', cwd=tmp_path)
    assert code == 0, err
    res = json.loads((tmp_path / 'fit.json').read_text(encoding='utf-8'))
    lo, hi = res['phi_ci']
    assert lo <= res['phi'] <= hi and abs(res['phi'] - 0.46) < 0.1
    assert {'alpha', 'beta', 'E', 'A', 'B'} <= set(res) and set(res['fits']) == {'free', 'phi=0', 'phi=1'}
    assert f"phi = {res['phi']:.3f}, 95 % CI [{lo:.3f}, {hi:.3f}]" in out and 'phi=1' in out


def put(rows, line, column, value):
    # rows of a CSV, header first, with one field replaced; line counts from 1 (the header), as errors do
    i, j = line - 1, rows[0].index(column)
    return rows[:i] + [rows[i][:j] + [value] + rows[i][j + 1:]] + rows[i + 1:]


BAD_TABLES = {  # the rows of a good CSV -> a bad one, and what the error says
    'no_loss': (lambda rows: [r[:4] + r[5:] for r in rows], 'missing column(s) loss'),
    'zero_tokens': (lambda rows: put(rows, 4, 'tokens', '0'), 'tokens = 0 on line 4'),
    'nan_loss': (lambda rows: put(rows, 3, 'loss', 'nan'), 'loss = nan on line 3'),
    'text': (lambda rows: put(rows, 3, 'loss', 'low'), 'loss = low on line 3'),
    'no_runs': (lambda rows: rows[:1], '0 runs: the law has 6 free parameters'),
}


@pytest.mark.parametrize('edit,why', BAD_TABLES.values(), ids=BAD_TABLES.keys())
def test_a_bad_table_stops_with_one_line(tmp_path, edit, why, capsys):
    path = write_csv(tmp_path / 'runs.csv', draw(0.46))
    with open(path, encoding='utf-8') as f:
        rows = [line.split(',') for line in f.read().splitlines()]
    (tmp_path / 'bad.csv').write_text('\n'.join(','.join(r) for r in edit(rows)) + '\n', encoding='utf-8')
    assert_clean_error(*main_error(capsys, '--fit', str(tmp_path / 'bad.csv')), why)


def test_the_sweep_is_not_built_yet_and_says_so(capsys):
    assert_clean_error(*main_error(capsys), 'the iso-depth sweep', 'not built yet', '--fit RUNS.csv')
