"""lab/harness.py: a checkpoint as an lm-eval model. Its log-likelihoods are the model's own per-token CE at
every exit depth, its rolling log-likelihood is the val CE, the tiny local task in tests/data/harness runs
through lm-eval's entry point and through the command line, and bad input gets one line.

All offline: lm-eval's named tasks (hellaswag, arc_easy, ...) download their data, so none runs here."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

os.environ.setdefault('HF_DATASETS_OFFLINE', '1')  # before datasets is imported: never reach the hub
os.environ.setdefault('HF_HUB_OFFLINE', '1')
lm_eval = pytest.importorskip('lm_eval', reason='pip install lm-eval (requirements-dev.txt)')
from lm_eval.api.instance import Instance  # noqa: E402

from run import checkpoint  # noqa: E402
import harness  # noqa: E402
from conftest import REPO, save_tiny_checkpoint, tiny_text  # noqa: E402
from decoding.engine import Decoding, generate  # noqa: E402

TASKS = REPO / 'tests' / 'data' / 'harness'
DOCS = [json.loads(line) for line in (TASKS / 'tiny_shakespeare.jsonl').read_text('utf-8').splitlines()]
DEPTHS = (1, 2, 3)  # R = 2 trained; 3 extrapolates


@pytest.fixture(scope='module')
def out(tmp_path_factory):
    # a tiny random char-level model whose vocabulary covers the task's characters
    text = tiny_text(2000) + ''.join(d['context'] + ' '.join(d['choices']) for d in DOCS)
    itos = sorted(set(text))
    meta = dict(dataset='harness_tiny', tokenizer='char', vocab_size=len(itos), itos=itos)
    folder = tmp_path_factory.mktemp('harness') / 'out'
    save_tiny_checkpoint(str(folder / 'ckpt.pt'), len(itos), dataset='harness_tiny', meta=meta, init='gpt2')
    return folder


@pytest.fixture(scope='module')
def deep(tmp_path_factory):
    # a model whose exits disagree: block matrices 3x their init make the greedy text differ at depths 1
    # and 2 (at the init every depth repeats one character), and the final_only readout reads exit 1
    # without the norm, exit 2 with it
    text = tiny_text(2000) + ''.join(d['context'] + ' '.join(d['choices']) for d in DOCS)
    itos = sorted(set(text))
    meta = dict(dataset='harness_tiny', tokenizer='char', vocab_size=len(itos), itos=itos)
    path = str(tmp_path_factory.mktemp('harness_deep') / 'out' / 'ckpt.pt')
    model = save_tiny_checkpoint(path, len(itos), dataset='harness_tiny', meta=meta, seed=1,
                                 readout='final_only')
    with torch.no_grad():
        for p in model.transformer.h.parameters():
            p.mul_(3.0 if p.dim() == 2 else 1.0)
    ckpt = torch.load(path, weights_only=False)
    torch.save(dict(ckpt, model=model.state_dict()), path)
    return Path(path).parent


@pytest.fixture(scope='module')
def lm(out):
    torch.set_num_threads(1)
    return harness.NanoLoop(str(out), depths=DEPTHS, batch_size=3)


def model_and_ids(out):
    ckpt = checkpoint.load(str(out / 'ckpt.pt'))
    stoi = {c: i for i, c in enumerate(ckpt['meta']['itos'])}
    return checkpoint.build_model(ckpt).eval(), lambda s: [stoi[c] for c in s]


def reference_ll(model, ids, context, continuation, k):
    """sum of log softmax at each continuation token, from model.readout over model.states, at exit k of a
    k-loop pass; an empty context is the prefix '\\n', and a context over the block loses its start."""
    ctx, cont = ids(context) or ids('\n'), ids(continuation)
    x = (ctx + cont)[-(model.config.block_size + 1):-1]
    with torch.no_grad():
        h = model.run(torch.tensor([x]), k).states[k - 1]
        logp = F.log_softmax(model.readout(h, k)[0].float(), -1)  # (T, V)
    rows = logp[len(x) - len(cont):]
    return rows[torch.arange(len(cont)), torch.tensor(cont)].sum().item(), rows.argmax(-1).tolist() == cont


def test_loglikelihood_is_the_models_own_ce_at_every_depth(out, lm):
    model, ids = model_and_ids(out)
    long = 'JULIET:\nO Romeo, Romeo! wherefore art thou Romeo? Deny thy father and refuse'  # > block_size
    pairs = [(d['context'], ' ' + c) for d in DOCS[:3] for c in d['choices']]
    pairs += [('', 'HAMLET:'), (long, ' thy name.'), ('To be, or not ', 'to')]
    reqs = [Instance('loglikelihood', {}, p, i) for i, p in enumerate(pairs)]
    for k in DEPTHS:
        lm.n_loop = k
        for (ctx, cont), (ll, greedy) in zip(pairs, lm.loglikelihood(reqs)):
            if ctx.endswith(' '):  # lm-eval's convention: the context's trailing space is scored too
                ctx, cont = ctx[:-1], ' ' + cont
            want, want_greedy = reference_ll(model, ids, ctx, cont, k)
            assert ll == pytest.approx(want, abs=1e-4), (k, ctx, cont)
            assert greedy == want_greedy


def test_rolling_loglikelihood_is_the_val_ce_times_the_tokens(out, lm):
    # text after the prefix '\n' in train.py's val batches: windows of block_size, targets shifted by one
    model, ids = model_and_ids(out)
    bs = model.config.block_size
    text = tiny_text(200, seed=1)
    for n in (2 * bs, 11):  # two whole windows; one short one
        s = torch.tensor(ids('\n' + text[:n]))
        X, Y = s[:-1].view(-1, min(n, bs)), s[1:].view(-1, min(n, bs))
        ce, _, _ = model.exit_metrics(X, Y, n_loop=max(DEPTHS))
        for k in DEPTHS:
            lm.n_loop = k
            got, = lm.loglikelihood_rolling([Instance('loglikelihood_rolling', {}, (text[:n],), 0)])
            assert got == pytest.approx(-ce[k - 1].item() * n, rel=1e-5), (n, k)


def test_generate_until_is_greedy_generate_cut_at_the_stop_string(deep):
    lm = harness.NanoLoop(str(deep), depths=(1, 2), batch_size=3)
    model, ids = model_and_ids(deep)
    decode, texts = lm.decode, set()
    for k in (1, 2):
        lm.n_loop = k
        ctx = DOCS[0]['context']
        y, _, _ = generate(model, torch.tensor([ids(ctx)]), 20, Decoding(temperature=0, n_loop=k))
        full = decode(y[0, len(ctx):].tolist())
        texts.add(full)
        stop = full[5]  # a character it does produce: the answer is the text before its first occurrence
        req = Instance('generate_until', {}, (ctx, {'until': [stop], 'max_gen_toks': 20}), 0)
        assert lm.generate_until([req]) == [full.split(stop)[0]]
        req = Instance('generate_until', {}, (ctx, {'until': ['never'], 'max_gen_toks': 20}), 0)
        assert lm.generate_until([req]) == [full]
    assert len(texts) == 2  # the depths decode other text, so a generate_until at the wrong depth shows


def test_generate_until_decodes_many_requests_in_flight_as_each_alone(deep):
    # contexts of unequal length and two max_gen_toks: rows at their own positions (batching.serve), each
    # the text its request decodes by itself
    lm = harness.NanoLoop(str(deep), depths=(2,), batch_size=3)
    model, ids = model_and_ids(deep)
    asks = [(DOCS[i % len(DOCS)]['context'][:20 + 7 * i], n) for i, n in enumerate((12, 20, 12, 7, 20))]
    reqs = [Instance('generate_until', {}, (ctx, {'until': ['never'], 'max_gen_toks': n}), 0)
            for ctx, n in asks]
    want = [lm.decode(generate(model, torch.tensor([ids(ctx)]), n, Decoding(temperature=0, n_loop=2))[0][0,
                      len(ctx):].tolist()) for ctx, n in asks]
    assert lm.generate_until(reqs) == want and len(set(want)) > 1


def test_each_depth_is_scored_at_its_own_exit(deep):
    # under final_only, exit 1 of a 2-loop pass is read without the readout norm: scoring it as exit R
    # (with the norm) gives other log-likelihoods
    lm = harness.NanoLoop(str(deep), depths=(1, 2), batch_size=3)
    model, ids = model_and_ids(deep)
    pairs = [(d['context'], ' ' + d['choices'][0]) for d in DOCS[:3]]
    reqs = [Instance('loglikelihood', {}, p, i) for i, p in enumerate(pairs)]
    got = {}
    for k in (1, 2):
        lm.n_loop = k
        got[k] = [ll for ll, _ in lm.loglikelihood(reqs)]
        for (ctx, cont), ll in zip(pairs, got[k]):
            assert ll == pytest.approx(reference_ll(model, ids, ctx, cont, k)[0], abs=1e-4), (k, ctx)
    assert all(abs(a - b) > 1e-2 for a, b in zip(got[1], got[2]))


def test_local_task_through_lm_evals_entry_point(out, lm, monkeypatch):
    # lm_eval.simple_evaluate on the YAML + JSONL task: acc is the share of questions whose right choice has
    # the highest log-likelihood, recomputed here from the model
    monkeypatch.chdir(REPO)  # the task's data_files are relative to the repo root
    model, ids = model_and_ids(out)
    tm = lm_eval.tasks.TaskManager(include_path=str(TASKS), include_defaults=False)
    for k in (1, 2):
        lm.n_loop = k
        res = lm_eval.simple_evaluate(model=lm, tasks=['tiny_shakespeare'], task_manager=tm,
                                      log_samples=False)
        right = 0
        for d in DOCS:
            lls = [reference_ll(model, ids, d['context'], ' ' + c, k)[0] for c in d['choices']]
            right += max(range(len(lls)), key=lls.__getitem__) == d['label']
        assert res['results']['tiny_shakespeare']['acc,none'] == pytest.approx(right / len(DOCS))


def run_harness_cli(*args):
    """lab/harness.py as a real process, from the repo root."""
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, str(REPO / 'lab' / 'harness.py'), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_prints_the_table_per_depth_and_writes_lm_evals_json(out, tmp_path):
    r = run_harness_cli(str(out), f'--include_path={TASKS}', '--tasks=tiny_shakespeare', '--n_loop=1,3',
                f'--output_path={tmp_path}', '--device=cpu', '--batch_size=4')
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith('task/metric'))
    assert lines[head].split() == ['task/metric', 'n_loop=1', 'n_loop=3']
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in lines[head + 1:head + 3]}
    assert set(rows) == {'tiny_shakespeare/acc', 'tiny_shakespeare/acc_norm'}
    combined = json.loads((tmp_path / 'results.json').read_text(encoding='utf-8'))
    for i, R in enumerate((1, 3)):
        res = json.loads((tmp_path / f'results_n_loop{R}.json').read_text(encoding='utf-8'))
        acc = res['results']['tiny_shakespeare']['acc,none']
        assert res['config']['n_loop'] == R and combined['results'][str(R)]['results'] == res['results']
        assert rows['tiny_shakespeare/acc'][i] == pytest.approx(acc, abs=1e-4)


@pytest.mark.parametrize('case', ['no ckpt', 'depth 0', 'depth over cap', 'not a depth', 'bad limit',
                                  'unknown task'])
def test_bad_input_is_one_line(out, tmp_path, capsys, case):
    local = [f'--include_path={TASKS}', '--tasks=tiny_shakespeare']
    args, says = {
        'no ckpt': ([str(tmp_path), *local], 'no ckpt.pt there'),
        'depth 0': ([str(out), *local, '--n_loop=0,2'], '--n_loop=0: must be >= 1'),
        'depth over cap': ([str(out), *local, '--n_loop=2,9'], 'supports 1..8 loops'),
        'not a depth': ([str(out), *local, '--n_loop=two'], 'as integers'),
        'bad limit': ([str(out), *local, '--limit=0'], '--limit=0.0: must be > 0'),
        'unknown task': ([str(out), '--tasks=hellaswag,tiny_shakespere', f'--include_path={TASKS}'],
                         "unknown task 'tiny_shakespere' (did you mean 'tiny_shakespeare'?)"),
    }[case]
    with pytest.raises(SystemExit) as e:  # in this process: a traceback would be any other exception
        harness.main(args)
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count('\n') == 1 and says in err, err


def test_without_lm_eval_it_says_what_to_install(out, tmp_path):
    # a folder on PYTHONPATH whose lm_eval fails to import, as a missing package does
    (tmp_path / 'lm_eval').mkdir()
    (tmp_path / 'lm_eval' / '__init__.py').write_text("raise ImportError('no lm_eval')\n")
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    r = subprocess.run([sys.executable, str(REPO / 'lab' / 'harness.py'), str(out), '--tasks=hellaswag'],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.strip().endswith('pip install lm-eval'), r.stderr
    assert r.stderr.count('\n') == 1
