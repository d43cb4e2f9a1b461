"""
train.py, configurator.py and the config files: the training loop runs end to end, every config file runs,
overrides compose in order, and the eval block reports every exit and every loop norm.

Most runs here execute train.py in this process (runpy), which is fast and sees exactly what the command
line would: a clean error is a SystemExit(1) with one line on stderr, anything else would be a traceback.
A few tests start real subprocesses to pin the command line itself.
"""
import functools
import glob
import json
import os

import numpy as np
import pytest
import torch

from conftest import REPO, TEXT, TINY, read_metrics, run_train, run_train_process, write_data


@functools.lru_cache(maxsize=1)
def train_defaults():
    """Every config key with its default, as train.py itself resolves them (its globals + GPTConfig)."""
    r = run_train_process(['--print_config=True'], REPO)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


# -----------------------------------------------------------------------------

def test_train_runs_end_to_end_writes_checkpoint_and_resumes(tmp_path):
    # the real command line: a few iterations, a checkpoint in train.py's format, then a resume that continues
    write_data(tmp_path)
    r = run_train_process([*TINY, '--max_iters=4', '--eval_interval=2', '--out_dir=out'], tmp_path)
    assert r.returncode == 0, r.stderr
    assert 'step 4:' in r.stdout and 'saving checkpoint' in r.stdout
    ckpt = torch.load(tmp_path / 'out' / 'ckpt.pt', weights_only=True)
    for key in ('model', 'model_args', 'optimizer', 'scaler', 'iter_num', 'best_val_loss', 'config',
                'dataset', 'rng', 'data_rng', 'world_size'):
        assert key in ckpt, key
    assert ckpt['iter_num'] == 4 and ckpt['dataset'] == 'tiny' and ckpt['world_size'] == 1
    assert not any(k.startswith(('_orig_mod.', 'module.')) for k in ckpt['model'])
    r = run_train_process(['--init_from=resume', '--out_dir=out', '--max_iters=6', '--eval_interval=2'],
                          tmp_path)
    assert r.returncode == 0, r.stderr
    assert 'resuming from' in r.stdout and 'iter 4:' in r.stdout and 'step 6:' in r.stdout
    assert "max_iters 4 -> 6" in r.stdout  # a schedule change is allowed and printed
    assert [m['iter'] for m in read_metrics(tmp_path / 'out' / 'metrics.jsonl')] == [0, 2, 4, 6]


def test_eval_block_reports_ce_at_every_exit_and_norm_of_every_loop(tmp_path):
    write_data(tmp_path)
    code, out, err = run_train([*TINY, '--n_loop=3', '--max_iters=2', '--eval_interval=1', '--out_dir=out'],
                               tmp_path)
    assert code == 0, err
    assert 'exit k' in out and 'train CE' in out and 'val CE' in out and '||h_k||' in out
    rows = read_metrics(tmp_path / 'out' / 'metrics.jsonl')
    assert [r['iter'] for r in rows] == [0, 1, 2]
    for r in rows:
        for key in ('iter', 'train_ce', 'val_ce', 'norm', 'train_loss', 'val_loss', 'lr', 'time'):
            assert key in r, key
        assert len(r['train_ce']) == len(r['val_ce']) == len(r['norm']) == 3
        assert r['val_loss'] == r['val_ce'][-1] and r['train_loss'] == r['train_ce'][-1]
        assert all(n > 0 for n in r['norm'])


@pytest.mark.parametrize('config_file', sorted(glob.glob(os.path.join(REPO, 'config', '*.py'))),
                         ids=lambda p: os.path.basename(p))
def test_every_config_file_runs_two_iterations(config_file, tmp_path):
    # GPU presets too: the tiny overrides come after the file, so size, data and device are local and small
    write_data(tmp_path)
    # (from scratch: a preset that starts from GPT-2's weights would download them; tests/test_retrofit.py)
    code, out, err = run_train([config_file, *TINY, '--max_iters=2', '--eval_interval=2',
                                '--init_from=scratch', '--out_dir=out'], tmp_path)
    assert code == 0, err
    assert 'step 2:' in out
    ckpt = torch.load(tmp_path / 'out' / 'ckpt.pt', weights_only=True)
    assert ckpt['iter_num'] == 2
    # the arm's own keys reached the model
    ns = {}
    exec(open(config_file).read(), ns)
    for key in ('readout', 'supervision', 'norm_penalty', 'inter_loop_norm', 'block', 'depth_scaling'):
        if key in ns:
            assert ckpt['model_args'][key] == ns[key], key


def test_config_files_compose_in_order_then_flags_override(tmp_path):
    import configurator
    defaults = train_defaults()
    preset, arm = os.path.join(REPO, 'config', 'paper_44m.py'), os.path.join(REPO, 'config', 'loop_raw.py')
    config, explicit = configurator.configure(defaults, [preset, arm, '--learning_rate=1e-3', '--n_loop=2'])
    assert config['n_embd'] == 512 and config['dataset'] == 'wikitext103_word'  # from the preset
    assert config['readout'] == 'raw' and config['supervision'] == 'per_loop'  # from the arm, applied after
    assert config['learning_rate'] == 1e-3 and config['n_loop'] == 2          # flags win
    assert {'n_embd', 'readout', 'learning_rate'} <= explicit and 'seed' not in explicit
    # a file that assigns a default value still counts as setting it (resume compares it with the checkpoint)
    f = tmp_path / 'same.py'
    f.write_text(f"readout = {defaults['readout']!r}\nn_head = n_embd // 32\n")
    config, explicit = configurator.configure(defaults, [str(f)])
    assert 'readout' in explicit and config['n_head'] == defaults['n_embd'] // 32


def test_override_values_are_typed_like_their_defaults():
    import configurator
    d = train_defaults()
    c, _ = configurator.configure(d, ['--learning_rate=3', '--dataset=wikitext103', '--compile=True',
                                      '--depth_scaling=0.3', '--n_layer=3'])
    # an int is accepted where a float is expected
    assert c['learning_rate'] == 3.0 and isinstance(c['learning_rate'], float)
    assert c['dataset'] == 'wikitext103'            # not a Python literal: taken as a string
    assert c['compile'] is True and c['n_layer'] == 3
    assert c['depth_scaling'] == 0.3                # a number, or a name
    c, _ = configurator.configure(d, ['--depth_scaling=deeploop'])
    assert c['depth_scaling'] == 'deeploop'


def help_line(out, key):
    """The line of --help's output that lists key."""
    return next(line for line in out.splitlines() if line.startswith(f'  {key} = '))


@pytest.mark.parametrize('flag', ['--help', '-h'])
def test_help_lists_every_key_with_its_default_and_comment_grouped_as_in_the_files(flag, tmp_path):
    # a folder without data: --help exits before any data or model work
    r = run_train_process([flag], tmp_path)
    assert r.returncode == 0 and 'error' not in r.stderr, r.stderr
    out = r.stdout
    assert out.startswith('usage: python train.py ') and os.listdir(tmp_path) == []
    assert [k for k in train_defaults() if f'\n  {k} = ' not in out] == []  # train.py's and GPTConfig's
    assert help_line(out, 'learning_rate').split('#')[0].strip() == 'learning_rate = 1e-3'
    assert '# max learning rate' in help_line(out, 'learning_rate')
    assert '# R: rounds through that stack' in help_line(out, 'n_loop')
    assert '# before the LM head: rmsnorm | layernorm | raw | final_only' in help_line(out, 'readout')
    # the groups of the files, in their order: train.py's comment headers, then GPTConfig's sections
    at = lambda text: out.index(text)
    assert at('# AdamW optimizer') < at('  learning_rate = ') < at('# system') < at('  dtype = ') \
        < at("the model's keys") < at('  n_loop = ') < at('# §1 the readout blind spot') < at('  readout = ')
    # a comment that goes on over a second line stays with its key
    lines = out.splitlines()
    assert 'else fp16 on CUDA' in lines[lines.index(help_line(out, 'dtype')) + 1]


def test_lr_schedules_constant_and_warmup_cosine(tmp_path):
    write_data(tmp_path)
    code, out, err = run_train([*TINY, '--max_iters=6', '--eval_interval=1', '--out_dir=c',
                                '--learning_rate=1e-3', '--lr_schedule=constant'], tmp_path)
    assert code == 0, err
    assert {r['lr'] for r in read_metrics(tmp_path / 'c' / 'metrics.jsonl')} == {1e-3}
    code, out, err = run_train([*TINY, '--max_iters=6', '--eval_interval=1', '--out_dir=w',
                                '--learning_rate=1e-3', '--lr_schedule=cosine', '--warmup_iters=2',
                                '--lr_decay_iters=5', '--min_lr=1e-4'], tmp_path)
    assert code == 0, err
    lrs = [r['lr'] for r in read_metrics(tmp_path / 'w' / 'metrics.jsonl')]
    # warmup (it+1)/(warmup+1) * lr, then cosine from lr to min_lr at lr_decay_iters, then min_lr
    expect = [1e-3 / 3, 2e-3 / 3, 1e-3, 1e-4 + 0.5 * (1 + np.cos(np.pi / 3)) * 9e-4,
              1e-4 + 0.5 * (1 + np.cos(2 * np.pi / 3)) * 9e-4, 1e-4, 1e-4]
    assert np.allclose(lrs, expect, rtol=1e-9)


def test_default_run_downloads_and_prepares_missing_shakespeare_char(tmp_path, monkeypatch):
    # no data/ folder: the embedded default downloads tinyshakespeare once and prepares it; the download
    # is served from a local file:// URL here (urllib reads both), so the real path runs offline
    import prepare
    text = TEXT * 40
    (tmp_path / 'input.txt').write_text(text, encoding='utf-8')
    monkeypatch.setattr(prepare, 'SHAKESPEARE_URL', (tmp_path / 'input.txt').as_uri())
    tiny = [a for a in TINY if not a.startswith('--dataset')]
    code, out, err = run_train([*tiny, '--max_iters=1', '--eval_interval=1', '--out_dir=out'], tmp_path)
    assert code == 0, err
    assert 'preparing it' in out and 'downloading' in out and 'step 1:' in out
    meta = json.loads((tmp_path / 'data' / 'shakespeare_char' / 'meta.json').read_text())
    assert meta['vocab_size'] == len(set(text)) and meta['tokenizer'] == 'char'
    assert (tmp_path / 'data' / 'shakespeare_char' / 'input.txt').read_text(encoding='utf-8') == text


def test_dtype_auto_says_what_it_chose_and_why(tmp_path):
    # auto: bf16 autocast on a CPU with bf16 units, fp32 on one without (hardware.auto_dtype); the startup
    # line names the choice and its reason
    from compute.hardware import auto_dtype
    write_data(tmp_path)
    args = [a for a in TINY if not a.startswith('--dtype')] + ['--max_iters=1', '--eval_interval=1']
    code, out, err = run_train([*args, '--out_dir=out'], tmp_path)
    assert code == 0, err
    dtype, why = auto_dtype('cpu')
    assert f"device: cpu, 1 threads, {dtype} (auto: {why}), 1 process(es)" in out
    code, out, err = run_train([*args, '--dtype=float32', '--out_dir=out32'], tmp_path)
    assert code == 0 and "device: cpu, 1 threads, float32, 1 process(es)" in out

    code, out, err = run_train([*args, '--dtype=float16', '--out_dir=out16'], tmp_path)
    assert code == 0 and "float16 (warning: float16 is far slower than float32 or bfloat16 on a CPU" in out


def test_max_iters_0_saves_the_model_as_built_and_says_where(tmp_path):
    # a conversion: init_from's model (here a run of ours, retrofitted with a prelude) saved without training
    write_data(tmp_path)
    code, out, err = run_train([*TINY, '--n_layer=2', '--n_loop=1', '--max_iters=2', '--eval_interval=2',
                                '--out_dir=src'], tmp_path)
    assert code == 0, err
    code, out, err = run_train([*TINY, '--max_iters=0', '--init_from=src', '--n_prelude=1', '--out_dir=conv'],
                               tmp_path)
    assert code == 0, err
    ckpt = torch.load(tmp_path / 'conv' / 'ckpt.pt', weights_only=False)
    src = torch.load(tmp_path / 'src' / 'ckpt.pt', weights_only=False)
    assert ckpt['iter_num'] == 0 and f"checkpoint {os.path.join('conv', 'ckpt.pt')}" in out
    for part, j in (('prelude', 0), ('h', 1)):  # source layers 0 | 1 as prelude | loop, unchanged
        assert torch.equal(ckpt['model'][f'transformer.{part}.0.attn.c_attn.weight'],
                           src['model'][f'transformer.h.{j}.attn.c_attn.weight'])

def test_per_loop_rmsnorm_default_shows_growing_loop_norms(tmp_path):
    # the embedded default is paper 1's blind-spot setting (per-loop CE, RMSNorm readout, reference init);
    # even a few dozen steps at d 32 show ||h_k|| growing with k and with training (docs/papers.md §1)
    write_data(tmp_path)
    args = ['--n_layer=1', '--n_loop=4', '--n_head=2', '--n_embd=32', '--block_size=16', '--batch_size=8',
            '--eval_iters=2', '--device=cpu', '--dataset=tiny', '--max_iters=40', '--eval_interval=40',
            '--log_interval=100', '--out_dir=out']
    code, out, err = run_train(args, tmp_path)
    assert code == 0, err
    first, last = read_metrics(tmp_path / 'out' / 'metrics.jsonl')
    assert last['norm'][-1] > first['norm'][-1]                 # grows with training
    assert all(a < b for a, b in zip(last['norm'], last['norm'][1:]))  # and with depth
    assert last['val_loss'] < first['val_loss']


def test_log_kappa_writes_the_visit_alignment_at_every_eval_and_only_when_asked(tmp_path):
    # docs/papers.md §2: kappa_R = ||sum_r G_r||^2 / sum_r ||G_r||^2 lies in [0, R]; it is R only if every
    # visit pushes a shared matrix the same way, which distinct visits of a random model do not; one visit: 1
    write_data(tmp_path)
    for R in (3, 1):
        code, out, err = run_train([*TINY, f'--n_loop={R}', '--max_iters=2', '--eval_interval=1',
                                    '--log_kappa=True', f'--out_dir=R{R}'], tmp_path)
        assert code == 0, err
        assert 'kappa_R' in out
    rows = read_metrics(tmp_path / 'R3' / 'metrics.jsonl')
    assert [r['iter'] for r in rows] == [0, 1, 2]
    assert all(0 < r['kappa'] < 3 for r in rows), [r['kappa'] for r in rows]
    assert all(r['kappa'] == pytest.approx(1.0) for r in read_metrics(tmp_path / 'R1' / 'metrics.jsonl'))
    code, out, err = run_train([*TINY, '--max_iters=1', '--eval_interval=1', '--out_dir=off'], tmp_path)
    assert code == 0, err
    assert 'kappa_R' not in out
    assert all('kappa' not in r for r in read_metrics(tmp_path / 'off' / 'metrics.jsonl'))


def test_log_kappa_logs_the_mean_over_matrices_of_kappa_on_one_fixed_training_batch(tmp_path):
    # the kappa of eval k is that of the weights saved at eval k, on the training batch drawn by a generator
    # seeded with seed + 1 (the same batch at every eval); recomputed here from the checkpoint and train.bin
    from run import checkpoint
    from run import diagnostics as eval_depth
    write_data(tmp_path)
    code, out, err = run_train([*TINY, '--n_loop=3', '--max_iters=2', '--eval_interval=1', '--log_kappa=True',
                                '--out_dir=out'], tmp_path)
    assert code == 0, err
    logged = read_metrics(tmp_path / 'out' / 'metrics.jsonl')[-1]
    assert logged['iter'] == 2
    ckpt = checkpoint.load(str(tmp_path / 'out' / 'ckpt.pt'))
    assert ckpt['iter_num'] == 2
    model = checkpoint.build_model(ckpt).eval()
    data = np.memmap(tmp_path / 'data' / 'tiny' / 'train.bin', dtype=np.uint16, mode='r')
    ix = torch.randint(len(data) - 16, (4,), generator=torch.Generator().manual_seed(1337 + 1)).tolist()
    X = torch.stack([torch.from_numpy(data[i:i + 16].astype(np.int64)) for i in ix])
    Y = torch.stack([torch.from_numpy(data[i + 1:i + 17].astype(np.int64)) for i in ix])
    kappas = []
    for name, G in eval_depth.visit_gradients(model, X, Y).items():  # G: the R per-visit gradients
        total = sum(G)
        kappas.append(float((total * total).sum() / sum((g * g).sum() for g in G)))  # kappa by hand
    assert len(kappas) == 4 and max(kappas) - min(kappas) > 1e-3  # the mean is not the minimum here
    assert logged['kappa'] == pytest.approx(sum(kappas) / len(kappas), rel=1e-5)


# -----------------------------------------------------------------------------
# denormals: fp32 values below 2^-126 count as zero in training (hardware.flush_denormals)

def denormal_product():
    """1e-20 squared: 1e-40, below float32's smallest normal number (~1.2e-38), so a denormal or zero."""
    x = torch.tensor([1e-20])
    return (x * x).item()


@pytest.fixture
def can_flush():
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot count denormals as zero (torch.set_flush_denormal is x86-only)")
    torch.set_flush_denormal(False)  # the test starts with denormals on; conftest resets after it


def test_flush_denormals_makes_a_product_below_the_smallest_normal_float_exactly_zero(can_flush):
    from compute.hardware import flush_denormals
    assert denormal_product() > 0  # a denormal, by default
    flush_denormals()
    assert denormal_product() == 0.0


def test_a_train_py_process_counts_denormals_as_zero(tmp_path, can_flush):
    # a real process running train.py, asked after the run (an exit handler: train.py may sys.exit): an
    # underflowing early-exit softmax made a CPU step ~20x slower with denormals on
    write_data(tmp_path)
    args = [*TINY, '--max_iters=1', '--eval_interval=1', '--out_dir=out']
    r = run_train_process(args, tmp_path, hook='denormals_at_exit')
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines()[-1] == 'after train.py: 1e-20 ** 2 = 0.0', r.stdout[-2000:]


def test_every_seed_is_scored_on_one_fixed_validation_set(tmp_path):
    # a seed varies the init and the data order, never the eval batches: the same weights evaluated
    # under two seeds give the same CE at every exit, train and val
    write_data(tmp_path)
    code, out, err = run_train([*TINY, '--max_iters=2', '--eval_interval=2', '--out_dir=out'], tmp_path)
    assert code == 0, err
    scores = []
    for seed in (1, 2):
        args = ['--init_from=resume', '--out_dir=out', '--eval_only=True', f'--seed={seed}']
        code, out, err = run_train(args, tmp_path)
        assert code == 0, err
        scores.append([line for line in out.splitlines() if 'CE' in line])
    assert scores[0] == scores[1] and len(scores[0]) == 2
