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
from contextlib import nullcontext

import torch

from run import checkpoint
import configurator
from decoding.batching import serve
from decoding.engine import Decoding, generate
from configurator import die, pick_device
from decoding.exits import EXIT_POLICIES, KV_POLICIES
from prepare import checkpoint_meta, get_tokenizer

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
config_keys = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, str))]
defaults = {k: globals()[k] for k in config_keys}  # main() starts every call from these


def main(argv=None):
    config, explicit = configurator.configure(defaults, sys.argv[1:] if argv is None else argv, __file__)
    globals().update(config)  # the flags, as nanoGPT's configurator sets them
    configurator.check_flags(config, dict(num_samples=1, max_new_tokens=0, temperature=0, top_k=0, n_loop=0,
                                          kv_slots=0, draft_loops=0, speculate=1, batch_size=1),
                             dict(exit_policy=EXIT_POLICIES, kv_policy=KV_POLICIES))  # before the slow load
    if prompts and {'start', 'num_samples'} & explicit:
        die("--prompts decodes each line of its file once: drop --start and --num_samples")
    text, flag = read_prompts()  # before the (slow) checkpoint load: a typo in a path fails at once
    dev, device_type = pick_device(device)
    torch.manual_seed(seed)  # every device's generator
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    ptdtype = torch.bfloat16 if device_type == 'cuda' and torch.cuda.is_bf16_supported() else torch.float16
    ctx = torch.autocast(device_type=device_type, dtype=ptdtype) if device_type == 'cuda' else nullcontext()
    ckpt_path = checkpoint.path_of(out_dir)
    ckpt = checkpoint.load(ckpt_path)  # on the CPU: the weights go to the device with the model
    encode, decode = get_tokenizer(checkpoint_meta(meta, ckpt, ckpt_path))
    try:
        rows = [encode(t) for t in text.splitlines() if t] if prompts else [encode(text)] * num_samples
    except ValueError as e:
        die(f"--{flag}: {e}")
    if not all(rows):
        die(f"--{flag}: the prompt is empty (give some text, e.g. --start='\\n')")
    model = checkpoint.build_model(ckpt).eval().to(dev)  # the optimizer state is not needed to sample
    opts = Decoding(temperature, top_k or None, n_loop or None, None if exit_threshold == -1 else
                    exit_threshold, exit_policy, kv_policy, kv_slots or None, draft_loops,
                    speculate if 'speculate' in explicit else None, batch_size, compile=compile)
    if why := opts.why_not(model.config):
        die(why)
    R = opts.n_loop or model.config.n_loop
    print(f"sampling {len(rows)} x {max_new_tokens} tokens, {mode(opts, R)}, trained with "
          f"n_loop={model.config.n_loop}, {dev}")
    t0 = time.time()
    with torch.no_grad(), ctx:
        outs, used, stats = decode_rows(model, rows, opts, dev)
    seconds = time.time() - t0
    for out in outs:
        print(decode(out) + '\n---------------')
    print(summary(torch.tensor([k for u in used for k in u], dtype=torch.float), seconds, R, opts, stats))


def read_prompts():  # the text of --prompts or --start (FILE:path reads a file), and its flag
    flag = 'prompts' if prompts else 'start'
    path = prompts or (start[5:] if start.startswith('FILE:') else '')
    try:
        return (open(path, encoding='utf-8').read() if path else start), flag
    except (OSError, UnicodeDecodeError) as e:
        die(f"--{flag} {prompts or start}: {e.strerror if isinstance(e, OSError) and e.strerror else e}")


def mode(opts, R):  # the decoding in words, for the header line
    words = f"adaptive exit ({exit_policy} >= {exit_threshold}, at most {R} loops)" if opts.exit_threshold \
        is not None else f"fixed exit at loop {R}"
    if draft_loops:
        words += f", self-speculative (drafts of {speculate} tokens from loop {draft_loops})"
    if kv_policy != 'recompute':
        words += f", kv_policy={kv_policy}" + (f" ({kv_slots} slots)" if kv_slots else "")
    return words + (f", {batch_size} rows in flight" if batch_size > 1 else "") + (", compiled" * compile)


def decode_rows(model, rows, opts, dev):
    # every prompt's tokens, the loops each new token used, the decoding's counts
    if opts.batch_size > 1 or opts.compile:  # depth batching: rows at their own loops share each call
        return serve(model, rows, max_new_tokens, opts)
    runs = [generate(model, torch.tensor([ids], device=dev), max_new_tokens, opts) for ids in rows]
    return ([y[0].tolist() for y, _, _ in runs], [u[0].tolist() for _, u, _ in runs],
            sum((Counter(c) for _, _, c in runs), Counter()))


def summary(used, seconds, R, opts, stats):
    # every mode prints its speed: plain fixed-depth decoding is the baseline of the others
    n, adaptive = used.numel(), opts.exit_threshold is not None
    depth = (f"mean loops used per token: {used.mean():.2f} of {R} (min {used.min():.0f}, "
             f"max {used.max():.0f}, {n} tokens); ") if adaptive and n else ""
    ok, checked = stats.get('accepted', 0), stats.get('checked', 0)
    drafts = f", {ok} of {checked} drafts accepted ({ok / checked:.0%})" if draft_loops and checked else ""
    return (f"{depth}{n} tokens in {seconds:.2f} s ({n / max(seconds, 1e-9):.1f} tokens/s)"
            + ("" if depth else f", {R} loops per token") + drafts)

if __name__ == '__main__':
    main()
