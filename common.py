"""
Pieces shared by train.py, sample.py and the tools: clean errors, checkpoints, token data.

Everything that reads user input (a config value, a .bin file, a checkpoint) goes through here, so a bad
input stops with one line on stderr (`error: ...`) and exit code 1, never a traceback, and never after
touching a checkpoint that is already on disk.
"""
import json
import os
import random
import sys

import numpy as np
import torch

# -----------------------------------------------------------------------------
# errors

def die(msg):
    """The single way to stop on bad input: one line on stderr, exit code 1, no traceback."""
    msg = ' '.join(str(msg).split())  # one line, whatever the message held
    print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)

def first_line(e):
    """An exception as one short line: its type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0].split('. ')[0][:200]}" if text else type(e).__name__

# -----------------------------------------------------------------------------
# checkpoints

def atomic_save(obj, path):
    """torch.save that never leaves a half-written file under `path`.

    A kill -9 or a full disk halfway through torch.save would truncate the checkpoint in place and lose the
    run. So we write a temporary file in the same folder (same filesystem, so the rename is atomic), flush
    and fsync it to disk, and only then os.replace it over the old one: at every instant `path` holds either
    the previous complete checkpoint or the new complete one.
    """
    folder = os.path.dirname(os.path.abspath(path))
    tmp = path + '.tmp'
    with open(tmp, 'wb') as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:  # make the rename itself durable (POSIX; not possible on every platform)
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass

def load_checkpoint(path, device='cpu'):
    """A checkpoint dict written by train.py, or a clean die() if the file is missing, truncated or foreign.

    weights_only=True: a checkpoint is data (tensors, numbers, strings), so a pickle that tries to run code
    or build arbitrary objects is refused rather than executed.
    """
    if not os.path.isfile(path):
        die(f"checkpoint {path} not found (train one first, or point --out_dir at the folder holding ckpt.pt)")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # truncated zip, random bytes, a pickle of something else: all one line
        die(f"{path} is not a readable checkpoint (truncated or not written by train.py): {first_line(e)}")
    if not isinstance(ckpt, dict) or not {'model', 'model_args'} <= ckpt.keys() \
            or not isinstance(ckpt['model'], dict) or not isinstance(ckpt['model_args'], dict):
        die(f"{path} is not a nanoloop checkpoint (expected a dict with 'model' and 'model_args')")
    return ckpt

def strip_prefixes(state_dict):
    """State dict keys without the wrappers' prefixes: torch.compile adds '_orig_mod.', DDP adds 'module.'."""
    out = {}
    for k, v in state_dict.items():
        while k.startswith(('_orig_mod.', 'module.')):
            k = k.split('.', 1)[1]
        out[k] = v
    return out

def model_config(model_args):
    """GPTConfig from a dict, with a one-line error for a bad value or a key this model.py does not know."""
    from model import GPTConfig
    try:
        return GPTConfig(**model_args)
    except TypeError as e:  # an unexpected keyword: a checkpoint from another version of model.py
        die(f"model arguments do not fit this model.py: {first_line(e)}")
    except ValueError as e:  # GPTConfig's own message names the key and the allowed values
        die(str(e))

def load_state(model, state_dict, where):
    """Load weights into model (prefixes stripped), or die naming what does not fit."""
    try:
        model.load_state_dict(strip_prefixes(state_dict))
    except (RuntimeError, KeyError, TypeError) as e:
        die(f"{where}: weights do not fit the model ({first_line(e)})")

def build_model(ckpt):
    """GPT(GPTConfig(**ckpt['model_args'])) with the checkpoint's weights, on the CPU."""
    from model import GPT
    model = GPT(model_config(ckpt['model_args']))
    load_state(model, ckpt['model'], 'checkpoint')
    return model

# -----------------------------------------------------------------------------
# random number generators: everything the next step depends on, as plain data (weights_only-loadable)

def rng_state():
    np_state = np.random.get_state()
    return {'python': random.getstate(),
            'numpy': (np_state[0], np_state[1].tolist(), *np_state[2:]),
            'torch': torch.get_rng_state(),
            'cuda': torch.cuda.get_rng_state() if torch.cuda.is_available() else None}

def set_rng_state(state):
    random.setstate(state['python'])
    name, keys, *rest = state['numpy']
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state['torch'].cpu())
    if state['cuda'] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state['cuda'].cpu())

# -----------------------------------------------------------------------------
# token data: data/<dataset>/{train,val}.bin + meta.json, written by prepare.py

def prepare_command(data_dir):
    root, dataset = os.path.split(os.path.normpath(data_dir))
    return f"python prepare.py {dataset}" + ('' if root == 'data' else f" --out_dir {root or '.'}")

def load_meta(data_dir):
    """data_dir/meta.json as a dict, checked; a missing or broken file dies with the prepare command."""
    path = os.path.join(data_dir, 'meta.json')
    if not os.path.isfile(path):
        die(f"{path} not found: prepare the data first with `{prepare_command(data_dir)}`")
    try:
        with open(path, encoding='utf-8') as f:
            meta = json.load(f)
        vocab_size, dtype = meta['vocab_size'], meta['dtype']
    except (OSError, ValueError, KeyError, TypeError) as e:
        die(f"{path} is not a prepare.py meta.json ({first_line(e)}); rerun `{prepare_command(data_dir)}`")
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1 \
            or dtype not in ('uint16', 'uint32') or vocab_size > np.iinfo(dtype).max + 1:
        die(f"{path}: vocab_size={vocab_size!r} with dtype={dtype!r} is not valid; rerun `{prepare_command(data_dir)}`")
    return meta

class TokenFile:
    """One split's flat token file, checked once on open, then sampled in random (B, T) windows."""

    def __init__(self, data_dir, split, meta):
        self.path = os.path.join(data_dir, f'{split}.bin')
        self.dtype = np.dtype(meta['dtype'])
        if not os.path.isfile(self.path):
            die(f"{self.path} not found: prepare the data first with `{prepare_command(data_dir)}`")
        size = os.path.getsize(self.path)
        if size % self.dtype.itemsize:
            die(f"{self.path}: {size} bytes is not a whole number of {meta['dtype']} tokens (truncated?); "
                f"rerun `{prepare_command(data_dir)}`")
        self.n_tokens = size // self.dtype.itemsize
        # a token id >= vocab_size would index past the embedding table: a device-side assert on CUDA, a
        # cryptic IndexError on the CPU, hours into a run. Scan the whole file once, in 16M-token chunks.
        data = self.memmap()
        for i in range(0, self.n_tokens, 1 << 24):
            hi = int(data[i:i + (1 << 24)].max())
            if hi >= meta['vocab_size']:
                die(f"{self.path} holds token id {hi} >= vocab_size {meta['vocab_size']} from meta.json; "
                    f"the files do not belong together, rerun `{prepare_command(data_dir)}`")

    def memmap(self):
        # a fresh memmap per batch, as nanoGPT does: a long-lived one keeps growing the process's memory
        return np.memmap(self.path, dtype=self.dtype, mode='r') if self.n_tokens else np.zeros(0, self.dtype)

    def get_batch(self, batch_size, block_size, generator, device):
        """(X, Y) of shape (B, T): random windows and the same windows shifted by one token.

        Offsets come from `generator`, a torch.Generator private to this data stream, so the data order is
        independent of everything else that draws random numbers and its state can go into the checkpoint.
        """
        data = self.memmap()
        ix = torch.randint(self.n_tokens - block_size, (batch_size,), generator=generator)
        x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix.tolist()])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix.tolist()])
        if device.startswith('cuda'):
            # pinned memory lets the copy to the GPU run asynchronously (non_blocking)
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x.to(device), y.to(device)

def open_data(data_dir, block_size):
    """meta.json and both splits, checked; dies with one line if anything does not fit."""
    meta = load_meta(data_dir)
    splits = {split: TokenFile(data_dir, split, meta) for split in ('train', 'val')}
    for split, tf in splits.items():
        if tf.n_tokens < block_size + 1:
            die(f"block_size={block_size} is longer than the {split} split of {data_dir} ({tf.n_tokens} tokens); "
                f"use a smaller --block_size or more data")
    return meta, splits

# -----------------------------------------------------------------------------
# the non-finite guard's diagnosis

@torch.no_grad()
def nonfinite_report(model, X, Y, norm_penalty=0.0):
    """Which exit's CE or which loop's state went non-finite on batch (X, Y), as one short phrase.
    model.exit_losses runs the same loop as the loss, so a NaN that starts at loop k shows up from exit k on."""
    ce, norms = model.exit_losses(X, Y)
    bad_ce = [k for k, v in enumerate(ce.tolist(), start=1) if not np.isfinite(v)]
    bad_norm = [k for k, v in enumerate(norms.tolist(), start=1) if not np.isfinite(v)]
    if bad_ce or bad_norm:
        parts = ([f"CE at exit {', '.join(map(str, bad_ce))}"] if bad_ce else []) + \
                ([f"||h_k|| at loop {', '.join(map(str, bad_norm))}"] if bad_norm else [])
        return "non-finite " + " and ".join(parts)
    if norm_penalty > 0:  # every exit is finite but lambda * mean(h^2) can still overflow
        return "every exit CE and loop norm is finite: the norm penalty term or the backward pass overflowed"
    return "every exit CE and loop norm is finite on this batch: the backward pass (or another rank) went non-finite"
