"""
Downstream accuracy at every exit depth, through EleutherAI's lm-evaluation-harness (pip install lm-eval).

    python lab/harness.py out --include_path=tests/data/harness --tasks=tiny_shakespeare --n_loop=1,2,4
    python lab/harness.py out-deeploop-small --tasks=hellaswag,arc_easy,piqa,lambada_openai --n_loop=1,2,3

Prints one table, a row per task/metric and a column per exit depth (--n_loop; default the trained R), and
writes lm-eval's results JSON for each depth and a combined one under --output_path (OUT_DIR/harness/).
Named tasks download their data from the Hugging Face hub on first use; --include_path tasks are local.
The checkpoint is registered as lm-eval's model 'nanoloop', so after `import harness`,
lm_eval.simple_evaluate(model='nanoloop', model_args='out_dir=out,n_loop=2', tasks=[...]) works too.
Details, and how to write a local task: docs/harness.md.
"""
import difflib
import json
import logging
import os
import sys
import time
from contextlib import nullcontext

import torch
from torch.nn import functional as F
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the core is one folder up
from configurator import Parser, die, first_line, pick_device
from decoding.batching import serve
from decoding.engine import Decoding, generate
from prepare import checkpoint_meta, get_tokenizer
from run import checkpoint
from run.ops import duration

try:
    import lm_eval
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import get_rolling_token_windows, handle_non_serializable, make_disjoint_window
except ImportError:  # an optional extra: main() says so in one line
    lm_eval, LM, register_model = None, object, lambda name: (lambda cls: cls)


@register_model('nanoloop')
class NanoLoop(LM):
    """A checkpoint as an lm-eval model that exits at loop n_loop. The exits at `depths` are all scored in
    the deepest one's pass and kept: exit k of that pass is the n_loop=k model (loop k never sees the loops
    after it), so the results at the other depths cost nothing more."""

    def __init__(self, out_dir='out', n_loop=None, depths=(), batch_size=16, device='cpu', meta=None):
        super().__init__()
        path = checkpoint.path_of(out_dir)
        ckpt = checkpoint.load(path)
        meta = checkpoint_meta(meta, ckpt, path)  # as sample.py finds it
        self.encode, self.decode = get_tokenizer(meta)
        self.chars = set(meta.get('itos') or ())
        self.stand_in = ' ' if ' ' in self.chars else (meta.get('itos') or ' ')[0]
        self.unknown = set()
        self.model = checkpoint.build_model(ckpt).eval().to(device)
        self.n_loop = n_loop or min(map(int, depths), default=self.model.config.n_loop)
        self.depths = sorted({self.n_loop, *[int(d) for d in depths]})
        self.batch_size, self._device = int(batch_size), torch.device(device)
        # the token before the first one: GPT-2's <|endoftext|>, a newline for characters
        self.prefix = self.tok('<|endoftext|>' if meta['tokenizer'] == 'gpt2' else '\n')[0]
        ptdtype = torch.bfloat16 if self._device.type == 'cuda' and torch.cuda.is_bf16_supported() \
            else torch.float16
        self.ctx = torch.autocast('cuda', dtype=ptdtype) if self._device.type == 'cuda' else nullcontext()
        self.memo = {}  # (context ids, continuation ids) -> {depth: (log-likelihood, is greedy)}

    def tok(self, s):
        try:
            return self.encode(s)
        except ValueError:  # characters the training text never had: read as the stand-in, and counted
            self.unknown |= set(s) - self.chars
            return self.encode(''.join(c if c in self.chars else self.stand_in for c in s))

    def score(self, pairs, desc):
        """(log P(continuation | context), continuation is the greedy one) at exit n_loop, per pair of token
        tuples. Batches are sorted longest first and padded on the right, which causal attention keeps
        out of the real tokens."""
        todo = {p for p in pairs if self.n_loop not in self.memo.get(p, {})}
        todo = sorted(todo, key=lambda p: -len(p[0]) - len(p[1]))
        bs, R = self.model.config.block_size, max(self.depths)
        desc = f"{desc}, n_loop={','.join(map(str, self.depths))}"
        for i in tqdm(range(0, len(todo), self.batch_size), desc=desc, disable=not todo, mininterval=2):
            batch = todo[i:i + self.batch_size]
            # contexts longer than block_size are cropped from the left: the model was never trained past
            # block_size positions, so a continuation is scored after the last tokens of its context that fit
            rows = [list(ctx + cont)[-(bs + 1):-1] for ctx, cont in batch]
            T = max(map(len, rows))
            x = torch.tensor([r + [0] * (T - len(r)) for r in rows], device=self._device)  # (B, T)
            with torch.no_grad(), self.ctx:
                states = self.model.run(x, R).states
                for k in self.depths:
                    z = self.model.coda_readout(states[k - 1], k)  # (B, T, C): exit k's readout input
                    for b, ((ctx, cont), r) in enumerate(zip(batch, rows)):
                        n = min(len(cont), len(r))  # a continuation longer than the block loses its start
                        logits = self.model.lm_head(z[b, len(r) - n:len(r)]).float()  # (n, V)
                        logp = F.log_softmax(logits, -1)
                        y = torch.tensor(cont[len(cont) - n:], device=self._device)
                        ll = logp.gather(1, y[:, None]).sum().item()
                        self.memo.setdefault((ctx, cont), {})[k] = (ll, bool((logp.argmax(-1) == y).all()))
        return [self.memo[p][self.n_loop] for p in pairs]

    def pair(self, context, continuation):
        # lm-eval's convention: the context's trailing spaces belong to the continuation, whose tokens are
        # those the whole string adds to the context's (so a BPE merge across the seam is kept)
        n = len(context) - len(context.rstrip(' '))
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        if not context:
            return (self.prefix,), tuple(self.tok(continuation))
        whole, ctx = self.tok(context + continuation), self.tok(context)
        return tuple(ctx), tuple(whole[len(ctx):])

    def loglikelihood(self, requests, disable_tqdm=False):
        return self.score([self.pair(*r.args) for r in requests], 'loglikelihood')

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        # lm-eval's rolling windows: the first holds the prefix token and block_size - 1 tokens, each
        # later one predicts the next block_size tokens (the last, fewer) after the tokens just before them
        bs = self.model.config.block_size
        windows = lambda s: get_rolling_token_windows(self.tok(s), self.prefix, bs, 1)
        docs = [[tuple(map(tuple, make_disjoint_window(w))) for w in windows(r.args[0])] for r in requests]
        scores = iter(self.score([w for d in docs for w in d], 'loglikelihood_rolling'))
        return [sum(next(scores)[0] for _ in d) for d in docs]

    def generate_until(self, requests, disable_tqdm=False):
        # greedy. The requests that ask for the same max_gen_toks decode together, batch_size rows in flight
        # (batching.serve: prompts of unequal length, each row at its own position, the text each decodes
        # alone); a model serve cannot run goes one request at a time. Each is one call of max_gen_toks,
        # cut at its first stop string: calls in chunks would each start a fresh cache and, past the block
        # size, crop the context at other places than one call does
        bs, out, groups = self.model.config.block_size, [None] * len(requests), {}
        for i, r in enumerate(requests):
            groups.setdefault(int(r.args[1].get('max_gen_toks', 256)), []).append(i)
        rows = self.batch_size if Decoding(batch_size=2).why_not(self.model.config) is None else 1
        desc = f"generate_until, n_loop={self.n_loop}, {rows} rows in flight"
        for n, todo in tqdm(groups.items(), desc=desc, disable=disable_tqdm, mininterval=2):
            prompts = [self.tok(requests[i].args[0])[-bs:] or [self.prefix] for i in todo]
            with self.ctx:
                if rows > 1:
                    opts = Decoding(batch_size=rows, temperature=0, n_loop=self.n_loop)
                    tokens = serve(self.model, prompts, n, opts)[0]
                else:
                    opts = Decoding(temperature=0, n_loop=self.n_loop)
                    ids = [torch.tensor([p], device=self._device) for p in prompts]
                    tokens = [generate(self.model, p, n, opts)[0][0].tolist() for p in ids]
            for i, p, t in zip(todo, prompts, tokens):
                until = requests[i].args[1].get('until') or []
                text = self.decode(t[len(p):])
                for u in [until] if isinstance(until, str) else until:
                    text = text.split(u)[0]
                out[i] = text
        return out


def table(results):
    """The accuracy table: a row per task/metric, a column per exit depth."""
    rows = {}
    for R, res in results.items():
        for task, metrics in res['results'].items():
            for key, v in metrics.items():
                name, _, filt = key.partition(',')
                if ',' in key and not name.endswith('_stderr') and isinstance(v, (int, float)):
                    row = f"{task}/{name}" + ('' if filt in ('', 'none') else f" ({filt})")
                    rows.setdefault(row, {})[R] = v
    w = max([len('task/metric')] + [len(r) for r in rows])
    lines = [f"{'task/metric':<{w}}" + ''.join(f"{f'n_loop={R}':>11}" for R in results)]
    for row, v in rows.items():
        lines.append(f"{row:<{w}}" + ''.join(f"{v[R]:>11.4f}" if R in v else f"{'-':>11}" for R in results))
    return '\n'.join(lines), rows


p = Parser('lab/harness.py', __doc__)
p.add_argument('out_dir', help='folder holding ckpt.pt (or the path of a checkpoint file)')
p.add_argument('--tasks', required=True, help='lm-eval task names, comma-separated (lm-eval ls tasks)')
p.add_argument('--n_loop', default=None, help='exit depths, comma-separated, each 1..loop_cap (default: R)')
p.add_argument('--include_path', default=None, help='a folder of local task YAMLs, as lm-eval\'s')
p.add_argument('--limit', type=float, default=None, help='examples per task at most (< 1: a fraction)')
p.add_argument('--num_fewshot', type=int, default=None, help='few-shot examples (default: the task\'s)')
p.add_argument('--batch_size', type=int, default=16, help='sequences per forward pass')
p.add_argument('--device', default='auto', help='auto (cuda, then mps, then cpu), cpu, cuda, cuda:1, mps')
p.add_argument('--meta', default=None, help='a meta.json (or its folder) to tokenize with, as sample.py')
p.add_argument('--output_path', default=None, help='folder for the results JSON (OUT_DIR/harness/)')


def main(argv=None):
    args = p.parse_args(argv)
    try:
        depths = [int(d) for d in args.n_loop.split(',')] if args.n_loop else []
    except ValueError:
        die(f"--n_loop={args.n_loop}: give exit depths as integers, e.g. --n_loop=1,2,4")
    for name, v in [('n_loop', d) for d in depths] + [('batch_size', args.batch_size)]:
        if v < 1:
            die(f"--{name}={v}: must be >= 1")
    if args.limit is not None and not args.limit > 0:
        die(f"--limit={args.limit}: must be > 0 (a count of examples, or below 1 a fraction)")
    if lm_eval is None:
        die("lab/harness.py needs lm-evaluation-harness: pip install lm-eval")
    path = checkpoint.path_of(args.out_dir)
    if not os.path.isfile(path):
        die(f"{args.out_dir}: no ckpt.pt there (train one first: python train.py --out_dir={args.out_dir})")
    if args.include_path and not os.path.isdir(args.include_path):
        die(f"--include_path={args.include_path}: not a folder (give the folder holding the task YAMLs)")
    # the task names are checked before the (slow) model load. Tasks all in --include_path skip indexing
    # lm-eval's own ~15k (15-20 s on a laptop); a group there may name lm-eval's tasks, so it does not
    logging.getLogger('lm_eval').setLevel(logging.WARNING)
    tasks = [t for t in args.tasks.split(',') if t]
    tm = TaskManager(include_path=args.include_path, include_defaults=False) if args.include_path else None
    if tm is None or not set(tasks) <= set(tm.all_tasks) - set(tm.all_groups):
        tm = TaskManager(include_path=args.include_path)
    for t in tasks:
        if t not in tm.all_tasks:
            near = difflib.get_close_matches(t, tm.all_tasks, n=1)
            die(f"--tasks: unknown task {t!r}" + (f" (did you mean {near[0]!r}?)" if near else '') +
                f"; see lm-eval ls tasks" + ('' if args.include_path else ', or add --include_path=FOLDER'))
    device, _ = pick_device(args.device)
    lm = NanoLoop(args.out_dir, depths=depths, batch_size=args.batch_size, device=device, meta=args.meta)
    # the KV cache and the loop run any depth; the limit is the most loops training could draw (max_loop,
    # default 4R), as far as eval_depth.py extrapolates: past it the model was never trained or measured
    cap, cfg = lm.model.config.loop_cap, lm.model.config
    if max(lm.depths) > cap:
        die(f"--n_loop={max(lm.depths)}: this model supports 1..{cap} loops (trained with R={cfg.n_loop}, "
            f"loop_cap={cap}: max_loop, else 4R)")
    limit = None if args.limit is None else int(args.limit) if args.limit >= 1 else args.limit
    out_dir = args.output_path or os.path.join(os.path.dirname(path) or '.', 'harness')
    os.makedirs(out_dir, exist_ok=True)
    results, t_all = {}, time.time()
    for i, R in enumerate(lm.depths):
        lm.n_loop, t0 = R, time.time()
        print(f"n_loop={R} ({i + 1}/{len(lm.depths)}): {', '.join(tasks)} on {device}")
        # bootstrap_iters: the stderr of perplexity-like metrics is resampled; 1000 is plenty for two digits
        try:
            res = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=tm, limit=limit,
                                          num_fewshot=args.num_fewshot, bootstrap_iters=1000,
                                          log_samples=False)
        except OSError as e:  # ConnectionError, FileNotFoundError: a task's data could not be read
            die(f"a task's data could not be loaded ({first_line(e)}): named tasks download theirs from the "
                f"Hugging Face hub, so they need the network; a local task's data_files are relative to the "
                f"folder the command runs in")
        res['config'].update(model='nanoloop', checkpoint=path, n_loop=R, trained_n_loop=cfg.n_loop)
        results[R] = res
        with open(os.path.join(out_dir, f"results_n_loop{R}.json"), 'w', encoding='utf-8') as f:
            json.dump(res, f, indent=2, default=handle_non_serializable, ensure_ascii=False)
        print(f"n_loop={R} done in {duration(time.time() - t0)}")
    text, rows = table(results)
    with open(os.path.join(out_dir, 'results.json'), 'w', encoding='utf-8') as f:
        json.dump({'checkpoint': path, 'n_loop': list(results), 'table': rows,
                   'results': {str(R): res for R, res in results.items()}},
                  f, indent=2, default=handle_non_serializable, ensure_ascii=False)
    if lm.unknown:
        print(f"note: {len(lm.unknown)} character(s) outside the model's vocabulary were read as "
              f"{lm.stand_in!r}: {''.join(sorted(lm.unknown))[:40]!r}")
    print(f"accuracy by exit depth ({path}, trained with R={cfg.n_loop}; {duration(time.time() - t_all)}):")
    print(text)
    print(f"wrote {out_dir}/results.json and results_n_loop<R>.json")


if __name__ == '__main__':
    main()
