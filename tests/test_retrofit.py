"""
Retrofitted recurrence (docs/papers.md §6): a model trained without loops, its layers placed into a looped
model's prelude, loop and coda. Offline: GPT-2 is a small random GPT-2 (perturbed biases and LayerNorms,
weights wide enough that GELU's tanh and exact forms differ) saved to a temporary folder and read back
through the same path as init_from='gpt2'. With transformers installed (CI) it goes through transformers;
without it, through a stand-in that serves the same state dict, so that the retrofit, its Conv1D mapping
and the loop curriculum are tested either way (the logits against GPT-2's forward written out by hand).
"""
import json
import math
import os
import signal
import subprocess
import sys
import time
import types

import numpy as np
import pytest
import torch

from conftest import REPO, TINY, cli_env, read_metrics, run_train, train_command, write_data
from test_reliability import assert_clean_error, snapshot

from configurator import gpt_config
from model import GPT, GPTConfig
from run import checkpoint
from run import ops
from run import retrofit

try:
    import transformers as HF
except ImportError:
    HF = None
SHAPE = dict(vocab_size=50257, n_positions=32, n_embd=16, n_layer=6, n_head=2)  # TINY's width and heads
GPT2_CONFIG = dict(SHAPE, activation_function='gelu_new', layer_norm_epsilon=1e-5, n_inner=None,
                   scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False)
STATE = 'random_gpt2.pt'  # the state dict gpt2_dir also keeps as a torch file, for the stand-in


def random_gpt2(seed=0, std=0.5):
    """A GPT-2 state dict in transformers' names and layouts (Conv1D weights (in, out)), drawn by torch.
    Weights N(0, std^2): at GPT-2's initializer_range 0.02 the MLP's inputs stay near 0, where GELU's two
    forms agree to float noise. Biases N(0, 0.1^2), LayerNorm weights 1 + N(0, 0.2^2), their biases
    N(0, 0.2^2): a bias or a norm weight dropped moves the logits."""
    g = torch.Generator().manual_seed(seed)
    C, V, P = SHAPE['n_embd'], SHAPE['vocab_size'], SHAPE['n_positions']
    normal = lambda *shape, std=std, mean=0.0: mean + std * torch.randn(*shape, generator=g)
    sd = {'transformer.wte.weight': normal(V, C), 'transformer.wpe.weight': normal(P, C)}
    for i in range(SHAPE['n_layer']):
        h = f'transformer.h.{i}.'
        for ln in ('ln_1', 'ln_2'):
            sd |= {h + ln + '.weight': normal(C, std=0.2, mean=1.0), h + ln + '.bias': normal(C, std=0.2)}
        for name, n_in, n_out in (('attn.c_attn', C, 3 * C), ('attn.c_proj', C, C), ('mlp.c_fc', C, 4 * C),
                                  ('mlp.c_proj', 4 * C, C)):
            sd |= {h + name + '.weight': normal(n_in, n_out), h + name + '.bias': normal(n_out, std=0.1)}
    sd |= {'transformer.ln_f.weight': normal(C, std=0.2, mean=1.0),
           'transformer.ln_f.bias': normal(C, std=0.2)}
    return sd | {'lm_head.weight': sd['transformer.wte.weight']}  # GPT-2's head is tied to wte


@pytest.fixture(scope='module')
def gpt2_dir(tmp_path_factory):
    """random_gpt2 saved as save_pretrained writes it (what from_pretrained reads) where transformers is
    installed, and as a torch file (STATE) for the stand-in either way."""
    path, sd = tmp_path_factory.mktemp('gpt2'), random_gpt2()
    torch.save(sd, path / STATE)
    if HF is not None:
        hf = HF.GPT2LMHeadModel(HF.GPT2Config(**GPT2_CONFIG))
        missing, unexpected = hf.load_state_dict(sd, strict=False)
        assert not unexpected and not [k for k in missing if not k.endswith(('attn.bias', 'masked_bias'))]
        hf.save_pretrained(path)
    else:  # what save_pretrained writes beside the weights, and what marks a folder as a saved GPT-2
        (path / 'config.json').write_text(json.dumps(dict(GPT2_CONFIG, model_type='gpt2')))
    return str(path)


@pytest.fixture(scope='module')
def gpt2_state(gpt2_dir):
    return torch.load(os.path.join(gpt2_dir, STATE), weights_only=True)


def stand_in():
    """The part of transformers that retrofit.gpt2_source uses, serving a folder's STATE as GPT-2's."""
    def from_pretrained(name, local_files_only=False):
        if not os.path.isfile(os.path.join(name, STATE)):
            raise OSError(f"{name} does not appear to have a file named {STATE}")
        sd = torch.load(os.path.join(name, STATE), weights_only=True)
        return types.SimpleNamespace(config=types.SimpleNamespace(**GPT2_CONFIG), state_dict=lambda: sd)
    module = types.ModuleType('transformers')
    module.GPT2LMHeadModel = types.SimpleNamespace(from_pretrained=from_pretrained)
    module.utils = types.SimpleNamespace(logging=types.SimpleNamespace(disable_progress_bar=lambda: None))
    return module


@pytest.fixture(autouse=True)
def transformers_or_its_stand_in(monkeypatch):
    if HF is None:
        monkeypatch.setitem(sys.modules, 'transformers', stand_in())


def hf_model(path):
    with retrofit.hf_imports('test') as transformers:
        return transformers.GPT2LMHeadModel.from_pretrained(path).eval()


def retrofitted(source, **keys):
    """The GPT that train.py builds for init_from=source with these keys set, and the lines it prints."""
    config = {**vars(GPTConfig()), **keys}
    args, ckpt, notes = retrofit.retrofit(source, config, set(keys))
    model = GPT(gpt_config(args))
    model.load_state_dict(ckpt['model'])
    return model.eval(), notes


@torch.no_grad()
def all_logits(model, idx):
    out = model.run(idx)
    return model.lm_head(model.coda_readout(out.states[-1], len(out.states)))


def gpt2_by_hand(sd, idx):
    """GPT-2's logits (B, T, V) written out from its state dict, in float64: LayerNorms with their biases
    (eps 1e-5), Conv1D as x @ W + b, causal attention, GELU's tanh form, the head tied to wte."""
    w = lambda k: sd['transformer.' + k].double()
    C, nh, (B, T) = SHAPE['n_embd'], SHAPE['n_head'], idx.shape

    def ln(x, k):
        mu, var = x.mean(-1, keepdim=True), ((x - x.mean(-1, keepdim=True)) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + 1e-5) * w(k + '.weight') + w(k + '.bias')
    conv = lambda x, k: x @ w(k + '.weight') + w(k + '.bias')
    gelu = lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    heads = lambda t: t.reshape(B, T, nh, C // nh).transpose(1, 2)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    x = w('wte.weight')[idx] + w('wpe.weight')[:T]
    for i in range(SHAPE['n_layer']):
        h = f'h.{i}.'
        q, k, v = map(heads, conv(ln(x, h + 'ln_1'), h + 'attn.c_attn').split(C, dim=-1))
        att = (q @ k.transpose(-1, -2) / math.sqrt(C // nh)).masked_fill(future, -math.inf).softmax(-1)
        x = x + conv((att @ v).transpose(1, 2).reshape(B, T, C), h + 'attn.c_proj')
        x = x + conv(gelu(conv(ln(x, h + 'ln_2'), h + 'mlp.c_fc')), h + 'mlp.c_proj')
    return ln(x, 'ln_f') @ w('wte.weight').T


SPLITS = [{}, dict(n_prelude=2, n_layer=2, n_coda=2)]


@pytest.mark.parametrize('split', SPLITS, ids=['all_looped', '2_2_2'])
def test_unrolled_gpt2_logits_equal_gpt2_written_out(gpt2_dir, gpt2_state, split):
    # n_loop = 1 with every layer placed in order is GPT-2 itself: its Conv1D weights transposed into
    # nn.Linear, its biases, tanh GELU and LayerNorms (weights and biases), to float tolerance. The random
    # GPT-2's biases and norms are perturbed and its MLP inputs wide: a bias dropped or the exact GELU
    # moves these logits far past the tolerance (without transformers too)
    model, _ = retrofitted(retrofit.gpt2_source(gpt2_dir), n_loop=1, **split)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, SHAPE['vocab_size'], (2, SHAPE['n_positions']), generator=gen)
    ref = gpt2_by_hand(gpt2_state, idx)
    torch.testing.assert_close(all_logits(model, idx).double(), ref, atol=1e-4, rtol=1e-5)


@pytest.mark.skipif(HF is None, reason="transformers is not installed (CI installs it)")
@pytest.mark.parametrize('split', SPLITS, ids=['all_looped', '2_2_2'])
def test_unrolled_gpt2_logits_equal_transformers(gpt2_dir, split):
    # n_loop = 1 with every layer placed in order is GPT-2 itself: its Conv1D weights transposed into
    # nn.Linear, its biases, tanh GELU and LayerNorms, to float tolerance
    model, _ = retrofitted(retrofit.gpt2_source(gpt2_dir), n_loop=1, **split)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, SHAPE['vocab_size'], (2, SHAPE['n_positions']), generator=gen)
    with torch.no_grad():
        ref = hf_model(gpt2_dir)(idx).logits
    torch.testing.assert_close(all_logits(model, idx), ref, atol=2e-5, rtol=1e-5)


def test_the_loop_takes_the_layers_just_before_the_coda(gpt2_dir, gpt2_state):
    # McLeish et al.'s placement: prelude the first P, coda the last C, the loop the L before the coda,
    # the layers between prelude and loop dropped
    assert retrofit.placement(6, 1, 2, 1) == ([0], [3, 4], [5], [1, 2])
    source = retrofit.gpt2_source(gpt2_dir)
    model, notes = retrofitted(source, n_prelude=1, n_layer=2, n_coda=1, n_loop=4, injection='concat')
    t, sd = model.transformer, gpt2_state
    hf = lambda i, name: sd[f'transformer.h.{i}.{name}']
    same = lambda block, i: torch.equal(block.attn.c_attn.weight, hf(i, 'attn.c_attn.weight').t()) \
        and torch.equal(block.mlp.c_proj.bias, hf(i, 'mlp.c_proj.bias'))
    assert same(t.prelude[0], 0) and same(t.h[0], 3) and same(t.h[1], 4) and same(t.coda[0], 5)
    assert not same(t.h[0], 1) and not same(t.h[0], 2)
    assert 'its layers 0 -> prelude, 3-4 -> loop (x 4), 5 -> coda, 1-2 dropped, of 6' in notes[0]
    # the adapter has no source weights: W = [I 0], so loop 2 first reads loop 1's state unchanged
    assert 'transformer.adapter.weight' in notes[1]
    C = SHAPE['n_embd']
    assert torch.equal(t.adapter.weight, torch.cat([torch.eye(C), torch.zeros(C, C)], dim=1))


def test_a_non_looped_nanoloop_checkpoint_retrofits_the_same_way():
    torch.manual_seed(0)
    args = dict(vars(GPTConfig()), n_layer=4, n_loop=1, n_embd=32, n_head=2, vocab_size=50, mlp='gelu')
    unique = GPT(gpt_config(args)).eval()
    ckpt = {'model': unique.state_dict(), 'model_args': args, 'meta': {'tokenizer': 'char'}}
    source = retrofit.nanoloop_source(ckpt, 'unique/ckpt.pt')
    same, _ = retrofitted(source, n_prelude=1, n_layer=2, n_coda=1, n_loop=1)
    idx = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(all_logits(same, idx), all_logits(unique, idx), atol=1e-5, rtol=1e-5)
    looped, _ = retrofitted(source, n_prelude=1, n_layer=2, n_coda=1, n_loop=3)
    assert torch.equal(looped.transformer.h[0].attn.c_attn.weight, unique.transformer.h[1].attn.c_attn.weight)
    ckpt['model_args'] = dict(args, n_loop=2)
    with pytest.raises(SystemExit):
        retrofit.nanoloop_source(ckpt, 'looped/ckpt.pt')


def test_a_sources_prelude_loop_and_coda_are_its_layers_in_that_order():
    # a non-looped source with a prelude and a coda of its own is the stack prelude, h, coda: split the same
    # way again (n_loop = 1) it is the source itself, layer for layer, and its logits are the source's
    torch.manual_seed(0)
    args = dict(vars(GPTConfig()), n_prelude=1, n_layer=2, n_coda=1, n_loop=1, n_embd=32, n_head=2,
                vocab_size=50, mlp='gelu')
    unique = GPT(gpt_config(args)).eval()
    source = retrofit.nanoloop_source({'model': unique.state_dict(), 'model_args': args}, 'unique/ckpt.pt')
    layer = lambda m, part, j: getattr(m.transformer, part)[j].attn.c_attn.weight
    order = [('prelude', 0), ('h', 0), ('h', 1), ('coda', 0)]
    assert all(torch.equal(source['blocks'][i]['attn.c_attn.weight'], layer(unique, *at))
               for i, at in enumerate(order))
    same, _ = retrofitted(source, n_prelude=1, n_layer=2, n_coda=1, n_loop=1)
    idx = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(all_logits(same, idx), all_logits(unique, idx), atol=1e-5, rtol=1e-5)


def test_a_shorter_context_keeps_the_sources_first_positions():
    # block_size below the source's: the learned position table keeps rows 0..block_size-1 (positions
    # 0.. are the ones a window starts at), as nanoGPT's crop does
    torch.manual_seed(0)
    args = dict(vars(GPTConfig()), n_layer=2, n_loop=1, n_embd=32, n_head=2, vocab_size=50, mlp='gelu',
                pos='learned', block_size=64)
    unique = GPT(gpt_config(args)).eval()
    source = retrofit.nanoloop_source({'model': unique.state_dict(), 'model_args': args}, 'unique/ckpt.pt')
    short, _ = retrofitted(source, block_size=24)
    wpe = unique.transformer.wpe.weight
    assert short.config.block_size == 24 and torch.equal(short.transformer.wpe.weight, wpe[:24])


def test_the_curriculum_ramps_the_mean_loop_count_from_1_to_R():
    fixed = GPTConfig(n_loop=4)
    counts = [ops.loop_count(fixed, None, it, 60) for it in range(100)]
    assert counts[0] == 1 and counts[59] == 4 and set(counts[60:]) == {4}
    assert all(a <= b for a, b in zip(counts, counts[1:])) and set(counts) == {1, 2, 3, 4}
    assert abs(np.mean(counts[:60]) - 2.5) < 0.1  # a linear ramp: its mean is halfway
    assert [ops.loop_count(fixed, None, it, 0) for it in range(5)] == [4] * 5  # 0 = no curriculum
    # a sampled depth's mean ramps with it (Huginn's draw: mean n_loop + 1)
    sampled, gen = GPTConfig(n_loop=4, loop_sampling='poisson_lognormal'), torch.Generator().manual_seed(0)
    early = [ops.loop_count(sampled, gen, 0, 1000) for _ in range(2000)]
    late = [ops.loop_count(sampled, gen, 1000, 1000) for _ in range(2000)]
    assert abs(np.mean(early) - 2) < 0.1 and abs(np.mean(late) - 5) < 0.2


def write_gpt2_data(root):
    """A dataset of GPT-2 token ids (random), as prepare.py writes a tiktoken dataset."""
    folder = os.path.join(str(root), 'data', 'tok')
    os.makedirs(folder, exist_ok=True)
    ids = np.random.default_rng(0).integers(0, 50257, 6000).astype(np.uint16)
    ids[:5000].tofile(os.path.join(folder, 'train.bin'))
    ids[5000:].tofile(os.path.join(folder, 'val.bin'))
    import json
    with open(os.path.join(folder, 'meta.json'), 'w') as f:
        json.dump(dict(dataset='tok', tokenizer='gpt2', vocab_size=50257, dtype='uint16', train_tokens=5000,
                       val_tokens=1000), f)


RETROFIT = ['--n_prelude=1', '--n_layer=2', '--n_coda=1', '--n_loop=3', '--injection=concat']


def test_train_py_retrofits_gpt2_and_refuses_a_split_that_does_not_fit(gpt2_dir, tmp_path):
    write_gpt2_data(tmp_path)
    args = [*TINY, '--dataset=tok', f'--init_from={gpt2_dir}', '--max_iters=3', '--eval_interval=3']
    code, out, err = run_train([*args, *RETROFIT, '--loop_schedule=0.5', '--out_dir=r'], tmp_path)
    assert code == 0, err
    assert 'of 6' in out and 'K=2 layers looped R=3 times' in out
    ckpt = torch.load(tmp_path / 'r' / 'ckpt.pt', weights_only=True)
    assert ckpt['iter_num'] == 3 and ckpt['model_args']['bias'] and ckpt['model_args']['mlp'] == 'gelu_tanh'
    code, out, err = run_train([*args, '--n_prelude=3', '--n_layer=3', '--n_coda=3', '--out_dir=x'], tmp_path)
    assert_clean_error(code, err, '3 + 3 + 3 = 9 exceeds', '6 layers')
    code, out, err = run_train([*args, *RETROFIT, '--n_embd=32', '--out_dir=x'], tmp_path)
    assert_clean_error(code, err, 'n_embd=32', "source's: 16")
    # GPT-2's tokens on a character dataset: refused, naming the tokenizer
    write_data(tmp_path)
    code, out, err = run_train([*args, *RETROFIT, '--dataset=tiny', '--out_dir=x'], tmp_path)
    assert_clean_error(code, err, 'tokenizer')
    code, out, err = run_train([*TINY, '--init_from=no-such-folder', '--out_dir=x'], tmp_path)
    assert_clean_error(code, err, "init_from='no-such-folder'", 'gpt2')


@pytest.mark.parametrize('init_from', ['scratch', 'gpt2', 'gpt2-xl', 'unique', 'saved/gpt2'])
def test_no_init_from_kind_starts_a_new_run_over_an_earlier_checkpoint(tmp_path, capsys, init_from):
    # a forgotten --init_from=resume: a new run (from scratch, from GPT-2 by name or from a folder) would
    # write over out_dir's checkpoint at its first eval. Only a resume or an eval-only run may go on there
    path = tmp_path / 'out' / 'ckpt.pt'
    path.parent.mkdir()
    path.write_bytes(b'an earlier run')
    with pytest.raises(SystemExit):
        checkpoint.refuse_overwrite(str(path), init_from, eval_only=False)
    assert 'already exists' in capsys.readouterr().err
    checkpoint.refuse_overwrite(str(path), 'resume', eval_only=False)
    checkpoint.refuse_overwrite(str(path), init_from, eval_only=True)
    checkpoint.refuse_overwrite(str(tmp_path / 'new' / 'ckpt.pt'), init_from, eval_only=False)


@pytest.mark.parametrize('kind', ['scratch', 'nanoloop_folder', 'gpt2_folder', 'gpt2_by_name'])
def test_train_py_refuses_every_init_from_kind_over_an_earlier_checkpoint(kind, gpt2_dir, tmp_path,
                                                                        monkeypatch):
    # through train.py: the source is read, then the run refused in one line before it writes anything.
    # GPT-2 by name reads the random GPT-2's folder (offline: the hub is not asked)
    write_data(tmp_path)
    write_gpt2_data(tmp_path)
    if kind == 'nanoloop_folder':
        unique = [*TINY, '--n_layer=4', '--n_loop=1', '--max_iters=2', '--out_dir=u']
        code, _, err = run_train(unique, tmp_path)
        assert code == 0, err
    real = retrofit.gpt2_source
    monkeypatch.setattr(retrofit, 'gpt2_source', lambda name: real(gpt2_dir) | {'name': name})
    src, data = {'scratch': ('scratch', 'tiny'), 'nanoloop_folder': ('u', 'tiny'),
                 'gpt2_folder': (gpt2_dir, 'tok'), 'gpt2_by_name': ('gpt2', 'tok')}[kind]
    ckpt = tmp_path / 'x' / 'ckpt.pt'
    ckpt.parent.mkdir()
    ckpt.write_bytes(b'an earlier run')
    before = snapshot(ckpt)
    args = [*TINY, f'--dataset={data}', f'--init_from={src}', *RETROFIT, '--max_iters=2', '--out_dir=x']
    code, out, err = run_train(args, tmp_path)
    assert_clean_error(code, err, 'already exists', '--init_from=resume')
    assert snapshot(ckpt) == before


def test_train_py_ramps_each_steps_loop_count_over_its_share_of_max_iters(tmp_path, monkeypatch):
    # loop_schedule is a share of max_iters, not a step count: 0.5 of 14 steps ramps the loop count over
    # steps 0-6 (the mean 1 + 3 it / 7, rounded: 1.00 1.43 1.86 2.29 2.71 3.14 3.57), then n_loop = 4.
    # Recorded at the model's training forwards, step by step, through train.py itself
    seen, forward = [], GPT.forward

    def spy(self, idx, targets=None, n_loop=None):
        if self.training and targets is not None:
            seen.append(n_loop)
        return forward(self, idx, targets, n_loop)
    monkeypatch.setattr(GPT, 'forward', spy)
    write_data(tmp_path)
    args = [*TINY, '--n_loop=4', '--loop_schedule=0.5', '--max_iters=14', '--eval_interval=14', '--out_dir=c']
    code, out, err = run_train(args, tmp_path)
    assert code == 0, err
    assert seen == [1, 1, 2, 2, 3, 3, 4] + [4] * 7


def test_without_transformers_init_from_gpt2_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, 'transformers', None)  # import transformers now raises ImportError
    with pytest.raises(SystemExit):
        retrofit.gpt2_source('gpt2')
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and 'pip install transformers' in err


def test_a_retrofit_stopped_mid_curriculum_resumes_bit_exact(tmp_path):
    # pretrain a unique model here, retrofit it with a sampled depth whose mean ramps over the whole run;
    # a stop signal somewhere in the ramp, then the same run resumed, equals the run without a stop
    write_data(tmp_path)
    code, out, err = run_train([*TINY, '--n_layer=4', '--n_loop=1', '--max_iters=2', '--out_dir=u'], tmp_path)
    assert code == 0, err
    args = [*TINY, '--init_from=u', *RETROFIT, '--loop_sampling=poisson_lognormal', '--loop_schedule=1.0',
            '--max_iters=300', '--eval_interval=100', '--log_interval=1']
    code, out_a, err = run_train([*args, '--out_dir=a'], tmp_path)
    assert code == 0, err
    env = cli_env(PYTHONUNBUFFERED='1')  # each line as it is printed
    p = subprocess.Popen(train_command([*args, '--out_dir=b']), cwd=tmp_path, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in p.stdout:
        if line.startswith('iter 20:'):
            p.send_signal(signal.SIGUSR1)
            break
    p.communicate(timeout=120)
    assert p.returncode == 0
    stopped = torch.load(tmp_path / 'b' / 'ckpt.pt', weights_only=True)['iter_num']
    assert 20 < stopped < 300, stopped  # mid-curriculum
    code, out_b, err = run_train(['--init_from=resume', '--out_dir=b'], tmp_path)
    assert code == 0, err
    rows = lambda d: [{k: v for k, v in r.items() if k != 'time'}
                      for r in read_metrics(tmp_path / d / 'metrics.jsonl')]
    assert rows('a') == rows('b')
    losses = lambda out: [line.split(', time')[0] for line in out.splitlines() if line.startswith('iter ')]
    assert losses(out_a)[stopped:] == losses(out_b)  # the same losses and drawn loop counts from there
    a, b = (torch.load(tmp_path / d / 'ckpt.pt', weights_only=True)['model'] for d in 'ab')
    assert all(torch.equal(a[k], b[k]) for k in a)

# -----------------------------------------------------------------------------
# the laptop sweep (lab/ablate.py retrofit): equal FLOPs, and verdicts by the one rule

import retrofit_sweep as sweep  # lab/retrofit_sweep.py (lab/ is on sys.path: conftest)


@pytest.fixture(scope='module')
def sweep_runs():
    a = sweep.parser().parse_args(['--seeds=1', '--loops=2,4', '--pretrain_iters=100', '--retrofit_iters=40'])
    a.seeds, a.loops = [1], [2, 4]
    sweep.BASE_MODEL.update(sweep.base_model())
    return {r['arm']: r for r in sweep.plan(a)}


def test_the_arms_spend_the_retrofits_total_flops(sweep_runs):
    per_token = sweep.model_flops
    pre = sweep.TOKENS * 100 * per_token(sweep.UNIQUE)
    for R in (2, 4):
        looped = {**sweep.LOOPED, 'n_loop': R}
        # the retrofit pays the loop count its curriculum gives each step: 1 at first, R from step 20 on
        cfg = gpt_config({**sweep.BASE_MODEL, **looped})
        counts = [ops.loop_count(cfg, None, it, 20) for it in range(40)]
        assert counts[0] == 1 and counts[20:] == [R] * 20
        extra = sweep.TOKENS * sum(per_token(looped, n_loop=r) for r in counts)
        rf, sc, more = (sweep_runs[f'{arm}_R{R}'] for arm in ('retrofit', 'scratch', 'unique_more'))
        assert rf['flops'] == pytest.approx(pre + extra) and rf['cost'] == pytest.approx(extra)
        # scratch trains as long as pretraining + retrofit cost; the unique model trains on for the extra
        step = sweep.TOKENS * per_token(looped)
        assert abs(sc['flags']['max_iters'] * step - (pre + extra)) <= step / 2
        step = sweep.TOKENS * per_token(sweep.UNIQUE)
        assert abs((more['flags']['max_iters'] - 100) * step - extra) <= step / 2
        assert rf['flags']['init_from'] == more['start'] == sweep_runs['unique']['out_dir']


def fake_runs(gap_scratch, gap_more, noise, seeds=(1, 2, 3, 4)):
    """Finished runs whose val CE is given: the retrofit at 2.0 + noise per seed, the others a gap above."""
    runs = []
    for i, s in enumerate(seeds):
        e = noise * (-1) ** i * (1 + i / 4)
        runs += [dict(arm='retrofit_R2', R=2, seed=s, val_ce=[2.2, 2.0 + e, 2.1, 2.3]),
                 dict(arm='scratch_R2', R=2, seed=s, val_ce=[2.5, 2.0 + gap_scratch - e, 2.1, 2.3]),
                 dict(arm='unique_more_R2', R=1, seed=s, val_ce=[2.0 + gap_more - e])]
    return sweep.arms(runs)


def test_the_sweeps_verdicts_come_from_the_rule():
    words = lambda by: {k: w for k, w, n, why in sweep.claims(by, [2])}
    v = words(fake_runs(gap_scratch=0.1, gap_more=-0.1, noise=0.005))
    assert v['beats scratch at equal total FLOPs, R = 2'] == 'reproduces'       # lower, beyond noise
    assert v['beats the unique model trained on, R = 2'] == 'does not reproduce'  # the unique model wins
    assert v['gains from more test-time loops, R = 2'] == 'reproduces'          # k = 2 beats k = 1
    assert v['gains past the trained R, R = 2'] == 'does not reproduce'         # k = 4 is worse than k = 2
    v = words(fake_runs(gap_scratch=0.01, gap_more=0.01, noise=0.05))
    assert {v['beats scratch at equal total FLOPs, R = 2'], v['beats the unique model trained on, R = 2']} \
        == {'inconclusive'}


@pytest.mark.parametrize('name', ['retrofit', 'retrofit_long'])
def test_the_committed_report_is_the_rule_on_its_runs(name):
    # assets/<name>.md's verdict lines are what claims() gives on assets/<name>.json's runs
    import json
    runs = json.load(open(os.path.join(REPO, 'assets', f'{name}.json')))
    text = open(os.path.join(REPO, 'assets', f'{name}.md')).read()
    verdicts = sweep.claims(sweep.arms(runs), [2, 4])
    assert len(verdicts) == 8
    for key, word, n, why in verdicts:
        assert f"- {key}: {word} ({n} seeds); {why}" in text


def test_a_gpt2_that_cannot_be_loaded_is_one_line(tmp_path, capsys):
    # offline with a hub name, or a folder of something else: transformers' error in one line, what to do
    (tmp_path / 'config.json').write_text('{"model_type": "gpt2"}')
    with pytest.raises(SystemExit):
        retrofit.gpt2_source(str(tmp_path))
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and 'could not load it' in err and 'save_pretrained' in err


@pytest.mark.parametrize('env', [dict(HF_HUB_OFFLINE='1'), dict(HF_ENDPOINT='http://127.0.0.1:9')],
                         ids=['HF_HUB_OFFLINE', 'hub unreachable'])
def test_offline_init_from_gpt2_fails_in_seconds_not_after_the_hubs_retries(tmp_path, env):
    # transformers retries an unreachable hub for ~25-45 s; with none reachable only its cache is read
    code = "from run.retrofit import gpt2_source; gpt2_source('gpt2')"
    env = {**os.environ, 'HF_HOME': str(tmp_path / 'hf'), 'PYTHONPATH': str(REPO), **env}
    env.pop('HF_HUB_OFFLINE', None) if 'HF_ENDPOINT' in env else None
    t0 = time.time()
    r = subprocess.run([sys.executable, '-c', code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and r.stderr.count('\n') == 1 and 'save_pretrained' in r.stderr, r.stderr
    assert time.time() - t0 < 15, time.time() - t0  # imports included
