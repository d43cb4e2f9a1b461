"""
Checkpoints and random-number state: what a run needs to stop and continue bit for bit.

    save(obj, path)          atomic: path always holds the previous or the new complete checkpoint
    load(path)               the checkpoint dict, or a one-line error for a missing, torn or foreign file
    build_model(ckpt)        the GPT it describes, with its weights
    load_weights(model, sd)  weights into a model, whether saved from a compiled, DDP or plain model
    rng_state() / set_rng_state(s)   python, numpy, torch and CUDA generators as plain data

and what train.py calls to continue a run (or to refuse to start one over it):
    resume(config, explicit) init_from: the checkpoint, and its config under the keys this command set
    start_from(config, explicit)  init_from=gpt2 or a folder: a trained model's layers, looped (retrofit.py)
    check_tokens(...)        the data's tokens are the ones the checkpoint trained on
    restore(...)             the optimizer, every rank's random streams, the step counters
    refuse_overwrite(...)    a run from scratch never overwrites an earlier run's checkpoint
"""
import os
import random

import numpy as np
import torch

from configurator import die, first_line, gpt_config, resume_config
from model import GPT
from run import retrofit


def save(obj, path):
    """torch.save that never leaves a half-written file under `path`.

    A kill -9 or a full disk halfway through torch.save would truncate the checkpoint in place and lose the
    run. So we write a temporary file in the same folder (same filesystem, so the rename is atomic), flush
    and fsync it to disk, and only then os.replace it over the old one: at every instant `path` holds either
    the previous complete checkpoint or the new complete one. If the write fails (a full disk, an unwritable
    folder) the error propagates, `path` is untouched and the partial temporary file is removed, so that it
    holds no disk space.
    """
    tmp = path + '.tmp'
    try:
        with open(tmp, 'wb') as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass  # never created (an unwritable folder): the original error is the one to report
        raise
    try:  # make the rename itself durable (POSIX; not possible on every platform)
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def path_of(out_dir):
    # the checkpoint a command is pointed at: the file itself, or the folder's ckpt.pt
    return out_dir if os.path.isfile(out_dir) else os.path.join(out_dir, 'ckpt.pt')


def load(path, device='cpu'):
    """A checkpoint dict written by train.py, or a clean die() if the file is missing, truncated or foreign.

    weights_only=True: a checkpoint is data (tensors, numbers, strings), so a pickle that tries to run code
    or build arbitrary objects is refused rather than executed.
    """
    if not os.path.isfile(path):
        die(f"checkpoint {path} not found (train one first, or point --out_dir at the folder with ckpt.pt)")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # truncated zip, random bytes, a pickle of something else: all one line
        die(f"{path} is not a readable checkpoint (truncated or not written by train.py): {first_line(e)}")
    if not isinstance(ckpt, dict) or not {'model', 'model_args'} <= ckpt.keys() \
            or not isinstance(ckpt['model'], dict) or not isinstance(ckpt['model_args'], dict):
        die(f"{path} is not a nanoloop checkpoint (expected a dict with 'model' and 'model_args')")
    ckpt['model_args'] = model_args(ckpt['model_args'], path)
    return ckpt


# keys that earlier versions of model.py had, with the only value this version implements
RETIRED_KEYS = {'tie_weights': True, 'exit_weights': (), 'moe_where': 'loop'}


# keys that earlier versions of model.py named otherwise: old name -> new name
RENAMED_KEYS = {'loop_eps': 'loop_lambda'}


def model_args(args, path):
    """A checkpoint's model arguments without retired keys, renamed keys under their new names; dies if a
    retired key held a value no longer built."""
    args = {RENAMED_KEYS.get(k, k): v for k, v in args.items()}
    for key, only in RETIRED_KEYS.items():
        value = args.pop(key, only)
        if (tuple(value) if key == 'exit_weights' else value) != only:
            die(f"{path} was trained with {key}={value!r}, which this model.py no longer implements")
    return args


def strip_prefixes(state_dict):
    """State dict keys without the wrappers' prefixes: torch.compile adds '_orig_mod.', DDP adds 'module.'."""
    out = {}
    for k, v in state_dict.items():
        while k.startswith(('_orig_mod.', 'module.')):
            k = k.split('.', 1)[1]
        out[k] = v
    return out


def load_weights(model, state_dict, where):
    """Load weights into model (prefixes stripped), or die naming what does not fit."""
    try:
        model.load_state_dict(strip_prefixes(state_dict))
    except (RuntimeError, KeyError, TypeError) as e:
        die(f"{where}: weights do not fit the model ({first_line(e)})")


def build_model(ckpt):
    """GPT(GPTConfig(**ckpt['model_args'])) with the checkpoint's weights, on the CPU."""
    model = GPT(gpt_config(ckpt['model_args']))
    load_weights(model, ckpt['model'], 'checkpoint')
    return model


def rng_state():
    """Everything random the next step depends on, as plain data (loadable with weights_only=True)."""
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
# what a resumed run continues from

def resume(config, explicit):
    """train.py's init_from: 'auto' resumes if out_dir holds ckpt.pt (a requeued job reruns the same
    command), else starts from scratch. A resumed run takes the checkpoint's config as the base, and only
    what this command sets explicitly overrides it. Returns (config, the checkpoint or None, the lines
    to print)."""
    if config['init_from'] not in ('scratch', 'resume', 'auto'):
        return start_from(config, explicit)
    path = os.path.join(config['out_dir'], 'ckpt.pt')
    if config['init_from'] == 'auto':
        config['init_from'] = 'resume' if os.path.exists(path) else 'scratch'
        if config['init_from'] == 'scratch':
            return config, None, [f"init_from=auto: no {path} yet, starting from scratch"]
    if config['init_from'] == 'scratch':
        return config, None, []
    ckpt = load(path)
    missing = [k for k in ('optimizer', 'iter_num', 'config') if k not in ckpt]
    if missing or not isinstance(ckpt['iter_num'], int) or not isinstance(ckpt['config'], dict):
        die(f"{path} cannot be resumed: it lacks {', '.join(missing) or 'a valid iter_num/config'}")
    config, changes = resume_config(config, explicit, ckpt, path)
    explicit.add('vocab_size')  # the checkpoint's, not meta.json's
    return config, ckpt, [f"resume: {change}" for change in changes]


def start_from(config, explicit):
    """init_from=gpt2 (-medium, -large, -xl, or a folder transformers saved) or a folder with a nanoloop
    ckpt.pt of a non-looped model: its layers placed into this config's prelude, loop and coda, and a new
    run from there (step 0, a fresh optimizer). Returns what resume() returns."""
    src, path = config['init_from'], retrofit.source_path(config['init_from'])
    if path is not None:
        source = retrofit.nanoloop_source(load(path), path)
    elif src in retrofit.GPT2_NAMES or os.path.isfile(os.path.join(src, 'config.json')):
        source = retrofit.gpt2_source(src)
    else:
        die(f"init_from={src!r}: choose scratch, resume, auto, one of {', '.join(retrofit.GPT2_NAMES)}, or a "
            f"folder holding a nanoloop ckpt.pt (or a saved GPT-2)")
    args, ckpt, notes = retrofit.retrofit(source, config, explicit)
    config.update(args)
    explicit.add('vocab_size')  # the source's, not meta.json's
    return config, ckpt, notes


def check_tokens(ckpt, meta_id, path, data_dir):
    """Dies unless data_dir's tokens (meta_id: tokenizer, vocab_size, itos) are the ones ckpt trained on."""
    path = ckpt.get('source', path)  # a trained model to loop (start_from), or a run's own checkpoint
    differ = [k for k in meta_id if k in (ckpt.get('meta') or {}) and ckpt['meta'][k] != meta_id[k]]
    if differ or ckpt['model_args']['vocab_size'] < meta_id['vocab_size']:
        die(f"{data_dir}/meta.json disagrees with {path} ({', '.join(differ) or 'vocab_size'}: the "
            f"checkpoint was trained on other tokens); use its dataset {ckpt.get('dataset')!r}")


def load_optimizer(optimizer, scaler, ckpt, path):
    """AdamW's moments (and fp16's loss scale) from the checkpoint; the hyperparameters (betas, weight
    decay) stay this run's."""
    hyper = [{k: v for k, v in g.items() if k != 'params'} for g in optimizer.param_groups]
    try:
        optimizer.load_state_dict(ckpt['optimizer'])
        if scaler.is_enabled() and ckpt.get('scaler'):
            scaler.load_state_dict(ckpt['scaler'])
    except (ValueError, KeyError, RuntimeError, TypeError) as e:
        die(f"{path}: optimizer state does not fit this model ({first_line(e)})")
    for g, h in zip(optimizer.param_groups, hyper):
        g.update(h)


def load_streams(ckpt, rank, world_size, train_gen, depth_gen):
    """Every rank continues its own random streams (dropout, data order) where the checkpoint left them.
    Returns None, or why they could not be (then they stay seeded as in a new run)."""
    rngs, data_rngs = ckpt.get('rng'), ckpt.get('data_rng')
    if ckpt.get('world_size') == world_size and isinstance(rngs, list) and isinstance(data_rngs, list):
        set_rng_state(rngs[rank])
        train_gen.set_state(data_rngs[rank])
        if 'depth_rng' in ckpt:  # checkpoints from before loop_sampling have none (and needed none)
            depth_gen.set_state(ckpt['depth_rng'])
        return None
    if ckpt.get('world_size') != world_size:
        return f"was written by {ckpt.get('world_size')} process(es), this run has {world_size}"
    return "holds no random-stream states"


def restore(ckpt, path, optimizer, scaler, rank, world_size, train_gen, depth_gen, eval_only):
    """A resumed run's state from its checkpoint: the optimizer (and fp16 scale), every rank's random
    streams, and (iter_num, best_val_loss, bad steps so far, the iteration already evaluated or None)."""
    load_optimizer(optimizer, scaler, ckpt, path)
    iter_num, best_val_loss = ckpt['iter_num'], float(ckpt.get('best_val_loss', float('inf')))
    # a checkpoint written at an eval was evaluated and logged there; one written when a signal
    # stopped the run was not, so this run evaluates that iteration as an uninterrupted run would
    evaluated_at = iter_num if ckpt.get('evaluated', True) and not eval_only else None
    # every rank continues its own random streams (dropout, data order) where the checkpoint left them
    why = load_streams(ckpt, rank, world_size, train_gen, depth_gen)
    if rank == 0:
        if why:
            print(f"resume: the checkpoint {why}: random streams are reseeded (not bit for bit from here)")
        print(f"resuming from {path} at iter {iter_num}")
    return iter_num, best_val_loss, int(ckpt.get('bad_steps', 0)), evaluated_at


def refuse_overwrite(path, init_from, eval_only):
    """A new run (from scratch or a trained model) would overwrite an earlier run's checkpoint at its
    first eval: a forgotten --init_from=resume. Refuse instead, with what to do."""
    if init_from != 'resume' and os.path.exists(path) and not eval_only:
        out_dir = os.path.dirname(path) or '.'
        die(f"{path} already exists: continue it with --init_from=resume, or start over with another "
            f"--out_dir (or delete {out_dir})")
