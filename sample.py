"""
Sample from a trained looped GPT, as nanoGPT's sample.py does. Flags are --key=value, checked as train.py's.

    python sample.py --out_dir=out --start="ROMEO:" --num_samples=3 --n_loop=2  # fixed exit at loop 2
    python sample.py --out_dir=out --exit_threshold=0.9 --kv_policy=copy   # adaptive exit (maxprob)
    python sample.py --out_dir=out-huginn --exit_policy=kl --exit_threshold=5e-4 --n_loop=16  # KL exit
    python sample.py --out_dir=out-ouro --exit_policy=gate --exit_threshold=0.5  # Ouro's learned gate
    python sample.py --out_dir=out --draft_loops=1 --speculate=4 --start=FILE:prompt.txt  # self-speculative
"""
import os
import sys
import time
from contextlib import nullcontext

import torch

import checkpoint
import configurator
from engine import generate
from errors import die
from exits import EXIT_POLICIES, KV_POLICIES, score_threshold
from hardware import pick_device
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
config_keys = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, str))]
defaults = {k: globals()[k] for k in config_keys}  # main() starts every call from these


def check(explicit, R, cfg):
    """Every constraint on the flags, each checked here once: a one-line error naming the flag."""
    adaptive, k, shared, flag = exit_threshold != -1, draft_loops, kv_policy == 'shared', globals().get
    rules = [(flag(key) >= v, f"--{key}={flag(key)}: must be >= {v}") for key, v in dict(
        num_samples=1, max_new_tokens=0, temperature=0, top_k=0, n_loop=0, kv_slots=0, draft_loops=0,
        speculate=1).items()]
    rules += [(flag(key) in allowed, f"--{key}={flag(key)!r}: choose one of {', '.join(allowed)}")
              for key, allowed in (('exit_policy', EXIT_POLICIES), ('kv_policy', KV_POLICIES))]
    rules += [
        (not adaptive or exit_policy != 'gate' or cfg.exit_gate == 'learned', "--exit_policy=gate reads the "
         "learned exit gate, and this model has none (exit_gate='none'): use maxprob, margin, entropy or kl"),
        (not kv_slots or shared, f"--kv_slots={kv_slots} sets the slots of --kv_policy=shared: add it"),
        (not shared or kv_slots, f"--kv_policy=shared needs --kv_slots=N, the slots per layer (1..{R})"),
        (kv_slots <= R, f"--kv_slots={kv_slots}: a token runs only {R} loops, so at most {R} slots"),
        (kv_policy not in ('copy', 'active') or adaptive or k,
         f"--kv_policy={kv_policy} decides what exited tokens leave in the cache: add --exit_threshold"),
        (k or 'speculate' not in explicit, f"--speculate={speculate} is the draft length: add --draft_loops"),
        (k < R, f"--draft_loops={k}: drafts must use fewer loops than the {R} each token runs (1..{R - 1})"),
        (not (k and adaptive), "--draft_loops gives fixed-depth tokens: drop --exit_threshold"),
        (not (k and shared), "--draft_loops verifies with every loop's own slots: drop --kv_policy=shared"),
        # tied routing (§5): loops 2..R reuse loop 1's experts, from the same pass and the same rows
        (not (cfg.tied_routing and adaptive), "--exit_threshold drops exited rows between loops, and this "
         "model's tied_routing=True needs loop 1's experts for every row: drop --exit_threshold"),
        (not (cfg.tied_routing and k), "--draft_loops verifies loops k+1.. in another pass, and this "
         "model's tied_routing=True needs loop 1's experts from the same pass: drop --draft_loops")]
    for ok, msg in rules:
        if not ok:
            die(msg)
    try:
        score_threshold(exit_policy, exit_threshold) if adaptive else None  # within the policy's range
    except ValueError as e:
        die(f"--{e}")


def main(argv=None):
    config, explicit = configurator.configure(defaults, sys.argv[1:] if argv is None else argv,
                                               keys_at="sample.py's globals")
    globals().update(config)  # the flags, as nanoGPT's configurator sets them
    try:  # the prompt before the (slow) checkpoint load: a typo in its path fails at once
        prompt = open(start[5:], encoding='utf-8').read() if start.startswith('FILE:') else start
    except (OSError, UnicodeDecodeError) as e:
        die(f"--start {start}: {e.strerror if isinstance(e, OSError) and e.strerror else e}")
    dev, device_type = pick_device(device)
    torch.manual_seed(seed)
    if device_type == 'cuda':
        torch.cuda.manual_seed(seed)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    ptdtype = torch.bfloat16 if device_type == 'cuda' and torch.cuda.is_bf16_supported() else torch.float16
    ctx = torch.autocast(device_type=device_type, dtype=ptdtype) if device_type == 'cuda' else nullcontext()
    ckpt_path = out_dir if os.path.isfile(out_dir) else os.path.join(out_dir, 'ckpt.pt')
    ckpt = checkpoint.load(ckpt_path)  # on the CPU: the weights go to the device with the model
    encode, decode = get_tokenizer(checkpoint_meta(meta, ckpt, ckpt_path))
    try:
        ids = encode(prompt) or die("--start: the prompt is empty (give some text, e.g. --start='\\n')")
    except ValueError as e:
        die(f"--start: {e}")
    model = checkpoint.build_model(ckpt).eval().to(dev)  # the optimizer state is not needed to sample
    R, adaptive, k = n_loop or model.config.n_loop, exit_threshold != -1, draft_loops
    check(explicit, R, model.config)
    mode = (f"adaptive exit ({exit_policy} >= {exit_threshold}, at most {R} loops)" if adaptive else
            f"fixed exit at loop {R}") + (f", self-speculative (drafts of {speculate} tokens from loop {k})"
                                          if k else "")
    if kv_policy != 'recompute':
        mode += f", kv_policy={kv_policy}" + (f" ({kv_slots} slots)" if kv_slots else "")
    print(f"sampling {num_samples} x {max_new_tokens} tokens, {mode}, trained with "
          f"n_loop={model.config.n_loop}, {dev}")
    used, stats, seconds = [], {}, 0.0
    with torch.no_grad(), ctx:
        for _ in range(num_samples):
            t0 = time.perf_counter()
            y, loops = generate(model, torch.tensor([ids], device=dev), max_new_tokens, temperature,
                                top_k or None, R, exit_threshold if adaptive else None, exit_policy,
                                kv_policy=kv_policy, kv_slots=kv_slots or None, draft_loops=k,
                                speculate=speculate, stats=stats)
            text = decode(y[0].tolist())  # (waits for the device)
            seconds += time.perf_counter() - t0
            print(text + '\n---------------')
            used.append(loops.float().flatten())
    print(summary(num_samples * max_new_tokens, torch.cat(used), seconds, R, adaptive, stats))


def summary(n, used, seconds, R, adaptive, stats):
    # every mode prints its speed: plain fixed-depth decoding is the baseline of the others
    depth = (f"mean loops used per token: {used.mean():.2f} of {R} (min {used.min():.0f}, "
             f"max {used.max():.0f}, {used.numel()} tokens); ") if adaptive and n else ""
    ok, checked = stats.get('accepted', 0), stats.get('checked', 0)
    drafts = f", {ok} of {checked} drafts accepted ({ok / checked:.0%})" if draft_loops and checked else ""
    return (f"{depth}{n} tokens in {seconds:.2f} s ({n / max(seconds, 1e-9):.1f} tokens/s)"
            + ("" if depth else f", {R} loops per token") + drafts)

if __name__ == '__main__':
    main()
