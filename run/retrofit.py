"""
Retrofitted recurrence (docs/papers.md §6): the layers of a model trained without loops, placed into a
looped model's prelude, loop and coda, so that training goes on from there instead of from scratch.

    gpt2_source(name)        GPT-2's weights through transformers, in nanoloop's names (its Conv1D transposed)
    nanoloop_source(ckpt)    a nanoloop checkpoint of a non-looped model (n_loop = 1), the same way
    placement(n, P, L, C)    which of the source's n layers go to the prelude, the loop and the coda
    retrofit(src, config, explicit)   the looped model's arguments and weights, and what to print

A source is a dict: args (the model keys its weights fix: width, heads, norms, vocabulary...), blocks (one
state dict per layer, in order, keys as in model.Block), rest (every other weight under the GPT's names),
meta (what its tokens mean) and name. checkpoint.resume calls retrofit() for train.py's init_from.
"""
import contextlib
import os
import socket
import urllib.parse

from configurator import die, first_line, gpt_config, model_keys
from model import GPT

GPT2_NAMES = ('gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl')
# what the retrofit itself may choose; every other model key is the source's (its weights mean nothing else)
LOOP_KEYS = ('n_prelude', 'n_layer', 'n_coda', 'n_loop', 'injection', 'adapter_init', 'loop_sampling',
             'max_loop', 'backprop_loops', 'supervision', 'inter_loop_norm', 'exit_gate', 'exit_entropy',
             'norm_penalty', 'dropout', 'attn_impl', 'block_size', 'hyper_lanes')
CONV1D = ('attn.c_attn.weight', 'attn.c_proj.weight', 'mlp.c_fc.weight', 'mlp.c_proj.weight')


def gpt2_source(name):
    """GPT-2 (a hub name, or a folder saved by save_pretrained) as a source. transformers' Conv1D stores
    its weight as (in, out), nn.Linear as (out, in): those four matrices a layer are transposed."""
    with hf_imports(name) as transformers:
        transformers.utils.logging.disable_progress_bar()  # stderr is for errors: one line each
        try:
            local = not os.path.isdir(name) and not hub_reachable()  # no ~45 s of retries offline
            hf = transformers.GPT2LMHeadModel.from_pretrained(name, local_files_only=local)
        except (OSError, ValueError) as e:  # no network, no such model, a folder of something else
            die(f"init_from={name!r}: transformers could not load it ({first_line(e)}); offline, point "
                f"init_from at a folder that GPT2LMHeadModel.save_pretrained wrote")
    c, sd = hf.config, hf.state_dict()
    tanh = {'gelu_new': 'gelu_tanh', 'gelu_pytorch_tanh': 'gelu_tanh', 'gelu': 'gelu'}
    act = tanh.get(c.activation_function)
    if act is None or c.layer_norm_epsilon != 1e-5 or c.scale_attn_by_inverse_layer_idx \
            or c.reorder_and_upcast_attn or c.n_inner not in (None, 4 * c.n_embd):
        die(f"{name}: this GPT-2 variant (activation {c.activation_function}, layer-norm eps "
            f"{c.layer_norm_epsilon}, ...) is not the one model.py builds")
    args = dict(vocab_size=c.vocab_size, n_embd=c.n_embd, n_head=c.n_head, block_size=c.n_positions,
                pos='learned', mlp=act, bias=True, norm='layernorm', readout='layernorm', tie_head=True,
                block='preln', depth_scaling='none', loop_lambda=0.0, n_expert=0)
    blocks = []
    for i in range(c.n_layer):
        prefix = f'transformer.h.{i}.'
        layer = {k[len(prefix):]: v for k, v in sd.items()  # less the causal-mask buffers of old versions
                 if k.startswith(prefix) and k[len(prefix):] not in ('attn.bias', 'attn.masked_bias')}
        blocks.append({k: v.t() if k in CONV1D else v for k, v in layer.items()})
    rest = {'transformer.wte.weight': sd['transformer.wte.weight'],
            'transformer.wpe.weight': sd['transformer.wpe.weight'],
            'transformer.ln_out.weight': sd['transformer.ln_f.weight'],
            'transformer.ln_out.bias': sd['transformer.ln_f.bias']}
    return dict(args=args, blocks=blocks, rest=rest, meta={'tokenizer': 'gpt2'}, name=name,
                dataset='openwebtext')  # WebText's open replica


def hub_reachable(timeout=3):
    # the Hugging Face hub answers a connection within `timeout` seconds (and HF_HUB_OFFLINE is not set)
    from huggingface_hub import constants
    if constants.HF_HUB_OFFLINE:
        return False
    try:
        socket.create_connection((urllib.parse.urlparse(constants.ENDPOINT).hostname, 443), timeout).close()
        return True
    except OSError:
        return False


@contextlib.contextmanager
def hf_imports(name):
    """transformers, or a one-line error saying how to install it."""
    try:
        import transformers
    except ImportError as e:
        if 'transformers' not in str(e):
            raise
        die(f"init_from={name!r} reads GPT-2's weights through transformers: pip install transformers")
    yield transformers


def nanoloop_source(ckpt, path):
    """A checkpoint (checkpoint.load's dict) of a model trained here without loops: its prelude, shared
    layers and coda, in order, are the layers to place."""
    args = ckpt['model_args']
    if args.get('n_loop', 1) != 1 or args.get('hyper_lanes', 0):
        die(f"{path} was trained with n_loop={args.get('n_loop')}: retrofit a model trained without loops "
            f"(n_loop=1), or continue this one with --init_from=resume")
    parts = [(part, args.get(n, 0)) for part, n in (('prelude', 'n_prelude'), ('h', 'n_layer'),
                                                    ('coda', 'n_coda'))]
    sd, blocks = ckpt['model'], []
    for part, n in parts:
        for j in range(n):
            prefix = f'transformer.{part}.{j}.'
            blocks.append({k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)})
    inside = tuple(f'transformer.{part}.' for part, _ in parts)
    rest = {k: v for k, v in sd.items() if not k.startswith(inside)}
    return dict(args=args, blocks=blocks, rest=rest, meta=ckpt.get('meta') or {}, name=path,
                dataset=ckpt.get('dataset'))


def placement(n, P, L, C):
    """(prelude, loop, coda, dropped): the source layers each part takes. The prelude is the first P
    layers, the coda the last C, the loop the L just before the coda; the layers between prelude and loop
    are dropped. McLeish et al. keep the later middle layers in the loop (TinyLlama (2,4,2): layers 0-1,
    16-19 and 20-21, 2-15 dropped)."""
    if P + L + C > n:
        die(f"n_prelude + n_layer + n_coda = {P} + {L} + {C} = {P + L + C} exceeds the source's {n} layers: "
            f"choose a split that fits, e.g. --n_prelude={n // 3} --n_layer={n - 2 * (n // 3)} "
            f"--n_coda={n // 3}")
    loop = list(range(n - C - L, n - C))
    return list(range(P)), loop, list(range(n - C, n)), list(range(P, n - C - L))


def retrofit(src, config, explicit):
    """The looped model's arguments, a checkpoint-like dict (model, model_args, meta, source) for train.py
    to load, and the lines to print. Keys the source fixes may not be set to other values; with none of
    n_prelude, n_layer, n_coda set, every layer goes to the loop (n_loop = 1 is then the source itself)."""
    n = len(src['blocks'])
    fixed = {k: v for k, v in src['args'].items() if k in model_keys() and k not in LOOP_KEYS}
    clash = [f"{k}={config[k]!r} (the source's: {v!r})" for k, v in fixed.items()
             if k in explicit and config[k] != v]
    if clash:
        die(f"init_from={src['name']}: the source's weights fix {', '.join(clash)}; drop these overrides")
    args = {k: config[k] for k in model_keys()} | fixed
    if not {'n_prelude', 'n_layer', 'n_coda'} & explicit:
        args.update(n_prelude=0, n_layer=n, n_coda=0)
    T = src['args']['block_size']
    args['block_size'] = config['block_size'] if 'block_size' in explicit else T
    if args['block_size'] > T:
        die(f"block_size={args['block_size']} exceeds the source's {T} positions: set block_size <= {T}")
    prelude, loop, coda, dropped = placement(n, args['n_prelude'], args['n_layer'], args['n_coda'])
    model = GPT(gpt_config(dict(args)))  # fresh: what the source has no weights for keeps its init
    sd = model.state_dict()
    given = dict(src['rest'])
    if 'transformer.wpe.weight' in given:  # a shorter context keeps the first positions (nanoGPT's crop)
        given['transformer.wpe.weight'] = given['transformer.wpe.weight'][:args['block_size']]
    for part, layers in (('prelude', prelude), ('h', loop), ('coda', coda)):
        for j, i in enumerate(layers):
            given |= {f'transformer.{part}.{j}.{k}': v for k, v in src['blocks'][i].items()}
    if args['tie_head'] and 'transformer.wte.weight' in given:
        given['lm_head.weight'] = given['transformer.wte.weight']
    wrong = [k for k, v in given.items() if k in sd and sd[k].shape != v.shape]
    if wrong:
        die(f"init_from={src['name']}: {wrong[0]} has shape {tuple(given[wrong[0]].shape)}, the model "
            f"{tuple(sd[wrong[0]].shape)}")
    sd |= {k: v.detach().clone() for k, v in given.items() if k in sd}
    new = sorted(k for k in sd if k not in given)
    span = lambda ids: f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else (str(ids[0]) if ids else 'none')
    notes = [f"init_from={src['name']}: its layers {span(prelude)} -> prelude, {span(loop)} -> loop "
             f"(x {args['n_loop']}), {span(coda)} -> coda, {span(dropped)} dropped, of {n}"]
    notes += [f"init_from: new weights at their init: {', '.join(new)}"] if new else []
    ckpt = dict(model=sd, model_args=args, meta=src['meta'], source=src['name'], dataset=src['dataset'])
    return args, ckpt, notes


def source_path(init_from):
    """The checkpoint file of a folder source, or None for a GPT-2 name (or transformers folder)."""
    path = os.path.join(init_from, 'ckpt.pt')
    return path if os.path.isfile(path) else None
