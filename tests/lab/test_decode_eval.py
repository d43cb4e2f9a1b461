"""
lab/decode_eval.py: teacher-forced decoding through the KV cache against the model's own full-sequence CE,
the report against its JSON, and one-line errors.
"""
import functools
import json
import math
import re

import pytest
import torch

import decode_eval as de
from conftest import save_tiny_checkpoint, tiny_gpt
from decoding.exits import KV_POLICIES

R, BS = 3, 16
KINDS = [dict(), dict(readout='raw'), dict(n_prelude=1, n_coda=1, injection='add', pos='rope')]


tiny = functools.partial(tiny_gpt, block_size=BS, vocab_size=11, n_layer=1, n_loop=R, training=False)


def windows(B=3, T=BS, V=11, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(V, (B, T), generator=g), torch.randint(V, (B, T), generator=g)


@pytest.mark.parametrize('kw', KINDS)
def test_a_threshold_that_never_exits_is_fixed_R_through_the_cache_is_the_full_sequence_ce(kw):
    m, (X, Y) = tiny(**kw), windows()
    full, _ = de.token_exits(m, X, Y, 'maxprob')         # (B*T, R), inside the block
    fixed, loops, refills = de.decode(m, X, Y, R)
    assert refills == 0 and bool((loops == R).all())
    assert torch.allclose(fixed.reshape(-1), full[:, -1], atol=1e-5)
    for policy in KV_POLICIES:  # shared with a slot per loop: no overwrite
        ce, loops, _ = de.decode(m, X, Y, R, math.inf, 'maxprob', policy, kv_slots=R)
        assert bool((loops == R).all())
        assert torch.allclose(ce, fixed, atol=1e-5), policy


@pytest.mark.parametrize('kw', KINDS)
def test_threshold_zero_exits_every_token_at_loop_one_with_exit_one_ce(kw):
    m, (X, Y) = tiny(**kw), windows()
    full, _ = de.token_exits(m, X, Y, 'maxprob')
    one, _, _ = de.decode(m, X, Y, 1)                    # fixed depth 1 through the cache
    assert torch.allclose(one.reshape(-1), full[:, 0], atol=1e-5)
    for policy in KV_POLICIES:
        ce, loops, _ = de.decode(m, X, Y, R, 0.0, 'maxprob', policy, kv_slots=2)
        assert bool((loops == 1).all()), policy
        assert torch.allclose(ce.reshape(-1), full[:, 0], atol=1e-5), policy


def test_past_the_block_the_engine_refills_every_half_block():
    m, (X, Y) = tiny(), windows(B=2, T=40)
    ce, loops, refills = de.decode(m, X, Y, R, 0.9, 'maxprob', 'copy')
    assert refills == 3  # windows slide at t = 16, 24, 32
    assert ce.shape == (2, 40) and bool(torch.isfinite(ce).all())
    full, _ = de.token_exits(m, X[:, :BS], Y[:, :BS], 'maxprob')
    fixed, _, _ = de.decode(m, X, Y, R)
    assert torch.allclose(fixed[:, :BS].reshape(-1), full[:, -1], atol=1e-5)  # inside the first block


def cropped_ce(m, X, Y, n_loop):
    """Per-token CE (B, T) of fixed-depth decoding by full recompute, each token read after the window
    generate crops to: when it would hold block_size + 1 tokens it keeps the last block_size/2."""
    start, ce = 0, torch.zeros(X.shape, dtype=torch.float64)
    with torch.no_grad():
        for t in range(X.size(1)):
            if t + 1 - start > BS:
                start = t + 1 - BS // 2
            logits = m(X[:, start:t + 1], n_loop=n_loop)[0][:, -1].float()
            ce[:, t] = torch.nn.functional.cross_entropy(logits, Y[:, t], reduction='none').double()
    return ce


@pytest.mark.parametrize('kw', KINDS)
def test_past_the_block_fixed_depth_decoding_is_recompute_on_the_window_generate_keeps(kw):
    # every token, refills included: a window one token longer or shorter, or a refill one position
    # behind, changes the CE of the tokens after it
    m, (X, Y) = tiny(**kw), windows(B=2, T=40)
    for n in (1, R):
        ce, loops, refills = de.decode(m, X, Y, n)
        assert refills == 3 and bool((loops == n).all())
        assert torch.allclose(ce, cropped_ce(m, X, Y, n), atol=1e-5), n


def test_gaps_are_measured_against_recompute_and_against_fixed_depth_through_the_cache():
    m, (X, Y) = tiny(readout='raw'), windows(B=2, T=24)
    res = de.evaluate(m, X, Y, kv_policies=('recompute', 'copy'), thresholds=[0.05, 0.3, 0.6, 1.0],
                      kv_slots=2)
    # the fixed-depth baseline: n loops for every token, the refill included, as recomputed by hand
    fixed = [de.point(cropped_ce(m, X, Y, n), torch.full(X.shape, float(n)), n_loop=n)
             for n in range(1, R + 1)]
    for got, want in zip(res['fixed'], fixed):
        assert got['loops'] == want['loops'] and got['ce'] == pytest.approx(want['ce'], abs=1e-6)
    pol = res['policies']
    assert len({p['loops'] for p in pol['copy']}) > 2  # the thresholds span several mean depths
    for p in ('recompute', 'copy'):
        assert res['over_fixed'][p] == pytest.approx(de.matched_gap(pol[p], fixed), abs=1e-6)
    assert res['gap'] == {'copy': de.matched_gap(pol['copy'], pol['recompute'])}
    assert res['gap']['copy']['n'] > 0 and res['over_fixed']['copy']['n'] > 0


def test_matched_gap_interpolates_in_loops():
    ref = [dict(loops=1.0, ce=2.0), dict(loops=3.0, ce=1.8)]
    curve = [dict(loops=0.5, ce=2.5), dict(loops=2.0, ce=2.0), dict(loops=2.5, ce=2.05)]
    g = de.matched_gap(curve, ref)  # ref at 2.0 is 1.9, at 2.5 is 1.85; 0.5 lies outside it
    assert g['n'] == 2 and g['max'] == pytest.approx(0.2) and g['mean'] == pytest.approx(0.15)
    assert de.matched_gap([dict(loops=3.5, ce=1.0)], ref) == dict(max=None, mean=None, n=0)


def test_report_cells_equal_the_json(tiny_data, tmp_path, capsys):
    meta = json.loads((tiny_data / 'meta.json').read_text(encoding='utf-8'))
    for name in ('a', 'b'):
        save_tiny_checkpoint(str(tmp_path / name / 'ckpt.pt'), meta['vocab_size'], dataset=tiny_data.name,
                             seed=len(name), block_size=16, n_loop=3)
    out = tmp_path / 'rep'
    de.main([str(tmp_path / 'a'), str(tmp_path / 'b'), f'--data_dir={tiny_data}', '--n_windows=2',
             '--window=20', '--quantiles=0.3,0.7', f'--report_dir={out}'])
    res = json.loads((out / 'decoding.json').read_text(encoding='utf-8'))
    md = (out / 'decoding.md').read_text(encoding='utf-8')
    assert res['commit'] in md and 'lab/decode_eval.py' in md
    assert len(res['arms']) == 2
    for name, r in res['arms'].items():
        section = md.split(f"### {name}")[1].split('###')[0]
        lines = [line for line in section.splitlines() if line.startswith('| ')]
        rows = [re.split(r'\s*\|\s*', line.strip('| ')) for line in lines]
        rows = [row for row in rows if row[0] not in ('curve', '---')]
        want = [(f"fixed n={p['n_loop']}", p) for p in r['fixed']]
        want += [(pol, p) for pol, c in r['policies'].items() for p in c]
        want += [('sequence-level', p) for p in r['sequence']]
        assert len(rows) == len(want)
        for row, (label, p) in zip(rows, want):
            assert row[0] == label
            assert row[2:5] == [f"{p['loops']:.2f}", f"{p['ce']:.4f}", f"{p['ppl']:.3f}"]
        gap_row = next(line for line in md.splitlines() if line.startswith(f"| {name} |"))
        g = r['gap']['copy']['max']
        assert (f"{g:+.4f}" if g is not None else '—') in gap_row


@pytest.mark.parametrize('args, msg', [(['--kv_policy=recompute,bogus'], 'unknown policy'),
                                       (['--exit_policy=bogus'], 'exit_policy'),
                                       (['--thresholds=2'], 'thresholds'),
                                       (['--kv_slots=9'], 'kv_slots')])
def test_bad_input_is_one_line(tiny_ckpt, tiny_data, args, msg, capsys):
    with pytest.raises(SystemExit) as e:
        de.main([str(tiny_ckpt), f'--data_dir={tiny_data}', *args])
    err = capsys.readouterr().err
    assert e.value.code == 1 and msg in err and err.count('\n') == 1


def test_a_folder_without_a_checkpoint_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        de.main([str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 1 and 'no ckpt.pt' in err and err.count('\n') == 1
