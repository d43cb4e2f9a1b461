"""
Looped-MoE (docs/papers.md §5): a mixture of experts in place of the MLP of the K shared layers (the
prelude and coda stay dense). The grouped dispatch is the per-expert loop, the router decides in fp32,
the balancing and z-losses are their formulas per visit, read from the routes a run returns, tied routing
reuses loop 1's experts, k of E experts of width 4C/k cost what the dense MLP costs, and everything the
dense model guarantees (exact resume, DDP, cached and self-speculative decoding, one-line errors) holds
with experts.
"""
import functools
import json
import math
import os

import pytest
import torch
from torch.nn import functional as F

from conftest import (REPO, T, TINY, V, read_metrics, run_train, run_train_process, save_tiny_checkpoint,
                      skip_without_torchrun, tiny_gpt, write_data)
from test_engine import logits_of_each_step
from test_reliability import assert_clean_error, model_tensors_equal, run_dir, snapshot  # noqa: F401
from test_sample import run_main

from compute import kernels
from configurator import check_model
from decoding.engine import Decoding, generate
from model import GPT, MLP, GPTConfig, MoE, Route, activation, router_losses
from run.accounting import active_params, flops_per_token

MOE = dict(n_expert=4, top_k=2)
tiny = functools.partial(tiny_gpt, n_embd=32, **MOE)  # K 2, R 3, C 32, 4 experts, top-2


def batch(B=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def routing(N=24, E=4, k=2, seed=0, skip=None):
    """k distinct experts per token (skip: an expert no token picks) and their weights, as the router gives"""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(N, E, generator=g)
    if skip is not None:
        scores[:, skip] = -1
    idx = scores.topk(k, dim=-1).indices
    w = torch.rand(N, k, generator=g).softmax(-1)
    return idx, w


def experts(E=4, C=32, H=16, swiglu=True, seed=1):
    g = torch.Generator().manual_seed(seed)
    c_fc = torch.randn(E, C, (2 if swiglu else 1) * H, generator=g) / C ** 0.5
    c_proj = torch.randn(E, H, C, generator=g) / H ** 0.5
    return c_fc, c_proj, lambda h: activation(h, 'swiglu' if swiglu else 'gelu')

# ---------------------------------------------------------------- the dispatch


@pytest.mark.parametrize('grouped', [True, False], ids=['grouped_mm', 'split_loop'])
@pytest.mark.parametrize('swiglu', [True, False], ids=['swiglu', 'gelu'])
def test_grouped_dispatch_equals_the_per_expert_loop_in_values_and_gradients(grouped, swiglu, monkeypatch):
    # kernels.moe sorts the (token, expert) pairs by expert and runs each expert once on its block of rows;
    # kernels.moe_loop is the formula y_t = sum_j w_tj expert_{idx_tj}(x_t), one expert at a time
    monkeypatch.setattr(kernels, 'grouped_mm_runs', lambda *a: grouped)
    x = torch.randn(24, 32, generator=torch.Generator().manual_seed(2))
    idx, w = routing()
    c_fc, c_proj, act = experts(swiglu=swiglu)
    leaves = [t.clone().requires_grad_() for t in (x, w, c_fc, c_proj)]
    twins = [t.clone().requires_grad_() for t in (x, w, c_fc, c_proj)]
    fast = kernels.moe(leaves[0], idx, leaves[1], leaves[2], leaves[3], act)
    slow = kernels.moe_loop(twins[0], idx, twins[1], twins[2], twins[3], act)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-6)
    up = torch.randn_like(slow)
    (fast * up).sum().backward()
    (slow * up).sum().backward()
    for name, a, b in zip(('x', 'w', 'c_fc', 'c_proj'), leaves, twins):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize('grouped', [True, False], ids=['grouped_mm', 'split_loop'])
def test_an_expert_that_receives_no_token_gets_a_zero_gradient(grouped, monkeypatch):
    # a gradient of zeros, not None: DDP all-reduces every parameter, so a starved expert must take part
    monkeypatch.setattr(kernels, 'grouped_mm_runs', lambda *a: grouped)
    x = torch.randn(24, 32)
    idx, w = routing(skip=3)
    c_fc, c_proj, act = (t.requires_grad_() if torch.is_tensor(t) else t for t in experts())
    kernels.moe(x, idx, w, c_fc, c_proj, act).square().sum().backward()
    for p in (c_fc, c_proj):
        assert p.grad is not None and torch.equal(p.grad[3], torch.zeros_like(p.grad[3]))
        assert all(p.grad[i].abs().sum() > 0 for i in range(3))


def test_routing_of_a_token_does_not_depend_on_the_rest_of_the_batch():
    # token choice, dropless: no capacity, so a token's experts and output are its own, whatever its batch
    m = tiny().eval()
    X, _ = batch(B=4)
    with torch.no_grad():
        together = m.run(X)
        for b in range(4):
            alone = m.run(X[b:b + 1])
            assert len(alone.routes) == len(together.routes) == 2 * 3  # every visit of a shared layer
            for visit, (r, r1) in enumerate(zip(together.routes, alone.routes)):
                assert torch.equal(r1.idx, r.idx.view(4, T, -1)[b]), (b, visit)
            for h, h1 in zip(together.states, alone.states):
                torch.testing.assert_close(h[b:b + 1], h1, rtol=1e-5, atol=1e-5)


def test_moe_under_bf16_autocast_on_cpu_runs_and_is_close_to_fp32():
    m = tiny()
    X, Y = batch()
    _, loss32 = m(X, Y)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        _, loss16 = m(X, Y)
    loss16.backward()
    assert loss16.dtype == torch.float32 and torch.isfinite(loss16)
    assert abs(loss16.item() - loss32.item()) < 0.02 * loss32.item(), (loss16.item(), loss32.item())
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)
    # the grouped kernel casts by hand (grouped_mm is not autocast): bf16 out, near the fp32 formula
    x, (idx, w), (c_fc, c_proj, act) = torch.randn(24, 32), routing(), experts()
    with torch.autocast('cpu', dtype=torch.bfloat16):
        y = kernels.moe(x, idx, w, c_fc, c_proj, act)
    assert y.dtype == torch.bfloat16
    exact = kernels.moe_loop(x, idx, w, c_fc, c_proj, act)
    torch.testing.assert_close(y.float(), exact, rtol=0.05, atol=0.05)


def test_the_router_decides_in_fp32_under_bf16_autocast():
    # a bf16 router would round logits ~1e-2 apart, enough to swap a token's top k: under autocast the
    # logits of every visit are the fp32 router's on that visit's input, whatever dtype the input has.
    # The concat adapter is a Linear, so under autocast loops 2..R's MoE reads bf16 activations
    m = tiny(n_prelude=1, n_coda=1, injection='concat')
    X, _ = batch()
    seen = []  # (the MoE, its input) at every visit, in call order: the order of the routes
    for layer in m.transformer.h:
        layer.mlp.register_forward_pre_hook(lambda moe, args: seen.append((moe, args[0].detach())))
    with torch.autocast('cpu', dtype=torch.bfloat16):
        routes = m.run(X).routes
    assert len(routes) == len(seen) == 2 * 3
    assert any(x.dtype == torch.bfloat16 for _, x in seen)  # the premise: bf16 activations reach it
    for visit, ((moe, x), route) in enumerate(zip(seen, routes)):
        assert route.logits.dtype == torch.float32, visit
        fp32 = F.linear(x.float().flatten(0, 1), moe.router.weight)  # outside autocast: fp32 throughout
        torch.testing.assert_close(route.logits, fp32, rtol=0, atol=1e-5, msg=f"visit {visit}")
        assert torch.equal(route.idx, fp32.topk(2, dim=-1).indices), visit

# ---------------------------------------------------------------- where the experts sit


def test_experts_never_sit_in_the_prelude_or_coda(monkeypatch):
    # §5 (Looped-MoE) puts experts in the K shared layers only: the prelude (run once) and the coda (run at
    # every exit) are dense MLPs whatever n_expert, and a pass routes once per visit of a shared layer
    m = tiny(n_prelude=1, n_coda=2, injection='add')
    t = m.transformer
    assert all(type(b.mlp) is MLP for b in (*t.prelude, *t.coda))
    assert all(isinstance(b.mlp, MoE) for b in t.h)
    calls, moe = [], kernels.moe
    monkeypatch.setattr(kernels, 'moe', lambda *a: calls.append(1) or moe(*a))
    X, Y = batch()
    for R in (3, 5):  # the trained R, and more loops at inference
        calls.clear()
        assert len(m.run(X, n_loop=R).routes) == len(calls) == 2 * R  # n_layer * n_loop, no more
    calls.clear()
    m(X, Y)  # a training pass reads the coda at each of the 3 exits: no expert runs there
    assert len(calls) == 2 * 3

# ---------------------------------------------------------------- the router losses


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_torch_compile_traces_the_moe_once_whatever_the_tokens_per_expert(dtype):
    # bf16: F.grouped_mm traces, one graph for the whole model. float32: grouped_mm's meta kernel wants
    # bf16, so the experts run eagerly behind a graph break. Either way new counts per expert recompile
    # nothing after the first step (dynamo's CompileCounter counts the graphs; its eager backend keeps the
    # values exact)
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    m, graphs = tiny(n_layer=1, n_loop=2), CompileCounter()
    compiled = torch.compile(m, backend=graphs, dynamic=False)
    seen = []
    with torch.autocast('cpu', dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        for seed in (1, 2, 3):  # other tokens, other counts per expert
            X, Y = batch(seed=seed)
            assert torch.equal(compiled(X, Y)[1], m(X, Y)[1])
            seen.append(graphs.frame_count)
    assert seen[1] == seen[2], f"recompiled: graphs after each call {seen}"
    if dtype == torch.bfloat16:
        assert seen[0] == 1, "the bf16 MoE should trace without a graph break"


def test_balance_and_z_loss_equal_their_formulas_on_a_hand_built_router_output():
    # E = 4 experts, k = 2 slots per token, 3 tokens. Balance = E sum_i f_i P_i, with f_i the share of the
    # N k slots sent to expert i and P_i its mean router probability; z = mean_t logsumexp(logits_t)^2
    rows = [[2.0, 0.0, 0.0, -1.0], [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 3.0, 0.5]]
    picks = [[0, 1], [1, 0], [2, 3]]
    balance, z = router_losses([Route(torch.tensor(rows), torch.tensor(picks))])
    f = [2 / 6, 2 / 6, 1 / 6, 1 / 6]
    P = [sum(math.exp(r[i]) / sum(math.exp(v) for v in r) for r in rows) / 3 for i in range(4)]
    lse = [math.log(sum(math.exp(v) for v in r)) for r in rows]
    assert balance.item() == pytest.approx(4 * sum(fi * Pi for fi, Pi in zip(f, P)), rel=1e-6)
    assert z.item() == pytest.approx(sum(s * s for s in lse) / 3, rel=1e-6)
    # uniform probabilities and a uniform load: balance 1; z = (log E)^2
    balance, z = router_losses([Route(torch.zeros(4, 4), torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0]]))])
    assert balance.item() == pytest.approx(1.0) and z.item() == pytest.approx(math.log(4) ** 2)


def test_balance_is_per_visit_so_a_routing_balanced_over_loops_but_not_within_one_scores_worse():
    # loop 1 sends every token to experts 0 and 1, loop 2 to experts 2 and 3: pooled over loops the load
    # is uniform, but within each loop half the experts idle. Per visit, it scores as badly as it is
    sure = lambda experts: torch.tensor([[4.0 if i == e else 0.0 for i in range(4)] for e in experts])
    split = [Route(sure([0, 1, 0, 1]), torch.tensor([[0], [1], [0], [1]])),
             Route(sure([2, 3, 2, 3]), torch.tensor([[2], [3], [2], [3]]))]
    even = [Route(sure([0, 1, 2, 3]), torch.tensor([[0], [1], [2], [3]]))] * 2
    per_loop, _ = router_losses(split)
    within, _ = router_losses(even)
    pooled, _ = router_losses([Route(torch.cat([split[0].logits, split[1].logits]),
                                     torch.cat([split[0].idx, split[1].idx]))])
    assert within.item() == pytest.approx(pooled.item()) and within.item() < 1.0
    assert per_loop.item() > 1.5 * within.item()


def test_the_router_losses_enter_the_training_loss_with_their_coefficients():
    m = tiny()
    X, Y = batch()
    m.config.aux_loss_coef = m.config.z_loss_coef = 0.0
    _, ce = m(X, Y)
    m.config.aux_loss_coef, m.config.z_loss_coef = 0.5, 0.25
    _, loss = m(X, Y)
    routes = m.run(X).routes
    assert len(routes) == 2 * 3  # K x R visits, each with its own Route
    balance, z = router_losses(routes)
    torch.testing.assert_close(loss, ce + 0.5 * balance + 0.25 * z)
    # and the diagnostics report the same pair for the same pass
    torch.testing.assert_close(m.exit_metrics(X, Y)[2], torch.stack([balance, z]))

# ---------------------------------------------------------------- tied routing


def test_tied_routing_reuses_loop_1s_experts_exactly_with_each_loops_own_weights(monkeypatch):
    calls, moe = [], kernels.moe
    monkeypatch.setattr(kernels, 'moe', lambda x, idx, w, *a: calls.append((idx, w)) or moe(x, idx, w, *a))
    tied, free = tiny(tied_routing=True), tiny()
    X, Y = batch()
    out_tied, out_free = tied.run(X), free.run(X)
    h_tied, h_free = out_tied.states, out_free.states
    K = 2  # routes in call order: loop 1's layers 0..K-1, then loop 2's, ...; layer j's visits are [j::K]
    for j in range(K):
        first, *later = out_tied.routes[j::K]
        assert torch.equal(first.idx, first.logits.topk(2, dim=-1).indices)  # loop 1 picks its own top k
        for logits, idx in later:
            assert torch.equal(idx, first.idx)
    # the weights of loop k are loop k's router probabilities at loop 1's experts, renormalised
    assert len(calls) == 2 * 6
    for (idx, w), (logits, _) in zip(calls[:6], out_tied.routes):
        p = logits.softmax(-1).gather(-1, idx)
        torch.testing.assert_close(w, p / p.sum(-1, keepdim=True))
    # the same weights: loop 1 is the untied model's loop 1, and untied routing does move between loops
    assert torch.equal(h_tied[0], h_free[0]) and not torch.equal(h_tied[-1], h_free[-1])
    assert any(not torch.equal(r.idx, out_free.routes[j].idx)
               for j in range(K) for r in out_free.routes[j::K])



def test_disjoint_routing_keeps_each_loop_inside_its_own_share_of_the_experts():
    # forced divergence: with E = 8 and R = 2, loop 1 routes among experts 0-3 and loop 2 among 4-7,
    # so no token can share an expert between loops; free routing, same weights, does share them
    forced = tiny(n_loop=2, n_expert=8, disjoint_routing=True)
    free = tiny(n_loop=2, n_expert=8)
    free.load_state_dict(forced.state_dict())
    X, _ = batch()
    K = 2
    routes = forced.run(X).routes
    for j in range(K):
        first, second = routes[j::K]
        assert (first.idx < 4).all() and (second.idx >= 4).all()
        assert torch.isinf(first.logits[:, 4:]).all() and torch.isfinite(first.logits[:, :4]).all()
    shared = [(a.idx[:, :, None] == b.idx[:, None, :]).any() for a, b in
              (free.run(X).routes[j::K] for j in range(K))]
    assert any(shared)
    # past the trained R, loop k takes share (k - 1) mod R: loop 3 routes as loop 1 does
    assert (forced.run(X, n_loop=3).routes[2 * K].idx < 4).all()


@pytest.mark.parametrize('kw, says', [(dict(n_expert=6, n_loop=4), 'multiple of n_loop'),
                                      (dict(n_expert=4, n_loop=4), 'at least top_k=2'),
                                      (dict(n_expert=8, n_loop=2, tied_routing=True), 'pick one')])
def test_disjoint_routing_refuses_shares_too_small_for_top_k_and_tied_routing(kw, says):
    with pytest.raises(ValueError) as e:
        check_model(GPTConfig(**dict(dict(n_layer=2, top_k=2, disjoint_routing=True), **kw)))
    assert says in str(e.value)


def test_depth_batching_refuses_disjoint_routing_in_one_line():
    # rows at different loops share a call that GPT.loops runs as loop 1: each loop's own experts
    # cannot be told apart there, so serve would route every row among loop 1's share
    why = Decoding(batch_size=2).why_not(tiny(n_loop=2, n_expert=8, disjoint_routing=True).config)
    assert why and 'disjoint routing' in why and '--batch_size=1' in why and '\n' not in why

# ---------------------------------------------------------------- what a token costs


@pytest.mark.parametrize('mlp', ['swiglu', 'gelu'])
@pytest.mark.parametrize('k', [1, 2, 4])
def test_k_of_E_experts_of_width_4C_over_k_cost_the_dense_mlp_plus_the_router(mlp, k):
    dense, moe = tiny(mlp=mlp, n_expert=0), tiny(mlp=mlp, n_expert=8, top_k=k)
    C, E, K, R = 32, 8, 2, 3
    router = C * E  # per MoE layer
    assert active_params(moe.transformer.h) == active_params(dense.transformer.h) + K * router
    # every visit of a shared layer runs its router once: R K of them per token, 6 flops per weight
    assert flops_per_token(moe) == flops_per_token(dense) + 6 * R * K * router
    # stored, the experts are E/k dense MLPs
    mlp_params = lambda m: sum(p.numel() for b in m.transformer.h for n, p in b.mlp.named_parameters()
                               if n != 'router.weight')
    assert mlp_params(moe) * k == mlp_params(dense) * E
    # with a prelude and a coda: they are dense MLPs either way, so only the R K shared visits pay a router
    dense, moe = (tiny(mlp=mlp, n_expert=n, top_k=k, n_prelude=1, n_coda=1) for n in (0, 8))
    assert flops_per_token(moe) == flops_per_token(dense) + 6 * R * K * router


def test_the_moe_keys_change_nothing_when_n_expert_is_0():
    # the dense path is the code before §5 (tests/test_recurrent.py holds it to the golden metrics); the MoE
    # keys it ignores must stay ignored
    X, Y = batch()
    plain = tiny(n_expert=0)
    other = tiny(n_expert=0, top_k=7, expert_hidden=5, aux_loss_coef=1.0, z_loss_coef=1.0)
    assert not any(isinstance(mod, MoE) for m in (plain, other) for mod in m.modules())
    assert plain.state_dict().keys() == other.state_dict().keys()
    assert model_tensors_equal(plain.state_dict(), other.state_dict())
    for m in (plain, other):
        m(X, Y)[1].backward()
    assert torch.equal(plain(X, Y)[1], other(X, Y)[1])
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), other.parameters()))
    assert other.run(X).routes == [] and other.exit_metrics(X, Y)[2] is None  # nothing routes

# ---------------------------------------------------------------- decoding


@pytest.mark.parametrize('kw', [dict(), dict(tied_routing=True),
                                dict(n_prelude=1, n_coda=1, pos='rope', injection='add')],
                         ids=['loop', 'tied', 'prelude_coda'])
def test_cached_decoding_equals_recompute_with_moe_blocks(kw, monkeypatch):
    # the logits of every step, past the block size too: a token routes alone, so one at a time is the same
    m = tiny(n_loop=4, **kw).eval()
    x = torch.randint(0, V, (2, 4), generator=torch.Generator().manual_seed(1))
    out, cached, _ = logits_of_each_step(monkeypatch, m, x, 24, temperature=0)
    ref, uncached, _ = logits_of_each_step(monkeypatch, m, x, 24, temperature=0, use_cache=False)
    assert torch.equal(out, ref)
    for i, (a, b) in enumerate(zip(cached, uncached)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"step {i}")


@pytest.mark.parametrize('kw', [dict(), dict(n_prelude=1, n_coda=1, injection='concat')],
                         ids=['loop', 'prelude_coda'])
def test_greedy_self_speculative_decoding_equals_fixed_depth_with_moe_blocks(kw):
    m = tiny(n_loop=4, **kw).eval()
    x = torch.randint(0, V, (2, 4), generator=torch.Generator().manual_seed(1))
    fixed, _, _ = generate(m, x, 20, Decoding(temperature=0))
    for k, gamma in ((1, 3), (2, 4), (3, 2)):
        out, _, stats = generate(m, x, 20, Decoding(temperature=0, draft_loops=k, speculate=gamma))
        assert torch.equal(out, fixed), (k, gamma)
        assert stats['checked'] > 0

# ---------------------------------------------------------------- train.py: resume, DDP, bad input

MOE_ARGS = [*TINY, '--n_expert=4', '--top_k=2']


def test_resume_with_moe_is_bit_exact_2n_equals_n_plus_n(tmp_path):
    # dropout on, so the restored RNG matters; the MoE balance and z-loss are logged at every eval
    write_data(tmp_path)
    args = [*MOE_ARGS, '--dropout=0.1', '--eval_interval=1']
    runs = [run_train([*args, '--max_iters=4', '--out_dir=a'], tmp_path),
            run_train([*args, '--max_iters=2', '--out_dir=b'], tmp_path),
            run_train(['--init_from=resume', '--max_iters=4', '--out_dir=b'], tmp_path)]
    for code, out, err in runs:
        assert code == 0, err
    assert 'MoE        balance' in runs[0][1]
    drop_time = lambda rows: [{k: v for k, v in r.items() if k != 'time'} for r in rows]
    rows_a, rows_b = (read_metrics(tmp_path / d / 'metrics.jsonl') for d in 'ab')
    assert [r['iter'] for r in rows_a] == list(range(5)) and all('moe_balance' in r for r in rows_a)
    assert drop_time(rows_a) == drop_time(rows_b)
    ca, cb = (torch.load(tmp_path / d / 'ckpt.pt', weights_only=True) for d in 'ab')
    assert model_tensors_equal(ca['model'], cb['model']) and 'transformer.h.0.mlp.c_fc' in ca['model']
    for pa, pb in zip(ca['optimizer']['state'].values(), cb['optimizer']['state'].values()):
        assert model_tensors_equal(pa, pb)


MOE_KEYS = ('n_expert', 'top_k', 'expert_hidden', 'aux_loss_coef', 'z_loss_coef', 'tied_routing')


def test_a_dense_checkpoint_from_before_moe_refuses_experts_and_resumes_dense(run_dir):
    # a checkpoint written before the §5 keys existed lacks them: its weights are GPTConfig's default, dense
    path = run_dir / 'out' / 'ckpt.pt'
    ckpt = torch.load(path, weights_only=True)
    for key in MOE_KEYS:
        ckpt['model_args'].pop(key)
        ckpt['config'].pop(key, None)
    torch.save(ckpt, path)
    before = snapshot(path)
    code, out, err = run_train(['--init_from=resume', '--out_dir=out', '--n_expert=8'], run_dir)
    assert_clean_error(code, err, 'n_expert=8 (checkpoint: 0)', 'architecture')
    assert snapshot(path) == before
    code, out, err = run_train(['--init_from=resume', '--out_dir=out', '--max_iters=3', '--n_expert=0'],
                               run_dir)
    assert code == 0, err  # the default, said out loud, is no change


def test_an_moe_checkpoint_resumed_as_dense_is_one_line(tmp_path):
    write_data(tmp_path)
    code, out, err = run_train([*MOE_ARGS, '--max_iters=1', '--eval_interval=1', '--out_dir=out'], tmp_path)
    assert code == 0, err
    before = snapshot(tmp_path / 'out' / 'ckpt.pt')
    for flags, says in ((['--n_expert=0'], 'n_expert=0 (checkpoint: 4)'), (['--top_k=1'], 'top_k=1'),
                        (['--tied_routing=True'], 'tied_routing=True')):
        code, out, err = run_train(['--init_from=resume', '--out_dir=out', *flags], tmp_path)
        assert_clean_error(code, err, says, 'architecture')
    assert snapshot(tmp_path / 'out' / 'ckpt.pt') == before


@pytest.mark.parametrize('flags,says', [
    (['--n_expert=4', '--top_k=5'], 'top_k=5 exceeds n_expert=4'),
    (['--n_expert=1'], 'n_expert=1 is a dense MLP with a router'),
    (['--n_expert=-2'], 'n_expert=-2: must be an integer >= 0'),
    (['--tied_routing=True'], 'tied_routing reuses loop 1'),
    (['--n_expert=4', '--top_k=0'], 'top_k=0: must be an integer >= 1'),
    (['--n_expert=4', '--aux_loss_coef=-1.0'], 'must be >= 0'),
], ids=['top_k>E', 'E=1', 'E<0', 'tied_dense', 'k=0', 'coef<0'])
def test_bad_moe_settings_are_one_line_errors(flags, says, tmp_path):
    write_data(tmp_path)
    code, out, err = run_train([*TINY, '--max_iters=1', '--out_dir=out', *flags], tmp_path)
    assert_clean_error(code, err, says)
    assert not (tmp_path / 'out' / 'ckpt.pt').exists()


@pytest.fixture
def tied_ckpt(tiny_data, tmp_path):
    meta = json.loads((tiny_data / 'meta.json').read_text(encoding='utf-8'))
    save_tiny_checkpoint(str(tmp_path / 'tied' / 'ckpt.pt'), meta['vocab_size'], dataset=tiny_data.name,
                         meta=meta, n_loop=3, n_expert=4, top_k=2, tied_routing=True)
    return tmp_path / 'tied'


@pytest.mark.parametrize('flags,says', [
    (['--exit_threshold=0.5'], "needs loop 1's experts for every row: drop --exit_threshold"),
    (['--exit_threshold=0.5', '--kv_policy=copy'], 'drop --exit_threshold'),
    (['--draft_loops=1'], "tied_routing=True needs loop 1's experts from the same pass: drop --draft_loops"),
])
def test_tied_routing_refuses_early_exits_and_self_speculative_decoding(flags, says, tied_ckpt, tiny_data,
                                                                       monkeypatch):
    # rows that exit leave loop 1's routing behind them, and verify runs loops k+1..R in a pass of its own:
    # loop 1's experts are not there to reuse
    monkeypatch.chdir(tiny_data.parent.parent)
    base = [f'--out_dir={tied_ckpt}', '--num_samples=1', '--max_new_tokens=6', '--device=cpu']
    code, out, err = run_main([*base, *flags])
    assert code not in (0, None) and err.startswith('error: ') and err.count('\n') == 1, err
    assert says in err, err
    code, out, err = run_main([*base, '--temperature=0'])  # fixed depth: every loop in one pass
    assert code == 0, err
    with pytest.raises(AssertionError, match='tied_routing'):  # and the library call says so too
        generate(GPT(GPTConfig(**torch.load(tied_ckpt / 'ckpt.pt', weights_only=True)['model_args'])),
                 torch.zeros(1, 2, dtype=torch.long), 2, Decoding(draft_loops=1))


def test_a_ddp_step_with_an_expert_that_receives_no_token_succeeds(tmp_path):
    # DDP all-reduces every parameter's gradient: the starved expert's is zeros on both ranks, the step
    # runs, both ranks hold the same weights after it, and the eval's MoE balance is averaged over ranks
    # (tests/train_hooks.py's starved_expert: every MoE layer's last expert's router logit pushed down by 1e4)
    write_data(tmp_path)
    (tmp_path / 'dump').mkdir()
    args = [*MOE_ARGS, '--gradient_accumulation_steps=2', '--max_iters=1', '--eval_interval=1',
            '--out_dir=out']
    r = run_train_process(args, tmp_path, 'starved_expert', nproc=2, DUMP=str(tmp_path / 'dump'))
    skip_without_torchrun(r)
    assert r.returncode == 0, r.stderr[-3000:]
    d0, d1 = (torch.load(tmp_path / 'dump' / f'rank{i}.pt', weights_only=True) for i in (0, 1))
    assert all(torch.equal(a, b) for a, b in zip(d0['grads'], d1['grads']))
    assert all(torch.equal(a, b) for a, b in zip(d0['after'], d1['after']))
    stacked = [g for g in d0['grads'] if g.dim() == 3]  # c_fc and c_proj of each MoE layer, (E, in, out)
    assert len(stacked) == 2
    for g in stacked:
        assert torch.equal(g[-1], torch.zeros_like(g[-1])) and all(g[i].abs().sum() > 0 for i in range(3))
    assert 'moe_balance' in read_metrics(tmp_path / 'out' / 'metrics.jsonl')[-1]


# ---------------------------------------------------------------- the sweep's evaluation and report (lab/)

SHAPE_KEYS = ('n_layer', 'n_loop', 'n_expert', 'top_k', 'tied_routing')


def test_a_run_evaluation_carries_the_model_config_and_kappa_given_token():
    import moe as lab_moe  # lab/moe.py: the sweep's evaluation of one run
    model = tiny().eval()
    X, Y = batch(B=4)
    res = json.loads(json.dumps(lab_moe.evaluate(model, X, Y, K=2, batch_size=2)))
    assert {k: res['config'][k] for k in SHAPE_KEYS} == dict(n_layer=2, n_loop=3, n_expert=4, top_k=2,
                                                             tied_routing=False)
    assert len(res['boundary_ce']) == 3
    pairs = [p for L in res['routing']['layers'] for p in L['pairs']]
    assert len(pairs) == 2 * 3 and all(p['o_ind_token'] is not None for p in pairs)


def fake_jobs(arms, cfg0):
    """A report's jobs as a --report_only call leaves them: the first resolved, the rest their arm only."""
    jobs = [dict(arm=dict(name=name, overrides=over), seed=1, out_dir='') for name, over in arms]
    jobs[0]['cfg'] = dict(cfg0, **arms[0][1])
    return jobs


HEADER_CFG = dict(dataset='shakespeare_char', n_embd=128, n_layer=2, n_loop=4, n_expert=0, top_k=2,
                  block_size=64, batch_size=8, gradient_accumulation_steps=1, max_iters=1000,
                  lr_schedule='constant', init='gpt2')


def test_the_report_header_states_each_arms_shape_where_the_arms_differ_in_K():
    # the moe sweep's header said 'K 8', the unique arms' K, of looped arms with K 2
    import reports
    args = type('Args', (), dict(base=[], command='python lab/ablate.py moe'))
    experts = dict(n_layer=2, n_loop=4, n_expert=8, top_k=2)
    moe_arms = [('dense_unique', dict(n_layer=8, n_loop=1)), ('looped_moe', experts),
                ('looped_moe_tied', dict(experts, tied_routing=True))]
    head = reports.report_header(dict(title='t'), fake_jobs(moe_arms, HEADER_CFG), 3, args, {})
    assert 'K 8' not in head[2] and 'K per arm below' in head[2]
    assert head[3] == ("Each arm's shape, K layers x R loops: dense_unique 8 x 1, dense; looped_moe 2 x 4, "
                       "top-2 of 8 experts; looped_moe_tied 2 x 4, top-2 of 8 experts, tied routing.")
    same_k = [('R1', dict(n_loop=1)), ('R7', dict(n_loop=7))]  # the deeploop sweep: one K, said once
    head = reports.report_header(dict(title='t'), fake_jobs(same_k, HEADER_CFG), 2, args, {})
    assert ', K 2, ' in head[2] and head[3].startswith('Wall time')


def test_a_run_record_carries_the_config_its_moe_evaluation_wrote(tmp_path):
    import reports
    run = tmp_path / 'looped_moe-s1'
    run.mkdir()
    config = dict(n_layer=2, n_loop=4, n_expert=8, top_k=2)
    (run / 'moe_eval.json').write_text(json.dumps(dict(boundary_ce=[2.0], K=2, config=config)))
    arms = dict(looped_moe=[dict(seed=1, out_dir=str(run), status={}, rows=[], depth=None)])
    rec = reports.summary(arms)['looped_moe'][0]
    assert rec['config'] == config and 'config' not in rec['moe_eval']


def committed(name):
    with open(os.path.join(REPO, 'assets', name), encoding='utf-8') as fh:
        return fh.read()


def test_every_run_record_in_assets_moe_json_carries_its_arms_shape():
    # the run folders are not committed: the records' configs were added from the moe preset's arms
    # (lab/ablate.py, resolved by train.py as the sweep resolved them); a new sweep writes them itself
    import ablate
    arms = {a['name']: a['overrides'] for a in ablate.PRESETS['moe']['arms']}
    records = json.loads(committed('moe.json'))
    assert set(records) == set(arms)
    for name, recs in records.items():
        want = dict(dict.fromkeys(SHAPE_KEYS), n_expert=0, top_k=GPTConfig.top_k, tied_routing=False)
        want.update({k: v for k, v in arms[name].items() if k in SHAPE_KEYS})
        for rec in recs:
            assert {k: rec['config'][k] for k in SHAPE_KEYS} == want, (name, rec['seed'])


def test_the_committed_moe_report_is_its_generator_applied_to_the_committed_records(tmp_path):
    # lab/ablate.py's --report_only path on run folders rebuilt from assets/moe.json (status.json, the
    # last metrics row, moe_eval.json with the record's config) writes assets/moe.md and moe.json again
    import ablate
    records = json.loads(committed('moe.json'))
    runs = tmp_path / 'runs'
    for name, recs in records.items():
        for rec in recs:
            run = runs / f"{name}-s{rec['seed']}"
            run.mkdir(parents=True)
            (run / 'status.json').write_text(json.dumps(rec['status']))
            (run / 'metrics.jsonl').write_text(json.dumps(rec['final']) + '\n')
            (run / 'moe_eval.json').write_text(json.dumps(dict(rec['moe_eval'], config=rec['config'])))
    # the sweep call's own facts, as its report's header states them (51.8 min: 3,108 s to a tenth)
    (runs / 'sweep.json').write_text(json.dumps(dict(
        command='python lab/ablate.py moe --workers=2', wall_seconds=3108.0, workers=2, cores_per_run=1,
        commit='c0a54121908f', dtype='float32 (auto: no bf16 units on this CPU)')))
    ablate.main(['moe', '--report_only', f'--out={runs}', f'--report_dir={tmp_path}'])
    assert (tmp_path / 'moe.md').read_text(encoding='utf-8') == committed('moe.md')
    assert json.loads((tmp_path / 'moe.json').read_text()) == records


def test_forcing_the_loops_apart_is_judged_by_a_ci_over_seeds_not_by_a_count_of_signs():
    import moe
    ev = lambda forced: {'looped_moe': {s: {'boundary_ce': [2.0, 1.9]} for s in (1, 2, 3)},  # noqa: E731
                         'looped_moe_disjoint': {s: {'boundary_ce': [2.0, 1.9 + d]}
                                                 for s, d in zip((1, 2, 3), forced)}}
    # below free routing in every seed, yet spread as the committed causal runs are: no CI excludes 0
    assert moe.forced_verdict(ev([-0.0059, -0.0080, -0.0024]))[0] == 'inconclusive'
    assert moe.forced_verdict(ev([-0.0050, -0.0052, -0.0048]))[0] == 'reproduces'
    assert moe.forced_verdict(ev([+0.0050, +0.0052, +0.0048]))[0] == 'does not reproduce'


def test_a_matched_pool_is_judged_only_where_its_arm_ran_and_states_what_the_pool_adds():
    import moe
    runs = lambda ds: {s: {'boundary_ce': [2.0, 1.9 + d]} for s, d in zip((1, 2, 3), ds)}  # noqa: E731
    ev = {'looped_moe': runs([0, 0, 0]), 'looped_moe_disjoint': runs([+0.010, +0.011, +0.009])}
    assert 'forcing the loops apart helps at a matched pool' not in [k for k, *_ in moe.verdicts(ev)]
    ev['looped_moe_pooled'] = runs([-0.0050, -0.0052, -0.0048])
    word, n, how = moe.pooled_verdict(ev)
    assert (word, n) == ('reproduces', 3) and 'pooled - disjoint (what the pool adds) -0.0150' in how
    ev['looped_moe_pooled'] = runs([+0.0050, -0.0060, +0.0010])
    assert moe.pooled_verdict(ev)[0] == 'inconclusive'


def test_the_moe_pool_preset_keeps_each_loops_pool_at_e_experts_beside_free_and_disjoint_routing():
    import ablate
    arms = {a['name']: a for a in ablate.PRESETS['moe_pool']['arms']}
    assert list(arms) == ['looped_moe', 'looped_moe_disjoint', 'looped_moe_pooled']
    pooled, disjoint = arms['looped_moe_pooled']['overrides'], arms['looped_moe_disjoint']['overrides']
    assert pooled['n_expert'] == pooled['n_loop'] * disjoint['n_expert'] and pooled['disjoint_routing']
