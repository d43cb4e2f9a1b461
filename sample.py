"""
Sample from a trained looped GPT, as nanoGPT's sample.py does.

    python sample.py --out_dir=out-shakespeare-char --start="ROMEO:" --num_samples=3
    python sample.py --out_dir=out-shakespeare-char --n_loop=2             # fixed exit: stop at loop 2
    python sample.py --out_dir=out-shakespeare-char --exit_threshold=0.9   # adaptive: first confident loop
    python sample.py --out_dir=out-huginn --exit_policy=kl --exit_threshold=5e-4 --n_loop=16  # KL exit
    python sample.py --out_dir=out-ouro --exit_policy=gate --exit_threshold=0.5  # the learned gate's exit
    python sample.py --out_dir=out-shakespeare-char --exit_threshold=0.9 --kv_policy=copy  # cheaper exits
    python sample.py --out_dir=out-shakespeare-char --draft_loops=1 --speculate=4  # self-speculative
    python sample.py --out_dir=out-shakespeare-char --start=FILE:prompt.txt

The tokenizer comes from data/<dataset>/meta.json (the dataset is named in the checkpoint), or --meta PATH.
"""
import os
import time
from contextlib import nullcontext

import torch

import checkpoint
from errors import Parser, die
from engine import EXIT_POLICIES, KV_POLICIES, check_decoding, generate, score_threshold
from hardware import pick_device
from prepare import get_tokenizer, load_meta


p = Parser('sample.py', __doc__)
p.add_argument('--out_dir', default='out', help='folder holding ckpt.pt (or a checkpoint file)')
p.add_argument('--start', default='\n', help='prompt text, or FILE:path to read it from a file')
p.add_argument('--num_samples', type=int, default=3, help='number of samples to draw')
p.add_argument('--max_new_tokens', type=int, default=500, help='tokens generated per sample')
p.add_argument('--temperature', type=float, default=0.8, help='1 = as trained, < 1 sharper, 0 = greedy')
p.add_argument('--top_k', type=int, default=200, help='keep the top_k most likely tokens (0 = all)')
p.add_argument('--seed', type=int, default=1337)
p.add_argument('--device', default='auto', help='auto (cuda, then mps, then cpu), cpu, cuda:N, mps')
p.add_argument('--n_loop', type=int, default=None,
               help='loops per token (default: the trained R); fewer = early exit, more = '
               'extrapolation; with --exit_threshold, the most loops a token may use')
p.add_argument('--exit_threshold', type=float, default=None,
               help='adaptive exit: a token stops at the first loop whose confidence reaches this')
p.add_argument('--exit_policy', default='maxprob', choices=EXIT_POLICIES,
               help='adaptive exit score: max softmax prob, top1 - top2 logit margin, 1 - H/log V, '
               'kl (exit when KL(previous exit || this exit) <= threshold), or gate (the learned '
               'gate\'s cumulative exit probability)')
p.add_argument('--kv_policy', default='recompute', choices=KV_POLICIES,
               help='what an exited token leaves in the cache slots of the loops it skips: '
               'recompute (their K/V from its exit state), copy (its exit loop\'s K/V), shared '
               '(--kv_slots slots per layer), active (nothing: a loop sees only the tokens that '
               'reached it); docs/decoding.md')
p.add_argument('--kv_slots', type=int, default=None, help='kv_policy=shared: slots per layer (1..R)')
p.add_argument('--draft_loops', type=int, default=None,
               help='self-speculative decoding: draft with this many loops, keep what the rest confirm')
p.add_argument('--speculate', type=int, default=None, help='with --draft_loops: tokens per draft (4)')
p.add_argument('--meta', default=None, help='a meta.json (or its folder) to decode with; default: '
               'data/<dataset>/meta.json, else the checkpoint\'s copy')


def tokenizer_meta(args, ckpt, ckpt_path):
    """The meta.json to decode with: --meta, else data/<dataset>/meta.json, else the copy train.py keeps in
    the checkpoint. A meta.json must agree with the checkpoint: other tokens would decode to nonsense."""
    dataset, saved = ckpt.get('dataset', '?'), ckpt.get('meta') or {}
    path = args.meta or os.path.join('data', dataset)
    if not args.meta and not os.path.isfile(os.path.join(path, 'meta.json')) and 'tokenizer' in saved:
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


def read_start(start):
    if not start.startswith('FILE:'):
        return start
    path = start[len('FILE:'):]
    try:
        with open(path, encoding='utf-8') as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        die(f"--start FILE:{path}: {e.strerror if isinstance(e, OSError) and e.strerror else e}")


def check_args(args):
    at_least = dict(num_samples=1, max_new_tokens=0, temperature=0, top_k=0, n_loop=1, exit_threshold=0,
                    kv_slots=1, draft_loops=1, speculate=1)
    for name, low in at_least.items():
        value = getattr(args, name)
        if value is not None and value < low:
            die(f"--{name}={value}: must be >= {low}")


def check_exit(args, config):
    """--exit_threshold within --exit_policy's range, and a gate to read for policy 'gate'."""
    if args.exit_threshold is None:
        return
    if args.exit_policy == 'gate' and config.exit_gate != 'learned':
        die("--exit_policy=gate reads the learned exit gate, and this model has none (exit_gate='none'): "
            "use maxprob, margin, entropy or kl")
    try:
        score_threshold(args.exit_policy, args.exit_threshold)
    except ValueError as e:
        die(f"--{e}")


def load(args, device):
    """The model on `device`, the tokenizer and the encoded prompt x (1, T) that args name."""
    start = read_start(args.start)  # before the (slow) checkpoint load: a typo in the path fails at once
    ckpt_path = args.out_dir if os.path.isfile(args.out_dir) else os.path.join(args.out_dir, 'ckpt.pt')
    ckpt = checkpoint.load(ckpt_path)  # on the CPU: the weights go to the device with the model, below
    encode, decode = get_tokenizer(tokenizer_meta(args, ckpt, ckpt_path))
    try:
        start_ids = encode(start)
    except ValueError as e:
        die(f"--start: {e}")
    if not start_ids:
        die("--start: the prompt is empty (give some text, e.g. --start='\\n')")
    x = torch.tensor(start_ids, dtype=torch.long, device=device)[None, ...]  # (1, T)
    model = checkpoint.build_model(ckpt)  # the optimizer state in ckpt is not needed to sample
    check_exit(args, model.config)
    return model.eval().to(device), decode, x


def main(argv=None):
    args = p.parse_args(argv)
    check_args(args)
    device, device_type = pick_device(args.device)
    torch.manual_seed(args.seed)
    if device_type == 'cuda':
        torch.cuda.manual_seed(args.seed)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    ptdtype = torch.bfloat16 if device_type == 'cuda' and torch.cuda.is_bf16_supported() else \
        torch.float16
    ctx = torch.autocast(device_type=device_type, dtype=ptdtype) if device_type == 'cuda' else \
        nullcontext()
    model, decode, x = load(args, device)

    R = model.config.n_loop if args.n_loop is None else args.n_loop
    try:
        check_decoding(R, args.kv_policy, args.kv_slots, args.draft_loops, args.speculate,
                       args.exit_threshold)
    except ValueError as e:
        die(str(e))
    k = args.draft_loops
    gamma = None if k is None else args.speculate or 4
    mode = (f"adaptive exit ({args.exit_policy} >= {args.exit_threshold}, at most {R} loops)"
            if args.exit_threshold is not None else f"fixed exit at loop {R}")
    if k is not None:
        mode += f", self-speculative (drafts of {gamma} tokens from loop {k})"
    if args.kv_policy != 'recompute':
        mode += f", kv_policy={args.kv_policy}" + (f" ({args.kv_slots} slots)" if args.kv_slots else "")
    print(f"sampling {args.num_samples} x {args.max_new_tokens} tokens, {mode}, trained with "
          f"n_loop={model.config.n_loop}, {device}")
    loops, stats, seconds = [], {}, 0.0
    with torch.no_grad(), ctx:
        for _ in range(args.num_samples):
            t0 = time.perf_counter()
            y, used = generate(model, x, args.max_new_tokens, temperature=args.temperature,
                               top_k=args.top_k or None, n_loop=R, exit_threshold=args.exit_threshold,
                               exit_policy=args.exit_policy, kv_policy=args.kv_policy,
                               kv_slots=args.kv_slots, draft_loops=k, speculate=gamma, stats=stats)
            ids = y[0].tolist()  # (waits for the device)
            seconds += time.perf_counter() - t0
            print(decode(ids))
            print('---------------')
            loops.append(used.float().flatten())
    n = args.num_samples * args.max_new_tokens
    if n and (args.exit_threshold is not None or k is not None or args.kv_policy != 'recompute'):
        print(summary(args, R, n, seconds, torch.cat(loops), stats))
    # plain fixed-depth decoding prints its samples only: the same text for the same seed


def summary(args, R, n, seconds, used, stats):
    # loops per generated token (the prompt always runs all R), speed, and accepted drafts
    line = f"{n} tokens in {seconds:.2f} s ({n / max(seconds, 1e-9):.1f} tokens/s)"
    if args.exit_threshold is not None:
        line = (f"mean loops used per token: {used.mean().item():.2f} of {R} "
                f"(min {used.min().item():.0f}, max {used.max().item():.0f}, {used.numel()} tokens); "
                + line)
    else:
        line += f", {R} loops per token"
    if args.draft_loops is not None and stats['checked']:
        line += (f", {stats['accepted']} of {stats['checked']} drafts accepted "
                 f"({stats['accepted'] / stats['checked']:.0%})")
    return line

if __name__ == '__main__':
    main()
