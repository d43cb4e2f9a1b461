"""
lab/eval_depth.py and diagnostics.py: every diagnostic on a tiny model with a known answer
(docs/papers.md §1).
"""
import functools
import json
import math

import numpy as np
import pytest
import torch

from run import diagnostics
import eval_depth as ed
from conftest import tiny_gpt


tiny = functools.partial(tiny_gpt, vocab_size=11, n_layer=1, training=False)  # K 1, R 3, C 16, context 16


def batch(B=6, T=16, V=11, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(V, (B, T), generator=g), torch.randint(V, (B, T), generator=g)


def test_radial_clamp_is_a_noop_on_a_purely_tangential_update():
    torch.manual_seed(0)
    h_prev = torch.randn(2, 5, 8) * 7
    delta = torch.randn(2, 5, 8)
    # make the update orthogonal to h_prev
    delta -= (delta * h_prev).sum(-1, keepdim=True) / h_prev.pow(2).sum(-1, keepdim=True) * h_prev
    h_new = h_prev + delta
    assert torch.allclose(diagnostics.remove_radial(h_new, h_prev), h_new, atol=1e-5)
    # a purely radial update (the state only grows) is removed entirely
    assert torch.allclose(diagnostics.remove_radial(2.5 * h_prev, h_prev), h_prev, atol=1e-4)


def test_freeze_clamp_rescales_every_loop_to_loop_one_rms():
    model = tiny(n_loop=4)
    X, _ = batch()
    with torch.no_grad():
        hs = diagnostics.clamped_states(model, X, clamp='freeze')
    rms = lambda h: h.pow(2).mean(-1).sqrt()
    for h in hs[1:]:
        assert torch.allclose(rms(h), rms(hs[0]), rtol=1e-4)


def blocks(model, x):
    for block in model.transformer.h:
        x, _ = block(x)
    return x


@pytest.mark.parametrize('loop_norm', ['none', 'rmsnorm'])
def test_freeze_clamped_state_is_what_enters_the_next_loop(loop_norm):
    # h_1 = loop 1; h_k = rescale(loop(ln_loop(h_{k-1})), to h_1's per-token RMS)
    model = tiny(n_loop=4, inter_loop_norm=loop_norm)
    X, _ = batch()
    rms = lambda h: h.pow(2).mean(-1, keepdim=True).sqrt()
    with torch.no_grad():
        hs = [blocks(model, model.embed(X))]
        for _ in range(3):
            h = blocks(model, model.transformer.ln_loop(hs[-1]))
            hs.append(h * rms(hs[0]) / rms(h))
        for k, (a, b) in enumerate(zip(diagnostics.clamped_states(model, X, clamp='freeze'), hs), start=1):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), k


@pytest.mark.parametrize('loop_norm', ['none', 'rmsnorm'])
def test_radial_clamp_removes_the_radial_update_and_feeds_the_clamped_state_forward(loop_norm):
    # x_k = ln_loop(h_{k-1}) enters loop k; the update is h_k - h_{k-1} measured from the state before the
    # inter-loop norm (the reference code's h_prev), and loses its component along h_{k-1}
    model = tiny(n_loop=4, inter_loop_norm=loop_norm)
    X, _ = batch()
    with torch.no_grad():
        hs = [blocks(model, model.embed(X))]
        for _ in range(3):
            prev = hs[-1]
            delta = blocks(model, model.transformer.ln_loop(prev)) - prev
            along = (delta * prev).sum(-1, keepdim=True) / prev.pow(2).sum(-1, keepdim=True) * prev
            hs.append(prev + delta - along)
        clamped = diagnostics.clamped_states(model, X, clamp='radial')
        for k, (a, b) in enumerate(zip(clamped, hs), start=1):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), k
        # the clamp is not a no-op here: the unclamped loop grows radially
        assert not torch.allclose(clamped[-1], diagnostics.clamped_states(model, X)[-1], atol=1e-2)


@pytest.mark.parametrize('kw', [dict(), dict(inter_loop_norm='rmsnorm'), dict(pos='rope', readout='raw'),
                                dict(block='sandwich', depth_scaling='deeploop', init='gpt2')])
def test_unclamped_loop_equals_model_loop_states(kw):
    model = tiny(**kw)
    X, _ = batch()
    with torch.no_grad():
        for a, b in zip(diagnostics.clamped_states(model, X, n_loop=5), model.run(X, n_loop=5).states):
            assert torch.equal(a, b)


@pytest.mark.parametrize('readout', ['rmsnorm', 'layernorm'])
def test_scale_invariant_readout_sends_no_radial_gradient(readout):
    # docs/papers.md §1 Lemma 1: <dL/dh, h> = 0 for a scale-invariant readout; a raw readout sees the scale
    X, Y = batch()
    frac, total = diagnostics.radial_gradient(tiny(readout=readout), X, Y, batch_size=3)
    assert max(frac) < 1e-5
    assert total[-1] < 1e-5  # the last state only reaches the loss through its readout
    raw, _ = diagnostics.radial_gradient(tiny(readout='raw'), X, Y, batch_size=3)
    assert min(raw) > 1e-3


def test_norm_penalty_makes_the_training_loss_see_the_scale():
    X, Y = batch()
    _, total = diagnostics.radial_gradient(tiny(norm_penalty=10.0), X, Y, batch_size=6)
    assert total[-1] > 1e-2


def test_quantile_thresholds_are_monotone_and_fewer_loops_follow():
    torch.manual_seed(0)
    ce, scores = torch.rand(50, 4).double(), torch.rand(50, 4).double()
    qs = [i / 10 for i in range(11)]
    thr = ed.quantile_thresholds(scores, qs)
    assert all(a <= b for a, b in zip(thr, thr[1:]))
    loops = [ed.adaptive(ce, scores, t)[0] for t in thr]
    assert all(a <= b + 1e-12 for a, b in zip(loops, loops[1:]))  # a higher bar = more loops
    assert loops[0] == 1.0 and ed.adaptive(ce, scores, math.inf)[0] == 4.0


def test_exit_at_first_confident_loop():
    scores = torch.tensor([[0.9, 0.1, 0.1], [0.1, 0.8, 0.9], [0.1, 0.1, 0.1]]).double()
    assert ed.exit_loops(scores, 0.5).tolist() == [1, 2, 3]


def test_calibrated_threshold_meets_its_constraint_with_fewest_loops():
    g = torch.Generator().manual_seed(0)
    N, R = 80, 4
    ce = (3.0 - torch.arange(R).double() * 0.3) + 0.5 * torch.rand(N, R, generator=g).double()  # depth helps
    scores = torch.rand(N, R, generator=g).double() - ce / 10  # confident where CE is low
    t, loops, p = ed.calibrate(ce, scores, tol=1.01)
    limit = 1.01 * ed.ppl(ce[:, -1])
    assert p <= limit and ed.adaptive(ce, scores, t) == (loops, p)
    for cand in torch.unique(scores[:, :-1]).tolist():  # no feasible threshold uses fewer loops
        lc, pc = ed.adaptive(ce, scores, cand)
        assert not (pc <= limit and lc < loops - 1e-12)
    # when exit 1 is as good as exit R, one loop is enough
    flat = ce[:, :1].repeat(1, R)
    assert ed.calibrate(flat, scores, tol=1.01)[1] == 1.0


def test_dynamic_batching_reproduces_the_simulated_exits():
    model = tiny(n_loop=3)
    X, Y = batch(B=12)
    ce, scores, _ = ed.exit_stats(model, X, Y, 3, batch_size=5)
    t = ed.quantile_thresholds(scores['margin'], [0.5])[0]
    loops, p = ed.adaptive(ce, scores['margin'], t)
    ce_sum, loops_sum = ed.depth_pass(model, X, Y, batch_size=5, threshold=t, policy='margin')
    assert loops_sum / 12 == pytest.approx(loops)
    assert math.exp(ce_sum / 12) == pytest.approx(p, rel=1e-4)
    ce_sum, loops_sum = ed.depth_pass(model, X, Y, batch_size=5)  # fixed depth
    assert loops_sum == 36 and math.exp(ce_sum / 12) == pytest.approx(ed.ppl(ce[:, -1]), rel=1e-4)


def test_confidence_policies_known_values():
    uniform, peaked = torch.zeros(1, 1, 8), torch.tensor([[[10.0, 2.0] + [0.0] * 6]])
    assert ed.exit_score(uniform, 'maxprob').item() == pytest.approx(1 / 8)
    assert ed.exit_score(uniform, 'entropy').item() == pytest.approx(0.0, abs=1e-6)
    assert ed.exit_score(peaked, 'margin').item() == pytest.approx(8.0)
    assert 0.9 < ed.exit_score(peaked, 'entropy').item() <= 1.0


def test_val_windows_targets_are_the_inputs_shifted_by_one_token(tmp_path):
    # distinct token ids, in no order: each window is located in val.bin by its first token
    val = np.random.default_rng(0).permutation(1000)[:200].astype(np.uint16)
    val.tofile(tmp_path / 'val.bin')
    X, Y = ed.val_windows(str(tmp_path), {'dtype': 'uint16'}, T=16, n_seqs=7)
    assert X.shape == Y.shape == (7, 16) and X.dtype == Y.dtype == torch.long
    assert torch.equal(Y[:, :-1], X[:, 1:])
    starts = [int(np.flatnonzero(val == x0)[0]) for x0 in X[:, 0].tolist()]
    assert starts[0] == 0 and starts[-1] == len(val) - 17  # spread over the whole split
    for s, x, y in zip(starts, X, Y):
        assert x.tolist() == val[s:s + 16].tolist() and y.tolist() == val[s + 1:s + 17].tolist()


def test_cli_writes_table_and_json(tiny_ckpt, tiny_data, capsys):
    ed.main([str(tiny_ckpt), '--data_dir', str(tiny_data), '--n_seqs=12', '--batch_size=4',
             '--timing_repeats=1', '--n_grad_seqs=4'])
    out = capsys.readouterr().out
    assert 'fixed depth' in out and 'calibrated halting' in out and 'radial gradient fraction' in out
    res = json.loads((tiny_ckpt / 'eval_depth.json').read_text())
    R = res['n_loop']
    assert len(res['fixed']['ce']) == 4 * R and len(res['radial_frac']['readout']) == R
    cal = res['calibrated']['margin']
    assert cal['cal_ppl'] <= 1.01 * res['calibrated']['fixed_ppl_cal'] + 1e-9
    assert res['throughput']['fixed']['tok_per_s'] > 0


# ------------------------------------------------------------ visit alignment kappa_R (docs/papers.md §2)

def test_kappa_is_R_for_aligned_visits_one_for_orthogonal_and_zero_for_cancelling():
    g = torch.randn(4, 3)
    assert diagnostics.kappa([g, g, g]) == pytest.approx(3.0)
    e1, e2 = torch.zeros(2, 2), torch.zeros(2, 2)
    e1[0, 0], e2[1, 1] = 1.0, 5.0
    assert diagnostics.kappa([e1, e2]) == pytest.approx(1.0)
    assert diagnostics.kappa([g, -g]) == pytest.approx(0.0) and diagnostics.kappa([0 * g, 0 * g]) is None


def test_per_visit_gradients_sum_to_the_models_own_gradient():
    model = tiny(n_loop=3, n_layer=2)
    X, Y = batch()
    per_visit = diagnostics.visit_gradients(model, X, Y)
    _, loss = model(X, Y)
    loss.backward()
    params = dict(model.named_parameters())
    assert len(per_visit) == 2 * 4 and all(len(g) == 3 for g in per_visit.values())  # K = 2 blocks x 4
    for name, grads in per_visit.items():
        torch.testing.assert_close(sum(grads), params['transformer.' + name].grad, rtol=1e-5, atol=1e-7)
    assert not isinstance(model.transformer.h[0], diagnostics.PerVisit)  # the stand-ins are gone


def test_kappa_is_R_when_every_visit_sees_the_same_input():
    # zero output projections make every block the identity: all R visits see the same input and, under
    # terminal supervision, pass back the same gradient, so the projections' R pushes are identical
    model = tiny(n_loop=4, n_layer=2, supervision='terminal')
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_proj.weight.zero_()
            block.mlp.c_proj.weight.zero_()
    X, Y = batch()
    kap = diagnostics.visit_alignment(model, X, Y)['per_matrix']
    for j in range(2):
        assert kap[f'h.{j}.attn.c_proj.weight'] == pytest.approx(4.0, rel=1e-5)
        assert kap[f'h.{j}.mlp.c_proj.weight'] == pytest.approx(4.0, rel=1e-5)


@pytest.mark.parametrize('injection', ['add', 'concat'])
def test_dynamic_batching_with_a_prelude_slices_the_injected_output_with_the_rows_that_stay(injection):
    # rows that exit leave the batch; the prelude output e re-fed to the rest must be theirs: the batched
    # pass equals each row run alone, and the simulated exits of exit_stats
    model = tiny(n_loop=4, n_prelude=1, injection=injection)
    if injection == 'concat':
        with torch.no_grad():
            model.transformer.adapter.weight.add_(0.3 * torch.randn_like(model.transformer.adapter.weight))
    X, Y = batch(B=8)
    ce, scores, _ = ed.exit_stats(model, X, Y, 4, batch_size=8)
    t = float(scores['margin'][:, 0].median())  # about half the rows exit at loop 1, the rest later
    assert len(set(ed.exit_loops(scores['margin'], t).tolist())) > 1  # rows exit at different loops
    together = ed.depth_pass(model, X, Y, batch_size=8, threshold=t, policy='margin')
    alone = [ed.depth_pass(model, X[i:i + 1], Y[i:i + 1], batch_size=1, threshold=t, policy='margin')
             for i in range(8)]
    assert together[1] == sum(a[1] for a in alone)
    assert together[0] == pytest.approx(sum(a[0] for a in alone), rel=1e-5)
    loops, p = ed.adaptive(ce, scores['margin'], t)
    assert together[1] / 8 == pytest.approx(loops) and math.exp(together[0] / 8) == pytest.approx(p, rel=1e-4)


# ------------------------------------------------------------ what the CLI prints is what a user can act on

@pytest.fixture
def threads_restored():
    # eval_depth.main sets torch's threads, a process-wide setting
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def quick_cli(ckpt, data, *extra):
    return ed.main([str(ckpt), '--data_dir', str(data), '--n_seqs=12', '--batch_size=4', '--timing_repeats=1',
                    '--n_grad_seqs=4', '--exits=2', '--no-progress', *extra])


@pytest.mark.parametrize('omp, threads', [('1', 1), (None, 8)])
def test_cli_runs_omp_num_threads_threads_else_one_per_core_and_says_the_speedup_depends_on_them(
        tiny_ckpt, tiny_data, capsys, monkeypatch, threads_restored, omp, threads):
    # on a shared 2-core machine one thread per core took 69 s where OMP_NUM_THREADS=1 took 12 s
    monkeypatch.setattr(ed.os, 'sched_getaffinity', lambda pid: set(range(8)), raising=False)
    if omp is None:
        monkeypatch.delenv('OMP_NUM_THREADS', raising=False)
    else:
        monkeypatch.setenv('OMP_NUM_THREADS', omp)
    quick_cli(tiny_ckpt, tiny_data)
    assert torch.get_num_threads() == threads
    res = json.loads((tiny_ckpt / 'eval_depth.json').read_text())
    assert res['throughput']['threads'] == threads
    line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith('dynamic-depth batching'))
    assert line.endswith(f"({threads} threads; timing depends on the thread count and the machine's load)")


def test_cli_rejects_an_omp_num_threads_that_is_not_a_count(tiny_ckpt, capsys, monkeypatch, threads_restored):
    monkeypatch.setenv('OMP_NUM_THREADS', 'four')
    with pytest.raises(SystemExit) as e:
        ed.main([str(tiny_ckpt), '--device=cpu'])
    assert e.value.code == 1 and 'OMP_NUM_THREADS=four: must be a positive integer' in capsys.readouterr().err


def test_missing_checkpoint_error_names_the_positional_out_dir_eval_depth_takes(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        ed.main([str(tmp_path / 'out-nowhere'), '--device=cpu'])
    err = capsys.readouterr().err
    assert e.value.code == 1 and len(err.strip().splitlines()) == 1
    assert 'out-nowhere' in err and 'python lab/eval_depth.py OUT_DIR' in err
    assert '--out_dir' not in err  # train.py's and sample.py's flag: eval_depth has none


def test_calibrated_kl_threshold_is_the_positive_kl_bound_sample_py_takes(capsys):
    # the kl score is -KL; sample.py --exit_policy=kl --exit_threshold=X exits when KL <= X
    # (exits.score_threshold: score -X), so the table and the JSON give X, not the score
    from decoding.exits import score_threshold
    model = tiny(n_loop=3)
    X, Y = batch(B=16)
    # a loose tolerance, so that an untrained model's early exits are worth calibrating
    res = ed.evaluate(model, X, Y, batch_size=8, tol=10.0, timing_repeats=1, n_grad_seqs=4, exits=3)
    ce, scores, _ = ed.exit_stats(model, X, Y, 3, batch_size=8)
    kl = res['calibrated']['kl']
    cal, held = torch.arange(0, 16, 2), torch.arange(1, 16, 2)
    score, loops, _ = ed.calibrate(ce[cal], scores['kl'][cal], tol=10.0)
    assert math.isfinite(score) and loops < 3  # an early kl exit was calibrated: its sign matters
    assert kl['threshold'] > 0 and score_threshold('kl', kl['threshold']) == score
    assert ed.adaptive(ce[held], scores['kl'][held], score_threshold('kl', kl['threshold']))[0] == \
        kl['held_avg_loops']
    assert all(t >= 0 for t in res['adaptive']['kl']['threshold'])  # every KL bound of the curve
    for p in ('maxprob', 'margin', 'entropy'):  # the other scores are their own flags
        assert score_threshold(p, res['calibrated'][p]['threshold']) == res['calibrated'][p]['threshold'] \
            or not math.isfinite(res['calibrated'][p]['threshold'])
    ed.print_report(res, 'tiny')
    row = next(s.split() for s in capsys.readouterr().out.splitlines() if s.split()[:1] == ['kl'])
    assert float(row[1]) == pytest.approx(kl['threshold'], rel=1e-3)
