"""
The recurrent-depth family (docs/papers.md §4): prelude and coda, input injection, sampled depth with
truncated backprop, the learned exit gate, and the KL and gate exits. Each test states one mechanism; the
first pins that with every piece switched off the model trains exactly as it did before the family existed.
"""
import json
import math
import os

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.nn import functional as F

from conftest import (REPO, T, TINY, V, read_metrics, run_train, run_train_process, skip_without_torchrun,
                      tiny_gpt as tiny, write_data)
from test_model import batch
from test_reliability import assert_clean_error, model_tensors_equal

from run import diagnostics
import eval_depth
from configurator import check_model
from decoding.engine import Decoding, generate
from decoding.exits import score_at_exit, score_threshold
from model import GPT, GPTConfig, exit_distribution
from run.accounting import flops_per_token

GOLDEN = os.path.join(REPO, 'tests', 'data', 'golden_metrics.json')

# -----------------------------------------------------------------------------
# off by default


@pytest.mark.parametrize('name,files', [('default', []), ('deeploop', ['config/deeploop.py'])])
def test_the_family_switched_off_trains_exactly_as_before(tmp_path, name, files):
    # tests/data/golden_metrics.json: 20 steps of the embedded default and of the DeepLoop arm, fp32, one
    # thread, on write_data's corpus, written by the code before the family existed (its eval batches
    # redrawn once the validation set stopped following the seed: the weights after 20 steps were
    # bit-identical across that change). Every exit's CE and every loop norm must match to float
    # rounding (other CPUs may round differently in the last bits).
    write_data(tmp_path)
    files = [os.path.join(REPO, f) for f in files]
    r = run_train_process([*files, '--dataset=tiny', '--device=cpu', '--dtype=float32', '--compile=False',
                 '--max_iters=20', '--eval_interval=10', '--eval_iters=2', '--out_dir=out'], tmp_path)
    assert r.returncode == 0, r.stderr
    rows = read_metrics(tmp_path / 'out' / 'metrics.jsonl')
    with open(GOLDEN, encoding='utf-8') as f:
        golden = json.load(f)[name]
    assert [row['iter'] for row in rows] == [g['iter'] for g in golden] == [0, 10, 20]
    for row, g in zip(rows, golden):
        for key in ('train_ce', 'val_ce', 'norm', 'train_norm'):
            torch.testing.assert_close(torch.tensor(row[key]), torch.tensor(g[key]), rtol=1e-4, atol=1e-5)


# -----------------------------------------------------------------------------
# prelude, coda, injection

def test_the_prelude_runs_once_and_the_coda_at_every_exit():
    m = tiny(n_loop=3, n_prelude=1, n_coda=1)
    calls = {'prelude': 0, 'coda': 0, 'shared': 0}
    for name, blocks in (('prelude', m.transformer.prelude), ('coda', m.transformer.coda),
                         ('shared', m.transformer.h)):
        for block in blocks:
            block.register_forward_hook(lambda *a, name=name: calls.__setitem__(name, calls[name] + 1))
    X, Y = batch()
    m(X, Y)  # per-loop CE: three exits
    assert calls == {'prelude': 1, 'coda': 3, 'shared': 2 * 3}
    # exit k reads z_k = Norm_out(coda(h_k)): the coda sits before the readout norm
    h = torch.randn(2, T, 16)
    expect = m.lm_head(m.transformer.ln_out(m.transformer.coda[0](h, m.rope(0, T))[0]))
    torch.testing.assert_close(m.readout(h, 2), expect)


def test_huginn_adapter_is_a_plain_linear_layer_and_its_blocks_are_sandwich_normed():
    # config/huginn.py: Huginn's adapter is not initialised to [I 0], its blocks norm every sublayer, and its
    # positions are rotary
    ns = {}
    exec(open(os.path.join(REPO, 'config', 'huginn.py')).read(), ns)
    assert ns['block'] == 'sandwich' and ns['adapter_init'] == 'default' and ns['pos'] == 'rope'
    m = tiny(n_prelude=1, injection='concat', adapter_init='default', block='sandwich')
    W = m.transformer.adapter.weight
    assert W.shape == (16, 32) and not torch.equal(W[:, :16], torch.eye(16))
    assert W[:, 16:].abs().sum() > 0  # the prelude output is read from the start
    assert all(isinstance(b.pn_1, torch.nn.RMSNorm) for b in m.transformer.h)


def test_concat_injection_starts_as_the_identity_and_add_injection_adds_the_prelude_output():
    X, Y = batch()
    plain, cat = tiny(n_prelude=1), tiny(n_prelude=1, injection='concat')
    cat.load_state_dict(plain.state_dict(), strict=False)  # the same weights, and W = [I 0] of its own
    assert torch.equal(cat.transformer.adapter.weight, torch.cat([torch.eye(16), torch.zeros(16, 16)], 1))
    for a, b in zip(plain.run(X).states, cat.run(X).states):
        torch.testing.assert_close(a, b)
    # add: the state entering loop k+1 is ln_loop(h_k) + e, with e the prelude output
    m = tiny(n_prelude=1, injection='add', inter_loop_norm='rmsnorm')
    e = m.transformer.prelude[0](m.embed(X), m.rope(0, T))[0]
    seen = []
    x = m.begin(X)
    states = m.loops(x, x, range(1, 4)).states
    for h, h_next in zip(states, states[1:]):  # loop k+1 starts from ln_loop(h_k) + e
        block_in = m.transformer.ln_loop(h) + e
        torch.testing.assert_close(h_next, m.loops(block_in, e, [1]).states[0])


# -----------------------------------------------------------------------------
# sampled depth and truncated backprop

def test_sampled_depth_has_mean_n_loop_plus_one_is_capped_and_depends_only_on_its_generator():
    m = tiny(n_loop=4, loop_sampling='poisson_lognormal', max_loop=12)
    def draws(seed, n):
        g = torch.Generator().manual_seed(seed)
        return [m.config.draw_n_loop(g) for _ in range(n)]
    many = draws(0, 4000)
    assert min(many) >= 1 and max(many) <= 12 and len(set(many)) > 5
    # Poisson(e^tau) + 1 with E[e^tau] = n_loop: mean n_loop + 1, a little less after the cap at 12
    assert 4.8 < sum(many) / len(many) < 5.05
    assert draws(7, 50) == draws(7, 50) and draws(7, 50) != draws(8, 50)
    assert tiny(n_loop=4).config.draw_n_loop(torch.Generator()) == 4  # loop_sampling='fixed'


def test_truncated_backprop_zeroes_the_gradient_of_the_early_loops():
    # backprop_loops = 2 of R = 4: the per-visit gradients G_r (diagnostics.visit_gradients) of visits 1 and
    # 2 are exactly zero for every shared matrix, those of visits 3 and 4 are not; the loss is unchanged
    X, Y = batch()
    full, cut = tiny(n_loop=4), tiny(n_loop=4, backprop_loops=2)
    torch.testing.assert_close(full(X, Y)[1], cut(X, Y)[1])
    for name, G in diagnostics.visit_gradients(cut, X, Y).items():
        assert all(float(g.abs().max()) == 0.0 for g in G[:2]), name
        assert all(float(g.abs().max()) > 0.0 for g in G[2:]), name
    for name, G in diagnostics.visit_gradients(full, X, Y).items():
        assert all(float(g.abs().max()) > 0.0 for g in G), name


# -----------------------------------------------------------------------------
# the learned exit gate

@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=1.0), min_size=1, max_size=8))
def test_gate_probabilities_sum_to_one_and_stop_at_the_first_exit_that_fires(lams):
    lam = torch.tensor(lams, dtype=torch.float64)
    p = exit_distribution(lam)
    assert float(p.sum()) == pytest.approx(1.0, abs=1e-12) and bool((p >= 0).all())
    stay = 1.0
    for k in range(len(lams) - 1):
        assert float(p[k]) == pytest.approx(lams[k] * stay, abs=1e-12)
        stay *= 1 - lams[k]
    assert float(p[-1]) == pytest.approx(stay, abs=1e-12)  # the last exit takes the remainder


def test_the_gate_loss_is_the_expected_exit_ce_minus_the_entropy_bonus():
    X, Y = batch()
    m = tiny(n_loop=3, exit_gate='learned', exit_entropy=0.1)
    Y[0, :3] = -1  # ignored positions count in neither term
    out = m.run(X)
    states = out.states
    loss = m.loss(out, Y)
    zs = [m.transformer.ln_out(h) for h in states]
    ce = torch.stack([F.cross_entropy(m.lm_head(z).view(-1, V), Y.view(-1), ignore_index=-1, reduction='none')
                      for z in zs])                                                      # (R, B*T)
    lam = torch.stack([torch.sigmoid(m.exit_gate(z)).view(-1) for z in zs])
    p = exit_distribution(lam)
    per_token = (p * ce).sum(0) + 0.1 * (p * p.log()).sum(0)
    valid = Y.view(-1) != -1
    naive = per_token[valid].mean()
    torch.testing.assert_close(loss, naive)
    # the chunked per-token CE (logits recomputed in the backward pass) gives the same gradients
    params = [m.lm_head.weight, m.exit_gate.weight, m.transformer.h[0].attn.c_attn.weight]
    for a, b in zip(torch.autograd.grad(loss, params, retain_graph=True), torch.autograd.grad(naive, params)):
        torch.testing.assert_close(a, b)


def test_kl_exit_never_stops_at_the_first_loop_and_gate_exit_follows_the_cumulative_probability():
    m = tiny(n_loop=4, exit_gate='learned').eval()
    prompt = batch(B=2)[0][:, :4]
    # KL <= a huge bound holds from exit 2 on; there is no KL at exit 1
    _, used, _ = generate(m, prompt, 5, Decoding(temperature=0, exit_threshold=1e9, exit_policy='kl'))
    assert used[:, 1:].eq(2).all()
    # a cumulative exit probability >= 0 holds at once; >= 1 is reached only by the last exit
    _, used, _ = generate(m, prompt, 5, Decoding(temperature=0, exit_threshold=0.0, exit_policy='gate'))
    assert used[:, 1:].eq(1).all()
    _, used, _ = generate(m, prompt, 5, Decoding(temperature=0, exit_threshold=1.0, exit_policy='gate'))
    assert used.eq(4).all()
    with pytest.raises(ValueError, match=r"exit_threshold=1.5 is outside \[0, 1\].*'gate'"):
        score_threshold('gate', 1.5)


def test_cached_decoding_equals_uncached_with_prelude_coda_and_injection():
    # past the block size too (T = 16: the context is cropped and the cache refilled)
    m = tiny(n_loop=3, n_prelude=1, n_coda=1, injection='concat', inter_loop_norm='rmsnorm').eval()
    with torch.no_grad():
        m.transformer.adapter.weight.add_(0.3 * torch.randn_like(m.transformer.adapter.weight))
    prompt = batch(B=2)[0][:, :5]
    cached, _, _ = generate(m, prompt, 20, Decoding(temperature=0))
    assert torch.equal(cached, generate(m, prompt, 20, Decoding(temperature=0, use_cache=False))[0])


def test_adaptive_decoding_with_a_coda_equals_decoding_each_row_alone():
    # rows exit at different loops; the coda's cache must hold each row's own exit state
    m = tiny(n_loop=4, n_coda=1, injection='add', readout='raw').eval()
    prompts = torch.randint(0, V, (6, 4), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        scores = torch.stack([score_at_exit(m, 'margin', None, m.readout(h, k)[:, -1])[0] for k, h in
                              enumerate(m.run(prompts).states, 1)])
    t = float(scores[:3].median())
    together, used, _ = generate(m, prompts, 6, Decoding(temperature=0, exit_threshold=t,
                                                         exit_policy='margin'))
    assert len(set(used[:, 1:].flatten().tolist())) > 1  # the rows really do exit at different loops
    for i in range(prompts.size(0)):
        alone, alone_used, _ = generate(m, prompts[i:i + 1], 6, Decoding(temperature=0, exit_threshold=t,
                                     exit_policy='margin'))
        assert torch.equal(alone, together[i:i + 1]) and torch.equal(alone_used, used[i:i + 1])


# -----------------------------------------------------------------------------
# bad input, resume, DDP

@pytest.mark.parametrize('kw,fragment', [
    (dict(n_loop=4, max_loop=3), 'max_loop=3 is below n_loop=4'),
    (dict(n_loop=2, max_loop=4, backprop_loops=5), 'backprop_loops=5 exceeds max_loop=4'),
    (dict(n_loop=2, backprop_loops=9), 'backprop_loops=9 exceeds max_loop=8'),
    (dict(exit_gate='learned', supervision='terminal'), "needs supervision='per_loop'"),
    (dict(exit_entropy=0.1), "set exit_gate='learned'"),
    (dict(inter_loop_norm='readout', readout='raw'), "needs readout='rmsnorm' or 'layernorm'"),
    (dict(n_prelude=-1), 'n_prelude=-1: must be an integer >= 0'),
    (dict(injection='gated'), "injection='gated': choose one of none, add, concat"),
])
def test_impossible_family_configs_are_rejected_in_one_line(kw, fragment):
    with pytest.raises(ValueError) as e:
        check_model(GPTConfig(**kw))
    assert fragment in str(e.value) and '\n' not in str(e.value)


def test_train_py_names_the_keys_of_an_impossible_family_config(tmp_path):
    write_data(tmp_path)
    code, _, err = run_train([*TINY, '--max_loop=1', '--backprop_loops=2', '--out_dir=out'], tmp_path)
    assert_clean_error(code, err, 'max_loop=1 is below n_loop=2')
    assert not (tmp_path / 'out' / 'ckpt.pt').exists()


def test_resume_with_sampled_depth_is_bit_exact(tmp_path):
    # the depth sampler's state is in the checkpoint: 6 steps = 3 steps + resume for 3
    write_data(tmp_path)
    args = [*TINY, '--loop_sampling=poisson_lognormal', '--backprop_loops=1', '--injection=add',
            '--n_prelude=1', '--eval_interval=1']
    a = run_train_process([*args, '--max_iters=6', '--out_dir=a'], tmp_path)
    b1 = run_train_process([*args, '--max_iters=3', '--out_dir=b'], tmp_path)
    b2 = run_train_process(['--init_from=resume', '--max_iters=6', '--out_dir=b'], tmp_path)
    for r in (a, b1, b2):
        assert r.returncode == 0, r.stderr
    steps = lambda out: [line.split(', lr')[0] for line in out.splitlines() if line.startswith('iter ')]
    assert steps(a.stdout) == steps(b1.stdout) + steps(b2.stdout)  # the loss and the drawn R of every step
    assert len({line.split('(R ')[1] for line in steps(a.stdout)}) > 1
    drop_time = lambda rows: [{k: v for k, v in r.items() if k != 'time'} for r in rows]
    assert drop_time(read_metrics(tmp_path / 'a' / 'metrics.jsonl')) == \
        drop_time(read_metrics(tmp_path / 'b' / 'metrics.jsonl'))
    ca, cb = (torch.load(tmp_path / d / 'ckpt.pt', weights_only=True) for d in 'ab')
    assert model_tensors_equal(ca['model'], cb['model'])


def test_ddp_ranks_draw_the_same_loop_count_every_step(tmp_path):
    # tests/train_hooks.py's loop_draws records every loop count each rank draws
    write_data(tmp_path)
    args = [*TINY, '--loop_sampling=poisson_lognormal', '--max_iters=8', '--eval_interval=8', '--out_dir=out']
    r = run_train_process(args, tmp_path, 'loop_draws', nproc=2, DUMP=str(tmp_path))
    skip_without_torchrun(r)
    assert r.returncode == 0, r.stderr[-3000:]
    d0, d1 = (json.loads((tmp_path / f'rank{i}.json').read_text()) for i in (0, 1))
    assert len(d0) == 8 and d0 == d1 and len(set(d0)) > 1


# -----------------------------------------------------------------------------
# evaluation

def test_eval_depth_reports_kl_and_gate_halting_and_exits_past_training():
    m = tiny(n_loop=3, exit_gate='learned', n_coda=1).eval()
    X, Y = batch(B=8)
    res = eval_depth.evaluate(m, X, Y, batch_size=4, timing_repeats=1, n_grad_seqs=4)
    assert res['fixed']['exit'] == list(range(1, 13))  # 1..4R
    assert {'margin', 'kl', 'gate'} <= set(res['calibrated'])
    ce, scores, _ = eval_depth.exit_stats(m, X, Y, 3, 4)
    assert bool(torch.isinf(scores['kl'][:, 0]).all()) and bool(torch.isfinite(scores['kl'][:, 1:]).all())
    assert bool((scores['gate'][:, 1:] >= scores['gate'][:, :-1]).all())  # cumulative: never decreases
    no_gate = tiny(n_loop=3).eval()
    assert 'gate' not in eval_depth.evaluate(no_gate, X, Y, batch_size=4, timing_repeats=1,
                                             n_grad_seqs=4)['calibrated']


# -----------------------------------------------------------------------------
# the values the exit scores, the depth sampler, the adapter and the flop count promise

def exit_logps(m, X):
    # log p_k of every exit k = 1..R, each from its own readout (B, T, V)
    with torch.no_grad():
        return [m.readout(h, k).float().log_softmax(-1) for k, h in enumerate(m.run(X).states, start=1)]


def scores_over_exits(m, policy, exits):
    """score_at_exit at exits 1, 2, ... of (z_k, logits_k) pairs, each passing on what the next needs."""
    got, prev = [], None
    for z, logits in exits:
        score, prev = score_at_exit(m, policy, z, logits, prev)
        got.append(score)
    return got


def test_kl_exit_score_is_minus_kl_between_successive_exits():
    m = tiny(n_loop=4).eval()
    X, _ = batch(B=2)
    logps = exit_logps(m, X)
    with torch.no_grad():
        got = scores_over_exits(m, 'kl', [(None, m.readout(h, k)) for k, h in enumerate(m.run(X).states, 1)])
    assert bool(torch.isneginf(got[0]).all())  # exit 1 has no previous exit
    for k in range(1, 4):
        p_prev, lp_prev, lp = logps[k - 1].exp(), logps[k - 1], logps[k]
        kl = (p_prev * (lp_prev - lp)).sum(-1)  # KL(p_{k-1} || p_k), by hand
        assert bool((kl > 1e-6).all())          # the exits really differ, so a sign or a zero shows
        torch.testing.assert_close(got[k], -kl, rtol=1e-4, atol=1e-7)


def test_gate_exit_score_is_the_cumulative_sum_of_the_exit_distribution():
    m = tiny(n_loop=4, exit_gate='learned').eval()
    with torch.no_grad():
        m.exit_gate.bias.fill_(-0.5)  # lambda near 0.4: far from 0 and 1, so stay*lam and stay*(1-lam) differ
    X, _ = batch(B=2)
    with torch.no_grad():
        zs = [m.coda_readout(h, k) for k, h in enumerate(m.run(X).states, start=1)]
        lam = torch.stack([torch.sigmoid(m.exit_gate(z).float()).squeeze(-1) for z in zs])  # (R, B, T)
        got = scores_over_exits(m, 'gate', [(z, m.lm_head(z)) for z in zs])
    p, total = [], torch.zeros_like(lam[0])
    for k in range(4):  # p(k) = lambda_k prod_{j<k} (1 - lambda_j), by hand; the score is sum_{j<=k} p(j)
        stay = torch.ones_like(lam[0])
        for j in range(k):
            stay = stay * (1 - lam[j])
        total = total + lam[k] * stay
        torch.testing.assert_close(got[k], total)
    # below the last exit that is the cumsum of model.exit_distribution
    torch.testing.assert_close(torch.stack(got[:3]), exit_distribution(lam).cumsum(0)[:3])


def hand_drawn_depths(g, n_loop, cap, n):
    # Huginn's sampler written out: tau ~ Normal(log n - sigma^2/2, sigma), sigma = 1/2, R = Poisson(e^tau)+1
    out = []
    for _ in range(n):
        tau = torch.normal(math.log(n_loop) - 0.5 ** 2 / 2, 0.5, (1,), generator=g)
        out.append(min(int(torch.poisson(tau.exp(), generator=g).item()) + 1, cap))
    return out


def test_sampled_depth_is_poisson_of_a_lognormal_draw_on_the_same_generator():
    m = tiny(n_loop=4, loop_sampling='poisson_lognormal', max_loop=40)
    g = torch.Generator().manual_seed(5)
    drawn = [m.config.draw_n_loop(g) for _ in range(6000)]
    assert drawn[:300] == hand_drawn_depths(torch.Generator().manual_seed(5), 4, 40, 300)
    # Var R = E[lambda] + Var[lambda] = n + n^2 (e^{sigma^2} - 1) = 4 + 16 (e^0.25 - 1) = 8.54 (the cap at
    # 40 cuts almost nothing); sigma = 0 would give 4, no Poisson step about 4.5
    d = torch.tensor(drawn, dtype=torch.float64)
    assert 7.6 < float(d.var()) < 9.5 and 4.8 < float(d.mean()) < 5.2
    capped = tiny(n_loop=4, loop_sampling='poisson_lognormal', max_loop=6)
    g = torch.Generator().manual_seed(5)
    assert [capped.config.draw_n_loop(g) for _ in range(300)] == \
        hand_drawn_depths(torch.Generator().manual_seed(5), 4, 6, 300)


def test_concat_adapter_reads_the_state_and_the_prelude_output():
    # the adapter's input entering loop k+1 is [ln_loop(h_k); e], e the prelude output, in training and
    # in cached decoding
    m = tiny(n_loop=3, n_prelude=1, injection='concat', inter_loop_norm='rmsnorm').eval()
    with torch.no_grad():
        m.transformer.adapter.weight.add_(0.3 * torch.randn_like(m.transformer.adapter.weight))
    X, _ = batch(B=2)
    seen = []
    m.transformer.adapter.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].detach()))
    with torch.no_grad():
        e = m.transformer.prelude[0](m.embed(X), m.rope(0, T))[0]
        states = m.run(X).states
    assert len(seen) == 2
    for k, x in enumerate(seen):
        torch.testing.assert_close(x, torch.cat([m.transformer.ln_loop(states[k]), e], -1))
    # and the states themselves follow x_{k+1} = W [ln_loop(h_k); e] through the shared blocks
    with torch.no_grad():
        x = e
        for k in range(3):
            if k:
                x = m.transformer.adapter(torch.cat([m.transformer.ln_loop(x), e], -1))
            for block in m.transformer.h:
                x, _ = block(x, m.rope(0, T))
            torch.testing.assert_close(states[k], x)


def test_flops_per_token_and_n_unrolled_count_prelude_coda_and_adapter():
    K, R, C = 2, 3, 16
    block = 2 * C + 16 * C * C  # swiglu: two norm gains, 4 C^2 attention, 12 C^2 MLP
    m = tiny(n_layer=K, n_loop=R, n_prelude=1, n_coda=2, injection='concat')
    assert m.config.n_unrolled == 1 + K * R + 2
    for kw, n_exits in ((dict(), R), (dict(supervision='terminal'), 1)):
        m = tiny(n_layer=K, n_loop=R, n_prelude=1, n_coda=2, injection='concat', **kw)
        weights = block * K * R + block * 1 + 2 * C * C * (R - 1) + (block * 2 + V * C) * n_exits
        visits = K * R + 1 + 2 * n_exits  # attention of every block visit: shared, prelude, coda per exit
        assert flops_per_token(m, T) == 6 * weights + 12 * visits * C * T, kw
    add = tiny(n_layer=K, n_loop=R, n_prelude=1, n_coda=2, injection='add')  # no adapter matrix
    assert flops_per_token(add, T) == 6 * (block * (K * R + 1) + (2 * block + V * C) * R) + \
        12 * (K * R + 1 + 2 * R) * C * T
    deep = GPTConfig(n_layer=K, n_loop=R, n_prelude=1, n_coda=2, block='sandwich', depth_scaling='deeploop')
    assert deep.alpha == pytest.approx((2 * 9) ** 0.5) and deep.beta == pytest.approx((8 * 9) ** -0.5)
