"""
The honest perplexity of token-level exits: decode validation text token by token through the KV cache,
as a deployed model would, and measure CE / PPL against the mean loops per token (docs/decoding.md).

    python lab/decode_eval.py out-rmsnorm out-raw out-penalty
    python lab/decode_eval.py out-raw --kv_policy=copy,shared --thresholds=0.5,0.8,0.95 --n_windows=2

Teacher forcing: the next input token is always the true validation token, never a sampled one, and the
CE at each position is that of the logits of the exit its token stopped at. (So batching.py's depth
batching, which samples each row's next token itself, does not serve here: the windows of a batch stand
at one position and go through exits.adaptive_step as one step; the CE does not depend on the batching.)
Each window starts from an empty cache; its first token runs alone at position 0 and every later token
runs as one decode step (exits.adaptive_step; engine.decode_step at fixed depth), so every token, the
first included, may exit early. Past the block size the engine's refill takes over, as in generate: when
the window is full it slides to its last block_size/2 tokens and one fixed-depth pass over them refills
the cache (that token counts R loops; the refill's pass over the context is not counted in the loops per
token).

Curves, per checkpoint:
  fixed depth    every token at loop n, n = 1..R, through the cache (KVCache with n loops)
  token-level    every kv_policy (exits.KV_POLICIES) at every threshold of --exit_policy: thresholds
                 at --quantiles of the per-token scores of exits 1..R-1, or the --thresholds given
  sequence-level lab/eval_depth.py's adaptive exit (a whole window stops) on the same tokens, cut
                 into block_size windows (its functions, on a full-sequence pass)
and, per kv_policy, its CE minus recompute's at matched mean loops per token (linear interpolation
in loops between thresholds). Writes <report_dir>/decoding.md, decoding.json and decoding_ppl.png.
"""
import json
import math
import os
import shlex
import sys
import time

import numpy as np
import torch
from torch.nn import functional as F
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the core is one folder up
from run import checkpoint
from ablate import code_version
from configurator import Parser, die
from decoding.engine import KVCache, decode_step, slide
from decoding.exits import EXIT_POLICIES, KV_POLICIES, adaptive_step, score_at_exit, score_threshold
from eval_depth import adaptive_curves, exit_stats, json_safe, quantile_thresholds, val_windows
from prepare import load_meta
from reports import fmt, plt_or_none, save

QUANTILES = (0.02, 0.1, 0.25, 0.4, 0.55, 0.7, 0.85, 0.95)  # of the per-token exit scores: ~1 to ~R loops

# -----------------------------------------------------------------------------
# teacher-forced decoding through the cache

def step(model, idx, cache, pos, n_loop, threshold, exit_policy):
    # one step as generate takes it: logits (B, V) and loops used (B,); fixed depth without a threshold
    if threshold is None:
        return decode_step(model, idx, cache, pos, n_loop), torch.full((idx.size(0),), float(n_loop))
    return adaptive_step(model, idx, cache, pos, n_loop, threshold, exit_policy)


@torch.no_grad()
def decode(model, X, Y, n_loop, threshold=None, exit_policy='maxprob', kv_policy='recompute',
           kv_slots=None, bar=None):
    """Decode windows X (B, T) one token at a time, teacher-forced: per-token CE (B, T) against Y at
    each token's exit, loops used (B, T), and the number of refills. threshold: a score (see
    exits.score_threshold); None = every token runs n_loop loops."""
    B, T = X.shape
    bs = model.config.block_size
    dtype = model.lm_head.weight.dtype
    ce = torch.zeros(B, T, dtype=torch.float64)
    loops = torch.zeros(B, T)
    start, cache, refills = 0, None, 0
    for t in range(T):
        if (s := slide(t + 1, start, bs)) != start:  # the window X[:, start:t+1] slid (as generate's)
            start, cache = s, None
            refills += 1
        pos = t - start
        if cache is None:
            cache = KVCache(model, B, n_loop, X.device, dtype, kv_policy, kv_slots)
            if pos == 0:
                logits, used = step(model, X[:, t:t + 1], cache, 0, n_loop, threshold, exit_policy)
            else:  # the refill: one fixed-depth pass over the window, as generate does
                logits, used = step(model, X[:, start:t + 1], cache, 0, n_loop, None, exit_policy)
        else:
            logits, used = step(model, X[:, t:t + 1], cache, pos, n_loop, threshold, exit_policy)
        ce[:, t] = F.cross_entropy(logits.float(), Y[:, t], reduction='none').double().cpu()
        loops[:, t] = used.cpu()
        if bar is not None:
            bar.update(1)
    return ce, loops, refills


@torch.no_grad()
def token_exits(model, X, Y, exit_policy):
    """The full-sequence pass on the windows cut into block_size pieces: per-token CE (N, R) and exit
    scores (N, R) at every exit 1..R (inside the block, so no refill)."""
    bs, R = model.config.block_size, model.config.n_loop
    ce, scores = [], []
    for s in range(0, X.size(1), bs):
        idx, tgt = X[:, s:s + bs], Y[:, s:s + bs]
        prev, c, sc = None, [], []
        for k, h in enumerate(model.run(idx).states, start=1):
            z = model.coda_readout(h, k)
            logits = model.lm_head(z).float()  # (B, t, V)
            c.append(F.cross_entropy(logits.transpose(1, 2), tgt, reduction='none').reshape(-1))
            score, prev = score_at_exit(model, exit_policy, z, logits, prev)
            sc.append(score.reshape(-1))
        ce.append(torch.stack(c, 1))
        scores.append(torch.stack(sc, 1))
    return torch.cat(ce).double().cpu(), torch.cat(scores).double().cpu()


def point(ce, loops, **kw):
    return dict(kw, loops=float(loops.double().mean()), ce=float(ce.mean()), ppl=math.exp(float(ce.mean())))


def matched_gap(curve, ref):
    """curve's CE minus ref's at the same mean loops per token: at each of curve's points that ref's
    loops span, ref's CE interpolated linearly in loops. Returns dict(max, mean, n); None when none."""
    pts = sorted((p['loops'], p['ce']) for p in ref)
    xs, ys = [x for x, _ in pts], [y for _, y in pts]
    gaps = [p['ce'] - float(np.interp(p['loops'], xs, ys)) for p in curve if xs[0] <= p['loops'] <= xs[-1]]
    if not gaps:
        return dict(max=None, mean=None, n=0)
    return dict(max=max(gaps), mean=sum(gaps) / len(gaps), n=len(gaps))


def evaluate(model, X, Y, kv_policies=KV_POLICIES, thresholds=None, exit_policy='maxprob', kv_slots=None,
             quantiles=QUANTILES, bar=None):
    """Every curve of one model on windows X, Y (B, T). thresholds: scores (None: at quantiles of the
    per-token scores). Returns a JSON-able dict."""
    R, bs = model.config.n_loop, model.config.block_size
    tok_ce, tok_scores = token_exits(model, X, Y, exit_policy)
    qs = list(quantiles) if thresholds is None else [None] * len(thresholds)
    thr = quantile_thresholds(tok_scores, quantiles) if thresholds is None else list(thresholds)
    res = dict(R=R, block_size=bs, windows=X.size(0), tokens_per_window=X.size(1), exit_policy=exit_policy,
               kv_slots=kv_slots, full_sequence_ce=tok_ce.mean(0).tolist())
    res['fixed'] = []
    for n in range(1, R + 1):
        ce, loops, refills = decode(model, X, Y, n, bar=bar)
        res['fixed'].append(point(ce, loops, n_loop=n, refills=refills))
    res['policies'] = {}
    for p in kv_policies:
        res['policies'][p] = []
        for q, t in zip(qs, thr):
            ce, loops, refills = decode(model, X, Y, R, t, exit_policy, p, kv_slots, bar=bar)
            res['policies'][p].append(point(ce, loops, quantile=q, threshold=t, refills=refills))
    ref = res['policies'].get('recompute')
    res['gap'] = {p: matched_gap(c, ref) for p, c in res['policies'].items() if ref and p != 'recompute'}
    res['over_fixed'] = {p: matched_gap(c, res['fixed']) for p, c in res['policies'].items()}
    # eval_depth's sequence-level adaptive exit on the same tokens, in block_size windows
    n = X.size(1) // bs
    if n:
        Xs = X[:, :n * bs].reshape(-1, bs)
        Ys = Y[:, :n * bs].reshape(-1, bs)
        seq_ce, seq_scores, _ = exit_stats(model, Xs, Ys, R, batch_size=16)
        curve = adaptive_curves(seq_ce, {exit_policy: seq_scores[exit_policy]}, quantiles)[exit_policy]
        res['sequence'] = [dict(quantile=q, threshold=t, loops=lo, ce=math.log(pp), ppl=pp) for q, t, lo, pp
                           in zip(curve['quantile'], curve['threshold'], curve['avg_loops'], curve['ppl'])]
    return res

# -----------------------------------------------------------------------------
# the report

def row(label, threshold, p):
    # a dash where a curve has no value (fixed depth's threshold; JSON's null for inf or nan)
    return (f"| {label} | {fmt(threshold, '.4g', none='—')} | {fmt(p['loops'], '.2f', none='—')} | "
            f"{fmt(p['ce'], '.4f', none='—')} | {fmt(p['ppl'], '.3f', none='—')} |")


def arm_lines(name, r):
    slots = f", kv_slots {r['kv_slots']}" if 'shared' in r['policies'] else ''
    lines = [f"### {name}", "",
             f"{r['windows']} windows x {r['tokens_per_window']} tokens, block {r['block_size']}, "
             f"R {r['R']}, exit score {r['exit_policy']}{slots}", "",
             "| curve | threshold | loops/token | CE | PPL |", "|---|---|---|---|---|"]
    lines += [row(f"fixed n={p['n_loop']}", None, p) for p in r['fixed']]
    lines += [row(pol, p['threshold'], p) for pol, curve in r['policies'].items() for p in curve]
    lines += [row('sequence-level', p['threshold'], p) for p in r.get('sequence', [])]
    return lines + [""]


def gap_table(results, key, pols):
    lines = ["| arm | " + " | ".join(f"{p} max | {p} mean" for p in pols) + " |",
             "|---|" + "---|---|" * len(pols)]
    for name, r in results.items():
        gap = lambda p, stat: fmt(r[key].get(p, {}).get(stat), '+.4f', none='—')
        lines.append(f"| {name} | " + " | ".join(f"{gap(p, 'max')} | {gap(p, 'mean')}" for p in pols) + " |")
    return lines + [""]


def gap_lines(results):
    pols = [p for p in KV_POLICIES if any(p in r['policies'] for r in results.values())]
    lines = []
    if 'recompute' in pols and len(pols) > 1:
        lines += ["CE minus recompute's CE at the same mean loops per token (nats; max and mean over the "
                  "policy's thresholds, recompute's curve interpolated linearly in loops):", ""]
        lines += gap_table(results, 'gap', [p for p in pols if p != 'recompute'])
    lines += ["CE minus fixed depth's CE at the same mean loops per token (fixed depth through the cache, "
              "interpolated between n and n + 1 loops):", ""]
    return lines + gap_table(results, 'over_fixed', pols)


def write_report(results, header, report_dir):
    os.makedirs(report_dir, exist_ok=True)
    with open(os.path.join(report_dir, 'decoding.json.tmp'), 'w', encoding='utf-8') as f:
        json.dump(json_safe(dict(header, arms=results)), f, indent=1, allow_nan=False)
    os.replace(os.path.join(report_dir, 'decoding.json.tmp'), os.path.join(report_dir, 'decoding.json'))
    lines = ["# Token-level exits, teacher-forced through the KV cache", "",
             f"`{header['command']}` at commit {header['commit']}; {header['device']}, "
             f"{header['seconds']:.0f}s.", "",
             "Validation text decoded token by token through the cache (teacher-forced): CE at each "
             "token's exit against mean loops per token, beside fixed depth through the cache and "
             "eval_depth's sequence-level exit on the same tokens. Each window starts from an empty cache; "
             "past the block the engine refills the cache from the last block_size/2 tokens at full depth "
             "(that token counts R loops). The sequence-level curve cuts the same tokens into block_size "
             "windows, each from an empty context, so its CE is not the decoded one's at equal loops. "
             "Under 'shared' with fewer slots than loops, later loops overwrite earlier ones even when "
             "no token exits: it is not fixed-R decoding at any threshold.", ""]
    lines += gap_lines(results)
    for name, r in results.items():
        lines += arm_lines(name, r)
    plot = plot_ppl(results, report_dir)
    if plot:
        lines += [f"![{plot}]({plot})", ""]
    with open(os.path.join(report_dir, 'decoding.md'), 'w', encoding='utf-8') as f:
        f.write('\n'.join(lines))
    return os.path.join(report_dir, 'decoding.md')


def plot_ppl(results, report_dir):
    plt = plt_or_none()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 3.8), squeeze=False)
    for ax, (name, r) in zip(axes[0], results.items()):
        f = r['fixed']
        ax.plot([p['loops'] for p in f], [p['ppl'] for p in f], 'k-o', label='fixed depth', ms=4)
        s = sorted(r.get('sequence', []), key=lambda p: p['loops'])
        if s:
            ax.plot([p['loops'] for p in s], [p['ppl'] for p in s], '--', color='gray',
                    label='sequence-level')
        for pol, curve in r['policies'].items():
            c = sorted(curve, key=lambda p: p['loops'])
            ax.plot([p['loops'] for p in c], [p['ppl'] for p in c], '.-', label=pol)
        ax.set(title=name.replace(' (', '\n('), xlabel='mean loops per token', ylabel='PPL (log scale)')
        ax.set_yscale('log')  # shared's PPL is many times the others'
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return save(fig, plt, report_dir, 'decoding_ppl.png')

# -----------------------------------------------------------------------------

def split(s, what):
    return [x.strip() for x in s.split(',') if x.strip()] or die(f"--{what} is empty: give a comma list")


def floats(s, what):
    try:
        return [float(x) for x in split(s, what)]
    except ValueError:
        die(f"--{what}={s}: give numbers, comma-separated")


def main(argv=None):
    ap = Parser('lab/decode_eval.py', __doc__)
    ap.add_argument('out_dirs', nargs='+', help='folders holding ckpt.pt (or the files)')
    ap.add_argument('--kv_policy', default=','.join(KV_POLICIES), help='comma list of kv policies')
    ap.add_argument('--kv_slots', type=int, default=0, help='shared: cache slots per layer (0: R // 2)')
    ap.add_argument('--exit_policy', default='maxprob', help=f"exit score: one of {', '.join(EXIT_POLICIES)}")
    ap.add_argument('--thresholds', default='', help='exit thresholds (default: at --quantiles)')
    ap.add_argument('--quantiles', default=','.join(map(str, QUANTILES)),
                    help="quantiles of the per-token exit scores that make the thresholds")
    ap.add_argument('--n_windows', type=int, default=4, help='validation windows (decoded as one batch)')
    ap.add_argument('--window', type=int, default=256, help='tokens per window (past the block: refills)')
    ap.add_argument('--data_dir', default=None, help="default: data/<the checkpoint's dataset>")
    ap.add_argument('--report_dir', default='assets', help='where decoding.md, .json and .png go')
    ap.add_argument('--device', default='cpu', help='cpu | cuda | cuda:N')
    args = ap.parse_args(argv)
    pols = split(args.kv_policy, 'kv_policy')
    for p in pols:
        if p not in KV_POLICIES:
            die(f"--kv_policy: unknown policy {p!r}; choose from {', '.join(KV_POLICIES)}")
    if args.exit_policy not in EXIT_POLICIES:
        die(f"--exit_policy={args.exit_policy!r}: choose one of {', '.join(EXIT_POLICIES)}")
    for name in ('n_windows', 'window'):
        if getattr(args, name) < 1:
            die(f"--{name}={getattr(args, name)}: must be >= 1")
    if args.kv_slots < 0:
        die(f"--kv_slots={args.kv_slots}: must be >= 1 (or 0 for R // 2)")
    qs = floats(args.quantiles, 'quantiles')
    if not all(0 <= q <= 1 for q in qs):
        die(f"--quantiles={args.quantiles}: each must lie in [0, 1]")
    arms = []
    for d in args.out_dirs:
        path = d if os.path.isfile(d) else os.path.join(d, 'ckpt.pt')
        if not os.path.isfile(path):
            die(f"{d}: no ckpt.pt there; train one first (python train.py --out_dir={d})")
        ckpt = checkpoint.load(path)
        model = checkpoint.build_model(ckpt).to(args.device).eval()
        cfg = model.config
        if args.exit_policy == 'gate' and cfg.exit_gate != 'learned':
            die(f"{d}: --exit_policy=gate needs a model trained with exit_gate='learned'")
        slots = args.kv_slots or max(1, cfg.n_loop // 2)
        if slots > cfg.n_loop:
            die(f"--kv_slots={slots}: {d} runs only {cfg.n_loop} loops, so at most {cfg.n_loop} slots")
        try:
            thr = [score_threshold(args.exit_policy, t) for t in floats(args.thresholds, 'thresholds')] \
                if args.thresholds else None
        except ValueError as e:
            die(f"--thresholds: {e}")
        data_dir = args.data_dir or os.path.join('data', ckpt.get('dataset', ''))
        X, Y = val_windows(data_dir, load_meta(data_dir), args.window, args.n_windows)
        name = f"{os.path.basename(os.path.normpath(os.path.dirname(path)))} ({cfg.readout} readout, " \
               f"penalty {cfg.norm_penalty:g}, iter {ckpt.get('iter_num')})"
        arms.append((name, model, X.to(args.device), Y.to(args.device), thr, slots))
    n_thr = len(qs) if not args.thresholds else len(args.thresholds.split(','))
    total = sum((m.config.n_loop + len(pols) * n_thr) * X.size(1) for _, m, X, *_ in arms)
    t0, results = time.time(), {}
    with tqdm(total=total, desc='decode steps', unit='tok', mininterval=2) as bar:
        for name, model, X, Y, thr, slots in arms:
            results[name] = evaluate(model, X, Y, pols, thr, args.exit_policy, slots, qs, bar)
    words = sys.argv[1:] if argv is None else argv
    header = dict(command='python lab/decode_eval.py ' + ' '.join(map(shlex.quote, words)),
                  commit=code_version(), device=f"{args.device}, {torch.get_num_threads()} thread(s)",
                  seconds=time.time() - t0)
    out = write_report(results, header, args.report_dir)
    print(f"wrote {out} ({header['seconds']:.0f}s)")
    for name, r in results.items():
        gaps = ', '.join(f"{p} {fmt(g['max'], '+.4f', none='—')}" for p, g in r['gap'].items())
        print(f"{name}: fixed-R CE {r['fixed'][-1]['ce']:.4f}; CE over recompute at matched loops "
              f"(max): {gaps}")


if __name__ == '__main__':
    main()
