"""
Sample from a trained looped GPT, as nanoGPT's sample.py does. Flags are --key=value, checked as train.py's.

    python sample.py --out_dir=out --start="ROMEO:" --num_samples=3 --n_loop=2  # fixed exit at loop 2
    python sample.py --out_dir=out --exit_threshold=0.9 --kv_policy=copy   # adaptive exit (maxprob)
    python sample.py --out_dir=out-huginn --exit_policy=kl --exit_threshold=5e-4 --n_loop=16  # KL exit
    python sample.py --out_dir=out-ouro --exit_policy=gate --exit_threshold=0.5  # Ouro's learned gate
    python sample.py --out_dir=out --draft_loops=1 --speculate=4 --start=FILE:prompt.txt  # self-speculative
    python sample.py --out_dir=out --prompts=prompts.txt --batch_size=8 --exit_threshold=0.9  # depth batching
"""
import sys
import time
from collections import Counter

import torch

from configurator import TRAIN_CHOICES, check_flags, configure, die, pick_device
from decoding.batching import serve
from decoding.engine import Decoding, generate
from decoding.exits import EXIT_POLICIES, KV_POLICIES
from prepare import checkpoint_meta, get_tokenizer
from run import checkpoint, ops

out_dir = 'out'              # the folder holding ckpt.pt (or a checkpoint file)
start = '\n'                 # the prompt, or FILE:path to read it from a file
num_samples = 3              # samples to draw
max_new_tokens = 500         # tokens generated per sample
temperature = 0.8            # 1 = as trained, < 1 sharper, 0 = greedy
top_k = 200                  # keep the top_k most likely tokens (0 = all)
seed = 1337
device = 'auto'              # auto (cuda, then mps, then cpu) | cpu | cuda:N | mps
n_loop = 0                   # loops per token (0 = the trained R): fewer = early exit, more = extrapolation
exit_threshold = -1.0        # adaptive exit at the first loop whose score reaches this (-1 = off)
exit_policy = 'maxprob'      # the score: maxprob | margin | entropy | kl (KL to the last exit <= it) | gate
kv_policy = 'recompute'      # what an exit leaves in skipped slots: recompute | copy | shared | active
kv_slots = 0                 # kv_policy=shared: the cache slots per layer (1..R)
draft_loops = 0              # self-speculative decoding: draft with this many loops (0 = off)
speculate = 4                # with draft_loops: tokens per draft
meta = ''                    # a meta.json (or its folder); '' = data/<dataset>/meta.json, else the ckpt's
prompts = ''                 # a file of prompts, one a line (blank lines skipped), each decoded once
batch_size = 1               # rows in flight (continuous depth batching, batching.py); 1 = one at a time
compile = False              # decode through batching.py's step compiled as one graph (torch.compile)
dtype = 'auto'               # float32 | bfloat16 | float16 | auto: train.py's rule (hardware.auto_dtype)
config_keys = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, str))]
defaults = {k: globals()[k] for k in config_keys}  # main() starts every call from these


def main(argv=None):
    config, explicit = configure(defaults, sys.argv[1:] if argv is None else argv, __file__)
    globals().update(config)  # the flags, as nanoGPT's configurator sets them
    check_flags(config, dict(num_samples=1, max_new_tokens=0, temperature=0, top_k=0, n_loop=0, kv_slots=0,
                             draft_loops=0, speculate=1, batch_size=1),  # before the slow load
                dict(exit_policy=EXIT_POLICIES, kv_policy=KV_POLICIES, dtype=TRAIN_CHOICES['dtype']))
    if prompts and {'start', 'num_samples'} & explicit:
        die("--prompts decodes each line of its file once: drop --start and --num_samples")
    text, flag = read_prompts()  # before the (slow) checkpoint load: a typo in a path fails at once
    dev, device_type = pick_device(device)
    torch.manual_seed(seed)  # every device's generator
    ctx, words = precision(dtype, device_type)
    ckpt = checkpoint.load(ckpt_path := checkpoint.path_of(out_dir))  # on the CPU: .to(dev) moves the model
    encode, decode = get_tokenizer(checkpoint_meta(meta, ckpt, ckpt_path))
    try:
        rows = [encode(t) for t in text.splitlines() if t] if prompts else [encode(text)] * num_samples
    except ValueError as e:
        die(f"--{flag}: {e}")
    if not rows or not all(rows):  # (a prompt of no tokens, or a file of blank lines)
        die(f"--{flag}: the prompt is empty (give some text, e.g. --start='\\n')" if rows else
            f"--prompts {prompts}: no prompt in the file (one a line, blank lines skipped)")
    model = checkpoint.build_model(ckpt).eval().to(dev)  # the optimizer state is not needed to sample
    opts = Decoding.from_flags(config, explicit)
    if why := opts.why_not(model.config):
        die(why)
    R = opts.n_loop or model.config.n_loop
    print(f"sampling {len(rows)} x {max_new_tokens} tokens, {mode(opts, R)}, trained with "
          f"n_loop={model.config.n_loop}, {dev}, {words}")
    t0 = time.time()
    with torch.no_grad(), ctx:
        outs, used, stats = decode_rows(model, rows, opts, dev)
    seconds = time.time() - t0 - stats.get('compiling', 0)  # --compile: the calls that compiled, apart
    print(''.join(decode(out) + '\n---------------\n' for out in outs), end='')
    print(summary(torch.tensor([k for u in used for k in u], dtype=torch.float), seconds, R, opts, stats))


def read_prompts():  # the text of --prompts or --start (FILE:path reads a file), and its flag
    flag = 'prompts' if prompts else 'start'
    path = prompts or (start[5:] if start.startswith('FILE:') else '')
    try:
        return (open(path, encoding='utf-8').read() if path else start), flag
    except (OSError, UnicodeDecodeError) as e:
        die(f"--{flag} {prompts or start}: {e.strerror if isinstance(e, OSError) and e.strerror else e}")


def precision(dtype, device_type):
    # --dtype by train.py's rule (ops.resolve_dtype): autocast in bf16 or fp16, none at float32; and in words
    dtype, note = ops.resolve_dtype(dtype, device_type)
    if device_type == 'cuda' and dtype != 'float32':  # tf32 matmuls, unless float32 was asked for
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    return torch.autocast(device_type, dtype=getattr(torch, dtype), enabled=dtype != 'float32'), dtype + note


def mode(o, R):  # the decoding options o in words, for the header line
    words = f"adaptive exit ({o.exit_policy} >= {o.exit_threshold}, at most {R} loops)" if o.exit_threshold \
        is not None else f"fixed exit at loop {R}"
    if o.draft_loops:
        words += f", self-speculative (drafts of {o.speculate or 4} tokens from loop {o.draft_loops})"
    if o.kv_policy != 'recompute':
        words += f", kv_policy={o.kv_policy}" + (f" ({o.kv_slots} slots)" if o.kv_slots else "")
    return words + (f", {o.batch_size} rows in flight" if o.batch_size > 1 else "") + ", compiled" * o.compile


def decode_rows(model, rows, opts, dev):
    # every prompt's tokens, the loops each new token used, the decoding's counts
    if opts.batch_size > 1 or opts.compile:  # depth batching: rows at their own loops share each call
        return serve(model, rows, max_new_tokens, opts)
    ys, us, cs = zip(*(generate(model, torch.tensor([r], device=dev), max_new_tokens, opts) for r in rows))
    return [y[0].tolist() for y in ys], [u[0].tolist() for u in us], sum(map(Counter, cs), Counter())


def summary(used, seconds, R, o, stats):
    # every mode prints its speed (compiled: without the calls that compiled): fixed depth is the baseline
    n, adaptive, took = used.numel(), o.exit_threshold is not None, stats.get('compiling', 0)
    depth = (f"mean loops used per token: {used.mean():.2f} of {R} (min {used.min():.0f}, "
             f"max {used.max():.0f}, {n} tokens); ") if adaptive and n else ""
    ok, checked = stats.get('accepted', 0), stats.get('checked', 0)
    drafts = f", {ok} of {checked} drafts accepted ({ok / checked:.0%})" if o.draft_loops and checked else ""
    rate = f"{n / max(seconds, 1e-9):.1f} tokens/s" + f"; compiling took {took:.2f} s" * o.compile
    return f"{depth}{n} tokens in {seconds:.2f} s ({rate}){'' if depth else f', {R} loops per token'}{drafts}"

if __name__ == '__main__':
    main()
