"""
Shared test set-up: the repo and lab/ on sys.path, the offline data copies, small data and checkpoints, the
one tiny-model builder, and the ways to run train.py (in this process, or as a real process, under torchrun
and with a test hook from tests/train_hooks.py).

Fixtures
  repo_dir      the repository root (REPO, for module-level use)
  offline_data  the folder named by NANOLOOP_OFFLINE_DATA (tinyshakespeare/input.txt, gutenberg/,
                tiktoken_cache/): offline copies of real corpora and of tiktoken's GPT-2 files, which CI
                passes in. Tests that need it skip, saying why, when the variable is unset
  tiny_data   a small char-level dataset written by prepare.py: tmp_path/data/tiny_char/{train,val}.bin,
              meta.json (returns that folder: .parent is the data root, .name the dataset name)
  tiny_ckpt   a checkpoint of a tiny, untrained looped GPT on tiny_data, as train.py writes it: a dict with
              'model' (the state dict), 'model_args' (GPTConfig as a dict), 'optimizer', 'iter_num',
              'config', 'dataset', 'meta' and the random states (train.py's checkpoint_state):
              tmp_path/out/ckpt.pt (returns the out folder)

Helpers
  tiny_gpt(seed, training, random_norms, **cfg)   a tiny GPT: K 2, R 3, C 16, 2 heads, vocabulary V,
                                    context T unless cfg says otherwise (each test file passes its own
                                    shape); random_norms: norm weights and biases not at their init
  run_train(args, cwd)              train.py in this process: (exit code, stdout, stderr)
  run_train_process(args, cwd, hook=..., nproc=...)   train.py as a real process, optionally after a hook
                                    of tests/train_hooks.py and under torchrun
"""
import atexit
import contextlib
import functools
import io
import json
import os
import random
import runpy
import signal
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
OFFLINE = Path(os.environ['NANOLOOP_OFFLINE_DATA']) if os.environ.get('NANOLOOP_OFFLINE_DATA') else None
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / 'lab'))  # the lab's scripts: import ablate, bench, eval_depth
# tiktoken reads its GPT-2 files from its cache folder before it tries the network
if OFFLINE is not None and (OFFLINE / 'tiktoken_cache').is_dir():
    os.environ.setdefault('TIKTOKEN_CACHE_DIR', str(OFFLINE / 'tiktoken_cache'))

from configurator import check_model  # noqa: E402  (the repo is importable from here on)
from model import GPT, GPTConfig  # noqa: E402

TRAIN = str(REPO / 'train.py')
TRAIN_HOOKS = str(REPO / 'tests' / 'train_hooks.py')


@pytest.fixture(autouse=True)
def subnormal_floats_after_each_test():
    # train.py and bench.py count fp32 denormals as zero (hardware.flush_denormals), a process-wide
    # CPU setting; tests that run them in-process must not leave it on for the next test
    yield
    torch.set_flush_denormal(False)


@pytest.fixture(scope='session')
def repo_dir():
    return REPO


@pytest.fixture(scope='session')
def offline_data():
    if OFFLINE is None or not OFFLINE.is_dir():
        pytest.skip("NANOLOOP_OFFLINE_DATA is not set to a folder of offline data copies")
    return OFFLINE

# -----------------------------------------------------------------------------
# tiny models

V, T = 48, 16  # the tiny models' vocabulary and context
TINY_GPT = dict(vocab_size=V, block_size=T, n_layer=2, n_loop=3, n_head=2, n_embd=16)


def tiny_gpt(seed=0, training=True, random_norms=False, **cfg):
    """A tiny looped GPT of TINY_GPT's shape with cfg's fields on top, its weights drawn after
    torch.manual_seed(seed): the same arguments give the same weights. training=False: in eval mode.
    random_norms: every norm's weight drawn from U(0.5, 1.5) and its bias (if any) from N(0, 0.1^2), so
    that a norm applied or skipped changes the argmax (at init, weight 1 and no bias only rescale h)."""
    torch.manual_seed(seed)
    model = GPT(check_model(GPTConfig(**{**TINY_GPT, **cfg})))
    if random_norms:
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm)) and m.weight is not None:
                    m.weight.uniform_(0.5, 1.5)
                    if getattr(m, 'bias', None) is not None:
                        m.bias.normal_(0.0, 0.1)
    return model if training else model.eval()

# -----------------------------------------------------------------------------
# small data and checkpoints

WORDS = ('the of and to my thy thou art love death king crown night sword sweet gentle lord lady sir '
         'heaven hath not what doth fair good well come go speak hear noble blood day').split()
SPEAKERS = ('ROMEO', 'JULIET', 'KING HENRY', 'LADY MACBETH', 'HAMLET')


def tiny_text(n_chars=20_000, seed=0):
    """Deterministic Shakespeare-shaped text: speaker lines and verse, about n_chars long."""
    rng = random.Random(seed)
    out, n = [], 0
    while n < n_chars:
        lines = [' '.join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))).capitalize()
                 + rng.choice('.,;!?') for _ in range(rng.randint(1, 4))]
        block = f"{rng.choice(SPEAKERS)}:\n" + '\n'.join(lines) + '\n\n'
        out.append(block)
        n += len(block)
    return ''.join(out)


@pytest.fixture
def tiny_data(tmp_path):
    from prepare import prepare
    src = tmp_path / 'tiny.txt'
    src.write_text(tiny_text(), encoding='utf-8')
    prepare('tiny_char', input_path=str(src), tokenizer='char', out_dir=str(tmp_path / 'data'))
    return tmp_path / 'data' / 'tiny_char'


def save_tiny_checkpoint(path, vocab_size, dataset='tiny_char', seed=0, meta=None, **overrides):
    """A checkpoint dict in train.py's format for a tiny, untrained looped GPT; returns the model.
    meta: the data's meta.json, of which train.py keeps tokenizer, vocab_size and itos in ckpt['meta']."""
    shape = dict(block_size=32, vocab_size=vocab_size, n_layer=1, n_loop=2)
    model = tiny_gpt(seed, **{**shape, **overrides})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = {'model': model.state_dict(), 'model_args': asdict(model.config),
            'optimizer': optimizer.state_dict(), 'scaler': None, 'iter_num': 0, 'best_val_loss': float('inf'),
            'config': {'dataset': dataset}, 'dataset': dataset, 'rng': {}, 'data_rng': {}, 'world_size': 1}
    if meta is not None:
        ckpt['meta'] = {k: meta.get(k) for k in ('tokenizer', 'vocab_size', 'itos')}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(ckpt, path)
    return model


@pytest.fixture
def tiny_ckpt(tmp_path, tiny_data):
    meta = json.loads((tiny_data / 'meta.json').read_text(encoding='utf-8'))
    save_tiny_checkpoint(str(tmp_path / 'out' / 'ckpt.pt'), meta['vocab_size'], dataset=tiny_data.name,
                         meta=meta)
    return tmp_path / 'out'

# -----------------------------------------------------------------------------
# running train.py

# a model small enough to train a few steps in well under a second
TINY = ['--n_layer=1', '--n_loop=2', '--n_head=2', '--n_embd=16', '--block_size=16', '--batch_size=4',
        '--eval_iters=2', '--device=cpu', '--dtype=float32', '--compile=False',
        '--gradient_accumulation_steps=1', '--log_interval=1', '--dataset=tiny']

TEXT = ("ROMEO:\nBut soft, what light through yonder window breaks?\n"
        "It is the east, and Juliet is the sun.\n\n"
        "JULIET:\nO Romeo, Romeo, wherefore art thou Romeo?\n"
        "Deny thy father and refuse thy name.\n\n")


def write_data(root, name='tiny', n_chars=6000, val_chars=800):
    """A char-level dataset in prepare.py's format under root/data/name; returns the folder."""
    text = (TEXT * (n_chars // len(TEXT) + 1))[:n_chars + val_chars]
    itos = sorted(set(text))
    stoi = {c: i for i, c in enumerate(itos)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    folder = os.path.join(str(root), 'data', name)
    os.makedirs(folder, exist_ok=True)
    ids[:n_chars].tofile(os.path.join(folder, 'train.bin'))
    ids[n_chars:].tofile(os.path.join(folder, 'val.bin'))
    meta = dict(dataset=name, tokenizer='char', vocab_size=len(itos), dtype='uint16', train_tokens=n_chars,
                val_tokens=val_chars, itos=itos)
    with open(os.path.join(folder, 'meta.json'), 'w', encoding='utf-8') as f:
        json.dump(meta, f)
    return folder


def read_metrics(path):
    with open(path, encoding='utf-8') as f:
        return [json.loads(line) for line in f]


def run_train(args, cwd):
    """train.py in this process with these arguments, from folder cwd. Returns (exit code, stdout, stderr).
    A clean error is SystemExit(1); any other exception propagates (it would be a traceback on the CLI)."""
    out, err = io.StringIO(), io.StringIO()
    old_argv, old_cwd, old_threads = sys.argv, os.getcwd(), torch.get_num_threads()
    old_omp = os.environ.get('OMP_NUM_THREADS')
    # train.py sets these handlers
    old_handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    sys.argv = ['train.py', *args]
    code, at_exit, register = 0, [], atexit.register

    def register_here(f, *a, **kw):
        # train.py's own exit handler runs when this run ends, as at the end of its process; left
        # registered, it would keep every run's globals (model, optimizer, data) alive to the suite's end
        if getattr(f, '__code__', None) and f.__code__.co_filename == TRAIN:
            at_exit.append(functools.partial(f, *a, **kw))
            return f
        return register(f, *a, **kw)
    atexit.register = register_here
    try:
        os.chdir(cwd)
        # tiny models: one thread is fastest, and the suite shares 2 cores
        os.environ['OMP_NUM_THREADS'] = '1'
        torch.set_num_threads(1)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(TRAIN, run_name='__main__')
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        atexit.register = register
        for f in at_exit:
            f()
        sys.argv = old_argv
        os.chdir(old_cwd)
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
        torch.set_num_threads(old_threads)
        torch.set_flush_denormal(False)  # train.py counts denormals as zero (hardware.flush_denormals)
        if old_omp is None:
            os.environ.pop('OMP_NUM_THREADS', None)
        else:
            os.environ['OMP_NUM_THREADS'] = old_omp
    return code, out.getvalue(), err.getvalue()


def cli_env(hook=None, **extra):
    """A real process's environment: one thread, the repo importable, TRAIN_HOOK=hook, and extra."""
    return dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=str(REPO), **extra,
                **({'TRAIN_HOOK': hook} if hook else {}))


def train_command(args, hook=None, nproc=1, torchrun=()):
    """The command line of a real train.py process with args: run by tests/train_hooks.py after the hook of
    that name (its environment: cli_env(hook)), under torchrun (plus its flags `torchrun`) if nproc > 1."""
    script = TRAIN_HOOKS if hook else TRAIN
    if nproc == 1:
        return [sys.executable, script, *args]
    return [sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={nproc}',
            *torchrun, script, *args]


def run_train_process(args, cwd, hook=None, nproc=1, torchrun=(), timeout=None, **env):
    """train_command run to its end from folder cwd, env added to its environment: the CompletedProcess."""
    timeout = timeout or (120 if nproc == 1 else 300)
    return subprocess.run(train_command(args, hook, nproc, torchrun), cwd=str(cwd), capture_output=True,
                          text=True, timeout=timeout, env=cli_env(hook, **env))


def skip_without_torchrun(r):
    """Skips the test when torchrun's run r failed because torchrun cannot start 2 gloo processes here."""
    if r.returncode != 0:
        reason = torchrun_unavailable()
        if reason:
            print(reason)
            pytest.skip(reason)


def torchrun_unavailable():
    """None if torchrun can start 2 gloo processes here, else the reason"""
    probe = ('import torch.distributed as d; d.init_process_group("gloo"); d.barrier(); '
             'd.destroy_process_group()')
    try:
        r = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone',
                            '--nproc_per_node=2', '--no-python', sys.executable, '-c', probe],
                           capture_output=True, text=True, timeout=120, env=cli_env())
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"torchrun could not start: {e}"
    if r.returncode == 0:
        return None
    return f"torchrun could not start 2 gloo processes: {r.stderr.strip()[-300:]}"

def real_data(tmp_path):
    """A folder whose data/shakespeare_char is the real one: prepared here from the offline copy CI passes
    in, else the repository's own (python prepare.py shakespeare_char); None if neither is here."""
    source = OFFLINE / 'tinyshakespeare' / 'input.txt' if OFFLINE else None
    if source is not None and source.is_file():
        from prepare import prepare
        prepare('shakespeare_char', input_path=str(source), out_dir=str(tmp_path / 'data'))
        return tmp_path
    return REPO if (REPO / 'data' / 'shakespeare_char' / 'meta.json').is_file() else None


# -----------------------------------------------------------------------------
# CI runs every test: there a skip means a missing install or data copy, not a pass

SKIPPED = []


def pytest_runtest_logreport(report):
    if report.skipped:
        SKIPPED.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get('CI') == 'true' and SKIPPED and exitstatus == 0:
        print(f"\nerror: {len(SKIPPED)} test(s) skipped in CI, which installs every extra and passes the "
              f"data copies (NANOLOOP_OFFLINE_DATA): {', '.join(SKIPPED[:5])}")
        session.exitstatus = 1
