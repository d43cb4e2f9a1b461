"""
lab/routing.py: the routing divergence of a Looped-MoE model across loops, on routings with a known answer
(docs/papers.md §5: overlap of the top-k sets, its chance level, kappa, JS, distinct experts, load).
"""
import json

import pytest
import torch

import routing as rt
from conftest import save_tiny_checkpoint

E, k = 8, 2


def uniform_routes(N, seed, E=E, k=k):
    """N tokens, each sent to k distinct experts drawn uniformly and independently: (N, k)."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(N, E, generator=g).argsort(1)[:, :k]


def test_hypergeometric_chance_for_top2_of_8_is_53_6_disjoint_and_3_6_identical():
    p = rt.hypergeom(8, 2)
    assert p.tolist() == pytest.approx([15 / 28, 12 / 28, 1 / 28])
    assert round(100 * p[0].item(), 1) == 53.6 and round(100 * p[2].item(), 1) == 3.6
    assert p.sum().item() == pytest.approx(1.0) and rt.mean_overlap(p) == pytest.approx(k * k / E)


def test_independent_uniform_routing_overlaps_hypergeometrically_and_kappa_is_zero():
    a, b = uniform_routes(200_000, 0), uniform_routes(200_000, 1)
    hist, chance = rt.overlap_hist(a, b, E), rt.chance_hist(a, b, E)
    # sampling error of a frequency over 200k tokens is <= 0.0012 (one sigma)
    assert torch.allclose(hist, rt.hypergeom(E, k), atol=0.005)
    assert torch.allclose(chance, rt.hypergeom(E, k), atol=0.005)
    assert abs(rt.kappa(hist, chance)) < 0.01
    assert rt.jaccard(hist) == pytest.approx(rt.jaccard(rt.hypergeom(E, k)), abs=0.003)
    assert rt.js_divergence(a, b, E) < 1e-3


def test_identical_routing_has_kappa_one_and_jaccard_one():
    a = uniform_routes(10_000, 0)
    hist, chance = rt.overlap_hist(a, a.flip(1), E), rt.chance_hist(a, a, E)  # the order within a set is moot
    assert hist.tolist() == [0.0, 0.0, 1.0]
    assert rt.kappa(hist, chance) == pytest.approx(1.0) and rt.jaccard(hist) == 1.0
    assert rt.js_divergence(a, a, E) == pytest.approx(0.0, abs=1e-12)
    assert rt.distinct_experts([a, a], E) == k


def test_loop_specialised_routing_has_js_of_one_bit_and_2k_distinct_experts():
    # loop 1 uses experts 0-3 only, loop 2 experts 4-7 only: the usage distributions share no expert
    a, b = uniform_routes(10_000, 0, E=4), uniform_routes(10_000, 1, E=4) + 4
    assert rt.js_divergence(a, b, E) == pytest.approx(1.0)  # bits: JS <= log 2 nats = 1 bit
    assert rt.distinct_experts([a, b], E) == 2 * k
    assert rt.overlap_hist(a, b, E).tolist() == [1.0, 0.0, 0.0]
    # every token disjoint against 53.6 % uniform; against the loops' own marginals disjoint is chance too:
    # specialisation by loop shows in JS, and kappa (o_ind = 0) says the loops agree exactly as chance would
    assert rt.chance_hist(a, b, E).tolist() == [1.0, 0.0, 0.0]
    assert rt.kappa(rt.overlap_hist(a, b, E), rt.chance_hist(a, b, E)) == 0.0


def test_collapsed_routing_shows_load_max_over_mean_of_E_over_k():
    collapsed = torch.tensor([[0, 1]]).repeat(1000, 1)  # every token on the same k experts
    assert rt.load_ratio(collapsed, E) == pytest.approx(E / k)
    assert rt.load_ratio(uniform_routes(100_000, 0), E) == pytest.approx(1.0, abs=0.02)  # balanced


def test_chance_histogram_is_exact_over_the_loops_set_distributions():
    # each loop sends half the tokens to {0, 1}, half to {2, 3}, the same way: chance pairs the sets
    # independently, 1/4 each: o = 2 for (01, 01) and (23, 23), o = 0 for the mixed pairs
    a = torch.tensor([[0, 1], [2, 3]])
    assert rt.chance_hist(a, a, E).tolist() == [0.5, 0.0, 0.5]
    assert rt.overlap_hist(a, a, E).tolist() == [0.0, 0.0, 1.0]
    assert rt.kappa(rt.overlap_hist(a, a, E), rt.chance_hist(a, a, E)) == pytest.approx(1.0)  # (2-1)/(2-1)


def test_chance_mean_overlap_is_the_sum_of_marginal_inclusion_products():
    # docs/papers.md §5: o_ind = sum_e P_a(e in S) P_b(e in S'), here on skewed, non-uniform usage
    g = torch.Generator().manual_seed(0)
    skew = torch.tensor([8., 4, 2, 1, 1, 1, 1, 1])
    a = torch.multinomial(skew.expand(5000, E), k, generator=g)
    b = torch.multinomial(skew.flip(0).expand(5000, E), k, generator=g)
    o_ind = (k * rt.usage(a, E) * k * rt.usage(b, E)).sum().item()
    assert rt.mean_overlap(rt.chance_hist(a, b, E)) == pytest.approx(o_ind, rel=1e-9)
    assert rt.chance_hist(a, b, E).sum().item() == pytest.approx(1.0)


def test_shared_skew_raises_chance_agreement_above_uniform_and_kappa_discounts_it():
    # two loops routing independently but both preferring experts 0 and 1: identical sets are far more
    # common than the uniform 3.6 %, yet kappa against their own marginals stays at 0
    g = torch.Generator().manual_seed(0)
    skew = torch.tensor([20., 20, 1, 1, 1, 1, 1, 1]).expand(100_000, E)
    a, b = torch.multinomial(skew, k, generator=g), torch.multinomial(skew, k, generator=g)
    hist, chance = rt.overlap_hist(a, b, E), rt.chance_hist(a, b, E)
    assert hist[2] > 5 * rt.hypergeom(E, k)[2]
    assert torch.allclose(hist, chance, atol=0.006) and abs(rt.kappa(hist, chance)) < 0.01


def test_distinct_experts_over_R_independent_uniform_loops_match_chance():
    R = 3
    loops = [uniform_routes(100_000, s) for s in range(R)]
    marg, unif = rt.distinct_chance(loops, E)
    assert unif == pytest.approx(E * (1 - (1 - k / E) ** R))  # 4.625 for top-2 of 8 over 3 loops
    assert rt.distinct_experts(loops, E) == pytest.approx(unif, abs=0.01)
    assert marg == pytest.approx(unif, abs=0.01)
    assert rt.distinct_chance([uniform_routes(10, 0)] * 2, E)[1] == pytest.approx(3.5)  # top-2 of 8, 2 loops


def test_kappa_is_undefined_when_chance_alone_gives_identical_sets():
    a = torch.tensor([[3, 5]]).repeat(50, 1)
    assert rt.kappa(rt.overlap_hist(a, a, E), rt.chance_hist(a, a, E)) is None


def test_divergence_reports_every_layer_and_loop_pair_as_json():
    R, N = 3, 500
    routes = {(j, r): uniform_routes(N, 10 * j + r) for j in range(2) for r in range(1, R + 1)}
    routes[1, 2] = routes[1, 1]  # layer 1 routes loop 2 as loop 1
    res = json.loads(json.dumps(rt.divergence(routes, E, k)))
    assert res['uniform']['overlap'] == pytest.approx(rt.hypergeom(E, k).tolist())
    assert [L['layer'] for L in res['layers']] == [0, 1]
    for L in res['layers']:
        assert [p['loops'] for p in L['pairs']] == [[1, 2], [1, 3], [2, 3]]
        assert L['tokens'] == N and len(L['load']) == R and len(L['usage']) == R
        for p in L['pairs']:
            assert sum(p['overlap']) == pytest.approx(1.0) and sum(p['chance']) == pytest.approx(1.0)
            assert {'mean_overlap', 'o_ind', 'jaccard', 'jaccard_chance', 'kappa', 'js_bits'} <= p.keys()
    assert res['layers'][1]['pairs'][0]['kappa'] == pytest.approx(1.0)
    assert res['layers'][0]['pairs'][0]['kappa'] == pytest.approx(0.0, abs=0.1)


# ------------------------------------------------------------ the command line on a checkpoint

def routing_cli_error(out, data, capsys, *flags):
    """lab/routing.py's main in this process on checkpoint folder out, which must fail: its one error line."""
    with pytest.raises(SystemExit) as e:
        rt.main([str(out), '--data_dir', str(data), '--device=cpu', *flags])
    err = capsys.readouterr().err
    assert e.value.code == 1 and len(err.strip().splitlines()) == 1
    return err


def test_cli_refuses_a_dense_checkpoint_in_one_line(tiny_ckpt, tiny_data, capsys):
    assert 'has no experts: n_expert = 0' in routing_cli_error(tiny_ckpt, tiny_data, capsys)


def test_cli_names_a_missing_checkpoint_in_one_line(tmp_path, tiny_data, capsys):
    err = routing_cli_error(tmp_path / 'out-nowhere', tiny_data, capsys)
    assert 'out-nowhere' in err and 'python lab/routing.py OUT_DIR' in err


def moe_ckpt(tmp_path, tiny_data, **kw):
    meta = json.loads((tiny_data / 'meta.json').read_text(encoding='utf-8'))
    save_tiny_checkpoint(str(tmp_path / 'moe' / 'ckpt.pt'), meta['vocab_size'], dataset=tiny_data.name,
                         meta=meta, n_layer=2, n_loop=3, n_expert=E, top_k=k, **kw)
    return tmp_path / 'moe'


def res_summary_is_stored(out):
    return json.loads((out / 'routing.json').read_text())['summary'][0].startswith('summary:')


def test_cli_prints_per_layer_pair_tables_and_writes_json(tmp_path, tiny_data, capsys):
    out = moe_ckpt(tmp_path, tiny_data)
    rt.main([str(out), '--data_dir', str(tiny_data), '--device=cpu', '--batches=2', '--batch_size=4'])
    text = capsys.readouterr().out
    assert 'layer h[0]' in text and 'layer h[1]' in text
    assert 'distinct experts' in text and 'load max/mean' in text
    assert 'summary: the loops route' in text and res_summary_is_stored(out)
    res = json.loads((out / 'routing.json').read_text())
    assert res['n_expert'] == E and res['top_k'] == k and len(res['layers']) == 2
    for L in res['layers']:
        assert L['loops'] == [1, 2, 3] and L['tokens'] == 2 * 4 * 32  # batches x batch_size x block_size
        assert [p['loops'] for p in L['pairs']] == [[1, 2], [1, 3], [2, 3]]


def test_cli_finds_tied_routing_identical_on_every_loop(tmp_path, tiny_data, capsys):
    # tied routing reuses loop 1's choice on later loops (docs/papers.md §5: the direct test of the
    # paper's claim), so every pair of loops agrees exactly: kappa 1, Jaccard 1, JS 0
    out = moe_ckpt(tmp_path, tiny_data, tied_routing=True)
    rt.main([str(out), '--data_dir', str(tiny_data), '--device=cpu', '--batches=1', '--batch_size=4',
             f"--json={tmp_path / 'r.json'}"])
    res = json.loads((tmp_path / 'r.json').read_text())
    for p in (p for L in res['layers'] for p in L['pairs']):
        assert p['overlap'][-1] == 1.0 and p['jaccard'] == 1.0
        assert p['js_bits'] == pytest.approx(0.0, abs=1e-9)
        assert p['kappa'] is None or p['kappa'] == pytest.approx(1.0)


def summarised(routes):
    return rt.summary(json.loads(json.dumps(rt.divergence(routes, E, k))))


def test_the_summary_says_alike_apart_or_chance_by_mean_kappa():
    N, a = 2000, uniform_routes(2000, 1)
    alike = summarised({(0, 1): a, (0, 2): a})
    apart = summarised({(0, 1): a, (0, 2): (a + E // 2) % E})  # loop 2 never shares an expert
    chance = summarised({(0, 1): a, (0, 2): uniform_routes(N, 2)})
    assert alike[0].startswith('summary: the loops route alike') and 'kappa +1.000' in alike[0]
    assert apart[0].startswith('summary: the loops route apart')
    assert chance[0].startswith('summary: the loops route as chance would')
    assert len(alike) == len(apart) == len(chance) == 1  # uniform load: no warning


def test_a_collapsed_layer_is_flagged_since_its_kappas_mean_little():
    N = 500
    stuck = torch.tensor([[0, 1]]).expand(N, k)  # every token on experts 0 and 1: load max/mean E/k
    lines = summarised({(0, 1): uniform_routes(N, 1), (0, 2): uniform_routes(N, 2),
                        (1, 1): stuck, (1, 2): stuck})
    assert len(lines) == 2 and lines[1].startswith('warning: layer h[1] has collapsed onto about 2 experts')


# ------------------------------------------------------------ kappa given the input token

PAIRS = torch.combinations(torch.arange(E), k)  # the 28 top-2 sets of 8 experts


def token_routes(tokens, sets):
    """Each token t sent to sets[t]: routing decided by the input token alone, (N, k)."""
    return sets[tokens]


def test_routing_fixed_by_the_input_token_has_kappa_one_and_kappa_given_token_undefined():
    # each of 28 input tokens always goes to its own pair of experts, on both loops: the loops agree
    # completely (kappa 1), but within a token the chance agreement is already total (o_ind|token = k),
    # so no agreement is left for the loops to explain: undefined, as kappa is when chance gives o = k
    tokens = torch.randint(0, len(PAIRS), (20_000,), generator=torch.Generator().manual_seed(0))
    a = token_routes(tokens, PAIRS)
    hist, chance = rt.overlap_hist(a, a, E), rt.chance_hist(a, a, E)
    assert rt.kappa(hist, chance) == pytest.approx(1.0)
    o_tok, k_tok = rt.kappa_given_token(a, a.flip(1), tokens, E)
    assert o_tok == pytest.approx(k) and k_tok is None


def test_routing_that_depends_only_on_the_token_and_loop_has_kappa_given_token_zero():
    # loop 2 sends token t to the pair after loop 1's: a deterministic function of (token, loop), so the
    # token explains every bit of agreement there is, whatever kappa says
    tokens = torch.randint(0, len(PAIRS), (20_000,), generator=torch.Generator().manual_seed(0))
    a, b = token_routes(tokens, PAIRS), token_routes(tokens, PAIRS.roll(-1, 0))
    hist, chance = rt.overlap_hist(a, b, E), rt.chance_hist(a, b, E)
    assert rt.kappa(hist, chance) > 0.05  # neighbouring pairs share an expert: above chance overall
    o_tok, k_tok = rt.kappa_given_token(a, b, tokens, E)
    assert o_tok == pytest.approx(rt.mean_overlap(hist)) and k_tok == pytest.approx(0.0, abs=1e-12)


def test_independent_uniform_routing_has_kappa_and_kappa_given_token_near_zero():
    tokens = torch.randint(0, 65, (200_000,), generator=torch.Generator().manual_seed(0))
    a, b = uniform_routes(200_000, 1), uniform_routes(200_000, 2)
    assert abs(rt.kappa(rt.overlap_hist(a, b, E), rt.chance_hist(a, b, E))) < 0.01
    o_tok, k_tok = rt.kappa_given_token(a, b, tokens, E)
    assert o_tok == pytest.approx(k * k / E, abs=0.01) and abs(k_tok) < 0.01


def test_a_loop_that_copies_the_last_keeps_kappa_given_token_at_one_when_routing_ignores_the_token():
    # routing drawn at random whatever the token, loop 2 a copy of loop 1: the token explains nothing,
    # within a token chance is near uniform's, and the loops' agreement is all beyond it
    tokens = torch.randint(0, 65, (100_000,), generator=torch.Generator().manual_seed(0))
    a = uniform_routes(100_000, 1)
    o_tok, k_tok = rt.kappa_given_token(a, a, tokens, E)
    assert o_tok == pytest.approx(k * k / E, abs=0.01) and k_tok == pytest.approx(1.0)


def test_kappa_given_token_needs_one_input_token_per_routed_row():
    with pytest.raises(AssertionError, match='10 input tokens for 20 routed rows'):
        rt.kappa_given_token(uniform_routes(20, 0), uniform_routes(20, 1), torch.zeros(10), E)


def test_divergence_reports_kappa_given_token_beside_kappa_when_given_the_tokens():
    N = 2000
    tokens = torch.randint(0, len(PAIRS), (N,), generator=torch.Generator().manual_seed(0))
    routes = {(0, 1): token_routes(tokens, PAIRS), (0, 2): token_routes(tokens, PAIRS.roll(-1, 0))}
    with_tokens = json.loads(json.dumps(rt.divergence(routes, E, k, tokens)))['layers'][0]['pairs'][0]
    assert with_tokens['kappa_given_token'] == pytest.approx(0.0, abs=1e-12) and with_tokens['kappa'] > 0.05
    assert with_tokens['o_ind_token'] == pytest.approx(with_tokens['mean_overlap'])
    without = rt.divergence(routes, E, k)['layers'][0]['pairs'][0]  # not measured: null in the JSON
    assert without['kappa_given_token'] is None and without['o_ind_token'] is None


def test_cli_prints_and_stores_kappa_given_token_and_its_mean_in_the_summary(tmp_path, tiny_data, capsys):
    out = moe_ckpt(tmp_path, tiny_data)
    rt.main([str(out), '--data_dir', str(tiny_data), '--device=cpu', '--batches=2', '--batch_size=4'])
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.lstrip().startswith('loops'))
    assert header.split()[-3:] == ['kappa|token', 'JS', 'bits'] and 'mean kappa|token' in text
    pairs = [p for L in json.loads((out / 'routing.json').read_text())['layers'] for p in L['pairs']]
    assert all(p['o_ind_token'] is not None and 'kappa_given_token' in p for p in pairs)
