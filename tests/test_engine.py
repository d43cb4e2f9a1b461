"""engine.py and exits.py: the KV-cache policies, what an early exit leaves in every slot, the refill past the
block size, self-speculative decoding."""
import copy
import functools
import math
from collections import Counter

import pytest
import torch

from decoding import engine
from decoding import exits
from decoding.engine import Decoding, KVCache, decode_step, generate, speculate_round
from decoding.exits import adaptive_forward, adaptive_step
from conftest import T, V, tiny_gpt
from test_sample import run_main  # sample.main in-process: (exit code, stdout, stderr)

tiny = functools.partial(tiny_gpt, n_loop=4, training=False)  # K 2, R 4, C 16, in eval mode


def prompts(B=3, n=4, seed=1):
    return torch.randint(0, V, (B, n), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- KV-cache policies

def test_recompute_with_a_threshold_that_never_exits_is_fixed_depth_decoding():
    m, x = tiny(), prompts()
    fixed, _, _ = generate(m, x, 10, Decoding(temperature=0))
    never, used, _ = generate(m, x, 10, Decoding(temperature=0, exit_threshold=1.0))  # maxprob never gets 1
    assert torch.equal(never, fixed) and used.eq(4).all()


@pytest.mark.parametrize('policy,kv_slots', [('recompute', None), ('copy', None), ('active', None),
                                             ('shared', 4), ('shared', 6)])
def test_every_policy_that_runs_all_loops_is_fixed_depth_decoding(policy, kv_slots):
    # a threshold only the last exit reaches: every token runs R loops, nothing is skipped
    m, x = tiny(), prompts()
    fixed, _, _ = generate(m, x, 10, Decoding(temperature=0))
    out, used, _ = generate(m, x, 10, Decoding(temperature=0, exit_threshold=1e9, exit_policy='margin',
                         kv_policy=policy, kv_slots=kv_slots))
    assert torch.equal(out, fixed) and used.eq(4).all()


def test_shared_slots_fewer_than_loops_decode_as_their_own_fixed_depth():
    # with kv_slots < R the cache itself is an approximation; exits that never fire change nothing more
    m, x = tiny(), prompts()
    fixed, _, _ = generate(m, x, 10, Decoding(temperature=0, kv_policy='shared', kv_slots=2))
    out, _, _ = generate(m, x, 10, Decoding(temperature=0, exit_threshold=1e9, exit_policy='margin',
                      kv_policy='shared', kv_slots=2))
    assert torch.equal(out, fixed)


def test_shared_cache_memory_is_independent_of_R():
    m = tiny()
    nbytes = lambda R, policy, n=None: KVCache(m, 2, R, 'cpu', torch.float32, policy, n).nbytes()
    assert len({nbytes(R, 'shared', 2) for R in (4, 8, 16)}) == 1
    assert nbytes(16, 'recompute') == 4 * nbytes(4, 'recompute')             # the others grow with R
    assert nbytes(4, 'shared', 4) == nbytes(4, 'recompute')


def exit_at(loops):
    """A stand-in for exits.score_at_exit whose rows exit at the loops given, one per row: what it passes
    on is each row's (exit loop, exits seen so far)."""
    def score(model, policy, z, logits, prev=None):
        prev = (torch.tensor([[k, 0] for k in loops]) if prev is None else prev) + torch.tensor([0, 1])
        return (prev[:, 0] <= prev[:, 1]).float(), prev  # >= the threshold 0.5 from loop loops[b] on
    return score


def visits(m, cache, tok, pos, R):
    """What tokens tok (B, 1) compute at pos when they run all R loops after the cache's history (on a copy
    of it): the input of every (loop, layer) visit {(k, j): (B, 1, C)} and the states {k: h_k}."""
    inputs, states, K = {}, {}, m.config.n_layer
    # (hooks that return None: the block runs as it would)
    hooks = [block.register_forward_pre_hook(lambda mod, args, j=j: inputs.__setitem__(
        (len(inputs) // K + 1, j), args[0])) for j, block in enumerate(m.transformer.h)]
    hooks.append(m.transformer.h[-1].register_forward_hook(
        lambda mod, args, out: states.__setitem__(len(states) + 1, out[0])))
    decode_step(m, tok, copy.deepcopy(cache), pos, R)
    for hook in hooks:
        hook.remove()
    return inputs, states


@pytest.mark.parametrize('kw', [dict(inter_loop_norm='layernorm', n_coda=1),
                                dict(injection='add', n_prelude=1),
                                dict(pos='rope', injection='add')])  # keys rotated at their own position
@pytest.mark.parametrize('policy,kv_slots', [('recompute', None), ('copy', None), ('active', None),
                                             ('shared', 2), ('shared', 3)])
def test_a_row_exiting_at_a_middle_loop_leaves_in_every_slot_what_its_policy_says(kw, policy, kv_slots,
                                                                                 monkeypatch):
    # rows 0 and 1 exit at loops 2 and 3 of R = 4; position 5 of every slot is pinned against what each visit
    # computes (the loops a row ran are those of a full-depth step up to its exit, even under shared slots).
    # A layernorm between loops, or the injection, makes carry(h, e) other than h: recompute must
    # start from what loop k+1 would read
    R, pos, K = 4, 5, 2
    m = tiny(**kw)
    with torch.no_grad():
        if kw.get('inter_loop_norm'):
            m.transformer.ln_loop.weight.uniform_(0.5, 1.5)
    seq = prompts(B=2, n=pos + 1, seed=4)
    cache = KVCache(m, 2, R, 'cpu', torch.float32, policy, kv_slots)
    decode_step(m, seq[:, :pos], cache, 0, R)
    monkeypatch.setattr(exits, 'score_at_exit', exit_at([2, 3]))
    with torch.no_grad():
        inputs, states = visits(m, cache, seq[:, pos:], pos, R)  # loop 1 reads e
        _, used = adaptive_forward(m, seq[:, pos:], cache, pos, R, 0.5, 'maxprob')
        rope = m.rope(pos, 1)
        def kv(x, j, b, block=None):
            block = block or m.transformer.h[j]
            return [t[b, :, 0] for t in block.attn.qkv(block.ln_1(x), rope)[1:]]
        assert used.tolist() == [2, 3]
        for b, exit_k in enumerate((2, 3)):
            want = {}  # (k, j) -> the K/V a later token reads at this visit, or None for 'not seen'
            for k in range(1, R + 1):
                for j in range(K):
                    if k <= exit_k:
                        want[k, j] = kv(inputs[k, j], j, b)
                    elif policy == 'recompute':
                        want[k, j] = kv(m.carry(states[exit_k], inputs[1, 0]), j, b)
                    elif policy == 'copy':
                        want[k, j] = kv(inputs[exit_k, j], j, b)
                    else:
                        want[k, j] = None
            if policy == 'shared':  # slot s holds the last loop this row ran in it, else its exit loop's
                for s in range(kv_slots):
                    ran = [k for k in range(1, exit_k + 1) if (k - 1) % kv_slots == s]
                    for j in range(K):
                        want[s + 1, j] = kv(inputs[ran[-1] if ran else exit_k, j], j, b)
                want = {key: w for key, w in want.items() if key[0] <= kv_slots}
            for (k, j), w in want.items():
                slot = cache.slot('loop', j, k)
                if policy == 'active':
                    assert bool(slot.reach[b, pos]) == (k <= exit_k), (b, k, j)
                    w = w if k <= exit_k else [torch.zeros_like(slot.key[b, :, pos])] * 2  # never written
                got = (slot.key[b, :, pos], slot.value[b, :, pos])
                assert all(torch.allclose(g, t, atol=1e-5) for g, t in zip(got, w)), (b, k, j)
            if m.config.n_coda:  # the coda's slot holds the K/V of the row's own exit state
                coda = cache.slot('coda', 0)
                w = kv(states[exit_k], 0, b, m.transformer.coda[0])
                assert torch.allclose(coda.key[b, :, pos], w[0], atol=1e-5)
                assert torch.allclose(coda.value[b, :, pos], w[1], atol=1e-5)


@pytest.mark.parametrize('policy', ['copy', 'shared', 'active'])
def test_batched_exits_under_each_policy_equal_decoding_each_row_alone(policy):
    m, x = tiny(readout='raw'), prompts(B=4, seed=3)
    with torch.no_grad():
        h1 = m.run(x, n_loop=1).states[0]
        t = m.readout(h1, 1).softmax(-1).amax(-1).median().item()  # about half the tokens exit at loop 1
    kw = dict(temperature=0, exit_threshold=t, kv_policy=policy, kv_slots=2)
    both, used, _ = generate(m, x, 8, Decoding(**kw))
    assert len(set(used[:, 1:].flatten().tolist())) > 1
    for b in range(4):
        alone, alone_used, _ = generate(m, x[b:b + 1], 8, Decoding(**kw))
        assert torch.equal(alone[0], both[b]) and torch.equal(alone_used[0], used[b]), b


def test_a_score_that_reaches_the_threshold_exactly_exits_there():
    # the rule is score >= threshold: a threshold set to exit 1's own maxprob stops the token at loop 1, and
    # the next float32 above it does not
    m, x, R = tiny(), prompts(B=1), 4

    def step(threshold):  # the last token of x after a fresh cache of the others: (logits, loops used)
        cache = KVCache(m, 1, R, 'cpu', torch.float32)
        decode_step(m, x[:, :-1], cache, 0, R)
        return adaptive_forward(m, x[:, -1:], cache, x.size(1) - 1, R, threshold, 'maxprob')

    logits, used = step(0.0)  # every maxprob is > 0: exit 1's logits
    score = exits.exit_score(logits, 'maxprob')[0]
    above = float(torch.nextafter(score, torch.tensor(1.0)))
    assert used.tolist() == [1.0] and step(float(score))[1].tolist() == [1.0]
    assert step(above)[1].item() > 1


def test_active_attention_sees_only_positions_that_reached_the_loop():
    m, x = tiny(), prompts(B=1)
    R = 4
    cache = KVCache(m, 1, R, 'cpu', torch.float32, 'active')
    decode_step(m, x, cache, 0, R)
    adaptive_step(m, x[:, -1:], cache, 4, R, 0.0, 'maxprob')            # position 4 exits at loop 1
    assert cache.slot('loop', 0, 1).reach[0, :5].all()
    assert cache.slot('loop', 0, 2).reach[0, :5].tolist() == [True] * 4 + [False]
    # the next token's loop 2 sees positions 0..3 and itself: 5 keys
    seen, slot = [], cache.slot('loop', 1, 2)
    update = slot.update

    def watch(k, v, pos):
        keys, values, mask = update(k, v, pos)
        seen.append(keys.size(2))
        return keys, values, mask

    slot.update = watch
    decode_step(m, x[:, :1], cache, 5, R)
    assert seen == [5]


# ---------------------------------------------------------------- past the block size

def cropped_by_hand(m, x, n_new, n_loop=None):
    """Greedy decoding by full recompute, cropping the context as generate does: when the window holds
    block_size tokens and a new one, it keeps its last block_size/2. Returns tokens and window starts."""
    start, starts = max(0, x.size(1) - T), []
    with torch.no_grad():
        for _ in range(n_new):
            if x.size(1) - start > T:
                start = x.size(1) - T // 2
            starts.append(start)
            logits, _ = m(x[:, start:], n_loop=n_loop)
            x = torch.cat((x, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    return x, starts


def logits_of_each_step(monkeypatch, *args, **kw):
    """generate(*args, **kw), the logits (B, V) each new token was picked from, and generate's counts."""
    seen, pick = [], engine.pick
    monkeypatch.setattr(engine, 'pick', lambda logits, *a: seen.append(logits.clone()) or pick(logits, *a))
    out, _, stats = generate(*args, Decoding(**kw))
    monkeypatch.undo()
    return out, seen, stats


@pytest.mark.parametrize('kw', [dict(), dict(pos='rope', n_prelude=1, n_coda=1, injection='add')])
def test_cached_decoding_past_the_block_size_equals_recompute_on_the_same_window(kw, monkeypatch):
    # the logits, not only the tokens: an untrained model repeats one token, which a stale cache gets right
    m, x = tiny(**kw), prompts(B=2)
    out, cached, stats = logits_of_each_step(monkeypatch, m, x, 60, temperature=0)
    ref, starts = cropped_by_hand(m, x, 60)
    assert torch.equal(out, ref)
    with torch.no_grad():
        for i, start in enumerate(starts):  # token i is picked after the window out[:, start:4 + i]
            want = m(out[:, start:4 + i])[0][:, -1]
            assert torch.allclose(cached[i], want, atol=1e-5), (i, start)
    # inside the first block the window is everything: plain uncached decoding, no crop
    assert starts[T - 4] == 0 and starts[T - 4 + 1] == T // 2 + 1
    _, uncached, _ = logits_of_each_step(monkeypatch, m, x, 60, temperature=0, use_cache=False)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(cached, uncached))
    # 4 + 60 tokens: the first slide when 17 are there, then every T/2 + 1 = 9 tokens: ~2N/T refills
    assert stats['refills'] == len(set(starts)) - 1 == 6


def test_refills_come_every_half_block():
    m, x = tiny(n_loop=1), prompts(B=1, n=T)  # a full first window: the first new token slides it
    for n in (40, 80, 160):
        stats = generate(m, x, n, Decoding(temperature=0))[2]
        # a window refilled with T/2 tokens slides again when it would hold T + 1: every T/2 + 1 tokens
        assert stats['refills'] == math.ceil((n - 1) / (T // 2 + 1)), n
        assert 0.8 * 2 * n / T <= stats['refills'] <= 2 * n / T


# ---------------------------------------------------------------- self-speculative decoding

@pytest.mark.parametrize('kw', [dict(), dict(pos='rope', n_prelude=1, n_coda=1, injection='concat',
                                             inter_loop_norm='rmsnorm', readout='final_only')])
def test_greedy_self_speculative_decoding_is_fixed_R_greedy_for_every_k_and_gamma(kw):
    m, x = tiny(**kw), prompts(B=2)
    if 'injection' in kw:
        with torch.no_grad():  # an adapter that mixes e in: other tokens at other depths
            m.transformer.adapter.weight.add_(0.5 * torch.randn_like(m.transformer.adapter.weight))
    fixed, _, _ = generate(m, x, 30, Decoding(temperature=0))  # 4 + 30 tokens: past the block size too
    rates = []
    for k in range(1, 4):
        for gamma in range(1, 5):
            out, used, stats = generate(m, x, 30, Decoding(temperature=0, draft_loops=k, speculate=gamma))
            assert torch.equal(out, fixed), (k, gamma)
            assert used.shape == (2, 30) and used.eq(4).all()
            assert 0 <= stats['accepted'] <= stats['checked'] <= stats['drafted']
            rates.append(stats['accepted'] / stats['checked'])
    assert 0 < max(rates) and min(rates) < 1  # drafts are both kept and rejected


def test_rejected_drafts_leave_nothing_stale_in_the_cache():
    # after a round, every kept position's slots hold what fixed-R decoding writes there
    m, x = tiny(n_coda=1), prompts(B=1, seed=2)
    fixed_cache = KVCache(m, 1, 4, 'cpu', torch.float32)
    out, _, _ = generate(m, x, 12, Decoding(temperature=0, draft_loops=1, speculate=4))
    decode_step(m, out[:, :-1], fixed_cache, 0, 4)
    spec_cache = KVCache(m, 1, 4, 'cpu', torch.float32)
    decode_step(m, x, spec_cache, 0, 4)
    pos, stats = 4, Counter()
    seq = out[:, :5]
    while seq.size(1) < out.size(1):
        gamma = min(4, out.size(1) - seq.size(1))
        new, counts = speculate_round(m, seq, spec_cache, pos, 4, 1, gamma, 0, None)
        stats.update(counts)
        seq = torch.cat((seq, new), dim=1)
        pos += new.size(1)
    assert torch.equal(seq, out) and stats['accepted'] < stats['checked']
    n = out.size(1) - 1  # positions 0..n-1 have run
    for part in ('prelude', 'loop', 'coda'):
        for a, b in zip(spec_cache.slots[part], fixed_cache.slots[part]):
            assert torch.allclose(a.key[:, :, :n], b.key[:, :, :n], atol=1e-6), part
            assert torch.allclose(a.value[:, :, :n], b.value[:, :, :n], atol=1e-6), part


def sharp(V=5, R=3):
    """A tiny-vocabulary model whose loops disagree: exit 1's next-token distribution is far from exit R's."""
    m = tiny_gpt(vocab_size=V, n_layer=1, n_loop=R, init='gpt2')
    with torch.no_grad():
        for name, p in m.transformer.h.named_parameters():
            # residual projections at 1/sqrt(2N) of the rest (N = 3), then all 30x: loops that disagree
            p.mul_((30.0 / math.sqrt(6) if name.endswith('c_proj.weight') else 30.0) if p.dim() == 2 else 1.0)
        m.lm_head.weight.mul_(20.0)
    return m.eval()


def hand_softmax(row, temperature, top_k=None):
    """exp(l / T) / sum over the top_k largest logits of one row (a list of floats), 0 elsewhere: by hand."""
    keep = sorted(range(len(row)), key=lambda i: -row[i])[:top_k or len(row)]
    w = [math.exp(row[i] / temperature) if i in keep else 0.0 for i in range(len(row))]
    return [x / sum(w) for x in w]


@pytest.mark.parametrize('temperature,top_k', [(0.8, None), (2.0, None), (0.5, 3), (1.0, 2), (1.7, 4)])
def test_sampling_distribution_is_softmax_of_logits_over_temperature(monkeypatch, temperature, top_k):
    # sample.py's default T = 0.8 sharpens: logits / T, not logits * T (which would sample at 1 / T = 1.25);
    # top_k keeps the k largest logits and renormalises. The expected rows are computed by hand, and pick
    # must hand exactly that distribution to the sampler
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0, -2.5], [0.3, 0.2, -0.4, 1.1, -3.0, 2.2]])
    expected = torch.tensor([hand_softmax(row, temperature, top_k) for row in logits.tolist()])
    assert torch.allclose(engine.probs(logits.clone(), temperature, top_k), expected, atol=1e-6)
    seen, multinomial = [], torch.multinomial
    monkeypatch.setattr(torch, 'multinomial', lambda p, *a, **k: seen.append(p.clone())
                        or multinomial(p, *a, **k))
    token = engine.pick(logits.clone(), temperature, top_k)
    assert torch.allclose(seen[0], expected, atol=1e-6)
    assert token.shape == (2, 1) and all(expected[b, token[b, 0]] > 0 for b in range(2))  # none cropped


def exact_pairs(m, x, n_loop, temperature=1.0, top_k=None):
    """P(t2, t3) (V, V) of tokens 2 and 3 sampled after x (logits / temperature, top_k kept), enumerated."""
    V = m.config.vocab_size
    p = lambda seq: engine.probs(m(seq, n_loop=n_loop)[0][:, -1], temperature, top_k)[0]
    out = torch.zeros(V, V)
    with torch.no_grad():
        p1 = p(x)
        for t1 in range(V):
            s1 = torch.cat((x, torch.tensor([[t1]])), 1)
            p2 = p(s1)
            for t2 in range(V):
                out[t2] += p1[t1] * p2[t2] * p(torch.cat((s1, torch.tensor([[t2]])), 1))
    return out


def chi2(counts, expected):
    """Pearson's statistic over cells expecting >= 5 (the rest pooled) and its 0.999 quantile."""
    big = expected >= 5
    obs = torch.cat((counts[big], counts[~big].sum()[None]))
    exp = torch.cat((expected[big], expected[~big].sum()[None]))
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum().item()
    df = int(keep.sum()) - 1
    z = 3.09  # Wilson-Hilferty: the chi-square quantile from the normal one
    return stat, df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize('k,gamma,batch,temperature,top_k', [
    (1, 2, False, 1.0, None), (2, 3, False, 1.0, None), (1, 2, True, 1.0, None), (2, 2, True, 0.7, 3)])
def test_speculative_sampling_follows_fixed_R_sampling(k, gamma, batch, temperature, top_k):
    # at temperature 0.7 with top_k = 3 of 5 tokens too: a draft drawn at temperature 1 or from all 5 tokens
    # (while accepted against the sharpened, cropped q) samples from another distribution
    m, x = sharp(), torch.tensor([[0, 1, 2, 3]])
    target, draft = exact_pairs(m, x, 3, temperature, top_k), exact_pairs(m, x, k, temperature, top_k)
    N = 4000 if batch else 1500  # batched rows are cheap: more of them resolve a smaller error
    stats = Counter()
    if batch:  # rows in one batch (a round keeps tokens up to the first row's rejection)
        torch.manual_seed(0)
        out, _, stats = generate(m, x.expand(N, -1), 3, Decoding(temperature=temperature, top_k=top_k,
                                                                 draft_loops=k, speculate=gamma))
    else:      # one sequence per seed: later drafts are accepted too
        runs = []
        for seed in range(N):
            torch.manual_seed(seed)
            out, _, counts = generate(m, x, 3, Decoding(temperature=temperature, top_k=top_k, draft_loops=k,
                                      speculate=gamma))
            runs.append(out)
            stats.update(counts)
        out = torch.cat(runs)
    counts = torch.zeros(5, 5)
    counts.index_put_((out[:, 5], out[:, 6]), torch.ones(N), accumulate=True)
    stat, bound = chi2(counts.flatten(), N * target.flatten())
    assert stat < bound, (stat, bound)
    # the test can tell: the drafts alone are far from it (and some are rejected)
    assert chi2(N * draft.flatten(), N * target.flatten())[0] > 3 * bound
    assert 0 < stats['accepted'] < stats['checked']


# ---------------------------------------------------------------- sample.py

def test_sample_reports_tokens_per_second_loops_and_acceptance(tiny_data, tiny_ckpt, monkeypatch):
    import re
    monkeypatch.chdir(tiny_data.parent.parent)
    base = [f'--out_dir={tiny_ckpt}', '--num_samples=2', '--max_new_tokens=12', '--device=cpu',
            '--temperature=0', '--n_loop=3']
    code, fixed, err = run_main(base)
    assert code == 0, err  # plain decoding has its tokens/s too: the baseline of the others
    assert re.search(r'24 tokens in [\d.]+ s \([\d.]+ tokens/s\), 3 loops per token$', fixed.strip()), fixed
    code, spec, err = run_main(base + ['--draft_loops=1', '--speculate=3'])
    assert code == 0, err
    m = re.search(r'3 loops per token, (\d+) of (\d+) drafts accepted \((\d+)%\)', spec)
    assert m and int(m.group(1)) <= int(m.group(2))
    assert re.search(r'24 tokens in [\d.]+ s \([\d.]+ tokens/s\), 3 loops per token', spec)
    texts = lambda out: out[out.index('\n', out.index('sampling ')) + 1:].split('---------------\n')[:-1]
    assert len(texts(spec)) == 2 and texts(spec) == texts(fixed)            # greedy: the same text
    for policy in ('copy', 'shared', 'active'):
        slots = ['--kv_slots=2'] if policy == 'shared' else []
        code, out, err = run_main(base + ['--exit_threshold=0.5', f'--kv_policy={policy}', *slots])
        assert code == 0 and 'mean loops used per token' in out and 'tokens/s' in out, err


@pytest.mark.parametrize('args,says', [
    (['--kv_policy=latest'], "--kv_policy='latest': choose one of recompute, copy, shared, active"),
    (['--kv_policy=shared', '--kv_slots=-1'], '--kv_slots=-1: must be >= 0'),
    (['--kv_policy=shared', '--kv_slots=0'], '--kv_policy=shared needs --kv_slots=N'),
    (['--kv_policy=shared'], '--kv_policy=shared needs --kv_slots=N'),
    (['--kv_policy=shared', '--kv_slots=3'], 'at most 2 slots'),
    (['--kv_slots=2'], 'sets the slots of --kv_policy=shared: add it'),
    (['--kv_policy=copy'], 'add --exit_threshold'),
    (['--draft_loops=2'], 'fewer loops than the 2'),
    (['--draft_loops=1', '--speculate=0'], '--speculate=0: must be >= 1'),
    (['--draft_loops=-1'], '--draft_loops=-1: must be >= 0'),
    (['--speculate=2'], 'add --draft_loops'),
    (['--draft_loops=1', '--exit_threshold=0.5'], 'drop --exit_threshold'),
    (['--draft_loops=1', '--kv_policy=shared', '--kv_slots=1'], 'drop --kv_policy=shared'),
    (['--draft_loops=1', '--compile=True'], 'no --compile'),
    (['--compile=1'], '--compile'),
])
def test_bad_decoding_flags_are_one_line_errors(tiny_data, tiny_ckpt, monkeypatch, args, says):
    monkeypatch.chdir(tiny_data.parent.parent)
    code, _, err = run_main([f'--out_dir={tiny_ckpt}', '--max_new_tokens=4', '--device=cpu', *args])
    assert code not in (0, None) and err.startswith('error: ') and err.count('\n') == 1, err
    assert says in err, err


@pytest.mark.parametrize('k', [1, 3])
def test_verification_runs_the_drafted_positions_in_one_pass_with_fixed_R_logits(k, monkeypatch):
    # a round of 4 drafts after a 5-token prompt: loops k+1..R see the 4 positions as one multi-token step
    # at pos 5 (no other step there has T > 1), and their exit-R logits are the full forward's
    from decoding import engine
    m, x = tiny(n_prelude=1, n_coda=1, pos='rope', injection='add'), prompts(B=2, n=5, seed=3)
    cache = KVCache(m, 2, 4, 'cpu', torch.float32)
    decode_step(m, x, cache, 0, 4)
    verified, verify = [], engine.verify  # (positions verified, their logits) of each call

    def spy(model, state, cache, pos, k, R):
        verified.append((state[0].size(1), verify(model, state, cache, pos, k, R)))
        return verified[-1][1]
    monkeypatch.setattr(engine, 'verify', spy)
    block = m.transformer.h[0].attn
    seen = []
    monkeypatch.setattr(block, 'forward', lambda x, *a, f=block.forward: seen.append(x.size(1)) or f(x, *a))
    x_last = torch.cat((x, x[:, -1:]), 1)  # a last token at pos 5 that has not run yet
    speculate_round(m, x_last, cache, 5, 4, k, 4, 0, None)
    # the first layer's visits: 4 drafts one by one (k loops each), then loops k+1..R once over all 4
    assert [n for n, _ in verified] == [4] and seen == [1] * 4 * k + [4] * (4 - k)
    # the drafts are exit k's greedy picks: rebuild them with the full forward, then exit R's logits
    drafted = [x_last[:, -1:]]
    with torch.no_grad():
        for i in range(3):
            seq = torch.cat([x_last] + drafted[1:], 1)
            drafted.append(m.readout(m.run(seq, n_loop=k).states[-1], k)[:, -1:].argmax(-1))
        seq = torch.cat([x_last] + drafted[1:], 1)  # (2, 9): the prompt, its last token, 3 drafts
        full = m.readout(m.run(seq).states[-1], 4)[:, 5:9]
    assert torch.allclose(verified[0][1], full, atol=1e-5)


# ---------------------------------------------------------------- exit scores, pinned on fixed numbers

class FixedGate:
    """A stand-in model whose learned gate says lambda = lam[k] at exit k (z is the exit's index)."""
    def __init__(self, lam):
        self.lam = torch.tensor(lam)

    def gate(self, z):
        return self.lam[z]


def test_each_exit_score_has_its_formula_on_fixed_logits():
    # 4 tokens with logits (3, 1, 0.5, -1) at exit 1 and (2, 2.5, 0, 0) at exit 2: top1 - top2 is 2 and
    # 0.5 (top1 - top3 would be 2.5 and 2), the two KLs differ with their direction
    first, second = torch.tensor([[3.0, 1.0, 0.5, -1.0]]), torch.tensor([[2.0, 2.5, 0.0, 0.0]])
    p = first.softmax(-1)
    torch.testing.assert_close(exits.exit_score(first, 'maxprob'), p.max(-1).values)
    torch.testing.assert_close(exits.exit_score(first, 'margin'), torch.tensor([2.0]))
    torch.testing.assert_close(exits.exit_score(second, 'margin'), torch.tensor([0.5]))
    H = -(p * p.log()).sum(-1)
    torch.testing.assert_close(exits.exit_score(first, 'entropy'), 1 - H / math.log(4))
    # kl: -KL(p_1 || p_2), the earlier exit's distribution first; -inf at exit 1, where none came before
    s1, prev = exits.score_at_exit(None, 'kl', None, first)
    s2, _ = exits.score_at_exit(None, 'kl', None, second, prev)
    q = second.softmax(-1)
    forward, backward = (p * (p / q).log()).sum(-1), (q * (q / p).log()).sum(-1)
    assert bool(torch.isneginf(s1).all()) and abs(float(forward - backward)) > 0.1
    torch.testing.assert_close(s2, -forward)
    # gate: 1 - prod_{j<=k} (1 - lambda_j), the chance of having exited by exit k (not lambda_k alone)
    gate, got, prev = FixedGate([0.2, 0.5, 0.1]), [], None
    for k in range(3):
        score, prev = exits.score_at_exit(gate, 'gate', k, None, prev)
        got.append(float(score))
    assert got == pytest.approx([0.2, 1 - 0.8 * 0.5, 1 - 0.8 * 0.5 * 0.9])


@pytest.mark.parametrize('kw', [dict(exit_threshold=0.5), dict(draft_loops=1)])
def test_hyper_connection_lanes_refuse_early_exits_and_drafts_in_one_line(kw):
    # the lanes are carried from loop 1 within one pass (docs/papers.md §3): a token that runs loop k apart
    # from loops 1..k-1 (an exit test between loops, a verify pass after a draft) has no lanes to read
    m = tiny(hyper_lanes=2, inter_loop_norm='rmsnorm')
    options = dict(exit_threshold=None, exit_policy='maxprob', kv_policy='recompute', kv_slots=0,
                   draft_loops=0, speculate=None) | kw
    why = Decoding(**options).why_not(m.config)
    assert 'hyper-connection lanes' in why and '\n' not in why
    with pytest.raises(AssertionError, match='hyper_lanes'):
        generate(m, prompts(B=1), 2, Decoding(**kw))
