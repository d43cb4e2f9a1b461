"""
Shared test set-up: the repo and lab/ on sys.path, the offline data copies, and small data and checkpoints.

Fixtures
  repo_dir      the repository root
  offline_data  the folder named by NANOLOOP_OFFLINE_DATA (tinyshakespeare/input.txt, gutenberg/,
                tiktoken_cache/): offline copies of real corpora and of tiktoken's GPT-2 files, which CI
                passes in. Tests that need it skip, saying why, when the variable is unset
  tiny_data   a small char-level dataset written by prepare.py: tmp_path/data/tiny_char/{train,val}.bin,
              meta.json (returns that folder: .parent is the data root, .name the dataset name)
  tiny_ckpt   a checkpoint in the SPEC format for a tiny looped GPT on tiny_data: tmp_path/out/ckpt.pt
              (returns the out folder)
"""
import os
import random
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
OFFLINE = Path(os.environ['NANOLOOP_OFFLINE_DATA']) if os.environ.get('NANOLOOP_OFFLINE_DATA') else None
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / 'lab'))  # the lab's scripts: import ablate, bench, eval_depth
# tiktoken reads its GPT-2 files from its cache folder before it tries the network
if OFFLINE is not None and (OFFLINE / 'tiktoken_cache').is_dir():
    os.environ.setdefault('TIKTOKEN_CACHE_DIR', str(OFFLINE / 'tiktoken_cache'))


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
    import torch
    from model import GPT, GPTConfig
    torch.manual_seed(seed)
    cfg = dict(block_size=32, vocab_size=vocab_size, n_layer=1, n_loop=2, n_head=2, n_embd=16)
    cfg.update(overrides)
    model = GPT(GPTConfig(**cfg))
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
    import json
    meta = json.loads((tiny_data / 'meta.json').read_text(encoding='utf-8'))
    save_tiny_checkpoint(str(tmp_path / 'out' / 'ckpt.pt'), meta['vocab_size'], dataset=tiny_data.name,
                         meta=meta)
    return tmp_path / 'out'
