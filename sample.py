"""
Sample from a trained looped GPT, as nanoGPT's sample.py does (flags are --key=value, as in train.py).

    python sample.py --out_dir=out --start="ROMEO:" --num_samples=3
    python sample.py --out_dir=out --n_loop=2                     # fixed exit: stop at loop 2
    python sample.py --out_dir=out --exit_threshold=0.9           # adaptive: the first confident loop
    python sample.py --out_dir=out-huginn --exit_policy=kl --exit_threshold=5e-4 --n_loop=16  # KL exit
    python sample.py --out_dir=out-ouro --exit_policy=gate --exit_threshold=0.5   # the learned gate's exit
    python sample.py --out_dir=out --exit_threshold=0.9 --kv_policy=copy          # cheaper exits
    python sample.py --out_dir=out --draft_loops=1 --speculate=4                  # self-speculative
    python sample.py --out_dir=out --start=FILE:prompt.txt
"""
import os
import sys
import time
from contextlib import nullcontext
from types import SimpleNamespace

import torch

import checkpoint
import configurator
from engine import generate
from errors import die
from exits import EXIT_POLICIES, KV_POLICIES, score_threshold
from hardware import pick_device
from prepare import get_tokenizer, load_meta

out_dir = 'out'              # the folder holding ckpt.pt (or a checkpoint file)
start = '\n'                 # the prompt, or FILE:path to read it from a file
num_samples = 3              # samples to draw
max_new_tokens = 500         # tokens generated per sample
temperature = 0.8            # 1 = as trained, < 1 sharper, 0 = greedy
top_k = 200                  # keep the top_k most likely tokens (0 = all)
seed = 1337
device = 'auto'              # auto (cuda, then mps, then cpu) | cpu | cuda:N | mps
n_loop = 0                   # loops per token (0 = the trained R): fewer = early exit, more = extrapolation
exit_threshold = -1.0        # adaptive exit at the first loop whose score reaches this (-1 = off: n_loop)
exit_policy = 'maxprob'      # the score: maxprob | margin | entropy | kl (KL to the last exit <= it) | gate
kv_policy = 'recompute'      # what an exited token leaves in the slots it skips: recompute | copy | shared
                             # | active (exits.py, docs/decoding.md)
kv_slots = 0                 # kv_policy=shared: the cache slots per layer (1..R)
draft_loops = 0              # self-speculative decoding: draft with this many loops (0 = off)
speculate = 4                # with draft_loops: tokens per draft
meta = ''                    # a meta.json (or its folder); '' = data/<dataset>/meta.json, else the ckpt's
config_keys = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, str))]


def tokenizer_meta(c, ckpt, ckpt_path):
    """The meta.json to decode with: --meta, else data/<dataset>/meta.json, else the copy train.py keeps in
    the checkpoint. A meta.json must agree with the checkpoint: other tokens would decode to nonsense."""
    dataset, saved = ckpt.get('dataset', '?'), ckpt.get('meta') or {}
    path = c.meta or os.path.join('data', dataset)
    if not c.meta and not os.path.isfile(os.path.join(path, 'meta.json')) and 'tokenizer' in saved:
        return {'dataset': dataset, **saved}
    if os.path.isfile(path) and os.path.basename(path) != 'meta.json':
        die(f"--meta={path}: give a meta.json written by prepare.py, or the folder holding it")
    meta = load_meta(os.path.dirname(path) if os.path.basename(path) == 'meta.json' else path)  # checks it
    differ = [k for k in ('tokenizer', 'vocab_size', 'itos') if k in saved and saved[k] != meta.get(k)]
    model_vocab = ckpt['model_args'].get('vocab_size')
    if differ or not isinstance(model_vocab, int) or meta['vocab_size'] > model_vocab:
        die(f"{path} disagrees with {ckpt_path} ({', '.join(differ) or 'vocab_size'}: meta.json has "
            f"vocab_size {meta['vocab_size']}, the model {model_vocab}; it was trained on {dataset}); "
            f"pass that dataset's meta.json with --meta")
    return meta


def read_start(text):
    if not text.startswith('FILE:'):
        return text
    try:
        with open(text[len('FILE:'):], encoding='utf-8') as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        die(f"--start {text}: {e.strerror if isinstance(e, OSError) and e.strerror else e}")


def check(c, explicit, R, cfg):
    """Every constraint on the flags, once each: a one-line error naming the flag."""
    for key, low in dict(num_samples=1, max_new_tokens=0, temperature=0, top_k=0, n_loop=0, kv_slots=0,
                         draft_loops=0, speculate=1).items():
        if getattr(c, key) < low:
            die(f"--{key}={getattr(c, key)}: must be >= {low}")
    for key, allowed in (('exit_policy', EXIT_POLICIES), ('kv_policy', KV_POLICIES)):
        if getattr(c, key) not in allowed:
            die(f"--{key}={getattr(c, key)!r}: choose one of {', '.join(allowed)}")
    adaptive, k, shared = c.exit_threshold != -1, c.draft_loops, c.kv_policy == 'shared'
    rules = [
        (not adaptive or c.exit_policy != 'gate' or cfg.exit_gate == 'learned', "--exit_policy=gate reads "
         "the learned exit gate, and this model has none (exit_gate='none'): use maxprob, margin, entropy or kl"),
        (not c.kv_slots or shared, f"--kv_slots={c.kv_slots} sets the slots of --kv_policy=shared: add it, "
         "or drop --kv_slots"),
        (not shared or c.kv_slots, f"--kv_policy=shared needs --kv_slots=N, the cache slots per layer (1..{R})"),
        (c.kv_slots <= R, f"--kv_slots={c.kv_slots}: a token runs only {R} loops, so this model uses at most "
         f"{R} slots"),
        (c.kv_policy not in ('copy', 'active') or adaptive or k, f"--kv_policy={c.kv_policy} decides what "
         "exited tokens leave in the cache: add --exit_threshold"),
        (k or 'speculate' not in explicit, f"--speculate={c.speculate} is the draft length of "
         "self-speculative decoding: add --draft_loops"),
        (k < R, f"--draft_loops={k}: drafts must use fewer loops than the {R} each token runs (1..{R - 1})"),
        (not k or not adaptive, "--draft_loops: self-speculative decoding gives fixed-depth tokens; drop "
         "--exit_threshold"),
        (not k or not shared, "--draft_loops: verifying drafts needs every loop's own cache slots; drop "
         "--kv_policy=shared")]
    for ok, msg in rules:
        if not ok:
            die(msg)
    try:
        score_threshold(c.exit_policy, c.exit_threshold) if adaptive else None
    except ValueError as e:
        die(f"--{e}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    config, explicit = configurator.configure({k: globals()[k] for k in config_keys}, argv)
    c = SimpleNamespace(**config)
    prompt = read_start(c.start)  # before the (slow) checkpoint load: a typo in the path fails at once
    dev, device_type = pick_device(c.device)
    torch.manual_seed(c.seed)
    if device_type == 'cuda':
        torch.cuda.manual_seed(c.seed)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    ptdtype = torch.bfloat16 if device_type == 'cuda' and torch.cuda.is_bf16_supported() else torch.float16
    ctx = torch.autocast(device_type=device_type, dtype=ptdtype) if device_type == 'cuda' else nullcontext()
    ckpt_path = c.out_dir if os.path.isfile(c.out_dir) else os.path.join(c.out_dir, 'ckpt.pt')
    ckpt = checkpoint.load(ckpt_path)  # on the CPU: the weights go to the device with the model
    encode, decode = get_tokenizer(tokenizer_meta(c, ckpt, ckpt_path))
    try:
        ids = encode(prompt)
    except ValueError as e:
        die(f"--start: {e}")
    if not ids:
        die("--start: the prompt is empty (give some text, e.g. --start='\\n')")
    x = torch.tensor(ids, dtype=torch.long, device=dev)[None, ...]  # (1, T)
    model = checkpoint.build_model(ckpt).eval().to(dev)  # the optimizer state is not needed to sample
    R = c.n_loop or model.config.n_loop
    check(c, explicit, R, model.config)
    adaptive, k = c.exit_threshold != -1, c.draft_loops
    mode = (f"adaptive exit ({c.exit_policy} >= {c.exit_threshold}, at most {R} loops)" if adaptive
            else f"fixed exit at loop {R}")
    mode += f", self-speculative (drafts of {c.speculate} tokens from loop {k})" if k else ""
    mode += f", kv_policy={c.kv_policy}" + (f" ({c.kv_slots} slots)" if c.kv_slots else "") \
        if c.kv_policy != 'recompute' else ""
    print(f"sampling {c.num_samples} x {c.max_new_tokens} tokens, {mode}, trained with "
          f"n_loop={model.config.n_loop}, {dev}")
    loops, stats, seconds = [], {}, 0.0
    with torch.no_grad(), ctx:
        for _ in range(c.num_samples):
            t0 = time.perf_counter()
            y, used = generate(model, x, c.max_new_tokens, c.temperature, c.top_k or None, R,
                               c.exit_threshold if adaptive else None, c.exit_policy,
                               kv_policy=c.kv_policy, kv_slots=c.kv_slots or None, draft_loops=k,
                               speculate=c.speculate, stats=stats)
            ids = y[0].tolist()  # (waits for the device)
            seconds += time.perf_counter() - t0
            print(decode(ids))
            print('---------------')
            loops.append(used.float().flatten())
    n, used = c.num_samples * c.max_new_tokens, torch.cat(loops)
    line = f"{n} tokens in {seconds:.2f} s ({n / max(seconds, 1e-9):.1f} tokens/s)"  # every mode: a baseline
    if adaptive and n:
        line = (f"mean loops used per token: {used.mean().item():.2f} of {R} (min {used.min().item():.0f}, "
                f"max {used.max().item():.0f}, {used.numel()} tokens); " + line)
    else:
        line += f", {R} loops per token"
    if k and stats['checked']:
        line += f", {stats['accepted']} of {stats['checked']} drafts accepted " \
                f"({stats['accepted'] / stats['checked']:.0%})"
    print(line)


if __name__ == '__main__':
    main()
