"""batching.py: continuous depth batching. Rows at different loops share each block call, each reading and
writing the cache slots of its own (loop, layer) visit at its own position; a finished row takes the next
prompt. Every row decodes what it would decode alone."""
import pytest
import torch

from compute import kernels
from decoding import batching
from decoding import exits
from decoding.batching import serve
from decoding.engine import Decoding, generate
from conftest import REPO
from test_engine import V, tiny  # the engine tests' tiny model (V 48, block 16)
from test_sample import run_main


def prompts(lengths=(3, 5, 2, 7, 4), seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in lengths]


def alone(m, p, n, **kw):
    """generate's decoding of prompt p by itself: its tokens and the loops each new token used."""
    out, used, _ = generate(m, torch.tensor([p]), n, Decoding(temperature=0, **kw))
    return out[0].tolist(), used[0].tolist()


def test_a_key_mask_per_row_is_attention_over_that_rows_own_keys():
    q, k, v = (torch.randn(3, 2, n, 8) for n in (1, 6, 6))
    lengths = [2, 6, 4]
    keep = (torch.arange(6) < torch.tensor(lengths)[:, None])[:, None, None, :]
    got = kernels.attention(q, k, v, False, keep=keep)
    for b, n in enumerate(lengths):
        want = kernels.attention(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], False)
        torch.testing.assert_close(got[b:b + 1], want)


@pytest.mark.parametrize('kw', [dict(), dict(pos='rope', n_prelude=1, n_coda=1, injection='add'),
                                dict(readout='final_only', inter_loop_norm='rmsnorm', injection='concat')])
def test_with_an_unreachable_threshold_every_row_decodes_its_prompt_as_alone(kw):
    # 5 prompts of other lengths on 3 rows, 30 tokens each: past the block size, so every window slides.
    # Norm weights and biases at random: a readout norm skipped (final_only's at exit R) moves the argmax
    m, ps = tiny(random_norms=True, **kw), prompts()
    outs, used, stats = serve(m, ps, 30, Decoding(batch_size=3, temperature=0, exit_threshold=1e9,
                              exit_policy='margin'))
    for p, out, u in zip(ps, outs, used):
        assert (out, u) == alone(m, p, 30)
    assert stats['refills'] > len(ps)


@pytest.mark.parametrize('kv_policy,kv_slots', [('recompute', None), ('copy', None), ('shared', 2)])
@pytest.mark.parametrize('policy,threshold', [('maxprob', 0.05), ('margin', 0.2), ('entropy', 0.02),
                                              ('kl', 1e-2)])
def test_with_a_real_threshold_each_row_exits_and_decodes_as_at_batch_1(kv_policy, kv_slots, policy,
                                                                       threshold):
    # rows exit at other loops in the same call; each leaves in its skipped slots what its policy says, so
    # its later tokens see what they would see alone (copy and shared mean what they mean at batch 1)
    m, ps = tiny(pos='rope', n_coda=1, injection='add'), prompts()
    with torch.no_grad():  # a readout a tenth as sure: its scores reach the thresholds at other loops
        m.lm_head.weight.mul_(0.1)
    kw = dict(exit_threshold=threshold, exit_policy=policy, kv_policy=kv_policy, kv_slots=kv_slots)
    outs, used, _ = serve(m, ps, 20, Decoding(batch_size=4, temperature=0, **kw))
    loops = [k for u in used for k in u[1:]]  # (the first token of each prompt runs every loop)
    assert len(set(loops) - {4}) >= 2  # the rows really exit early, at other loops
    for p, out, u in zip(ps, outs, used):
        assert (out, u) == alone(m, p, 20, **kw)


@pytest.mark.parametrize('kv_policy,kv_slots', [('recompute', None), ('copy', None), ('shared', 3)])
@pytest.mark.parametrize('lengths,n', [((3, 5, 2, 7, 4), 20), ((2, 2, 12, 12, 2, 2, 12, 12), 3)])
def test_a_skipped_slot_is_filled_before_the_rows_next_token_reads_it(kv_policy, kv_slots, lengths, n,
                                                                      monkeypatch):
    # the exits of two calls fill their skipped slots together, and no later: a token that exits at loop
    # 1 has its loop-2 slot read by the next token two calls on. Values no token wrote hold 1e4 here (their
    # keys 0), so a read before the fill would change the texts and exits; nor may a finished row's fill
    # land on the next prompt's slots (short requests, then long prompts). The score is a hash of z_k, so
    # that tokens exit at every loop (the random model's maxprob exits at loop 1 or not at all)
    class Poisoned(batching.KVCache):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            self.loop_value.fill_(1e4)
    def hashed(model, policy, z, logits, prev=None):
        return (z.sum(-1) * 3).frac().abs(), None
    monkeypatch.setattr(batching, 'KVCache', Poisoned)
    monkeypatch.setattr(exits, 'score_at_exit', hashed)
    owner = spy_on_fills(monkeypatch)
    m, ps = tiny(pos='rope', n_coda=1, injection='add'), prompts(lengths)
    kw = dict(exit_threshold=0.7, exit_policy='maxprob', kv_policy=kv_policy, kv_slots=kv_slots)
    outs, used, _ = serve(m, ps, n, Decoding(batch_size=2, temperature=0, **kw))
    loops = [k for u in used for k in u[1:]]
    assert set(loops) == {1, 2, 3, 4}  # tokens exit at every loop
    for p, out, u in zip(ps, outs, used):
        assert (out, u) == alone(m, p, n, **kw)
    # a single slot overwritten in a long prompt seldom moves a greedy token of the random model, so the
    # texts alone let a misplaced fill through: every fill lands on the request whose token exited (or on
    # a row no request holds yet), and the case is reached: finished rows' fills still pending at a pass
    assert owner['fills'] and owner['misplaced'] == [] and owner['finished'] > 0


def spy_on_fills(monkeypatch):
    """Records, for every skipped-slot fill of serve, the request that held the cache row when the token
    exited and the one holding it at the fill: 'misplaced' lists the fills onto another request's row,
    'finished' counts the fills of finished requests' exits (their rows free, waiting for a prompt)."""
    seen, requests, step, fill = {'fills': 0, 'misplaced': [], 'finished': 0}, [], batching.step, \
        exits.fill_skipped
    exited = {}  # (cache row, position) -> the request whose token there exited early

    class Held(batching.Requests):
        def __init__(self, *args):
            super().__init__(*args)
            requests.append(self)

    def spied_step(model, cache, f, R, *args):
        out = step(model, cache, f, R, *args)
        for c, p, k, d in zip(f.rows.tolist(), f.pos.tolist(), out[1].tolist(), out[4].tolist()):
            if d and k < R:
                exited[c, p] = requests[-1].row[c]
        return out

    def spied_fill(model, cache, rows, h, e, exit_k, pos, R):
        if torch.is_tensor(rows):  # depth batching's (batch 1 passes ints)
            for c, p in zip(rows.tolist(), pos.tolist()):
                seen['fills'] += 1
                now = requests[-1].row[c]
                seen['finished'] += now is None
                if now is not None and now != exited[c, p]:
                    seen['misplaced'].append((c, p, exited[c, p], now))
        return fill(model, cache, rows, h, e, exit_k, pos, R)
    monkeypatch.setattr(batching, 'Requests', Held)
    monkeypatch.setattr(batching, 'step', spied_step)
    monkeypatch.setattr(exits, 'fill_skipped', spied_fill)
    return seen


def test_the_learned_gate_exits_as_at_batch_1():
    m = tiny(exit_gate='learned')
    with torch.no_grad():
        m.exit_gate.bias.fill_(-1.0)  # lambda near 0.27: rows leave after one, two or more loops
    ps = prompts()
    outs, used, _ = serve(m, ps, 20, Decoding(batch_size=3, temperature=0, exit_threshold=0.5,
                                              exit_policy='gate'))
    for p, out, u in zip(ps, outs, used):
        assert (out, u) == alone(m, p, 20, exit_threshold=0.5, exit_policy='gate')


def test_rows_at_different_loops_share_one_block_call(monkeypatch):
    m, ps, seen = tiny(), prompts(), []
    advance = m.advance

    def spy(h, e, k, cache, pos):  # a call of serve: each row at its own loop k
        seen.append(k.clone())
        return advance(h, e, k, cache, pos)
    monkeypatch.setattr(m, 'advance', spy)
    outs, used, stats = serve(m, ps, 12, Decoding(batch_size=3, temperature=0, exit_threshold=1e-3,
                                                  exit_policy='kl'))
    assert stats['calls'] == len(seen)
    assert any(len(set(ks.tolist())) > 1 for ks in seen)  # one call, rows at other loops
    # every loop a row ran is one row of one call, but the prefills': a prompt's (its first token) and a
    # sliding window's (R loops each)
    assert sum(ks.numel() for ks in seen) == sum(sum(u[1:]) for u in used) - 4 * stats['refills']
    # full: the share of the calls' places that held a row (below 1 in the tail, as rows run out)
    assert stats['full'] == pytest.approx(sum(ks.numel() for ks in seen) / (3 * len(seen)))
    assert stats['full'] < 1


def test_a_freed_row_takes_the_next_prompt_and_outputs_keep_the_prompts_order():
    m, ps = tiny(), prompts(lengths=(2, 9, 4, 3, 6, 5, 8))
    outs, used, _ = serve(m, ps, 6, Decoding(batch_size=2, temperature=0, exit_threshold=0.06))
    assert [o[:len(p)] for o, p in zip(outs, ps)] == ps and all(len(u) == 6 for u in used)
    assert serve(m, ps, 0, Decoding(batch_size=2))[0] == ps  # nothing asked: the prompts come back


def test_prompts_take_their_passes_a_batch_at_a_time_while_rows_free_one_by_one():
    # 8 prompts on 2 rows whose tokens exit at other loops: the rows free at other calls, yet the prompts
    # go through their prompt pass two at a time (the second waits, passed, for the next free row)
    m, ps = tiny(), prompts(lengths=(3, 5, 2, 7, 4, 6, 3, 5))
    kw = dict(exit_threshold=1e-3, exit_policy='kl')
    outs, used, stats = serve(m, ps, 6, Decoding(batch_size=2, temperature=0, **kw))
    assert stats['refills'] == 0 and stats['passes'] == 4
    assert len({sum(u) for u in used}) > 1  # the requests took other numbers of calls
    for p, out, u in zip(ps, outs, used):
        assert (out, u) == alone(m, p, 6, **kw)


def test_a_prompt_pass_runs_at_most_batch_size_rows_when_slid_windows_wait_beside_free_rows(monkeypatch):
    # prompts near the block size (16) slide while others finish: the rows whose window slid pass first,
    # and new prompts fill only what is left of the batch; each request decodes as alone
    m, ps = tiny(), prompts(lengths=(14, 3, 15, 2, 13, 4, 12, 5), seed=2)
    sizes, decode_step = [], batching.decode_step
    monkeypatch.setattr(batching, 'decode_step', lambda m, idx, *a: sizes.append(idx.size(0))
                        or decode_step(m, idx, *a))
    kw = dict(exit_threshold=0.06)
    outs, used, stats = serve(m, ps, 10, Decoding(batch_size=2, temperature=0, **kw))
    assert stats['refills'] > 0 and max(sizes) <= 2, sizes
    for p, out, u in zip(ps, outs, used):
        assert (out, u) == alone(m, p, 10, **kw)


@pytest.mark.parametrize('kw,says', [(dict(hyper_lanes=2, inter_loop_norm='rmsnorm'), 'hyper-connections'),
                                     (dict(injection='iso'), "injection='iso'"),
                                     (dict(n_expert=4, tied_routing=True), 'tied routing')])
def test_models_whose_loop_is_more_than_its_slots_are_refused_in_one_line(kw, says):
    why = Decoding(batch_size=2).why_not(tiny(**kw).config)
    assert says in why and '--batch_size=1' in why and '\n' not in why
    assert 'active' in Decoding(batch_size=2, kv_policy='active', exit_threshold=0.5).why_not(tiny().config)
    assert 'draft_loops' in Decoding(batch_size=2, kv_policy='copy', draft_loops=1).why_not(tiny().config)


def test_sample_decodes_a_file_of_prompts_in_order_with_rows_in_flight(tiny_data, tiny_ckpt, tmp_path,
                                                                     monkeypatch):
    monkeypatch.chdir(tiny_data.parent.parent)
    lines = ['ROMEO:', 'JULIET: my', '', 'KING HENRY:', 'the']  # a blank line is skipped
    (tmp_path / 'p.txt').write_text('\n'.join(lines) + '\n', encoding='utf-8')
    base = [f'--out_dir={tiny_ckpt}', f"--prompts={tmp_path / 'p.txt'}", '--max_new_tokens=10',
            '--device=cpu', '--temperature=0', '--exit_threshold=0.3']
    code, batched, err = run_main(base + ['--batch_size=3'])
    assert code == 0, err
    texts = lambda out: out.split('\n', 1)[1].split('\n---------------\n')[:-1]  # after the header line
    asked = [line for line in lines if line]
    assert [t[:len(p)] for t, p in zip(texts(batched), asked)] == asked and len(texts(batched)) == 4
    assert all(len(t) == len(p) + 10 for t, p in zip(texts(batched), asked))
    assert 'mean loops used per token' in batched and '3 rows in flight' in batched
    code, one_at_a_time, _ = run_main(base)  # batch 1: the same texts
    assert code == 0 and texts(one_at_a_time) == texts(batched) and 'rows in flight' not in one_at_a_time


@pytest.mark.parametrize('args,says', [(['--start=x'], 'drop --start'), (['--batch_size=0'], 'must be >= 1'),
                                       (['--batch_size=2', '--draft_loops=1'], '--draft_loops'),
                                       (['--batch_size=2', '--kv_policy=active', '--exit_threshold=0.5'],
                                        'kv_policy=active')])
def test_sample_refuses_what_rows_in_flight_cannot_do_in_one_line(tiny_data, tiny_ckpt, tmp_path, monkeypatch,
                                                                  args, says):
    monkeypatch.chdir(tiny_data.parent.parent)
    (tmp_path / 'p.txt').write_text('ROMEO:\nthe\n', encoding='utf-8')
    code, _, err = run_main([f'--out_dir={tiny_ckpt}', f"--prompts={tmp_path / 'p.txt'}", '--device=cpu',
                             *args])
    assert code == 1 and says in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize('autocast', [True, False])
def test_rows_in_flight_decode_under_bf16_autocast_and_in_bf16_weights(autocast):
    # AMP computes keys, values and states in bf16 while the cache and the rows' buffers keep the weights'
    # dtype; a batch-1 early exit and a batched one both write through the cache's own dtype
    m, ps = tiny(), prompts()
    if not autocast:
        m = m.to(torch.bfloat16)
    with torch.autocast('cpu', dtype=torch.bfloat16, enabled=autocast):
        outs, used, _ = serve(m, ps, 8, Decoding(batch_size=3, temperature=0, exit_threshold=0.06))
        generate(m, torch.tensor([p[:2] for p in ps]), 4, Decoding(temperature=0, exit_threshold=0.06))
    assert all(len(u) == 8 for u in used) and all(len(o) == len(p) + 8 for o, p in zip(outs, ps))


def test_serve_bench_times_every_path_against_fixed_r_generate_in_one_table(tiny_data, tiny_ckpt,
                                                                             tmp_path, monkeypatch, capsys):
    import serve_bench
    monkeypatch.chdir(tiny_data.parent.parent)
    (tmp_path / 'p.txt').write_text('ROMEO: hi\nJULIET: yes\n\nthe king\nKING: no\n', encoding='utf-8')
    serve_bench.main([str(tiny_ckpt), f"--prompts={tmp_path / 'p.txt'}", '--prompt_chars=4', '--batch_size=2',
                      '--max_new_tokens=5', '--repeats=2', '--thresholds=0.05,0.999', '--kv_policy=copy'])
    out = capsys.readouterr().out
    assert '4 prompts, 5 new tokens each, batch 2' in out and 'medians of 2' in out
    rows = [[c.strip() for c in line.split('|')[1:-1]] for line in out.splitlines()[3:]]
    assert [r[0] for r in rows] == [serve_bench.FIXED, 'fixed-R through serve',
                                    'serve, copy, maxprob >= 0.05', 'serve, copy, maxprob >= 0.999']
    R = int(out.split(' R ')[1].split(',')[0])
    served = float(rows[1][4][:-1])  # fixed-R through serve's speed-up over fixed-R generate
    for name, loops, seconds, tok_s, speedup, of_ideal, of_served, full, steady, steady_of in rows:
        assert steady == steady_of == '-'  # 4 prompts at batch 2: none start after the 4th finishes
        median, spread = seconds.split(' ')
        m = float(median)  # (to 0.01 s): new tokens / s is the 4 prompts' 5 tokens each over the median
        assert 20 / (m + 0.005) <= float(tok_s) + 0.05 and float(tok_s) - 0.05 <= 20 / max(m - 0.005, 1e-9)
        low, high = map(float, spread.strip('()').split('-'))
        assert low <= float(median) <= high
        # the fraction of the ideal is the speed-up over fixed-R generate divided by R / mean loops; the
        # next column takes the speed-up over serve with no threshold (sample.py's fixed depth) instead
        assert float(of_ideal) == pytest.approx(float(speedup[:-1]) * float(loops) / R, abs=0.011)
        assert float(of_served) == pytest.approx(float(of_ideal) / served, rel=0.03, abs=0.011)
        assert full == '-' if name == serve_bench.FIXED else 0 < float(full) <= 1
    assert rows[0][4] == '1.00x' and float(rows[0][1]) == float(rows[1][1]) == R
    assert rows[1][7] == '1.00'  # at fixed R the rows of one length move in step: every call runs full
    assert float(rows[2][1]) < float(rows[3][1])  # a lower threshold exits earlier


def test_serve_bench_pairs_compiled_with_eager_by_round(tiny_data, tiny_ckpt, tmp_path, monkeypatch,
                                                          capsys):
    # a round's two timings share the machine's state: the claim "compiled >= eager" is judged on the
    # ratios of the rounds and their t-interval, not on two medians taken apart
    import serve_bench
    from verdict import mean_ci
    eager, comp = [2.0, 3.0, 2.5], [1.0, 3.0, 2.0]  # ratios 2, 1, 1.25
    served, compiled = serve_bench.SERVED, serve_bench.SERVED + serve_bench.COMPILED
    line = serve_bench.paired({served: (eager,), compiled: (comp,)})
    m, lo, hi = mean_ci([2.0, 1.0, 1.25])
    assert '2.000 1.000 1.250' in line and f"mean {m:.3f}, 95 % CI [{lo:.3f}, {hi:.3f}] over 3 rounds" in line
    assert lo < 1 < hi  # three rounds this spread decide nothing
    monkeypatch.chdir(tiny_data.parent.parent)
    (tmp_path / 'p.txt').write_text('ROMEO: hi\nJULIET: yes\n', encoding='utf-8')
    serve_bench.main([str(tiny_ckpt), f"--prompts={tmp_path / 'p.txt'}", '--prompt_chars=4', '--batch_size=2',
                      '--max_new_tokens=3', '--repeats=1', '--fixed_only'])
    rows = [line.split('|')[1].strip() for line in capsys.readouterr().out.splitlines()[3:]]
    assert rows == [serve_bench.FIXED, serve_bench.SERVED]  # --fixed_only: no threshold's path


@pytest.mark.parametrize('args,says', [(['--thresholds=2'], 'outside [0, 1]'),
                                       (['--repeats=0'], 'must be >= 1'),
                                       (['--kv_policy=active'], 'kv_policy=active'),
                                       (['--prompts=nope.txt'], 'No such file')])
def test_serve_bench_refuses_bad_input_in_one_line(tiny_data, tiny_ckpt, tmp_path, monkeypatch, capsys, args,
                                                   says):
    import serve_bench
    monkeypatch.chdir(tiny_data.parent.parent)
    (tmp_path / 'p.txt').write_text('ROMEO:\n', encoding='utf-8')
    with pytest.raises(SystemExit) as e:
        serve_bench.main([str(tiny_ckpt), f"--prompts={tmp_path / 'p.txt'}", *args])
    err = capsys.readouterr().err
    assert e.value.code == 1 and says in err and len(err.strip().splitlines()) == 1


def test_serve_bench_answers_help_with_its_flags(capsys):
    import serve_bench
    with pytest.raises(SystemExit) as e:
        serve_bench.main(['--help'])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert all(f in out for f in ('--prompts', '--thresholds', '--kv_policy', '--repeats'))


@pytest.mark.parametrize('kw,opts', [(dict(), dict(exit_threshold=1e9, exit_policy='margin')),
                                     (dict(readout='final_only', pos='rope', n_coda=1, injection='add'),
                                      dict(exit_threshold=1e-2, exit_policy='kl'))])
def test_the_decode_step_reads_nothing_back_to_the_host(kw, opts, monkeypatch):
    # the step of depth batching (every place one loop, readout, exit score, who exits) is a function of
    # tensors: a host read planted in it (item, tolist, bool or int of a tensor) fails here
    m, ps, steps = tiny(**kw), prompts(), []
    plain = batching.step

    def guarded(*args):
        def sync(*a, **k):
            raise AssertionError('a host sync inside the decode step')
        with monkeypatch.context() as mp:
            for name in ('item', 'tolist', '__bool__', '__int__'):
                mp.setattr(torch.Tensor, name, sync)
            steps.append(plain(*args))
        return steps[-1]
    monkeypatch.setattr(batching, 'step', guarded)
    outs, used, _ = serve(m, ps, 8, Decoding(batch_size=3, temperature=0, **opts))
    assert steps and all(len(u) == 8 for u in used)
    real = m.exit

    def planted(h, k, *args):
        if torch.is_tensor(k):  # the step's exits (a prompt pass's is exit R for every row)
            int(k.max())  # a host read, as an exit decision read back at every call would be
        return real(h, k, *args)
    monkeypatch.setattr(m, 'exit', planted)
    with pytest.raises(AssertionError, match='host sync'):
        serve(m, ps, 2, Decoding(batch_size=3, temperature=0, **opts))


@pytest.mark.parametrize('opts', [dict(), dict(exit_threshold=0.05, exit_policy='maxprob'),
                                  dict(exit_threshold=1e-2, exit_policy='kl', kv_policy='copy')],
                         ids=['fixed', 'maxprob', 'kl'])
def test_the_decode_step_compiles_as_one_graph_and_decodes_as_eager(opts, monkeypatch):
    # fullgraph=True: a graph break (a host read, a Python branch on a tensor) raises instead of splitting
    # the step. Dynamo's own 'eager' backend checks the capture in seconds; the kernels are torch's either
    # way.
    torch._dynamo.reset()
    m, ps = tiny(pos='rope', n_coda=1, injection='add'), prompts()
    with torch.no_grad():
        m.lm_head.weight.mul_(0.1)  # rows exit at other loops in the same call
    run = lambda: serve(m, ps, 12, Decoding(batch_size=3, temperature=0, **opts))  # noqa: E731
    eager = run()
    monkeypatch.setattr(batching, 'step', torch.compile(batching.step, fullgraph=True, backend='eager'))
    compiled = run()
    assert compiled[:2] == eager[:2]
    if opts:
        assert any(k < m.config.n_loop for u in eager[1] for k in u)  # some token exited early
    torch._dynamo.reset()


def test_the_compiled_step_decodes_as_eager_and_refuses_what_serve_cannot_run(monkeypatch):
    # Decoding(compile=True): batching.compiled's one graph (inductor's kernels on the CPU) in place of
    # the eager step, at batch 1 (sample.py --compile) and with rows at other loops; and it must be the
    # compiled step that ran, not the eager one
    torch._dynamo.reset()
    m, ps = tiny(pos='rope', n_coda=1), prompts()
    with torch.no_grad():
        m.lm_head.weight.mul_(0.1)  # rows exit at other loops in the same call
    kw = dict(temperature=0, exit_threshold=0.05)
    eager = [serve(m, ps, 8, Decoding(batch_size=B, **kw)) for B in (1, 3)]
    batching.compiled('cpu')  # made from the eager step, which serve then cannot reach
    monkeypatch.setattr(batching, 'step', None)
    compiled = [serve(m, ps, 8, Decoding(batch_size=B, compile=True, **kw)) for B in (1, 3)]
    assert [c[:2] for c in compiled] == [e[:2] for e in eager]
    assert any(k < m.config.n_loop for u in eager[1][1] for k in u)
    why = Decoding(compile=True, draft_loops=1).why_not(m.config)
    assert '--compile' in why and '\n' not in why
    assert '--compile' in Decoding(compile=True).why_not(tiny(injection='iso').config)
    torch._dynamo.reset()


def test_the_gpu_checks_compiled_step_runs_serve_bench_as_written_and_counts_batch_1s_bytes(
        tiny_data, tiny_ckpt, repo_dir, tmp_path, monkeypatch, capsys):
    # lab/gpu_check.sh step 6's serve_bench call, as written there, on the CPU: its prompts come from the
    # data's validation text, and at batch 1 it prints the bytes a fixed-R token reads
    import re
    import serve_bench
    script = (repo_dir / 'lab' / 'gpu_check.sh').read_text(encoding='utf-8').replace('\\\n', ' ')
    maker = script.split("$PY - <<'EOF'\n")[1].split('\nEOF')[0]
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'data' / 'shakespeare_char').symlink_to(tiny_data)
    prompts = tmp_path / 'p.txt'
    exec(maker.replace('/tmp/gpu_prompts.txt', str(prompts)), {})
    lines = prompts.read_text(encoding='utf-8').splitlines()
    assert lines and all(len(line) >= 14 for line in lines)
    prompts.write_text('\n'.join(lines[:3]) + '\n', encoding='utf-8')  # (the script's batch 1 takes 8)
    call = re.search(r'lab/serve_bench.py (.*?) 2>&1', script).group(1).split()
    on_cpu = {'--device=cuda': '--device=cpu', '--timer=wall': '--timer=process'}
    args = [on_cpu.get(a, a).replace('$B', '1') for a in call[2:] if a != '--compile']  # (compiled: above)
    serve_bench.main([str(tiny_ckpt), f'--prompts={prompts}', *args, '--repeats=1', '--max_new_tokens=4'])
    out = capsys.readouterr().out
    assert 'batch 1' in out and re.search(r'reads [\d.]+ MB a token: [\d.]+ GB/s', out)
    # the bytes: the shared blocks once a loop, every visit's keys and values up to the position
    m4, m2 = tiny(n_loop=4, n_coda=1), tiny(n_loop=2, n_coda=1)
    block = sum(p.numel() for p in m4.transformer.h.parameters()) * 4
    C, K = m4.config.n_embd, m4.config.n_layer
    kv = serve_bench.bytes_per_token(m4, 11) - serve_bench.bytes_per_token(m4, 10)
    assert kv == (4 * K + 1) * 2 * C * 4  # R K loop visits and the coda's block, keys and values, fp32
    assert serve_bench.bytes_per_token(m4, 0) - serve_bench.bytes_per_token(m2, 0) == 2 * block


def test_the_batch_8_bar_is_what_the_eight_committed_calls_say_copy_holds_it_recompute_sits_on_it():
    # docs/decoding.md's table of the batch-8 bar (>= 0.85 of the prefill-adjusted bound, d 512) recomputed
    # from the raw calls in assets/serve_b8_repeats.txt: a call is the unit, its t-interval the evidence
    import os
    import re
    from verdict import mean_ci
    root = REPO
    path = os.path.join(root, 'assets', 'serve_b8_repeats.txt')
    calls = open(path, encoding='utf-8').read().split('=== call')
    whole, steady = {}, {}
    for call in calls[1:]:
        for line in call.splitlines():
            c = [x.strip() for x in line.split('|')]
            if line.startswith('| serve, '):
                key = (c[1].split(',')[1].strip(), c[1].endswith('compiled'))  # (kv policy, compiled)
                whole.setdefault(key, []).append(float(c[7]))
                steady.setdefault(key, []).append(float(c[10]))
    assert len(calls) - 1 == 8 and all(len(v) == 8 for v in whole.values())
    doc = open(os.path.join(root, 'docs', 'decoding.md'), encoding='utf-8').read()
    for policy, word in (('recompute', 'inconclusive'), ('copy', 'holds')):
        cis = [mean_ci(whole[policy, compiled]) for compiled in (False, True)]
        row = f"| {policy}{' (the default)' if policy == 'recompute' else ''} | " + ' | '.join(
            f"{m:.3f} [{lo:.3f}, {hi:.3f}]" for m, lo, hi in cis) + " | " + ' / '.join(
            f"{sum(steady[policy, c]) / 8:.3f}" for c in (False, True)) + f" | {word} |"
        assert row in doc, row
        above = [lo > 0.85 for _, lo, _ in cis]
        assert all(above) if word == 'holds' else not any(above) and all(hi > 0.85 for *_, hi in cis)
    assert re.search(r'about 140 calls', doc)


def test_compiled_fixed_r_at_d512_batch_32_is_at_best_even_as_the_paired_rounds_say(repo_dir):
    # docs/decoding.md's d 512, batch 32 table recomputed from the rounds in assets/serve_b32_paired.txt:
    # a round is the unit (its paths take turns), the t-interval of the rounds' ratios the evidence
    import re
    from verdict import mean_ci
    text = (repo_dir / 'assets' / 'serve_b32_paired.txt').read_text(encoding='utf-8')
    doc = (repo_dir / 'docs' / 'decoding.md').read_text(encoding='utf-8')
    cis = {}
    for run in [r for r in text.split('\n=== ') if r[:2] in ('A:', 'B:', 'C:', 'D:')]:
        found = re.search(r"per round \[(.*?)\]|paired by round: (.*?);", run)
        ratios = [float(x.strip("' ")) for x in (found.group(1) or found.group(2)).replace(',', ' ').split()]
        m, lo, hi = cis[run[0]] = mean_ci(ratios)
        assert f"{m:.3f} [{lo:.3f}, {hi:.3f}]" in doc, run[0]
    assert set(cis) == set('ABCD') and len(re.findall(r'round', text)) > 4
    assert cis['A'][2] < 1 and '| 0.953 [0.925, 0.980] | no: slower |' in doc  # A: compiled slower
    assert all(cis[r][1] < 1 < cis[r][2] for r in 'BCD')                      # the others decide nothing
    assert cis['C'][2] < 1.03 and 'rules out a gain above 3 %' in doc and '**not met**' in doc
