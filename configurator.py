"""
Config overrides, nanoGPT style, with typo, type and range checks.

    python train.py config/paper_44m.py config/loop_raw.py --batch_size=32 --readout=final_only

Arguments apply in the order given. A config file (an argument without a leading --) is plain Python whose
assignments override the defaults; `--key=value` sets one key, the value read as a Python literal (numbers,
True/False, strings) or else taken as a string. The defaults live in one place per key: training keys are
the globals at the top of train.py, model keys the fields of model.GPTConfig. An unknown key stops with the
nearest known one suggested; a value must have its default's type (an int is fine where a float is
expected); ranges are checked by check() below (training keys) and check_model (model keys). --help (or -h)
lists every key with its default and comment, read from the files that define them.
"""
import argparse
import ast
import difflib
import inspect
import io
import math
import os
import sys
import tokenize
import types
from dataclasses import fields

import torch

from model import DEPTH_EXPONENTS, GPTConfig


# -----------------------------------------------------------------------------
# one-line errors: a bad config value, flag, data file or checkpoint stops with one line on stderr
# (`error: ...`) and exit code 1, no traceback, never after touching a checkpoint already on disk

def die(msg):
    """The single way to stop on bad input: one line on stderr, exit code 1, no traceback."""
    msg = ' '.join(str(msg).split())  # one line, whatever the message held
    print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def first_line(e):
    """An exception as one short line: its type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0].split('. ')[0][:200]}" if text else type(e).__name__


class Parser(argparse.ArgumentParser):
    """argparse for the command-line tools, with a one-line error (and the nearest flag for a typo) instead
    of argparse's usage block. Flags are written --key=value or --key value; no abbreviations."""

    def __init__(self, prog, description):
        super().__init__(prog=prog, description=description, allow_abbrev=False,
                         formatter_class=argparse.RawDescriptionHelpFormatter)

    def error(self, message):
        if 'unrecognized arguments' in message:
            flags = [o[2:] for a in self._actions for o in a.option_strings if o.startswith('--')]
            bad = message.split(':', 1)[1].split()[0].split('=')[0].lstrip('-')
            near = difflib.get_close_matches(bad, flags, n=1)  # compared without the dashes they all share
            message += f"; did you mean --{near[0]}?" if near else ''
        die(f"{message} (see python {self.prog} --help)")


def pick_device(name):
    """(device, device_type) for --device, 'auto' resolved, or a one-line error if this machine does not
    have it: the one place that decides the device (under DDP, ops.init_processes then gives each rank
    on CUDA its own GPU)."""
    if name == 'auto':
        name = 'cuda' if torch.cuda.is_available() else 'mps' if torch.backends.mps.is_available() else 'cpu'
    try:
        device_type = torch.device(name).type
    except RuntimeError:
        die(f"--device={name}: not a torch device; use auto, cpu, cuda, cuda:N or mps")
    available = dict(cpu=True, cuda=torch.cuda.is_available(), mps=torch.backends.mps.is_available())
    if not available.get(device_type, False):
        die(f"--device={name}: not available on this machine; use --device=cpu or auto")
    return name, device_type

# -----------------------------------------------------------------------------
# the model keys: their defaults and meanings are model.GPTConfig's, their choices and ranges are here

# the named choices of every model key
MODEL_CHOICES = dict(
    pos=('learned', 'rope'),
    mlp=('swiglu', 'gelu', 'gelu_tanh'),
    norm=('rmsnorm', 'layernorm'),
    init=('reference', 'gpt2'),
    readout=('rmsnorm', 'layernorm', 'raw', 'final_only'),
    supervision=('per_loop', 'terminal'),
    inter_loop_norm=('none', 'rmsnorm', 'layernorm', 'readout'),
    block=('preln', 'postln', 'sandwich'),
    attn_impl=('auto', 'sdpa', 'math', 'explicit'),
    injection=('none', 'add', 'concat', 'iso'),
    adapter_init=('identity', 'default'),
    loop_sampling=('fixed', 'poisson_lognormal'),
    exit_gate=('none', 'learned'),
)
# the integer keys and their least value
INT_KEYS = dict(block_size=1, vocab_size=1, n_layer=1, n_loop=1, n_head=1, n_embd=1,
                n_prelude=0, n_coda=0, max_loop=0, backprop_loops=0, hyper_lanes=0, n_expert=0, top_k=1,
                expert_hidden=0)


def require(ok, msg):
    # a model value that model.py cannot build: one line, in the terms the user typed
    if not ok:
        raise ValueError(msg)


def check_model(cfg):
    """The values of a GPTConfig and the combinations this model.py can build: ValueError (one line) for
    anything else. Returns cfg, with depth_scaling parsed."""
    for key, allowed in MODEL_CHOICES.items():
        value = getattr(cfg, key)
        require(value in allowed, f"{key}={value!r}: choose one of {', '.join(allowed)}")
    for key, low in INT_KEYS.items():
        value = getattr(cfg, key)
        require(isinstance(value, int) and not isinstance(value, bool) and value >= low,
                f"{key}={value!r}: must be an integer >= {low}")
    for key in ('dropout', 'norm_penalty', 'loop_lambda', 'exit_entropy', 'embd_std', 'aux_loss_coef',
                'z_loss_coef'):
        value = getattr(cfg, key)
        require(math.isfinite(value), f"{key}={value!r}: must be a finite number")
    require(cfg.n_embd % cfg.n_head == 0,
            f"n_embd={cfg.n_embd} is not divisible by n_head={cfg.n_head}")
    require(cfg.pos != 'rope' or (cfg.n_embd // cfg.n_head) % 2 == 0,
            f"pos='rope' needs an even head size, got n_embd/n_head = {cfg.n_embd // cfg.n_head}")
    require(0.0 <= cfg.dropout < 1.0, f"dropout={cfg.dropout!r}: must be in [0, 1)")
    require(cfg.norm_penalty >= 0, f"norm_penalty={cfg.norm_penalty!r}: must be >= 0")
    require(cfg.embd_std >= 0, f"embd_std={cfg.embd_std!r}: must be >= 0 (0 = the init's own)")
    require(cfg.loop_lambda >= 0, f"loop_lambda={cfg.loop_lambda!r}: must be >= 0 (0 = off)")
    require(cfg.loop_lambda == 0 or cfg.block == 'preln',
            "loop_lambda scales pre-norm branches: it needs block='preln'")
    cfg.depth_scaling = parse_depth_scaling(cfg.depth_scaling)
    require(cfg.depth_exponent == 0 or cfg.block != 'preln', f"depth_scaling={cfg.depth_scaling!r} "
            f"scales post-norm skips: use block='postln' or 'sandwich'")
    # the keys of the recurrent-depth family that only make sense together
    require(not cfg.max_loop or cfg.max_loop >= cfg.n_loop, f"max_loop={cfg.max_loop} is below "
            f"n_loop={cfg.n_loop}: the cap on the sampled depth must be >= n_loop (or 0 = 4 x n_loop)")
    require(cfg.backprop_loops <= cfg.loop_cap, f"backprop_loops={cfg.backprop_loops} exceeds "
            f"max_loop={cfg.loop_cap}: no step runs that many loops")
    require(cfg.exit_gate != 'learned' or cfg.supervision != 'terminal', "exit_gate='learned' weights "
            "every exit's CE: it needs supervision='per_loop', not 'terminal'")
    require(cfg.exit_entropy == 0 or cfg.exit_gate == 'learned', f"exit_entropy={cfg.exit_entropy!r} "
            f"is the learned gate's entropy bonus: set exit_gate='learned' (or exit_entropy=0)")
    require(cfg.inter_loop_norm != 'readout' or cfg.readout in ('rmsnorm', 'layernorm'),
            f"inter_loop_norm='readout' feeds the readout norm back: it needs readout='rmsnorm' or "
            f"'layernorm', not {cfg.readout!r}")
    require(cfg.exit_entropy >= 0, f"exit_entropy={cfg.exit_entropy!r}: must be >= 0")
    # hyper-connections (docs/papers.md §3): parameters per loop 1..n_loop, every one of them trained
    if cfg.hyper_lanes:
        lanes = f"hyper_lanes={cfg.hyper_lanes}"
        require(cfg.hyper_lanes >= 2, f"{lanes}: hyper-connections need at least 2 lanes (0 = off)")
        require(cfg.injection == 'none', f"{lanes} replaces the injection: set injection='none', "
                f"not {cfg.injection!r}")
        require(cfg.loop_sampling == 'fixed', f"{lanes} has parameters per loop 1..n_loop: it needs "
                f"loop_sampling='fixed'")
        b = cfg.backprop_loops
        require(b == 0 or b >= cfg.n_loop, f"{lanes} with backprop_loops={b}: the lane parameters of loops "
                f"1..{cfg.n_loop - b} would get no gradient (0 = all loops)")
    # Looped-MoE (§5)
    require(cfg.n_expert != 1, "n_expert=1 is a dense MLP with a router: use n_expert=0 (dense) or >= 2")
    require(not cfg.n_expert or cfg.top_k <= cfg.n_expert,
            f"top_k={cfg.top_k} exceeds n_expert={cfg.n_expert}: a token picks at most every expert")
    require(cfg.n_expert or not cfg.tied_routing,
            "tied_routing reuses loop 1's experts: it needs experts (n_expert >= 2)")
    if cfg.disjoint_routing:
        share = cfg.n_expert // cfg.n_loop if cfg.n_expert % cfg.n_loop == 0 else 0
        require(share >= cfg.top_k, f"disjoint_routing gives each of n_loop={cfg.n_loop} loops "
                f"n_expert/n_loop experts: n_expert={cfg.n_expert} must be a multiple of n_loop with at "
                f"least top_k={cfg.top_k} each")
        require(not cfg.tied_routing, "disjoint_routing and tied_routing contradict each other: pick one")
    require(cfg.aux_loss_coef >= 0 and cfg.z_loss_coef >= 0,
            f"aux_loss_coef={cfg.aux_loss_coef!r}, z_loss_coef={cfg.z_loss_coef!r}: must be >= 0")
    return cfg


def parse_depth_scaling(p):
    # a name, or the exponent p itself (also as a string such as '0.3')
    bad = f"depth_scaling={p!r}: choose one of none, deepnorm, deeploop, or a number p >= 0"
    if isinstance(p, str) and p not in DEPTH_EXPONENTS:
        try:
            p = float(p)
        except ValueError:
            raise ValueError(bad) from None
    require(not isinstance(p, bool) and isinstance(p, (str, int, float)), bad)
    require(isinstance(p, str) or 0 <= p < 10, bad)
    return p


def model_keys():
    return [f.name for f in fields(GPTConfig)]


def gpt_config(model_args):
    """GPTConfig from a dict, with a one-line error for a bad value or a key this model.py does not know."""
    try:
        return check_model(GPTConfig(**model_args))
    except TypeError as e:  # an unexpected keyword: a checkpoint from another version of model.py
        die(f"model arguments do not fit this model.py: {first_line(e)}")
    except ValueError as e:  # check_model's message names the key and the allowed values
        die(str(e))

# -----------------------------------------------------------------------------
# parsing

def fit(key, value, default):
    """(True, value converted) if value has the type of default (an int is fine for a float), else
    (False, value). depth_scaling takes a name or a number."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if key == 'depth_scaling':
        return isinstance(value, str) or is_number, value
    if isinstance(default, bool):
        return isinstance(value, bool), value
    if isinstance(default, float):
        if not is_number:
            return False, value
        try:
            return True, float(value)
        except OverflowError:  # an int too large for a float
            return True, math.nan
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool), value
    return isinstance(value, type(default)), value


def coerce(key, value, default, where):
    """value, typed like default; else die naming the key and the expected type."""
    ok, value = fit(key, value, default)
    if not ok:
        want = ('a name (none, deepnorm, deeploop) or a number p' if key == 'depth_scaling' else
                'bool (True or False)' if isinstance(default, bool) else
                f"{type(default).__name__}, like the default {default!r}")
        die(f"{where}{key}={value!r}: expected {want}")
    return value


def unknown_key(key, known, where, script):
    near = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean {near[0]}?" if near else f"; see python {os.path.basename(script)} --help"
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
    # a Python literal if it is one (3e-4, True, 'x'), else the string itself (--dataset=foo)
    try:
        return ast.literal_eval(text)
    except Exception:  # ValueError, SyntaxError, and for pathological input MemoryError or RecursionError
        return text


def read_config_file(path, config):
    """The assignments of one config file, executed with the current config as its namespace."""
    if not os.path.isfile(path):
        # a typo of a file that is there (loop_rmsnom for loop_rmsnorm): name the nearest .py file in it
        folder = os.path.dirname(path)
        here = folder or '.'
        files = sorted(f for f in os.listdir(here) if f.endswith('.py')) if os.path.isdir(here) else []
        near = difflib.get_close_matches(os.path.basename(path), files, n=1)
        hint = f"; did you mean {os.path.join(folder, near[0])}?" if near else ''
        die(f"config file {path!r} not found (arguments are config files or --key=value){hint}")
    ns = Recorder(config)
    try:
        with open(path, encoding='utf-8') as f:
            exec(compile(f.read(), path, 'exec'), {'__builtins__': __builtins__}, ns)
    except Exception as e:  # a syntax error or a failing line in the file
        die(f"config file {path}: {first_line(e)}")
    return {k: ns[k] for k in ns.assigned if not k.startswith('_')
            and not isinstance(ns[k], types.ModuleType) and not callable(ns[k])}  # skip imports, helpers


TRAIN_PY = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'train.py')


def configure(defaults, argv, script=TRAIN_PY):
    """Apply config files and --key=value overrides in order; --help or -h prints the keys of defaults
    (documented in `script` and, for the model keys, model.py) and exits.
    Returns (config, explicit): the full dict, and the set of keys that a file or flag set."""
    if '--help' in argv or '-h' in argv:  # before any file is read or any key is checked
        try:
            print(help_text(defaults, script), flush=True)
        except BrokenPipeError:  # `--help | head` read what it wanted: no traceback, none at exit either
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    config, explicit = dict(defaults), set()
    for arg in argv:
        if arg.startswith('--'):
            key, eq, text = arg[2:].partition('=')
            if not eq:
                die(f"{arg}: expected --key=value")
            updates, where = {key: parse_value(text)}, '--'
        else:
            updates, where = read_config_file(arg, config), f"{arg}: "
        for key, value in updates.items():
            if key not in defaults:
                unknown_key(key, defaults, '' if where == '--' else where, script)
            config[key] = coerce(key, value, defaults[key], where)
            explicit.add(key)
    return config, explicit

# -----------------------------------------------------------------------------
# --help: the files that hold the defaults are their documentation

def key_lines(path, keys):
    """[(group, key, default, comment lines)] for each of `keys` that `path` assigns a literal to, at its
    top level or in a class, in file order. A key line reads `name = value  # comment` (or `name: type =
    value  # comment`); its comment may go on over deeper-indented comment lines below it; a comment line
    just above a key, at its indentation, starts a group (train.py's `# I/O`, GPTConfig's `# ---- §1`)."""
    with open(path, encoding='utf-8') as f:
        source = f.read()
    lines = source.splitlines()
    comments = {t.start[0]: (t.start[1], t.string.lstrip('#').strip())  # line -> (column, text)
                for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT}
    alone = lambda i: i in comments and not lines[i - 1][:comments[i][0]].strip()  # a comment-only line
    out, group = [], None
    for top in ast.parse(source).body:
        for n in top.body if isinstance(top, ast.ClassDef) else [top]:
            target = n.targets[0] if isinstance(n, ast.Assign) else getattr(n, 'target', None)
            name = getattr(target, 'id', '') if isinstance(n, (ast.Assign, ast.AnnAssign)) else ''
            if name not in keys or name in (row[1] for row in out):
                continue
            try:
                ast.literal_eval(n.value)  # a default, not a later use of the name (block_size = ...)
            except ValueError:
                continue
            if alone(n.lineno - 1) and comments[n.lineno - 1][0] == n.col_offset:
                group = comments[n.lineno - 1][1].strip('- ')
            i, text = n.end_lineno, []
            if i in comments and not alone(i):
                text.append(comments[i][1])
                while alone(i + 1) and comments[i + 1][0] > n.col_offset:  # the comment goes on
                    i += 1
                    text.append(comments[i][1])
            out.append((group, name, ast.get_source_segment(source, n.value), text))
    return out


def help_text(defaults, script):
    """A usage line, then every key of defaults with its default and comment, grouped as in the files:
    the script's globals, then GPTConfig's fields (for train.py)."""
    name = os.path.basename(script)
    files = [(script, f"{name}'s keys")]
    if set(model_keys()) <= defaults.keys():
        files.append((inspect.getsourcefile(GPTConfig), "the model's keys (model.py, GPTConfig)"))
    out = [f"usage: python {name} [config_file.py ...] [--key=value ...]",
           "Config files (Python assignments) and --key=value flags apply in order over these defaults."]
    left = dict(defaults)
    for path, title in files:
        rows = key_lines(path, left)
        width = max((len(f"{k} = {v}") for _, k, v, _ in rows), default=0) + 4
        out.append(f"\n{title}:")
        for i, (group, key, value, text) in enumerate(rows):
            if group and (i == 0 or group != rows[i - 1][0]):
                out.append(f"  # {group}")
            out.append(f"  {f'{key} = {value}':<{width}}# {text[0]}" if text else f"  {key} = {value}")
            out += [f"  {'':<{width}}# {t}" for t in text[1:]]
            del left[key]
    if left:  # a key no file assigns a literal to
        out += ["\nother keys:"] + [f"  {k} = {v!r}" for k, v in left.items()]
    return '\n'.join(out)

# -----------------------------------------------------------------------------
# ranges of train.py's own keys (check_model checks the model keys)

TRAIN_CHOICES = dict(lr_schedule=('constant', 'cosine'),
                     dtype=('auto', 'float32', 'bfloat16', 'float16'))
AT_LEAST_ONE = ('batch_size', 'gradient_accumulation_steps', 'eval_interval', 'eval_iters', 'log_interval',
                'max_bad_steps', 'lr_decay_iters', 'max_failed_saves', 'collective_timeout')
NON_NEGATIVE = ('max_iters', 'warmup_iters', 'learning_rate', 'min_lr', 'weight_decay', 'grad_clip')


def check_flags(config, at_least, choices):
    """A script's own flags (sample.py's): each at least its least value, or one of its choices."""
    for key, low in at_least.items():
        if config[key] < low:
            die(f"--{key}={config[key]}: must be >= {low}")
    for key, allowed in choices.items():
        if config[key] not in allowed:
            die(f"--{key}={config[key]!r}: choose one of {', '.join(allowed)}")


def check(config):
    """Ranges and choices of train.py's keys, then check_model's. Returns the GPTConfig."""
    c = config
    for key, v in c.items():
        if isinstance(v, float) and not math.isfinite(v):
            die(f"{key}={v!r}: must be a finite number")
    for key, allowed in TRAIN_CHOICES.items():
        if c[key] not in allowed:
            die(f"{key}={c[key]!r}: choose one of {', '.join(allowed)}")
    dev = c['device']
    if not (dev in ('auto', 'cpu', 'cuda', 'mps') or (dev.startswith('cuda:') and dev[5:].isdigit())):
        die(f"device={dev!r}: choose one of auto, cpu, cuda, cuda:N, mps")
    for key in AT_LEAST_ONE:
        if c[key] < 1:
            die(f"{key}={c[key]}: must be >= 1")
    for key in NON_NEGATIVE:
        if not 0 <= c[key] < math.inf:
            die(f"{key}={c[key]}: must be a finite number >= 0")
    if not 0 <= c['loop_schedule'] <= 1:
        die(f"loop_schedule={c['loop_schedule']}: a share of max_iters, in [0, 1]")
    if not c['init_from'].strip():
        die("init_from='': choose scratch, resume, auto, gpt2 (-medium, -large, -xl) or a folder to loop")
    if not 0 <= c['seed'] < 2**62:
        die(f"seed={c['seed']}: must be in [0, 2**62)")
    for key in ('beta1', 'beta2'):
        if not 0 <= c[key] < 1:
            die(f"{key}={c[key]}: must be in [0, 1)")
    for key in ('dataset', 'out_dir'):
        if not c[key].strip() or '\0' in c[key]:
            die(f"{key}={c[key]!r}: must be a non-empty name")
    if c['lr_schedule'] == 'cosine' and c['lr_decay_iters'] <= c['warmup_iters']:
        die(f"lr_decay_iters={c['lr_decay_iters']} must be > warmup_iters={c['warmup_iters']} for the cosine "
            f"schedule")
    if os.path.basename(c['dataset']) != c['dataset'] or c['dataset'] in ('.', '..'):
        die(f"dataset={c['dataset']!r}: give a folder name under data/, like shakespeare_char")
    return gpt_config({k: c[k] for k in model_keys()})


def vocab_size(config, explicit, meta, data_dir):
    """The model's vocab_size: meta.json's, unless a config file, a flag or the resumed checkpoint set
    it (then it must hold meta.json's tokens)."""
    if 'vocab_size' not in explicit:
        return meta['vocab_size']
    if config['vocab_size'] < meta['vocab_size']:
        die(f"vocab_size={config['vocab_size']} is smaller than {data_dir}/meta.json's {meta['vocab_size']}")
    return config['vocab_size']

# -----------------------------------------------------------------------------
# resuming

def resume_config(config, explicit, ckpt, path):
    """The config of a resumed run: the checkpoint's, with the keys this command set explicitly on top.
    A key that changes the architecture dies (naming every such key); the other changes (max_iters,
    learning_rate, ...) are allowed and returned as a list of 'key old -> new' for train.py to print."""
    saved = dict(ckpt.get('config') or {})
    saved.update(ckpt['model_args'])  # the weights' truth, vocab_size included
    # what the weights mean; dropout and the attention kernel (the same result, by another path) may change
    arch = [k for k in model_keys() if k not in ('dropout', 'attn_impl')] + ['dataset']
    # a model key the checkpoint lacks predates it: those weights were built with GPTConfig's default
    # (a dense checkpoint from before n_expert has n_expert=0), so --n_expert=8 is a change like any other
    was = {f.name: f.default for f in fields(GPTConfig)} | saved
    changed_arch = [k for k in arch if k in explicit and k in was and config[k] != was[k]]
    if changed_arch:
        diffs = ', '.join(f"{k}={config[k]!r} (checkpoint: {was[k]!r})" for k in changed_arch)
        die(f"cannot resume {path} with a different architecture: {diffs}; drop these overrides or use a "
            f"new out_dir")
    out = dict(config)
    for k, v in saved.items():
        if k in config and k not in explicit and k not in ('init_from', 'out_dir'):
            ok, v = fit(k, v, config[k])
            if not ok:
                die(f"{path}: the saved config has {k}={v!r}, expected {type(config[k]).__name__}")
            out[k] = v
    changes = [f"{k} {saved[k]!r} -> {config[k]!r}" for k in sorted(explicit)
               if k in saved and saved[k] != config[k] and k not in ('init_from', 'out_dir')]
    return out, changes
