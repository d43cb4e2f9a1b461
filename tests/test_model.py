"""model.py as a specification of the science: each test states one property of looped GPTs."""
import math
import dataclasses

import pytest
import torch
from torch.nn import functional as F

from compute.hardware import attention_path, auto_dtype, peak_flops
from compute.kernels import LinearCrossEntropy, attention
from configurator import MODEL_CHOICES, check_model
from decoding.engine import Decoding, KVCache, decode_step, generate
from decoding.exits import THRESHOLD_RANGES, adaptive_step
from model import GPTConfig
from run.accounting import estimate_mfu, flops_per_token

from conftest import T, V, tiny_gpt as tiny  # K 2, R 3, C 16: conftest.TINY_GPT


def batch(B=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


# ---------------------------------------------------------------- configuration

@pytest.mark.parametrize('key,value', [('readout', 'softmax'), ('block', 'preln2'), ('supervision', 'dense'),
                                       ('inter_loop_norm', 'batchnorm'), ('init', 'xavier'),
                                       ('pos', 'alibi'), ('attn_impl', 'flash')])
def test_unknown_choice_error_lists_the_allowed_values(key, value):
    with pytest.raises(ValueError) as e:
        check_model(GPTConfig(**{key: value}))
    msg = str(e.value)
    assert msg.startswith(f"{key}={value!r}: choose one of")
    assert ', '.join(MODEL_CHOICES[key]) in msg


@pytest.mark.parametrize('kw,fragment', [(dict(n_embd=30, n_head=4), 'not divisible'),
                                         (dict(n_loop=0), 'n_loop=0'),
                                         (dict(depth_scaling='huge'), 'depth_scaling'),
                                         (dict(depth_scaling='deeploop'), "block='postln'")])
def test_impossible_configs_are_rejected_in_one_line(kw, fragment):
    with pytest.raises(ValueError) as e:
        check_model(GPTConfig(**kw))
    assert fragment in str(e.value) and '\n' not in str(e.value)


def test_parameter_count_does_not_depend_on_loop_count():
    counts = {R: tiny(n_loop=R).get_num_params() for R in (1, 2, 4, 8)}
    assert len(set(counts.values())) == 1, counts
    # ...and the tied head is the embedding: no extra V*C matrix
    m = tiny()
    assert m.lm_head.weight is m.transformer.wte.weight
    assert m.get_num_params(non_embedding=False) == sum(p.numel() for p in m.transformer.parameters())


# ---------------------------------------------------------------- the loop

def test_loop_states_returns_one_state_per_loop_and_n_loop_overrides_R():
    m = tiny()
    idx, _ = batch()
    assert [h.shape for h in m.run(idx).states] == [(3, T, 16)] * 3
    assert len(m.run(idx, n_loop=1).states) == 1 and len(m.run(idx, n_loop=6).states) == 6
    # early exit: the first k states of a longer run are the states of a shorter run
    a, b = m.run(idx, n_loop=2).states, m.run(idx, n_loop=5).states
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
    assert torch.allclose(looped.run(idx).states[-1], untied.run(idx).states[-1], atol=1e-5)
    assert torch.allclose(looped(idx, tgt)[1], untied(idx, tgt)[1], atol=1e-5)


def test_inter_loop_norm_hands_each_loop_a_unit_rms_state():
    m = tiny(inter_loop_norm='rmsnorm', n_loop=4)
    seen = []
    hook = m.transformer.h[0].register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    m.run(batch()[0]).states
    hook.remove()
    # loop 1 gets the embedding (norm ~ 1 per entry under reference init); loops 2..R get LoopNorm(h_{k-1})
    for x in seen[1:]:
        assert torch.allclose(x.pow(2).mean(-1).sqrt(), torch.ones(x.shape[:2]), atol=1e-3)
    # ...while the states leaving each loop are not normalised (their scale is what docs/papers.md §1
    # reports)
    assert not torch.allclose(m.run(batch()[0]).states[-1].pow(2).mean(-1), torch.ones(3, T), atol=1e-2)


# ---------------------------------------------------------------- the readout blind spot (docs/papers.md §1)

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


def test_final_only_reads_each_row_at_its_own_exit_in_one_call():
    # depth batching reads rows at other exits in one call (model.exit with an exit per row): each row's
    # z and logits are those of its exit alone, raw before n_loop and normed from it on
    m = tiny(readout='final_only', n_coda=1)
    with torch.no_grad():
        m.transformer.ln_out.weight.uniform_(0.5, 1.5)  # a normed exit is then not a rescaled raw one
        h, k = torch.randn(4, 2, 16), torch.tensor([1, 2, 3, 4])
        z, logits = m.exit(h, k)
        for b in range(4):
            z_b, logits_b = m.exit(h[b:b + 1], int(k[b]))
            torch.testing.assert_close((z[b], logits[b]), (z_b[0], logits_b[0]))
        assert not torch.allclose(z[1], m.exit(h[1:2], 3)[0][0])  # exit 2 of 3 is raw, exit 3 normed


@pytest.mark.parametrize('R', [2, 5])
def test_final_only_norms_the_last_exit_of_a_sampled_depth(R):
    # a training step that draws R != n_loop (loop_sampling) still reads its last exit through the norm
    m = tiny(readout='final_only', supervision='terminal', n_loop=3)
    idx, tgt = batch()
    out = m.run(idx, n_loop=R)
    normed = F.cross_entropy(m.lm_head(m.transformer.ln_out(out.states[-1])).view(-1, V), tgt.view(-1))
    torch.testing.assert_close(m.loss(out, tgt), normed, atol=1e-5, rtol=1e-5)


def test_per_loop_loss_is_the_mean_of_exit_ces_and_terminal_is_the_last():
    idx, tgt = batch()
    per_loop, terminal = tiny(supervision='per_loop'), tiny(supervision='terminal')
    ce, _, _ = per_loop.exit_metrics(idx, tgt)
    assert torch.allclose(per_loop(idx, tgt)[1], ce.mean(), atol=1e-5)
    assert torch.allclose(terminal(idx, tgt)[1], terminal.exit_metrics(idx, tgt)[0][-1], atol=1e-5)


def test_norm_penalty_adds_lambda_times_mean_square_of_all_loop_states_and_zero_is_off():
    idx, tgt = batch()
    for supervision in ('per_loop', 'terminal'):
        plain, pen = tiny(supervision=supervision), tiny(supervision=supervision, norm_penalty=0.01)
        states = plain.run(idx).states
        expected = 0.01 * torch.stack([h.pow(2).mean() for h in states]).mean()
        assert torch.allclose(pen(idx, tgt)[1] - plain(idx, tgt)[1], expected, atol=1e-5)
    # lambda = 0: the loss is the exits' CE alone
    off = tiny(norm_penalty=0.0)
    ce = torch.stack([F.cross_entropy(off.readout(h, k).view(-1, V), tgt.view(-1))
                      for k, h in enumerate(off.run(idx).states, start=1)]).mean()
    assert torch.allclose(off(idx, tgt)[1], ce, atol=1e-6)


def test_exit_metrics_report_mean_per_token_l2_norm_of_each_loop_state():
    m = tiny()
    idx, tgt = batch()
    _, norms, _ = m.exit_metrics(idx, tgt)
    expected = torch.stack([h.norm(dim=-1).mean() for h in m.run(idx).states])
    assert torch.allclose(norms, expected)


def test_reference_init_starts_near_sqrt_d_and_gpt2_init_near_zero():
    # docs/papers.md §1: with PyTorch's default init (wte ~ N(0,1)) initial state norms are about sqrt(C)
    idx, tgt = batch()
    ref = tiny(init='reference', n_embd=64, n_head=4).exit_metrics(idx, tgt)[1][0].item()
    gpt2 = tiny(init='gpt2', n_embd=64, n_head=4).exit_metrics(idx, tgt)[1][0].item()
    assert 0.5 * math.sqrt(64) < ref < 3 * math.sqrt(64) and gpt2 < 1.0



@pytest.mark.parametrize('std', [1.0, 0.02])
def test_a_tied_head_takes_the_embeddings_scale_and_an_untied_one_keeps_its_inits_own(std):
    # the init split's caveat (docs/results.md): tied, embd_std is also the raw readout's logit scale;
    # untied, the head is a matrix of its own on PyTorch's default (Kaiming-uniform, std 1/sqrt(3C))
    C = 64
    tied = tiny(init='reference', embd_std=std, n_embd=C, n_head=4)
    own = tiny(init='reference', embd_std=std, n_embd=C, n_head=4, tie_head=False)
    assert tied.lm_head.weight is tied.transformer.wte.weight
    assert own.lm_head.weight is not own.transformer.wte.weight
    assert own.transformer.wte.weight.std().item() == pytest.approx(std, rel=0.1)
    assert own.lm_head.weight.std().item() == pytest.approx(1 / math.sqrt(3 * C), rel=0.1)
    # the untied head is one more V x C matrix to train, and the embedding's scale leaves the logits alone
    assert sum(p.numel() for p in own.parameters()) == sum(p.numel() for p in tied.parameters()) + V * C
    idx, tgt = batch()
    loss = own(idx, tgt)[1]
    loss.backward()
    assert own.lm_head.weight.grad is not None and own.transformer.wte.weight.grad is not None

# ---------------------------------------------------------------- DeepLoop scaling (docs/papers.md §2)

@pytest.mark.parametrize('K,R', [(1, 1), (2, 4), (4, 3), (12, 3)])
@pytest.mark.parametrize('scaling,p', [('none', 0.0), ('deepnorm', 0.25), ('deeploop', 0.5), (0.35, 0.35),
                                       ('0.6', 0.6)])
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
        for n0, n1 in ((b0.attn.c_proj, b1.attn.c_proj), (b0.mlp.c_fc, b1.mlp.c_fc),
                       (b0.mlp.c_proj, b1.mlp.c_proj)):
            assert torch.allclose(n0.weight * beta, n1.weight)
        assert abs(b1.alpha - (2 * 6) ** 0.5) < 1e-12               # alpha on the skip path, at run time
    assert torch.equal(base.transformer.wte.weight, scaled.transformer.wte.weight)  # embeddings untouched



@pytest.mark.parametrize('block,scaling,mlp', [
    ('sandwich', 'deeploop', 'gelu'), ('postln', 'deepnorm', 'gelu'), ('sandwich', 'deepnorm', 'swiglu'),
    ('sandwich', 'none', 'gelu'), ('preln', 'none', 'swiglu'), ('sandwich', 1e-6, 'gelu')])
def test_gpt2_init_is_n_0_0_02_times_beta_so_the_family_is_continuous_in_p(block, scaling, mlp):
    # docs/papers.md §2: N(0, 0.02) everywhere, then beta on V, W_o and the MLP matrices; no other
    # residual scaling, so p = 0 is the p -> 0 member and the baseline's init does not depend on R
    m = tiny(init='gpt2', block=block, depth_scaling=scaling, mlp=mlp, n_embd=256, n_head=4, n_layer=4)
    cfg, C = m.config, 256
    beta = cfg.beta
    assert (beta < 0.999) == (scaling not in ('none', 1e-6))
    for b in m.transformer.h:
        expected = [(b.attn.c_attn.weight[:2 * C], 0.02),            # Q, K: never scaled
                    (b.attn.c_attn.weight[2 * C:], 0.02 * beta),     # V
                    (b.mlp.c_fc.weight, 0.02 * beta),
                    (b.attn.c_proj.weight, 0.02 * beta),
                    (b.mlp.c_proj.weight, 0.02 * beta)]
        for w, std in expected:
            assert abs(w.std().item() / std - 1) < 0.03, (w.shape, w.std().item(), std)


@pytest.mark.parametrize('R', [1, 4, 8])
def test_pre_norm_baseline_init_does_not_depend_on_the_loop_count(R):
    # the paper's baseline is "standard init, no residual scaling": the same weights at every R
    m = tiny(init='gpt2', n_loop=R, n_embd=256, n_head=4)
    ref = tiny(init='gpt2', n_loop=1, n_embd=256, n_head=4)
    for a, b in zip(m.parameters(), ref.parameters()):
        assert torch.equal(a, b)

def rms_norm(x, norm):
    # RMSNorm written out (eps 1e-6 as in the reference code), with that norm module's learned gain
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight


def random_gains(b):
    # gains away from 1, so that swapping or dropping a norm shows in the output
    with torch.no_grad():
        for norm in (b.ln_1, b.ln_2, b.pn_1, b.pn_2):
            if isinstance(norm, torch.nn.RMSNorm):
                norm.weight.uniform_(0.5, 1.5)


@pytest.mark.parametrize('block', ['preln', 'postln', 'sandwich'])
def test_block_types_place_norms_and_alpha_where_the_formulas_say(block):
    # preln: x + f(Norm x); postln: Norm(a x + f(x)); sandwich: Norm(a x + f(Norm x)), a = (2N)^p
    m = tiny(block=block, depth_scaling='none' if block == 'preln' else 'deeploop')
    b = m.transformer.h[0]
    pre, post = block in ('preln', 'sandwich'), block in ('postln', 'sandwich')
    is_norm = lambda mod: isinstance(mod, torch.nn.RMSNorm)
    assert [is_norm(b.ln_1), is_norm(b.ln_2)] == [pre, pre]
    assert [is_norm(b.pn_1), is_norm(b.pn_2)] == [post, post]
    if not pre:
        assert isinstance(b.ln_1, torch.nn.Identity) and isinstance(b.ln_2, torch.nn.Identity)
    if not post:
        assert isinstance(b.pn_1, torch.nn.Identity) and isinstance(b.pn_2, torch.nn.Identity)
    random_gains(b)
    a = (2 * 2 * 3) ** 0.5 if post else 1.0  # N = K*R = 6 unrolled blocks
    x = 3.0 * torch.randn(2, T, 16)
    with torch.no_grad():
        if block == 'preln':
            y = x + b.attn(rms_norm(x, b.ln_1))
            expected = y + b.mlp(rms_norm(y, b.ln_2))
        elif block == 'postln':
            y = rms_norm(a * x + b.attn(x), b.pn_1)
            expected = rms_norm(a * y + b.mlp(y), b.pn_2)
        else:
            y = rms_norm(a * x + b.attn(rms_norm(x, b.ln_1)), b.pn_1)
            expected = rms_norm(a * y + b.mlp(rms_norm(y, b.ln_2)), b.pn_2)
        assert torch.allclose(b(x)[0], expected, atol=1e-5)


@pytest.mark.parametrize('block', ['preln', 'sandwich'])
def test_alpha_multiplies_the_skip_path_and_the_prenormed_branch_ignores_scale(block):
    # what reaches the first post-norm is s(x) = a x + f(Norm x): scaling x by c changes it by (c - 1) a x
    m = tiny(block=block, depth_scaling='none' if block == 'preln' else 'deeploop')
    b = m.transformer.h[0]
    seen = []
    hook = b.pn_1.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    x, c = torch.randn(2, T, 16), 4.0
    with torch.no_grad():
        b(x), b(c * x)
    hook.remove()
    a = (2 * 2 * 3) ** 0.5 if block == 'sandwich' else 1.0
    assert torch.allclose(seen[1] - seen[0], (c - 1) * a * x, atol=1e-4)


@pytest.mark.parametrize('lam', [0.0, 2.0])
def test_loop_eps_scales_prenorm_branches_by_lambda_over_R_sqrt_K_and_zero_is_off(lam):
    # docs/papers.md §3: h <- h + eps f(Norm h), eps = lambda / (R sqrt K); lambda = 0 leaves the branch
    # unscaled
    m = tiny(block='preln', n_layer=2, n_loop=4, loop_lambda=lam)
    b = m.transformer.h[0]
    eps = lam / (4 * math.sqrt(2)) if lam > 0 else 1.0
    assert math.isclose(b.eps, eps) and math.isclose(m.config.branch_scale, eps)
    random_gains(b)
    x = torch.randn(2, T, 16)
    with torch.no_grad():
        y = x + eps * b.attn(rms_norm(x, b.ln_1))
        assert torch.allclose(b(x)[0], y + eps * b.mlp(rms_norm(y, b.ln_2)), atol=1e-5)


# ---------------------------------------------------------------- attention paths

ATTN_IMPLS = ('sdpa', 'math', 'explicit')


def assert_matches_in_value_and_gradient(y, expected, inputs, g):
    # float64 attention against its hand-written reference, forward and backward
    assert torch.allclose(y, expected, atol=1e-12)
    w = torch.randn(y.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((y * w).sum(), inputs)
    for got, want in zip(grads, torch.autograd.grad((expected * w).sum(), inputs)):
        assert torch.allclose(got, want, atol=1e-12)


@pytest.mark.parametrize('impl', ATTN_IMPLS)
@pytest.mark.parametrize('Tq,Tk,causal', [(16, 16, True), (1, 9, False), (5, 5, False)])
def test_every_attention_path_computes_masked_softmax_attention(impl, Tq, Tk, causal):
    # softmax(q k^T / sqrt(hs) + mask) v written out in float64: a prompt at position 0 (causal, top-left
    # aligned) and one new token against a cache of 9 keys (no mask), forward and backward
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, T, 8, generator=g, dtype=torch.float64, requires_grad=True)
               for T in (Tq, Tk, Tk))
    att = (q @ k.transpose(-2, -1)) / math.sqrt(8)
    if causal:
        att = att.masked_fill(torch.ones(Tq, Tk, dtype=torch.bool).tril().logical_not(), float('-inf'))
    expected = att.softmax(-1) @ v
    y = attention(q, k, v, causal, impl)
    assert_matches_in_value_and_gradient(y, expected, (q, k, v), g)


@pytest.mark.parametrize('impl', ('math', 'explicit'))
@pytest.mark.parametrize('kw', [dict(), dict(pos='rope', block='sandwich', depth_scaling='deeploop')])
def test_every_attention_path_trains_the_same_model(impl, kw):
    # the whole model in fp32: the loss and every gradient agree with the sdpa path to float rounding
    idx, tgt = batch()
    ref, other = tiny(attn_impl='sdpa', **kw), tiny(attn_impl=impl, **kw)
    grads = []
    for m in (ref, other):
        loss = m(idx, tgt)[1]
        loss.backward()
        grads.append((loss, {n: p.grad for n, p in m.named_parameters()}))
    (l0, g0), (l1, g1) = grads
    assert torch.allclose(l0, l1, atol=1e-6, rtol=1e-6)
    for n in g0:
        assert torch.allclose(g0[n], g1[n], atol=1e-6, rtol=1e-5), n


@pytest.mark.parametrize('impl', ATTN_IMPLS)
def test_every_attention_path_agrees_under_bf16_autocast(impl):
    # bf16 rounds every path differently; each stays within bf16's resolution of the fp32 loss
    idx, tgt = batch()
    m = tiny(attn_impl=impl)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        low = m(idx, tgt)[1]
    assert low.dtype == torch.float32
    assert abs(low.item() - m(idx, tgt)[1].item()) < 0.02 * low.item()


def test_auto_attention_is_explicit_only_for_short_low_precision_cpu_attention():
    # measured (docs/performance.md, "Attention on a CPU"): the CPU flash kernel wins in fp32 and at long
    # contexts, loses in bf16
    assert attention_path('auto', 'cpu', torch.float32, 64) == 'sdpa'
    assert attention_path('auto', 'cpu', torch.bfloat16, 64) == 'explicit'
    assert attention_path('auto', 'cpu', torch.bfloat16, 4096) == 'sdpa'
    assert attention_path('auto', 'cuda', torch.bfloat16, 64) == 'sdpa'
    for impl in ATTN_IMPLS:  # a named path is taken as given
        assert attention_path(impl, 'cpu', torch.bfloat16, 64) == impl


def test_auto_dtype_is_bf16_exactly_where_the_cpu_has_bf16_units(monkeypatch):
    from compute import hardware
    monkeypatch.setattr(hardware, 'cpu_bf16_units', lambda: None)
    assert auto_dtype('cpu') == ('float32', 'no bf16 units on this CPU')
    monkeypatch.setattr(hardware, 'cpu_bf16_units', lambda: 'AVX512-BF16')
    assert auto_dtype('cpu') == ('bfloat16', 'the CPU has AVX512-BF16')
    assert auto_dtype('mps')[0] == 'float32'


# ---------------------------------------------------------------- the lean per-loop loss

@pytest.mark.parametrize('kw', [dict(), dict(supervision='terminal'),
                                dict(readout='final_only', norm_penalty=0.1),
                                dict(readout='layernorm', norm='layernorm')])
def test_lean_per_loop_loss_and_gradients_equal_the_naive_version(kw):
    m = tiny(**kw)
    idx, tgt = batch()
    tgt[0, :5] = -1  # ignored positions
    _, loss = m(idx, tgt)
    loss.backward()
    lean = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    states = m.run(idx).states
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


def test_linear_cross_entropy_under_bf16_autocast_matches_the_full_logit_loss():
    # both sides under the same autocast: bf16 logits, then an fp32 softmax; only the summation order differs
    torch.manual_seed(0)
    W = torch.randn(V, 16, requires_grad=True)
    hs = torch.randn(2, 3, T, 16, requires_grad=True)  # two supervised exits
    tgt = torch.randint(0, V, (3, T))
    tgt[0, :5] = -1
    ws = (0.25, 0.75)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        loss = LinearCrossEntropy.apply(W, tgt, ws, hs)
        ref = sum(w * F.cross_entropy((h @ W.t()).view(-1, V), tgt.view(-1), ignore_index=-1)
                  for w, h in zip(ws, hs))
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-3)
    gW, gh = torch.autograd.grad(loss, (W, hs), retain_graph=True)
    rW, rh = torch.autograd.grad(ref, (W, hs))
    torch.testing.assert_close(gW, rW, rtol=0, atol=1e-3 * rW.abs().max().item())
    torch.testing.assert_close(gh, rh, rtol=0, atol=1e-3 * rh.abs().max().item())
    # the backward pass scales the saved gradients by the incoming one: (2.5 * loss) gets 2.5x the gradients
    gW2, gh2 = torch.autograd.grad(loss, (W, hs), grad_outputs=torch.tensor(2.5))
    assert torch.equal(gW2, 2.5 * gW) and torch.equal(gh2, 2.5 * gh)


def test_overriding_n_loop_supervises_every_exit_uniformly_or_the_last_under_terminal():
    # the weights follow the loop count of the call, not the trained R
    idx, tgt = batch()
    m = tiny()  # R = 3
    assert m.exit_weights(3) == [1 / 3] * 3
    assert m.exit_weights(2) == [0.5, 0.5] and m.exit_weights(5) == [0.2] * 5
    term = tiny(supervision='terminal')
    assert term.exit_weights(5) == [0.0] * 4 + [1.0]
    for R in (2, 5):
        ce = lambda model: torch.stack([F.cross_entropy(model.readout(h, k).view(-1, V), tgt.view(-1))
                                        for k, h in enumerate(model.run(idx, R).states, start=1)])
        assert torch.allclose(m(idx, tgt, n_loop=R)[1], ce(m).mean(), atol=1e-5), R
        assert torch.allclose(term(idx, tgt, n_loop=R)[1], ce(term)[-1], atol=1e-5), R


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


@pytest.mark.parametrize('impl', ('math', 'explicit'))
def test_every_attention_path_compiles_without_graph_breaks(impl):
    idx, tgt = batch()
    with torch.autocast('cpu', dtype=torch.bfloat16):
        explanation = torch._dynamo.explain(tiny(attn_impl=impl))(idx, tgt)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons


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
                                dict(inter_loop_norm='layernorm', readout='final_only'),
                                dict(attn_impl='explicit'), dict(attn_impl='math', pos='rope')])
def test_cached_decoding_equals_full_recompute(kw):
    m = tiny(**kw).eval()
    idx, _ = batch(B=2)
    # 4 prompt tokens + 30 new tokens runs past block_size 16, so the cache is also rebuilt after the crop
    for n_loop in (None, 5):
        fast, _, _ = generate(m, idx[:, :4], 30, Decoding(temperature=0, n_loop=n_loop))
        slow, _, _ = generate(m, idx[:, :4], 30, Decoding(temperature=0, n_loop=n_loop, use_cache=False))
        assert torch.equal(fast, slow), n_loop


def exit_logits(m, seq):
    """(R, B, V): every exit's logits at the last position of seq, from the uncached full forward"""
    states = m.run(seq).states
    return torch.stack([m.readout(h[:, -1], k) for k, h in enumerate(states, start=1)])


def confidence(logits, policy):
    if policy == 'maxprob':
        return logits.softmax(-1).max(-1).values
    top2 = logits.topk(2, dim=-1).values  # margin: top1 - top2 logit
    return top2[..., 0] - top2[..., 1]


def middle_exit(m, prompt, policy):
    """A threshold between the second new token's scores at loops 1 and 2 (so loop 2 of R is the first
    confident loop), with that token's exit logits (R, B, V). The token is decoded after the first new one,
    whose prompt pass runs all loops, so its per-loop states are those of the full forward."""
    with torch.no_grad():
        logits = exit_logits(m, generate(m, prompt, 1, Decoding(temperature=0))[0])
    s = confidence(logits, policy)[:, 0]
    assert s[1] > s[0] + 1e-3, s  # the set-up: loop 2 is more confident than loop 1
    return (s[0] + s[1]).item() / 2, logits


@pytest.mark.parametrize('policy', ['maxprob', 'margin'])
def test_adaptive_exit_uses_the_first_confident_loop(policy):
    m = tiny(n_loop=4).eval()
    prompt = batch(B=4)[0][3:, :4]
    # threshold 0: every token exits at loop 1 (the first new token is read off the prompt pass: all loops)
    _, used, _ = generate(m, prompt, 6, Decoding(temperature=0, exit_threshold=0.0, exit_policy=policy))
    assert used.tolist() == [[4] + [1] * 5]
    # unreachable (the top of the policy's range): every token runs all R loops, which is fixed exit at R
    top = THRESHOLD_RANGES[policy][1]
    never, used, _ = generate(m, prompt, 6, Decoding(temperature=0, exit_threshold=min(top, 1e9),
                                                     exit_policy=policy))
    assert used.tolist() == [[4] * 6]
    assert torch.equal(never, generate(m, prompt, 6, Decoding(temperature=0))[0])
    # a threshold only loop 2 reaches: the token stops at loop 2 and is loop 2's argmax
    t, logits = middle_exit(m, prompt, policy)
    out, used, _ = generate(m, prompt, 2, Decoding(temperature=0, exit_threshold=t, exit_policy=policy))
    assert used.tolist() == [[4, 2]]
    assert out[0, -1].item() == logits[1, 0].argmax().item() != logits[3, 0].argmax().item()


@pytest.mark.parametrize('policy', ['maxprob', 'margin'])
def test_batched_adaptive_decoding_equals_decoding_each_row_alone(policy):
    # rows exit at different loops in one batch; an exited row's state, K/V and logits must stay its own.
    # A layernorm between loops and a raw readout make a frozen state read at a later exit give other
    # logits, and stronger attention makes each row's cache show in its later tokens.
    m = tiny(n_loop=4, inter_loop_norm='layernorm', readout='raw').eval()
    with torch.no_grad():
        for block in m.transformer.h:
            block.attn.c_proj.weight.mul_(3.0)
    prompts = torch.randint(0, V, (8, 4), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = exit_logits(m, generate(m, prompts, 1, Decoding(temperature=0))[0])  # (R, B, V), 2nd token
    s = confidence(logits, policy)
    r = (s[1] - s[0]).argmax()
    t = (s[0, r] + s[1, r]).item() / 2  # row r's first confident loop is loop 2
    # each row's first confident loop, else R
    first = torch.where(s[:3] >= t, torch.arange(1, 4)[:, None], 4).min(0).values
    assert (s - t).abs().min() > 1e-4 and len(set(first.tolist())) >= 2, (s, t)
    both, used, _ = generate(m, prompts, 14, Decoding(temperature=0, exit_threshold=t, exit_policy=policy))
    assert torch.equal(used[:, 1], first.float())
    assert torch.equal(both[:, 5], logits[first - 1, torch.arange(8)].argmax(-1))
    for row in range(8):
        alone, alone_used, _ = generate(m, prompts[row:row + 1], 14, Decoding(temperature=0, exit_threshold=t,
                                     exit_policy=policy))
        assert torch.equal(alone[0], both[row]) and torch.equal(alone_used[0], used[row]), row


def test_skipped_loops_fill_their_cache_slots_from_the_exit_state():
    m = tiny().eval()
    idx, _ = batch(B=1)
    K, R = 2, 3
    cache = KVCache(m, 1, R, 'cpu', torch.float32)
    decode_step(m, idx[:, :4], cache, 0, R)
    _, used = adaptive_step(m, idx[:, 4:5], cache, 4, R, 0.0, 'maxprob')  # exits after loop 1
    assert used.item() == 1
    # the exit state entering loop 2 is frozen; loops 2..R write K/V computed from it
    x = m.run(idx[:, :5], n_loop=1).states[0][:, -1:]  # the new token's state after loop 1
    for k in (2, 3):
        for j, block in enumerate(m.transformer.h):
            _, kk, vv = block.attn.qkv(block.ln_1(x))
            slot = cache.slots['loop'][(k - 1) * K + j]
            assert torch.allclose(slot.key[:, :, 4:5], kk, atol=1e-5)
            assert torch.allclose(slot.value[:, :, 4:5], vv, atol=1e-5)


@pytest.mark.parametrize('kw,n_exits', [(dict(), 3), (dict(supervision='terminal'), 1)])
def test_estimate_mfu_counts_every_loop_and_every_supervised_exit(kw, n_exits):
    # 6 flops per weight use (forward + backward): the K layers once per loop, the V x C head once per
    # supervised exit; attention scores 12 K R C T
    m = tiny(**kw)  # K=2, R=3, C=16, swiglu: per layer 2 norm gains + 4 C^2 attention + 12 C^2 MLP
    K, R, C = 2, 3, 16
    layer_params = K * (2 * C + 16 * C * C)
    expected = 6 * (layer_params * R + V * C * n_exits) + 12 * K * R * C * T
    assert flops_per_token(m, T) == expected
    # at another loop count (and context length) every loop is counted, and under per-loop supervision
    # with the default uniform weights every exit
    exits_6 = 1 if kw.get('supervision') == 'terminal' else 6
    assert flops_per_token(m, 8, n_loop=6) == 6 * (layer_params * 6 + V * C * exits_6) + 12 * K * 6 * C * 8
    mfu = estimate_mfu(m, fwdbwd_per_iter=10, dt=0.5, peak=1e9)
    assert math.isclose(mfu, expected * T * 10 / 0.5 / 1e9)
    assert math.isclose(estimate_mfu(m, fwdbwd_per_iter=4, dt=2.0, peak=1e9, T=8),
                        flops_per_token(m, 8) * 8 * 4 / 2.0 / 1e9)
    assert peak_flops('NVIDIA H200') == 989e12 and peak_flops('some cpu') is None


# ---------------------------------------------------------------- several new tokens after a cache

@pytest.mark.parametrize('impl', ATTN_IMPLS)
@pytest.mark.parametrize('Tq,Tk', [(4, 9), (1, 9), (3, 3), (7, 8)])
def test_every_attention_path_aligns_the_causal_mask_bottom_right_after_a_cache(impl, Tq, Tk):
    # Tq new tokens after Tk - Tq cached ones: query i is position Tk - Tq + i and sees keys 0..Tk - Tq + i
    # (is_causal's top-left mask would hide the cached keys from them), forward and backward
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g, dtype=torch.float64, requires_grad=True)
               for n in (Tq, Tk, Tk))
    att = (q @ k.transpose(-2, -1)) / math.sqrt(8)
    sees = torch.tensor([[j <= Tk - Tq + i for j in range(Tk)] for i in range(Tq)])
    expected = att.masked_fill(~sees, float('-inf')).softmax(-1) @ v
    y = attention(q, k, v, True, impl)
    assert_matches_in_value_and_gradient(y, expected, (q, k, v), g)
    with pytest.raises(AssertionError, match='queries'):
        attention(k, q[:, :, :0], v[:, :, :0], True, impl)  # more queries than keys


@pytest.mark.parametrize('kw', [dict(), dict(pos='rope', n_prelude=1, n_coda=1, injection='concat'),
                                dict(attn_impl='explicit'), dict(attn_impl='math', pos='rope')])
def test_a_cached_multi_token_step_after_position_0_equals_the_full_recompute(kw):
    # a prompt of 5, then steps of 4, 1 and 6 tokens through the cache: each step's logits at every one
    # of its positions are the full forward's at those positions
    m = tiny(**kw).eval()
    idx, _ = batch(B=2)
    R = m.config.n_loop
    with torch.no_grad():
        full = m.readout(m.run(idx).states[-1], R)  # (B, T, V)
        cache, pos = KVCache(m, 2, R, 'cpu', torch.float32), 0
        for n in (5, 4, 1, 6):
            e = m.begin(idx[:, pos:pos + n], cache, pos)
            h = m.loops(e, e, range(1, R + 1), cache, pos).states[-1]
            got = m.lm_head(m.coda_readout(h, R, cache, pos))
            assert torch.allclose(got, full[:, pos:pos + n], atol=1e-5), (pos, n)
            pos += n


def attributes(model):
    """Every module's own attributes, as (module name, attribute, id of its value): parameters and buffers
    by identity, everything else set on a module (a list, a tensor, a flag) too."""
    def snapshot(v):  # a container by what it holds: an append in place shows
        return tuple(map(id, v)) if isinstance(v, (list, tuple)) else \
            tuple((k, id(x)) for k, x in v.items()) if isinstance(v, dict) else ()
    out = set()
    for name, mod in model.named_modules():
        for attr, value in vars(mod).items():
            items = value.items() if attr in ('_parameters', '_buffers', '_modules') else [(attr, value)]
            out |= {(name, key, id(v), snapshot(v)) for key, v in items}
    return out


@pytest.mark.parametrize('kw', [dict(n_expert=4, tied_routing=True, n_prelude=1, n_coda=1,
                                     injection='concat'),
                                dict(hyper_lanes=2, inter_loop_norm='rmsnorm', supervision='terminal'),
                                dict(exit_gate='learned', norm_penalty=0.1)])
def test_a_pass_returns_what_it_computes_and_leaves_the_model_as_it_found_it(kw):
    # the loop's states and the experts' routes come back from the call: no forward, loss or metric writes
    # to the model, so a second pass cannot read the first one's leftovers
    m = tiny(**kw)
    idx, tgt = batch()
    before = attributes(m)
    out = m.run(idx)
    m(idx, tgt)[1].backward()
    m.loss(out, tgt)
    m.exit_metrics(idx, tgt)
    m.loops(out.states[0], out.states[0], [1, 2])
    assert attributes(m) == before
    assert len(out.routes) == (m.config.n_layer * m.config.n_loop if m.config.n_expert else 0)
