"""
The DeepLoop report's verdicts (report_deeploop.deeploop_verdicts, docs/papers.md §2) on hand-built runs of
the deeploop preset's grid: each claim is judged at every block's own best LR, no verdict rests on a cell
whose best LR is at its grid's edge or whose runs have not all finished, and the verdict lines are the ones
tests/lab/test_claims.py binds the README's and docs' verdicts to.
"""
import math

import presets
import report_deeploop
from test_claims import REPORT_VERDICT  # how the README's and docs' verdicts are read from a report

FLOOR = 3.35                       # a unigram floor: a run is stuck at or above FLOOR - ESCAPE_MARGIN
VARIANTS = [v for v, _, _ in presets.DEEPLOOP_VARIANTS]
BLOCK = {v: block for v, block, _ in presets.DEEPLOOP_VARIANTS}


def run(v, R, lr, seed, loss, status='done'):
    return dict(seed=seed, arm=dict(tags=dict(variant=v, R=R, lr=lr)), status=dict(train=status),
                rows=[dict(val_loss=loss)])


def sweep(level, best=lambda v, R: 1e-3, seeds=(1, 2, 3)):
    """The preset's whole grid: variant v at R and seed ends at level(v, R, seed) at its best LR, and 0.05
    nats higher per factor of 10 away from it."""
    return [run(v, R, lr, s, level(v, R, s) + 0.05 * abs(math.log10(lr / best(v, R))))
            for v in VARIANTS for R in presets.DEEPLOOP_RS for lr in presets.DEEPLOOP_LRS[BLOCK[v]]
            for s in seeds]


def verdicts(runs, floor=FLOOR):
    return {key: (word, n, how) for key, word, n, how, _ in verdicts_and_cells(runs, floor)[0]}


def verdicts_and_cells(runs, floor=FLOOR):
    Rs = sorted({r['arm']['tags']['R'] for r in runs})
    lrs = sorted({r['arm']['tags']['lr'] for r in runs})
    return report_deeploop.deeploop_verdicts(runs, Rs, lrs, floor)


def deeploop_wins(v, R, s):
    # DeepLoop ahead of every other block at R > 1 in every seed; all level at R = 1 up to a seed noise
    # well inside the neutral margin
    noise = 0.01 * (s - 2)
    if R == 1:
        return 2.2 + 0.1 * noise * (1 if v == 'preln' else -1)
    return 2.2 + noise + (0.0 if v == 'sandwich_p0.5' else 0.1)


def revisited(R):
    return f"{report_deeploop.REVISITED} at R = {R}"


def test_the_verdicts_name_blocks_of_the_deeploop_preset():
    rd = report_deeploop
    assert {rd.DEEPLOOP_BASE, rd.DEEPLOOP, *rd.SMALLER_P} == set(VARIANTS)


def test_deeploop_ahead_in_every_seed_at_every_revisited_R_reproduces():
    got = verdicts(sweep(deeploop_wins))
    assert all(got[revisited(R)][:2] == ('reproduces', 3) for R in presets.DEEPLOOP_RS if R > 1)
    assert got[report_deeploop.REASON][:2] == ('reproduces', 3)
    # +-0.002 by seed around 0: inside the margin
    assert got[report_deeploop.NEUTRAL][:2] == ('reproduces', 3)


def test_deeploop_ahead_in_the_mean_but_not_beyond_the_seed_spread_is_inconclusive_at_that_R_only():
    def level(v, R, s):  # seed 3 of DeepLoop falls behind the baseline at R = 7, the mean stays ahead
        return deeploop_wins(v, R, s) + (0.15 if (v, R, s) == ('sandwich_p0.5', 7, 3) else 0.0)
    got = verdicts(sweep(level))
    word, _, how = got[revisited(7)]
    assert word == 'inconclusive' and 'seeds would decide it (n 3 now' in how
    assert got[revisited(5)][0] == 'reproduces'  # a weak R does not pull a solid one down


def test_deeploop_behind_is_not_better_and_a_smaller_p_ahead_of_it_is_not_the_reason():
    def level(v, R, s):  # p = 0 a little ahead of DeepLoop in every cell; the baseline ahead at R = 3
        x = deeploop_wins(v, R, s) - (0.11 if v == 'sandwich_p0' and R > 1 else 0.0)
        return x - (0.2 if v == 'preln' and R == 3 else 0.0)
    got = verdicts(sweep(level))
    assert got[revisited(3)][0] == 'does not reproduce'
    assert got[report_deeploop.REASON][0] == 'does not reproduce'


def test_a_gap_at_R_1_beyond_the_neutral_margin_is_not_neutral_and_a_wide_one_is_inconclusive():
    def level(gap, spread):  # DeepLoop `gap` behind at R = 1, +-spread by seed
        at = lambda v, R, s: gap + spread * (s - 2) if (v, R) == ('sandwich_p0.5', 1) else 0.0  # noqa: E731
        return lambda v, R, s: deeploop_wins(v, R, s) + at(v, R, s)
    assert verdicts(sweep(level(0.05, 0.005)))[report_deeploop.NEUTRAL][0] == 'does not reproduce'
    # the committed runs' case: behind in every seed, but the CI crosses the margin
    assert verdicts(sweep(level(0.04, 0.02)))[report_deeploop.NEUTRAL][0] == 'inconclusive'


def dl5_at_the_top(v, R):
    # every cell's best LR is 1e-3, inside both grids, but DeepLoop's at R = 5 is the highest it tried
    return presets.DEEPLOOP_LRS['sandwich'][-1] if (v, R) == ('sandwich_p0.5', 5) else 1e-3


def test_a_best_lr_at_the_grids_edge_gives_no_verdict_and_names_the_cell():
    got = verdicts(sweep(deeploop_wins, best=dl5_at_the_top))
    grid = presets.DEEPLOOP_LRS['sandwich']
    for key in (revisited(5), report_deeploop.REASON):
        word, _, how = got[key]
        assert word is None
        assert how == f"best LR at the grid's edge in cell sandwich_p0.5, R = 5 (lr {grid[-1]:g} of " \
                      + ' / '.join(f'{lr:g}' for lr in grid) + ")"
    assert got[report_deeploop.NEUTRAL][0] == 'reproduces'  # R = 1's cells are interior: its verdict stands
    assert got[revisited(3)][0] == 'reproduces'  # and so are R = 3's


def test_an_unfinished_run_gives_no_verdict_on_its_cells_and_a_failed_one_is_never_the_best_lr():
    runs = sweep(deeploop_wins)
    for r in runs:
        if r['arm']['tags'] == dict(variant='preln', R=1, lr=1e-4) and r['seed'] == 2:
            r['status'] = {}                             # still training
        if r['arm']['tags'] == dict(variant='preln', R=3, lr=1e-3) and r['seed'] == 1:
            r['status'], r['rows'] = dict(train='failed'), [dict(val_loss=1.0)]
    got = verdicts(runs)
    neutral = got[report_deeploop.NEUTRAL]
    assert neutral[0] is None and 'preln, R = 1 (1 of 12 runs)' in neutral[2]
    cell = report_deeploop.best_cell(runs, 'preln', 3, sorted(presets.DEEPLOOP_LRS['preln']))
    assert cell['lr'] != 1e-3 and math.isfinite(cell['mean'])  # 1e-3 lost a seed to a failure: not the best


def test_trainability_counts_stuck_runs_at_interior_lrs_only():
    def stuck_at(cells):  # smaller-p runs stuck on the floor in the given (variant, R, lr) cells, seed 1
        runs = sweep(deeploop_wins)
        for r in runs:
            t = r['arm']['tags']
            if (t['variant'], t['R'], t['lr']) in cells and r['seed'] == 1:
                r['rows'] = [dict(val_loss=FLOOR)]
        return verdicts(runs)[report_deeploop.TRAINABILITY]
    word, n, how = stuck_at({('sandwich_p0', 7, 3e-3), ('sandwich_p0.25', 7, 1e-3)})
    assert (word, n) == ('inconclusive', 3)  # one stuck run of 36 against none: no CI excludes 0
    assert 'sandwich_p0 1/60 over the grid (R = 7 lr 0.003 seed 1), 1/36 at lr 0.0003 / 0.001 / 0.003;' in how
    assert 'sandwich_p0.5 0/60 over the grid, 0/36 at lr 0.0003 / 0.001 / 0.003;' in how
    # stuck only at the grid's largest LR: an LR too large for that block, which is no reading of p
    assert stuck_at({('sandwich_p0', 7, 1e-2), ('sandwich_p0.25', 7, 1e-2)})[0] == 'inconclusive'
    # every smaller p stuck at two interior LRs at every R, p = 1/2 never
    many = {(v, R, lr) for v in report_deeploop.SMALLER_P for R in presets.DEEPLOOP_RS for lr in (1e-3, 3e-3)}
    assert stuck_at(many)[0] == 'reproduces'  # seed 1 stuck in each: 8 of 36 against 0 of 36
    # p = 1/2 stuck more often than the smaller p: the other sign beyond noise
    assert stuck_at({('sandwich_p0.5', R, lr) for R in presets.DEEPLOOP_RS for lr in (1e-3, 3e-3)})[0] \
        == 'does not reproduce'


def test_the_verdict_block_is_what_test_claims_binds_and_no_verdict_lines_bind_nothing():
    vs, cell = verdicts_and_cells(sweep(deeploop_wins, best=dl5_at_the_top))
    block = report_deeploop.deeploop_verdict_block(vs)
    bound = {m.group(1): (m.group(2), m.group(3)) for m in map(REPORT_VERDICT.match, block) if m}
    assert bound[report_deeploop.NEUTRAL] == ('reproduces', '3')
    assert bound[report_deeploop.TRAINABILITY] == ('inconclusive', '3')  # no run stuck anywhere: 0 of 36 each
    assert revisited(5) not in bound and report_deeploop.REASON not in bound
    assert f"- {revisited(5)}: no verdict; best LR at the grid's edge in cell sandwich_p0.5, R = 5" \
        in '\n'.join(block)
    table = '\n'.join(report_deeploop.verdict_cells_table(vs, cell))
    assert ('| sandwich_p0.5 | 5 | 0.01 | 0.0001 / 0.0003 / 0.001 / 0.003 / 0.01 | 2.200 | 0.010 | 3 | '
            f'*edge* | 0 of 15 | {revisited(5)}; {report_deeploop.REASON} |') in table
