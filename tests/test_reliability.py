"""
Never lose a run: exact resume, crash-safe checkpoints, the non-finite guard, one-line errors, DDP parity.
Each test pins one guarantee of the README's "Reliability" section and fails without the code behind it.
"""
import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import (REPO, TINY, cli_env, read_metrics, run_train, run_train_process, skip_without_torchrun,
                      tiny_gpt, train_command, write_data)
from test_train import train_defaults

import configurator
import prepare
from run import checkpoint


def snapshot(path):
    """bytes and mtime of a file: 'untouched' means both are unchanged"""
    with open(path, 'rb') as f:
        return f.read(), os.stat(path).st_mtime_ns


def assert_clean_error(code, err, *fragments):
    lines = err.strip().splitlines()
    assert code == 1, (code, err)
    assert len(lines) == 1 and lines[0].startswith('error: '), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture
def run_dir(tmp_path):
    """tmp_path with data/tiny and a checkpoint out/ckpt.pt from a 2-iteration run"""
    write_data(tmp_path)
    code, out, err = run_train([*TINY, '--max_iters=2', '--eval_interval=2', '--out_dir=out'], tmp_path)
    assert code == 0, err
    return tmp_path


def model_tensors_equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

# -----------------------------------------------------------------------------
# exact resume

def test_resume_is_bit_exact_2n_equals_n_plus_n(tmp_path):
    # dropout and gradient accumulation on, so the restored torch RNG and the data-order generator both matter
    write_data(tmp_path)
    common_args = [*TINY, '--dropout=0.1', '--gradient_accumulation_steps=2', '--eval_interval=1']
    a = run_train_process([*common_args, '--max_iters=6', '--out_dir=a'], tmp_path)
    b1 = run_train_process([*common_args, '--max_iters=3', '--out_dir=b'], tmp_path)
    b2 = run_train_process(['--init_from=resume', '--max_iters=6', '--out_dir=b'], tmp_path)
    for r in (a, b1, b2):
        assert r.returncode == 0, r.stderr
    drop_time = lambda rows: [{k: v for k, v in r.items() if k != 'time'} for r in rows]
    rows_a = read_metrics(tmp_path / 'a' / 'metrics.jsonl')
    rows_b = read_metrics(tmp_path / 'b' / 'metrics.jsonl')
    assert [r['iter'] for r in rows_a] == list(range(7))
    assert drop_time(rows_a) == drop_time(rows_b)  # every exit's CE and every loop norm, bit for bit
    losses = lambda out: [line.split(', time')[0] for line in out.splitlines() if line.startswith('iter ')]
    assert losses(a.stdout) == losses(b1.stdout) + losses(b2.stdout)
    ca, cb = (torch.load(tmp_path / d / 'ckpt.pt', weights_only=True) for d in 'ab')
    assert model_tensors_equal(ca['model'], cb['model'])
    for pa, pb in zip(ca['optimizer']['state'].values(), cb['optimizer']['state'].values()):
        assert model_tensors_equal(pa, pb)


def test_resume_with_architecture_change_names_every_differing_key(run_dir):
    before = snapshot(run_dir / 'out' / 'ckpt.pt')
    code, out, err = run_train(['--init_from=resume', '--out_dir=out', '--n_embd=32', '--readout=raw'],
                               run_dir)
    assert_clean_error(code, err, 'n_embd=32', 'readout=', 'architecture')
    assert snapshot(run_dir / 'out' / 'ckpt.pt') == before


def make_previous_version(path):
    """The checkpoint as earlier model.py versions wrote it: its config had bias, tie_weights and
    exit_weights (always False, True and () in practice), train.py's vocab_size=0 meant 'from meta.json',
    and there was no attn_impl key yet."""
    ckpt = torch.load(path, weights_only=True)
    ckpt['model_args'].update(bias=False, tie_weights=True, exit_weights=())
    ckpt['config'].update(bias=False, tie_weights=True, exit_weights=(), vocab_size=0)
    for args in (ckpt['model_args'], ckpt['config']):
        del args['attn_impl']
    torch.save(ckpt, path)
    return ckpt


def test_a_checkpoint_of_the_previous_version_loads_samples_and_resumes(run_dir):
    ckpt = make_previous_version(run_dir / 'out' / 'ckpt.pt')
    model = checkpoint.build_model(checkpoint.load(str(run_dir / 'out' / 'ckpt.pt')))
    assert model_tensors_equal(model.state_dict(), ckpt['model'])
    code, out, err = run_train(['--init_from=resume', '--out_dir=out', '--max_iters=3'], run_dir)
    assert code == 0, err
    assert torch.load(run_dir / 'out' / 'ckpt.pt', weights_only=True)['iter_num'] == 3


def test_resume_may_change_the_attention_kernel_but_not_the_architecture(run_dir):
    # attn_impl picks how attention is computed, not what: a resume may switch it, and says so
    args = ['--init_from=resume', '--out_dir=out', '--max_iters=3', '--attn_impl=explicit']
    code, out, err = run_train(args, run_dir)
    assert code == 0, err
    assert "resume: attn_impl 'auto' -> 'explicit'" in out
    assert torch.load(run_dir / 'out' / 'ckpt.pt', weights_only=True)['model_args']['attn_impl'] == 'explicit'


def test_a_checkpoint_with_a_retired_setting_is_refused_in_one_line(run_dir, capsys):
    path = run_dir / 'out' / 'ckpt.pt'
    ckpt = make_previous_version(path)
    ckpt['model_args']['tie_weights'] = False
    torch.save(ckpt, path)
    with pytest.raises(SystemExit):
        checkpoint.load(str(path))
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and 'tie_weights=False' in err and 'no longer implements' in err


def test_a_previous_version_checkpoint_with_loop_eps_loads_it_as_loop_lambda(tmp_path):
    # model.py once named loop_lambda loop_eps: such a checkpoint builds the model it trained, its value kept
    model = tiny_gpt(loop_lambda=0.5, block='preln')
    args = {('loop_eps' if k == 'loop_lambda' else k): v for k, v in vars(model.config).items()}
    path = str(tmp_path / 'ckpt.pt')
    torch.save({'model': model.state_dict(), 'model_args': args}, path)
    ckpt = checkpoint.load(path)
    assert ckpt['model_args']['loop_lambda'] == 0.5 and 'loop_eps' not in ckpt['model_args']
    assert checkpoint.build_model(ckpt).config.loop_lambda == 0.5


@pytest.mark.parametrize('flag,evaluated_at', [({}, 7), ({'evaluated': True}, 7),
                                               ({'evaluated': False}, None)])
def test_a_previous_version_checkpoint_was_written_at_an_eval_a_stopped_runs_was_not(flag, evaluated_at):
    # before the flag existed a checkpoint was written only at an eval: a resume does not evaluate its
    # iteration again; a checkpoint a signal wrote (evaluated False) is evaluated where the run resumes
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.AdamW([param])
    ckpt = {'optimizer': optimizer.state_dict(), 'iter_num': 7, **flag}
    out = checkpoint.restore(ckpt, 'ckpt.pt', optimizer, torch.amp.GradScaler('cpu', enabled=False), 1, 1,
                             torch.Generator(), torch.Generator(), eval_only=False)
    assert out == (7, float('inf'), 0, evaluated_at)


def test_print_config_shows_the_resolved_config_and_touches_nothing(tmp_path):
    # no data, no out_dir: only the configurator runs
    r = run_train_process(['config/deeploop.py', '--n_loop=8', '--print_config=True'], REPO)
    assert r.returncode == 0, r.stderr
    config = json.loads(r.stdout)
    assert config['block'] == 'sandwich' and config['depth_scaling'] == 'deeploop' and config['n_loop'] == 8
    assert config['learning_rate'] == 1e-3 and config['n_layer'] == 2  # train.py's and GPTConfig's defaults
    r = run_train_process(['--print_config=True', '--n_loop=0'], tmp_path)
    assert r.returncode == 1 and r.stderr.startswith('error: n_loop=0') and not list(tmp_path.iterdir())


def test_resume_takes_the_checkpoint_config_and_prints_schedule_changes(run_dir):
    # no size flags: the architecture comes from the checkpoint, not from train.py's defaults
    code, out, err = run_train(['--init_from=resume', '--out_dir=out', '--max_iters=3',
                                '--learning_rate=5e-4'], run_dir)
    assert code == 0, err
    assert 'learning_rate 0.001 -> 0.0005' in out and 'max_iters 2 -> 3' in out
    ckpt = torch.load(run_dir / 'out' / 'ckpt.pt', weights_only=True)
    assert ckpt['iter_num'] == 3 and ckpt['model_args']['n_embd'] == 16
    assert ckpt['optimizer']['param_groups'][0]['lr'] == 5e-4


def test_resume_uses_this_runs_weight_decay_and_betas_not_the_checkpoints(run_dir):
    # the AdamW moments come from the checkpoint, the hyperparameters from this command
    shutil.copytree(run_dir / 'out', run_dir / 'same')
    code, out, err = run_train(['--init_from=resume', '--out_dir=out', '--max_iters=3', '--weight_decay=0.5',
                                '--beta2=0.9'], run_dir)
    assert code == 0, err
    assert 'weight_decay 0.01 -> 0.5' in out and 'beta2 0.99 -> 0.9' in out
    decay, no_decay = torch.load(run_dir / 'out' / 'ckpt.pt', weights_only=True)['optimizer']['param_groups']
    assert decay['weight_decay'] == 0.5 and no_decay['weight_decay'] == 0.0  # gains and biases never decay
    assert tuple(decay['betas']) == tuple(no_decay['betas']) == (0.9, 0.9)
    # ...and they are the ones that stepped: the same resume without the changes ends elsewhere
    code, out, err = run_train(['--init_from=resume', '--out_dir=same', '--max_iters=3'], run_dir)
    assert code == 0, err
    changed, same = (torch.load(run_dir / d / 'ckpt.pt', weights_only=True)['model'] for d in ('out', 'same'))
    assert not model_tensors_equal(changed, same)


def test_checkpoints_load_whether_or_not_compiled_or_ddp_wrapped(run_dir):
    from model import GPT
    ckpt = torch.load(run_dir / 'out' / 'ckpt.pt', weights_only=True)
    # what a compiled model's (and a DDP-wrapped compiled model's) state_dict keys look like
    model = checkpoint.build_model(ckpt)
    assert all(k.startswith('_orig_mod.') for k in torch.compile(model).state_dict())
    for prefix in ('_orig_mod.', 'module.', 'module._orig_mod.'):
        ckpt['model'] = {prefix + k: v for k, v in model.state_dict().items()}
        torch.save(ckpt, run_dir / 'out' / 'ckpt.pt')
        assert model_tensors_equal(checkpoint.build_model(ckpt).state_dict(), model.state_dict())
        code, out, err = run_train(['--init_from=resume', '--out_dir=out',
                                    f'--max_iters={ckpt["iter_num"] + 1}'], run_dir)
        assert code == 0, err

# -----------------------------------------------------------------------------
# crash-safe checkpoints

def test_atomic_save_keeps_the_previous_checkpoint_when_a_write_dies(tmp_path, monkeypatch):
    path = str(tmp_path / 'ckpt.pt')
    checkpoint.save({'model': {'w': torch.ones(3)}, 'model_args': {}}, path)
    before = snapshot(path)

    def dying_save(obj, f):  # writes half a file, then the process "dies"
        f.write(b'PK\x03\x04 half a zip')
        raise KeyboardInterrupt
    monkeypatch.setattr(checkpoint.torch, 'save', dying_save)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save({'model': {'w': torch.zeros(3)}, 'model_args': {}}, path)
    assert snapshot(path) == before
    monkeypatch.undo()
    assert torch.equal(checkpoint.load(path)['model']['w'], torch.ones(3))


def files(folder):
    """name -> (size, mtime) of the files in folder, metrics.jsonl aside"""
    return {e.name: (e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(folder)
            if e.is_file() and not e.name.startswith('metrics')}


def test_kill_9_during_saves_leaves_a_checkpoint_that_loads_and_resumes(tmp_path):
    # a 2M-parameter model (~25 MB checkpoints with the AdamW moments) saved every iteration. Each trial
    # resumes from what the last kill left, watches out/ and sends SIGKILL a random 0-40 ms after a save
    # starts touching the disk, i.e. in the middle of writing the checkpoint, fsyncing it or renaming it.
    write_data(tmp_path)
    args = ['--n_layer=2', '--n_loop=2', '--n_head=4', '--n_embd=256', '--block_size=16', '--batch_size=2',
            '--eval_iters=1', '--eval_interval=1', '--log_interval=1000', '--device=cpu', '--dataset=tiny',
            '--out_dir=out']
    r = run_train_process([*args, '--max_iters=1'], tmp_path)
    assert r.returncode == 0, r.stderr
    ckpt, rng, iters = tmp_path / 'out' / 'ckpt.pt', random.Random(0), []
    for trial in range(3):
        p = subprocess.Popen(train_command([*args, '--init_from=resume', '--max_iters=100000']),
                             cwd=tmp_path, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            before, deadline = files(tmp_path / 'out'), time.time() + 60
            while files(tmp_path / 'out') == before:  # poll until this process starts a save
                assert p.poll() is None, p.stderr.read().decode()
                assert time.time() < deadline, 'no save started within 60 s'
                time.sleep(0.001)
            time.sleep(rng.uniform(0.0, 0.04))
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait()
        loaded = checkpoint.load(str(ckpt))  # dies (SystemExit) if the kill had torn the file
        assert all(torch.isfinite(v).all() for v in loaded['model'].values())
        iters.append(loaded['iter_num'])
    r = run_train_process([*args, '--init_from=resume', f'--max_iters={iters[-1] + 1}'], tmp_path)
    assert r.returncode == 0, r.stderr
    assert torch.load(ckpt, weights_only=True)['iter_num'] == iters[-1] + 1

# -----------------------------------------------------------------------------
# non-finite guard

def poison_loops(monkeypatch, bad_call):
    """Make the loop states after loop 1 NaN for training forward passes whose number (1-based) satisfies
    bad_call. The NaN goes through the real loss, backward and guard; the guard's diagnosis (exit_metrics on
    the same batch, still in training mode) sees it too, so it can name the exits that went bad."""
    import model as M
    state = {'n': 0, 'armed': False}
    forward, run = M.GPT.forward, M.GPT.run

    def poisoned_forward(self, idx, targets=None, n_loop=None):
        if self.training and targets is not None:
            state['n'] += 1
            state['armed'] = bad_call(state['n'])
        return forward(self, idx, targets, n_loop)

    def poisoned_run(self, idx, n_loop=None):
        out = run(self, idx, n_loop)
        if self.training and state['armed']:
            out = out._replace(states=out.states[:1] + [h * float('nan') for h in out.states[1:]])
        return out
    monkeypatch.setattr(M.GPT, 'forward', poisoned_forward)
    monkeypatch.setattr(M.GPT, 'run', poisoned_run)


def test_nonfinite_loss_skips_the_update_names_the_exits_and_training_recovers(tmp_path, monkeypatch):
    write_data(tmp_path)
    poison_loops(monkeypatch, lambda n: n == 4)  # iteration 3 (one micro-batch per iteration)
    code, out, err = run_train([*TINY, '--n_loop=3', '--max_iters=8', '--eval_interval=4', '--out_dir=out'],
                               tmp_path)
    assert code == 0, err
    bad = [line for line in out.splitlines() if 'non-finite' in line]
    assert len(bad) == 1 and bad[0].startswith('iter 3:'), out
    assert 'update skipped (1 in a row, 1 total)' in bad[0] and 'CE at exit 2, 3' in bad[0]
    ckpt = torch.load(tmp_path / 'out' / 'ckpt.pt', weights_only=True)
    assert all(torch.isfinite(v).all() for v in ckpt['model'].values())
    steps = {float(s['step']) for s in ckpt['optimizer']['state'].values()}
    assert steps == {7.0}  # 8 iterations, one update skipped: AdamW never saw the NaN gradient
    assert read_metrics(tmp_path / 'out' / 'metrics.jsonl')[-1]['bad_steps'] == 1


def test_consecutive_nonfinite_steps_stop_the_run_with_one_line(tmp_path, monkeypatch):
    write_data(tmp_path)
    poison_loops(monkeypatch, lambda n: n >= 4)
    code, out, err = run_train([*TINY, '--max_iters=50', '--eval_interval=2', '--max_bad_steps=3',
                                '--out_dir=out'], tmp_path)
    assert_clean_error(code, err, 'stopping at iter 5', '3 consecutive', 'max_bad_steps=3')
    ckpt = torch.load(tmp_path / 'out' / 'ckpt.pt', weights_only=True)
    assert ckpt['iter_num'] == 4 and all(torch.isfinite(v).all() for v in ckpt['model'].values())


def test_a_checkpoint_with_nonfinite_weights_is_never_written(tmp_path, monkeypatch):
    # break the weights themselves after the 3rd update (the guard cannot undo that): the next eval refuses
    # to save, so out/ckpt.pt stays the last good one (iter 2)
    write_data(tmp_path)
    step, n = torch.optim.AdamW.step, {'steps': 0}

    def breaking_step(self, *args, **kwargs):
        result = step(self, *args, **kwargs)
        n['steps'] += 1
        if n['steps'] == 3:
            self.param_groups[0]['params'][0].data.fill_(float('nan'))
        return result
    monkeypatch.setattr(torch.optim.AdamW, 'step', breaking_step)
    code, out, err = run_train([*TINY, '--max_iters=10', '--eval_interval=2', '--max_bad_steps=100',
                                '--out_dir=out'], tmp_path)
    assert_clean_error(code, err, 'non-finite weights at iter 4', 'not saving')
    ckpt = torch.load(tmp_path / 'out' / 'ckpt.pt', weights_only=True)
    assert ckpt['iter_num'] == 2 and all(torch.isfinite(v).all() for v in ckpt['model'].values())

# -----------------------------------------------------------------------------
# one-line errors: every row gives one line on stderr, exit 1, no traceback, and leaves out/ckpt.pt untouched

def bad_token_data(root):
    folder = write_data(root, 'badtok')
    ids = np.fromfile(os.path.join(folder, 'train.bin'), dtype=np.uint16)
    ids[123] = 200  # >= vocab_size
    ids.tofile(os.path.join(folder, 'train.bin'))

def edit_meta(root, changes):
    path = os.path.join(root, 'data', 'tiny', 'meta.json')
    meta = json.load(open(path))
    meta.update(changes(meta))
    json.dump(meta, open(path, 'w'))

def write_file(path, data):
    with open(path, 'wb') as f:
        f.write(data)

ABSENT_DEVICE = 'mps' if torch.cuda.is_available() else 'cuda'  # no machine has both

ERROR_ROWS = {
    # name: (setup(root) or None, args, fragments of the one-line message)
    'unknown_key': (None, ['--n_layers=3'], ["unknown config key 'n_layers'", 'did you mean n_layer?']),
    'unknown_key_near_nothing': (None, ['--xyzzy=3'],
                                 ["unknown config key 'xyzzy'", 'see python train.py --help']),
    'device_not_here': (None, [f'--device={ABSENT_DEVICE}'],
                        [f'--device={ABSENT_DEVICE}', 'not available on this machine']),
    'unknown_key_in_file': (lambda r: write_file(r / 'arm.py', b"readuot = 'raw'\n"), ['arm.py'],
                            ['arm.py', "'readuot'", 'did you mean readout?']),
    'wrong_type_int': (None, ['--n_layer=two'], ["n_layer='two'", 'expected int']),
    'wrong_type_bool': (None, ['--compile=1'], ['compile=1', 'expected bool']),
    'wrong_type_float': (None, ['--learning_rate=fast'], ["learning_rate='fast'", 'expected float']),
    'choice_model': (None, ['--readout=softmax'],
                     ["readout='softmax'", 'choose one of rmsnorm, layernorm, raw']),
    'choice_train': (None, ['--lr_schedule=linear'],
                     ["lr_schedule='linear'", 'choose one of constant, cosine']),
    'choice_init_from': (None, ['--init_from=latest'], ["init_from='latest'", 'scratch, resume, auto']),
    'collective_timeout_below_1': (None, ['--collective_timeout=0'], ['collective_timeout=0', '>= 1']),
    'max_failed_saves_below_1': (None, ['--max_failed_saves=0'], ['max_failed_saves=0', '>= 1']),
    'n_embd_not_divisible': (None, ['--n_embd=30', '--n_head=4'], ['n_embd=30', 'n_head=4']),
    'block_size_longer_than_val': (None, ['--block_size=5000'], ['block_size=5000', 'val split']),
    'n_loop_below_1': (None, ['--n_loop=0'], ['n_loop=0']),
    'missing_data': (None, ['--dataset=nothere'], ['data/nothere', 'python prepare.py nothere']),
    'token_id_out_of_vocab': (bad_token_data, ['--dataset=badtok'], ['token id 200', 'vocab_size']),
    'config_file_missing': (None, ['config/nope.py'], ["'config/nope.py' not found"]),
    'config_file_typo': (lambda r: (r / 'config').mkdir() or write_file(r / 'config' / 'arm_a.py', b''),
                         ['config/arm_b.py'], ['did you mean config/arm_a.py?']),
    'dataset_typo': (None, ['--dataset=shakespeare_chr'],
                     ['did you mean shakespeare_char?', '`python prepare.py shakespeare_char`']),
    'flag_without_value': (None, ['--n_layer'], ['--n_layer', 'expected --key=value']),
    'scratch_over_a_checkpoint': (None, [], ['already exists', '--init_from=resume']),
    'meta_disagrees_with_checkpoint': (lambda r: edit_meta(r, lambda m: {'itos': m['itos'][::-1]}),
                                       ['--init_from=resume'], ['meta.json disagrees', 'itos']),
    'meta_vocab_disagrees': (lambda r: edit_meta(r, lambda m: {'vocab_size': m['vocab_size'] + 7}),
                             ['--init_from=resume'], ['meta.json disagrees', 'vocab_size']),
    'resume_missing_checkpoint': (lambda r: os.remove(r / 'out' / 'ckpt.pt'), ['--init_from=resume'],
                                  ['ckpt.pt not found']),
    'resume_truncated_checkpoint': (lambda r: write_file(r / 'out' / 'ckpt.pt',
                                                         open(r / 'out' / 'ckpt.pt', 'rb').read()[:5000]),
                                    ['--init_from=resume'], ['not a readable checkpoint']),
    'resume_not_a_checkpoint': (lambda r: write_file(r / 'out' / 'ckpt.pt', b'just some text\n'),
                                ['--init_from=resume'], ['not a readable checkpoint']),
    'resume_foreign_torch_file': (lambda r: torch.save({'weights': torch.ones(2)}, r / 'out' / 'ckpt.pt'),
                                  ['--init_from=resume'], ['not a nanoloop checkpoint']),
}


@pytest.mark.parametrize('row', ERROR_ROWS)
def test_bad_input_gives_one_line_and_touches_no_checkpoint(row, run_dir):
    setup, args, fragments = ERROR_ROWS[row]
    if setup:
        setup(run_dir)
    ckpt = run_dir / 'out' / 'ckpt.pt'
    before = snapshot(ckpt) if ckpt.exists() else None
    code, out, err = run_train([*TINY, '--out_dir=out', '--max_iters=4', *args], run_dir)
    assert_clean_error(code, err, *fragments)
    assert (snapshot(ckpt) if ckpt.exists() else None) == before


@pytest.mark.parametrize('args', [['--n_layers=3'], ['--init_from=resume']],
                         ids=['unknown_key', 'truncated_ckpt'])
def test_command_line_error_has_no_traceback(args, run_dir):
    # the same rows through a real process: exit status 1, one line on stderr
    ckpt = run_dir / 'out' / 'ckpt.pt'
    write_file(ckpt, open(ckpt, 'rb').read()[:3000])
    before = snapshot(ckpt)
    r = run_train_process(['--out_dir=out', *args], run_dir)
    assert_clean_error(r.returncode, r.stderr)
    assert 'Traceback' not in r.stderr and snapshot(ckpt) == before

# -----------------------------------------------------------------------------
# property-based: random flags and random bytes give success or one clean line, nothing else

DEFAULTS = train_defaults()
KEYS = sorted(DEFAULTS)
key = st.one_of(st.sampled_from(KEYS), st.text(min_size=1, max_size=12))
value = st.one_of(st.text(max_size=20), st.integers().map(str), st.floats().map(repr),
                  st.sampled_from(['True', 'False', '()', '(1, 2)', '[0.5]', 'none', 'deeploop', 'raw',
                                   'rope', 'resume', 'cosine', '1e400', 'nan', '((((', '{1: 2}', "'x'"]))
flags = st.lists(st.tuples(key, value).map(lambda kv: f'--{kv[0]}={kv[1]}'), max_size=4)


def outcome(fn, capsys):
    """'ok', or 'error' if fn stopped with die(); any other exception fails the test"""
    try:
        fn()
        return 'ok'
    except SystemExit as e:
        err = capsys.readouterr().err
        assert e.code == 1 and len(err.strip().splitlines()) == 1 and err.startswith('error: '), err
        return 'error'


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(args=flags)
def test_random_flags_parse_and_validate_or_fail_cleanly(args, capsys):
    capsys.readouterr()
    outcome(lambda: configurator.check(configurator.configure(DEFAULTS, args)[0]), capsys)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(blob=st.binary(max_size=600), which=st.sampled_from(['train.bin', 'val.bin', 'meta.json', 'ckpt.pt']),
       block_size=st.integers(1, 64))
def test_random_bytes_as_data_or_checkpoint_load_or_fail_cleanly(blob, which, block_size, tmp_path, capsys):
    root = Path(tempfile.mkdtemp(dir=tmp_path))  # a fresh folder per example
    folder = write_data(root)
    capsys.readouterr()
    if which == 'ckpt.pt':
        write_file(root / 'ckpt.pt', blob)
        outcome(lambda: checkpoint.load(str(root / 'ckpt.pt')), capsys)
    else:
        write_file(os.path.join(folder, which), blob)
        outcome(lambda: prepare.open_data(folder, block_size), capsys)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(args=flags, blob=st.binary(max_size=300),
       which=st.sampled_from(['none', 'val.bin', 'meta.json', 'ckpt.pt']))
def test_train_entry_point_with_random_flags_and_files_succeeds_or_fails_cleanly(args, blob, which, tmp_path):
    # the whole entry point, random flags first, then pins that keep it tiny, local and quick
    root = Path(tempfile.mkdtemp(dir=tmp_path))  # a fresh folder per example
    folder = write_data(root)
    if which == 'ckpt.pt':
        os.makedirs(root / 'out')
        write_file(root / 'out' / 'ckpt.pt', blob)
    elif which != 'none':
        write_file(os.path.join(folder, which), blob)
    pins = ['--out_dir=out', '--max_iters=1', '--eval_iters=1', '--compile=False', '--wandb_log=False',
            '--batch_size=2', '--block_size=8', '--n_embd=16', '--n_head=2', '--n_layer=1', '--n_loop=2',
            '--gradient_accumulation_steps=1', '--eval_interval=1', '--device=cpu']
    code, out, err = run_train([*args, *pins], root)
    assert code == 0 or (code == 1 and len(err.strip().splitlines()) == 1 and err.startswith('error: ')), err

# -----------------------------------------------------------------------------
# distributed parity: torchrun with 2 CPU processes (gloo) against one process on the same global batch

def test_ddp_two_cpu_processes_match_one_process_on_the_same_global_batch(tmp_path):
    # tests/train_hooks.py's ddp_parity records each rank's micro-batches, eval statistics, first gradients
    write_data(tmp_path)
    (tmp_path / 'dump').mkdir()
    # 4 micro-batches per step in total: 2 per rank. eval_iters=3 batches per split per rank.
    args = [*TINY, '--gradient_accumulation_steps=4', '--grad_clip=0', '--eval_iters=3', '--max_iters=2',
            '--eval_interval=2', '--out_dir=out']
    r = run_train_process(args, tmp_path, 'ddp_parity', nproc=2, DUMP=str(tmp_path / 'dump'))
    skip_without_torchrun(r)
    assert r.returncode == 0, r.stderr[-3000:]
    d0, d1 = (torch.load(tmp_path / 'dump' / f'rank{i}.pt', weights_only=True) for i in (0, 1))

    # the same initial weights and, after DDP's all-reduce, the same gradients on both ranks
    assert model_tensors_equal(d0['params'], d1['params'])
    for n in d0['grads']:
        torch.testing.assert_close(d0['grads'][n], d1['grads'][n], rtol=0, atol=0)
    # gradient accumulation: 2 micro-batches per rank, each rank's own data
    assert len(d0['train']) >= 2 and len(d1['train']) >= 2
    assert not torch.equal(d0['train'][0][0], d1['train'][0][0])

    # one process, the same 4 micro-batches as one global batch: mean of their losses
    from model import GPT
    ckpt = torch.load(tmp_path / 'out' / 'ckpt.pt', weights_only=True)
    model = GPT(configurator.gpt_config(ckpt['model_args']))
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(d0['params'][n])
    batches = d0['train'][:2] + d1['train'][:2]
    loss = sum(model(X, Y)[1] for X, Y in batches) / len(batches)
    loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, d0['grads'][n], rtol=1e-4, atol=1e-6)

    # evaluation averages over both ranks (the first eval: 3 train batches then 3 val batches per rank)
    first = read_metrics(tmp_path / 'out' / 'metrics.jsonl')[0]
    per_rank = [torch.stack([ce for ce, _ in d['first_eval'][3:6]]).mean(0) for d in (d0, d1)]
    torch.testing.assert_close(torch.tensor(first['val_ce']), (per_rank[0] + per_rank[1]) / 2, rtol=1e-5,
                               atol=1e-6)
    assert not torch.allclose(torch.tensor(first['val_ce']), per_rank[0], rtol=1e-5, atol=1e-6)

    # only rank 0 writes checkpoints and logs
    assert d0['saves'] == 1 and d1['saves'] == 0
    assert [m['iter'] for m in read_metrics(tmp_path / 'out' / 'metrics.jsonl')] == [0, 2]
    assert r.stdout.count('step 2:') == 1 and r.stdout.count('saving checkpoint') == 1


@pytest.mark.parametrize('nproc,accum', [(2, 1), (3, 2)])
def test_torchrun_runs_for_any_process_count_and_rounds_the_global_batch_up(tmp_path, nproc, accum):
    # nanoGPT's convention: gradient_accumulation_steps micro-batches per step over all ranks; a count that
    # does not divide it rounds up (3 processes, 2 micro-batches: 1 each, 3 in all) instead of failing
    write_data(tmp_path)
    args = [*TINY, f'--gradient_accumulation_steps={accum}', '--max_iters=2', '--eval_interval=2',
            '--out_dir=out']
    r = run_train_process(args, tmp_path, nproc=nproc)
    skip_without_torchrun(r)
    assert r.returncode == 0, r.stderr[-3000:]
    per_rank = -(-accum // nproc)
    assert (f"rounded up to {per_rank * nproc}" in r.stdout) == (per_rank * nproc != accum)
    assert f"{nproc} process(es)" in r.stdout and r.stdout.count('step 2:') == 1
    tokens = read_metrics(tmp_path / 'out' / 'metrics.jsonl')[-1]['tokens']
    assert tokens == 2 * per_rank * nproc * 4 * 16  # iterations x micro-batches x batch_size x block_size


FAMILY_KEYS = ('n_prelude', 'n_coda', 'injection', 'loop_sampling', 'max_loop', 'backprop_loops', 'exit_gate',
               'exit_entropy')


def make_pre_family_version(path):
    """The checkpoint as train.py wrote it before the recurrent-depth family: make_previous_version's, and
    no depth sampler state, no family keys in model_args or config, no log_kappa."""
    ckpt = make_previous_version(path)
    del ckpt['depth_rng']
    for key in FAMILY_KEYS:
        del ckpt['model_args'][key]
        del ckpt['config'][key]
    del ckpt['config']['log_kappa']
    torch.save(ckpt, path)
    return ckpt


def test_a_checkpoint_from_before_the_recurrent_family_loads_samples_and_resumes_bit_exact(run_dir,
                                                                                          monkeypatch):
    import sample
    ckpt = make_pre_family_version(run_dir / 'out' / 'ckpt.pt')
    assert 'depth_rng' not in ckpt and not set(FAMILY_KEYS) & set(ckpt['model_args'])
    model = checkpoint.build_model(checkpoint.load(str(run_dir / 'out' / 'ckpt.pt')))
    assert model_tensors_equal(model.state_dict(), ckpt['model'])
    monkeypatch.chdir(run_dir)
    sample.main(['--out_dir=out', '--start=ROMEO:', '--num_samples=1', '--max_new_tokens=4', '--device=cpu',
                 '--exit_threshold=0.5'])
    # 2 steps, then this checkpoint resumed to 4, is the same run as 4 steps without a stop
    code, out, err = run_train(['--init_from=resume', '--out_dir=out', '--max_iters=4'], run_dir)
    assert code == 0, err
    code, out, err = run_train([*TINY, '--max_iters=4', '--eval_interval=2', '--out_dir=whole'], run_dir)
    assert code == 0, err
    drop_time = lambda rows: [{k: v for k, v in r.items() if k != 'time'} for r in rows]
    assert drop_time(read_metrics(run_dir / 'out' / 'metrics.jsonl')) == \
        drop_time(read_metrics(run_dir / 'whole' / 'metrics.jsonl'))
    a, b = (torch.load(run_dir / d / 'ckpt.pt', weights_only=True) for d in ('out', 'whole'))
    assert a['iter_num'] == 4 and model_tensors_equal(a['model'], b['model'])
