"""model.py as a specification of the science: each test states one property of looped GPTs."""
import math
import dataclasses

import pytest
import torch
from torch.nn import functional as F

from model import GPT, GPTConfig, LinearCrossEntropy

V, T = 48, 16


def tiny(**kw):
    base = dict(vocab_size=V, block_size=T, n_layer=2, n_loop=3, n_head=2, n_embd=16)
    base.update(kw)
    torch.manual_seed(0)
    return GPT(GPTConfig(**base))


def batch(B=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


# ---------------------------------------------------------------- configuration

@pytest.mark.parametrize('key,value', [('readout', 'softmax'), ('block', 'preln2'), ('supervision', 'dense'),
                                       ('inter_loop_norm', 'batchnorm'), ('init', 'xavier'), ('pos', 'alibi')])
def test_unknown_choice_error_lists_the_allowed_values(key, value):
    with pytest.raises(ValueError) as e:
        GPTConfig(**{key: value})
    msg = str(e.value)
    assert msg.startswith(f"{key}={value!r}: choose one of") and ', '.join(__import__('model').CHOICES[key]) in msg


@pytest.mark.parametrize('kw,fragment', [(dict(n_embd=30, n_head=4), 'not divisible'), (dict(n_loop=0), 'n_loop=0'),
                                         (dict(depth_scaling='huge'), 'depth_scaling'),
                                         (dict(depth_scaling='deeploop'), "block='postln'"),
                                         (dict(exit_weights=(1.0, 2.0)), 'exit_weights')])
def test_impossible_configs_are_rejected_in_one_line(kw, fragment):
    with pytest.raises(ValueError) as e:
        GPTConfig(**kw)
    assert fragment in str(e.value) and '\n' not in str(e.value)


def test_parameter_count_does_not_depend_on_loop_count():
    counts = {R: tiny(n_loop=R).get_num_params() for R in (1, 2, 4, 8)}
    assert len(set(counts.values())) == 1, counts
    # ...and the tied head is the embedding: no extra V*C matrix
    assert tiny(tie_weights=False).get_num_params() == counts[1] + V * 16


# ---------------------------------------------------------------- the loop

def test_loop_states_returns_one_state_per_loop_and_n_loop_overrides_R():
    m = tiny()
    idx, _ = batch()
    assert [h.shape for h in m.loop_states(idx)] == [(3, T, 16)] * 3
    assert len(m.loop_states(idx, n_loop=1)) == 1 and len(m.loop_states(idx, n_loop=6)) == 6
    # early exit: the first k states of a longer run are the states of a shorter run
    a, b = m.loop_states(idx, n_loop=2), m.loop_states(idx, n_loop=5)
    assert all(torch.allclose(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize('block', ['preln', 'sandwich'])
def test_one_layer_looped_R_times_equals_R_copied_layers_run_once(block):
    scaling = 'deeploop' if block == 'sandwich' else 'none'  # N = K*R = 3 in both models, so alpha/beta agree
    looped = tiny(n_layer=1, n_loop=3, supervision='terminal', block=block, depth_scaling=scaling)
    untied = tiny(n_layer=3, n_loop=1, supervision='terminal', block=block, depth_scaling=scaling)
    sd = looped.state_dict()
    for key, value in looped.state_dict().items():
        if key.startswith('transformer.h.0.'):
            for j in (1, 2):
                sd[key.replace('transformer.h.0.', f'transformer.h.{j}.')] = value
    untied.load_state_dict(sd)
    idx, tgt = batch()
    assert torch.allclose(looped.loop_states(idx)[-1], untied.loop_states(idx)[-1], atol=1e-5)
    assert torch.allclose(looped(idx, tgt)[1], untied(idx, tgt)[1], atol=1e-5)


def test_inter_loop_norm_hands_each_loop_a_unit_rms_state():
    m = tiny(inter_loop_norm='rmsnorm', n_loop=4)
    seen = []
    hook = m.transformer.h[0].register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    m.loop_states(batch()[0])
    hook.remove()
    # loop 1 gets the embedding (norm ~ 1 per entry under reference init); loops 2..R get LoopNorm(h_{k-1})
    for x in seen[1:]:
        assert torch.allclose(x.pow(2).mean(-1).sqrt(), torch.ones(x.shape[:2]), atol=1e-3)
    # ...while the states leaving each loop are not normalised (their scale is what papers.md §1 reports)
    assert not torch.allclose(m.loop_states(batch()[0])[-1].pow(2).mean(-1), torch.ones(3, T), atol=1e-2)


# ---------------------------------------------------------------- the readout blind spot (papers.md §1)

@pytest.mark.parametrize('readout,invariant', [('rmsnorm', True), ('layernorm', True), ('raw', False)])
def test_normalised_readout_hides_radial_scale(readout, invariant):
    m = tiny(readout=readout)
    h = torch.randn(2, T, 16)
    same = torch.allclose(m.readout(h, 3), m.readout(7.5 * h, 3), atol=1e-4)
    assert same == invariant


@pytest.mark.parametrize('readout,blind', [('rmsnorm', True), ('layernorm', True), ('raw', False)])
def test_radial_gradient_vanishes_only_through_a_scale_invariant_readout(readout, blind):
    # Lemma 1: for a scale-invariant readout <dL/dh, h> = 0, so the loss cannot push ||h|| either way
    m = tiny(readout=readout)
    _, tgt = batch()
    h = torch.randn(3, T, 16, dtype=torch.float64, requires_grad=True)
    m.double()
    loss = F.cross_entropy(m.readout(h, 3).view(-1, V), tgt.view(-1))
    (g,) = torch.autograd.grad(loss, h)
    frac = ((g * h).sum(-1).abs() / (g.norm(dim=-1) * h.norm(dim=-1))).max().item()
    # (not exactly 0: the norm's eps = 1e-6 inside the square root leaks a ~1e-6 radial part at unit RMS)
    assert (frac < 1e-4) == blind, frac


def test_final_only_readout_is_raw_at_early_exits_and_normalised_at_the_last():
    m = tiny(readout='final_only')
    h = torch.randn(2, T, 16)
    assert torch.equal(m.readout(h, 1), m.lm_head(h))
    assert torch.allclose(m.readout(h, 3), m.readout(4 * h, 3), atol=1e-4)


def test_per_loop_loss_is_the_mean_of_exit_ces_and_terminal_is_the_last():
    idx, tgt = batch()
    per_loop, terminal = tiny(supervision='per_loop'), tiny(supervision='terminal')
    ce, _ = per_loop.exit_losses(idx, tgt)
    assert torch.allclose(per_loop(idx, tgt)[1], ce.mean(), atol=1e-5)
    assert torch.allclose(terminal(idx, tgt)[1], terminal.exit_losses(idx, tgt)[0][-1], atol=1e-5)
    weighted = tiny(exit_weights=(0.0, 0.25, 0.75))
    assert torch.allclose(weighted(idx, tgt)[1], 0.25 * ce[1] + 0.75 * ce[2], atol=1e-5)


def test_norm_penalty_adds_lambda_times_mean_square_of_all_loop_states_and_zero_is_off():
    idx, tgt = batch()
    for supervision in ('per_loop', 'terminal'):
        plain, pen = tiny(supervision=supervision), tiny(supervision=supervision, norm_penalty=0.01)
        states = plain.loop_states(idx)
        expected = 0.01 * torch.stack([h.pow(2).mean() for h in states]).mean()
        assert torch.allclose(pen(idx, tgt)[1] - plain(idx, tgt)[1], expected, atol=1e-5)
    off = tiny(norm_penalty=0.0)
    assert torch.equal(off(idx, tgt)[1], tiny()(idx, tgt)[1])


def test_exit_losses_report_mean_per_token_l2_norm_of_each_loop_state():
    m = tiny()
    idx, tgt = batch()
    _, norms = m.exit_losses(idx, tgt)
    expected = torch.stack([h.norm(dim=-1).mean() for h in m.loop_states(idx)])
    assert torch.allclose(norms, expected)


def test_reference_init_starts_near_sqrt_d_and_gpt2_init_near_zero():
    # papers.md §1: with PyTorch's default init (wte ~ N(0,1)) initial state norms are about sqrt(C)
    idx, tgt = batch()
    ref = tiny(init='reference', n_embd=64, n_head=4).exit_losses(idx, tgt)[1][0].item()
    gpt2 = tiny(init='gpt2', n_embd=64, n_head=4).exit_losses(idx, tgt)[1][0].item()
    assert 0.5 * math.sqrt(64) < ref < 3 * math.sqrt(64) and gpt2 < 1.0


# ---------------------------------------------------------------- DeepLoop scaling (papers.md §2)

@pytest.mark.parametrize('K,R', [(1, 1), (2, 4), (4, 3), (12, 3)])
@pytest.mark.parametrize('scaling,p', [('none', 0.0), ('deepnorm', 0.25), ('deeploop', 0.5), (0.35, 0.35), ('0.6', 0.6)])
def test_alpha_and_beta_follow_the_depth_scaling_formulas(K, R, scaling, p):
    cfg = GPTConfig(n_layer=K, n_loop=R, block='sandwich', depth_scaling=scaling)
    N = K * R  # unrolled blocks
    assert math.isclose(cfg.alpha, (2 * N) ** p) and math.isclose(cfg.beta, (8 * N) ** -p)


def test_deeploop_beta_scales_only_value_output_and_mlp():
    base = tiny(block='sandwich', depth_scaling='none')
    scaled = tiny(block='sandwich', depth_scaling='deeploop')  # same seed -> same draws before beta
    beta, C = scaled.config.beta, 16
    assert beta == (8 * 6) ** -0.5
    for b0, b1 in zip(base.transformer.h, scaled.transformer.h):
        w0, w1 = b0.attn.c_attn.weight, b1.attn.c_attn.weight
        assert torch.equal(w0[:2 * C], w1[:2 * C])                  # Q and K untouched
        assert torch.allclose(w0[2 * C:] * beta, w1[2 * C:])        # V scaled
        for n0, n1 in ((b0.attn.c_proj, b1.attn.c_proj), (b0.mlp.c_fc, b1.mlp.c_fc), (b0.mlp.c_proj, b1.mlp.c_proj)):
            assert torch.allclose(n0.weight * beta, n1.weight)
        assert abs(b1.alpha - (2 * 6) ** 0.5) < 1e-12               # alpha on the skip path, at run time
    assert torch.equal(base.transformer.wte.weight, scaled.transformer.wte.weight)  # embeddings untouched


def test_block_types_place_norms_and_alpha_where_the_formulas_say():
    x = torch.randn(2, T, 16)
    for block in ('postln', 'sandwich'):
        m = tiny(block=block, depth_scaling='deeploop')
        b = m.transformer.h[0]
        f_in = x if block == 'postln' else b.ln_1(x)
        y = b.pn_1(b.alpha * x + b.attn(f_in))
        expected = b.pn_2(b.alpha * y + b.mlp(b.ln_2(y)))
        assert torch.allclose(b(x), expected, atol=1e-6)
        assert torch.allclose(b(x).pow(2).mean(-1), torch.ones(2, T), atol=1e-3)  # post-norm: unit RMS out
    pre = tiny(block='preln', loop_eps=1.0).transformer.h[0]
    eps = 1.0 / (3 * math.sqrt(2))  # papers.md §3: lambda / (R sqrt K)
    y = x + eps * pre.attn(pre.ln_1(x))
    assert torch.allclose(pre(x), y + eps * pre.mlp(pre.ln_2(y)), atol=1e-6)


# ---------------------------------------------------------------- the lean per-loop loss

@pytest.mark.parametrize('kw', [dict(), dict(supervision='terminal'), dict(readout='final_only', norm_penalty=0.1),
                                dict(readout='layernorm', bias=True, exit_weights=(0.2, 0.3, 0.5))])
def test_lean_per_loop_loss_and_gradients_equal_the_naive_version(kw):
    m = tiny(**kw)
    idx, tgt = batch()
    tgt[0, :5] = -1  # ignored positions
    _, loss = m(idx, tgt)
    loss.backward()
    lean = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    states = m.loop_states(idx)
    naive = sum(w * F.cross_entropy(m.readout(h, k).view(-1, V), tgt.view(-1), ignore_index=-1)
                for k, (h, w) in enumerate(zip(states, m.exit_weights(3)), start=1) if w > 0)
    naive = naive + m.config.norm_penalty * torch.stack([h.pow(2).mean() for h in states]).mean()
    naive.backward()
    assert torch.allclose(loss, naive, atol=1e-5)
    for n, p in m.named_parameters():
        assert torch.allclose(lean[n], p.grad, atol=1e-5, rtol=1e-4), n


def test_linear_cross_entropy_chunks_rows_without_changing_the_result():
    torch.manual_seed(0)
    Vbig = 2 ** 16 + 3  # rows per chunk = 2**22 // V = 63, so 200 rows take 4 chunks
    W = torch.randn(Vbig, 8, requires_grad=True)
    h = torch.randn(200, 8, requires_grad=True)
    tgt = torch.randint(0, Vbig, (200,))
    loss = LinearCrossEntropy.apply(W, tgt, (1.0,), h[None])
    loss.backward()
    gW, gh = W.grad.clone(), h.grad.clone()
    W.grad = h.grad = None
    ref = F.cross_entropy(h @ W.t(), tgt)
    ref.backward()
    assert torch.allclose(loss, ref, atol=1e-4)
    assert torch.allclose(gW, W.grad, atol=1e-6) and torch.allclose(gh, h.grad, atol=1e-6)


def test_a_small_looped_model_overfits_one_batch():
    m = tiny(n_embd=32, n_head=4, init='gpt2')
    idx, tgt = batch(B=4)
    opt = m.configure_optimizers(0.0, 3e-3, (0.9, 0.99), 'cpu')
    first = None
    for _ in range(150):
        _, loss = m(idx, tgt)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert first > 3.5 and loss.item() < 0.5, (first, loss.item())


# ---------------------------------------------------------------- compile

def test_looped_forward_compiles_without_graph_breaks():
    m = tiny(norm_penalty=0.01, inter_loop_norm='rmsnorm')
    idx, tgt = batch()
    for R in (1, 2):
        for args in ((idx, tgt), (idx,)):
            for grad in (True, False):
                with torch.set_grad_enabled(grad):
                    explanation = torch._dynamo.explain(m)(*args, n_loop=R)
                assert explanation.graph_break_count == 0, explanation.break_reasons
                assert explanation.graph_count == 1


def test_compiled_model_recompiles_once_per_distinct_n_loop():
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    counter = CompileCounter()
    m = tiny()
    cm = torch.compile(m, backend=counter, dynamic=False)  # as train.py compiles: n_loop is a static int
    idx, tgt = batch()
    for R in (3, 1, 2, 3, 1, 2, 3, 4, 4):
        with torch.no_grad():
            cm(idx, tgt, n_loop=R)
    assert counter.frame_count == 4, counter.frame_count  # R in {1, 2, 3, 4}


# ---------------------------------------------------------------- decoding

@pytest.mark.parametrize('kw', [dict(), dict(pos='rope', block='sandwich', depth_scaling='deeploop'),
                                dict(inter_loop_norm='layernorm', readout='final_only')])
def test_cached_decoding_equals_full_recompute(kw):
    m = tiny(**kw).eval()
    idx, _ = batch(B=2)
    # 4 prompt tokens + 30 new tokens runs past block_size 16, so the cache is also rebuilt after the crop
    for n_loop in (None, 5):
        fast = m.generate(idx[:, :4], 30, temperature=0, n_loop=n_loop)
        slow = m.generate(idx[:, :4], 30, temperature=0, n_loop=n_loop, use_cache=False)
        assert torch.equal(fast, slow), n_loop


def test_adaptive_exit_uses_the_first_confident_loop():
    m = tiny().eval()
    idx, _ = batch(B=2)
    m.generate(idx[:, :4], 6, temperature=0, exit_threshold=0.0)       # max-prob >= 0: always exit at loop 1
    assert torch.all(m.last_loops_used[:, 1:] == 1)
    assert torch.all(m.last_loops_used[:, 0] == 3)  # the first new token is read off the prompt pass (all loops)
    never = m.generate(idx[:, :4], 6, temperature=0, exit_threshold=2.0)  # max-prob never reaches 2: loop R
    assert torch.all(m.last_loops_used == 3)
    assert torch.equal(never, m.generate(idx[:, :4], 6, temperature=0))  # ...which is fixed exit at R
    m.generate(idx[:, :4], 6, temperature=0, exit_threshold=1e9, exit_policy='margin')
    assert torch.all(m.last_loops_used == 3)


def test_skipped_loops_fill_their_cache_slots_from_the_exit_state():
    m = tiny().eval()
    idx, _ = batch(B=1)
    K, R = 2, 3
    cache = m.new_cache(1, R, 'cpu', torch.float32)
    m.step(idx[:, :4], cache, 0, R)
    _, used = m.step(idx[:, 4:5], cache, 4, R, exit_threshold=0.0)     # exits after loop 1
    assert used.item() == 1
    # the exit state entering loop 2 is frozen; loops 2..R write K/V computed from it
    x = m.loop_states(idx[:, :5], n_loop=1)[0][:, -1:]  # the new token's state after loop 1
    for k in (2, 3):
        for j, block in enumerate(m.transformer.h):
            kk, vv = block.attn.kv(block.ln_1(x), None, None, 0)
            slot = cache[(k - 1) * K + j]
            assert torch.allclose(slot[0][:, :, 4:5], kk, atol=1e-5) and torch.allclose(slot[1][:, :, 4:5], vv, atol=1e-5)


def test_estimate_mfu_counts_every_loop_and_every_supervised_exit():
    per_loop, terminal = tiny(), tiny(supervision='terminal')
    head = 6 * V * 16
    assert per_loop.flops_per_token(T) - terminal.flops_per_token(T) == 2 * head  # R-1 extra exits
    assert tiny(n_loop=6).flops_per_token(T) > per_loop.flops_per_token(T)
    mfu = per_loop.estimate_mfu(fwdbwd_per_iter=10, dt=1.0, peak_flops=1e9)
    assert math.isclose(mfu, per_loop.flops_per_token(T) * T * 10 / 1e9)
    assert GPT.peak_flops('NVIDIA H200') == 989e12 and GPT.peak_flops('some cpu') is None
