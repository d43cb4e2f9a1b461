"""
Config overrides, nanoGPT style, with typo and type checking.

    python train.py config/paper_44m.py config/loop_raw.py --batch_size=32 --readout=final_only

Arguments are applied in the order given: a config file (any argument without a leading --) is plain
Python whose assignments override train.py's globals; then `--key=value` sets one key, the value read as a
Python literal (numbers, True/False, tuples like --exit_weights="(1, 1, 2, 4)") or else taken as a string. Every key must
already be a global of train.py (an unknown key stops with the nearest known one suggested) and every value
must have its default's type (an int is fine where a float is expected). Choices and ranges are checked by
check() below and by GPTConfig.
"""
import ast
import difflib
import math
import os
import types
from dataclasses import fields

from common import die, first_line

# keys whose value may be of more than one type (checked further by GPTConfig)
FLEXIBLE = {
    'depth_scaling': ((str, int, float), 'a name (none, deepnorm, deeploop) or a number p'),
    'exit_weights': ((tuple, list), 'a tuple of n_loop numbers, or ()'),
}

def expected(default):
    return 'bool (True or False)' if isinstance(default, bool) else type(default).__name__

def as_float(value):
    try:
        return float(value)
    except OverflowError:  # an int too large for a float
        return math.nan

def fit(key, value, default):
    """(True, value converted) if value has the type of default (an int is fine for a float), else (False, value)."""
    if key in FLEXIBLE:
        ok = isinstance(value, FLEXIBLE[key][0]) and not isinstance(value, bool)
        if ok and key == 'exit_weights':
            ok = all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in value)
            value = tuple(as_float(w) for w in value) if ok else value
        return ok, value
    if isinstance(default, bool):
        return isinstance(value, bool), value
    if isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, as_float(value) if ok else value
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool), value
    return isinstance(value, type(default)), value

def coerce(key, value, default, where):
    """value, typed like default; else die naming the key and the expected type."""
    ok, value = fit(key, value, default)
    if not ok:
        want = FLEXIBLE[key][1] if key in FLEXIBLE else f"{expected(default)}, like the default {default!r}"
        die(f"{where}{key}={value!r}: expected {want}")
    return value

def unknown_key(key, known, where):
    near = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean {near[0]}?" if near else "; the known keys are the globals at the top of train.py"
    die(f"{where}unknown config key {key!r}{hint}")

class Recorder(dict):
    """A config file's namespace that remembers which names the file assigned (even to the default value)."""
    def __init__(self, config):
        super().__init__(config)
        self.assigned = []
    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        if key not in self.assigned:
            self.assigned.append(key)

def parse_value(text):
    # a Python literal if it is one (3e-4, True, (0.9, 0.95)), else the string itself (--dataset=foo)
    try:
        return ast.literal_eval(text)
    except Exception:  # ValueError, SyntaxError, and for pathological input MemoryError or RecursionError
        return text

def configure(defaults, argv):
    """Apply config files and --key=value overrides in order.
    Returns (config, explicit): the full dict, and the set of keys that a file or flag set."""
    config, explicit = dict(defaults), set()
    for arg in argv:
        if not arg.startswith('--'):
            # a config file: exec it with the current config as its namespace
            if not os.path.isfile(arg):
                die(f"config file {arg!r} not found (arguments are config files or --key=value)")
            ns = Recorder(config)
            try:
                with open(arg, encoding='utf-8') as f:
                    exec(compile(f.read(), arg, 'exec'), {'__builtins__': __builtins__}, ns)
            except Exception as e:  # a syntax error or a failing line in the file
                die(f"config file {arg}: {first_line(e)}")
            for key in ns.assigned:
                value = ns[key]
                if key.startswith('_') or isinstance(value, types.ModuleType) or callable(value):
                    continue  # imports, helper functions, _private names
                if key not in defaults:
                    unknown_key(key, defaults, f"{arg}: ")
                config[key] = coerce(key, value, defaults[key], f"{arg}: ")
                explicit.add(key)
        else:
            key, eq, text = arg[2:].partition('=')
            if not eq:
                die(f"{arg}: expected --key=value")
            if key not in defaults:
                unknown_key(key, defaults, '--')
            config[key] = coerce(key, parse_value(text), defaults[key], '--')
            explicit.add(key)
    return config, explicit

# -----------------------------------------------------------------------------
# keys of the model (GPTConfig fields) and the checks of train.py's own keys

def model_keys():
    from model import GPTConfig
    return [f.name for f in fields(GPTConfig)]

# an architecture key changes what the weights mean; dropout is a training choice and may change on resume
def arch_keys():
    return [k for k in model_keys() if k != 'dropout'] + ['dataset']

CHOICES = dict(init_from=('scratch', 'resume'), lr_schedule=('constant', 'cosine'),
               dtype=('auto', 'float32', 'bfloat16', 'float16'))

def check(config):
    """Ranges and choices of train.py's keys, then GPTConfig's own validation. Returns the GPTConfig
    (its vocab_size is a placeholder until meta.json is read)."""
    c = config
    for key, v in c.items():
        if any(isinstance(x, float) and not math.isfinite(x) for x in (v if isinstance(v, tuple) else [v])):
            die(f"{key}={v!r}: must be a finite number")
    for key, allowed in CHOICES.items():
        if c[key] not in allowed:
            die(f"{key}={c[key]!r}: choose one of {', '.join(allowed)}")
    dev = c['device']
    if not (dev in ('auto', 'cpu', 'cuda', 'mps') or (dev.startswith('cuda:') and dev[5:].isdigit())):
        die(f"device={dev!r}: choose one of auto, cpu, cuda, cuda:N, mps")
    for key in ('batch_size', 'gradient_accumulation_steps', 'eval_interval', 'eval_iters', 'log_interval',
                'max_bad_steps', 'lr_decay_iters'):
        if c[key] < 1:
            die(f"{key}={c[key]}: must be >= 1")
    for key in ('max_iters', 'warmup_iters', 'vocab_size', 'learning_rate', 'min_lr', 'weight_decay', 'grad_clip'):
        if not (0 <= c[key] < math.inf):  # also catches nan
            die(f"{key}={c[key]}: must be a finite number >= 0")
    if not 0 <= c['seed'] < 2**62:
        die(f"seed={c['seed']}: must be in [0, 2**62)")
    for key in ('beta1', 'beta2'):
        if not 0 <= c[key] < 1:
            die(f"{key}={c[key]}: must be in [0, 1)")
    for key in ('dataset', 'out_dir'):
        if not c[key].strip() or '\0' in c[key]:
            die(f"{key}={c[key]!r}: must be a non-empty name")
    if c['lr_schedule'] == 'cosine' and c['lr_decay_iters'] <= c['warmup_iters']:
        die(f"lr_decay_iters={c['lr_decay_iters']} must be > warmup_iters={c['warmup_iters']} for the cosine schedule")
    if os.path.basename(c['dataset']) != c['dataset'] or c['dataset'] in ('.', '..'):
        die(f"dataset={c['dataset']!r}: give a folder name under data/, like shakespeare_char")
    from common import model_config
    return model_config({k: c[k] for k in model_keys() if k != 'vocab_size'})

def resume_config(config, explicit, ckpt, path):
    """The config of a resumed run: the checkpoint's, with the keys this command set explicitly on top.
    A key that changes the architecture dies (naming every such key); the other changes (max_iters,
    learning_rate, ...) are allowed and returned as a list of 'key old -> new' for train.py to print."""
    saved = dict(ckpt.get('config') or {})
    saved.update({k: v for k, v in ckpt['model_args'].items() if k != 'vocab_size'})  # the weights' truth
    changed_arch = [k for k in arch_keys() if k in explicit and k in saved and config[k] != saved[k]]
    if changed_arch:
        diffs = ', '.join(f"{k}={config[k]!r} (checkpoint: {saved[k]!r})" for k in changed_arch)
        die(f"cannot resume {path} with a different architecture: {diffs}; drop these overrides or use a new out_dir")
    out = dict(config)
    for k, v in saved.items():
        if k in config and k not in explicit and k not in ('init_from', 'out_dir'):
            ok, v = fit(k, v, config[k])
            if not ok:
                die(f"{path}: the saved config has {k}={v!r}, expected {expected(config[k])}")
            out[k] = v
    changes = [f"{k} {saved[k]!r} -> {config[k]!r}" for k in sorted(explicit)
               if k in saved and saved[k] != config[k] and k not in ('init_from', 'out_dir')]
    return out, changes


def train_defaults(train_py=os.path.join(os.path.dirname(os.path.abspath(__file__)), 'train.py')):
    """train.py's module-level config globals (the literal assignments above `config_keys`), read without
    running it: what ablate.py and the tests resolve configs against."""
    with open(train_py, encoding='utf-8') as f:
        tree = ast.parse(f.read())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id == 'config_keys':
                break
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    return out
