"""
Variable-depth diagnostics of a trained looped GPT: what does each loop buy, and does the loss see ||h||?
(docs/papers.md §1: the readout blind spot, its variable-depth benchmark, calibrated halting, radial clamp.)

    python lab/eval_depth.py out-loop-rmsnorm              # a folder holding ckpt.pt (or the file itself)
    python lab/eval_depth.py out-loop-raw --n_seqs=1024 --json=raw_depth.json
    python lab/eval_depth.py out-loop-raw --n_seqs=64 --n_grad_seqs=16 --timing_repeats=1   # quick look

Each phase shows a progress bar with its ETA on stderr (--no-progress: none); the report goes to stdout.

On n_seqs validation windows of the training context length it reports, on stdout and in a JSON file
(default <out_dir>/eval_depth.json):
  fixed depth      val CE / PPL and ||h_k|| at every exit k = 1..R, and R+1..4R (extrapolation: more loops
                   than trained)
  adaptive exit    sequence granularity: a sequence stops at the first exit k < R whose score (its tokens'
                   mean max-prob, top1-top2 logit margin, 1 - H/log V, -KL to the previous exit, or the
                   learned gate's cumulative exit probability) reaches a threshold, else at R;
                   thresholds at quantiles of the scores; the curve average loops vs PPL. Every threshold
                   printed or written is sample.py's --exit_threshold (for kl the KL bound, not -KL)
  calibrated       the threshold with the fewest average loops whose PPL <= 1.01 x the fixed-R PPL on a
  halting          calibration half (even-numbered windows), then tested on the other half, with real
                   dynamic-depth batching (exited sequences leave the batch) timed against fixed R
  radial clamp     CE when, at inference, each loop's update loses its radial part, or every loop's state is
                   rescaled to loop 1's per-token RMS: what the norm growth is worth to the predictions
  radial gradient  |<dL/dh, h>| / (||dL/dh|| ||h||) per token at each loop state, through exit k's readout
  fraction         alone (Lemma 1: ~0 for RMSNorm/LayerNorm readouts) and for the whole training loss
  visit alignment  kappa_R of every shared matrix: how far the R visits' gradients point the same way
                   (docs/papers.md §2)
The last three are diagnostics.py's, which train.py imports too.
How long: on train.py's default model (K 2, R 4, d 128, 64 tokens) the default 512 windows took 2-8 minutes
on busy 2-core CPUs, most of it in the 4R fixed-depth exits and the timed passes; the quick look: seconds.
On a CPU it runs OMP_NUM_THREADS threads if set, else one per core it may use: on a shared machine set it
(a 2-core run took 69 s with 2 threads, 12 s with OMP_NUM_THREADS=1). The timed speedup is a wall-clock
ratio: it moved from x6.90 to x2.98 with the thread count, so compare it only at the same threads and load.
"""
import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the core is one folder up
from configurator import Parser, die
from decoding.exits import EXIT_POLICIES, exit_score, score_at_exit
from prepare import load_meta, missing_file
from run import checkpoint
from run.diagnostics import clamped_states, radial_gradient, visit_alignment

TIMED_POLICIES = ('maxprob', 'margin', 'entropy')  # depth_pass drops exited rows: stateless scores only

# -----------------------------------------------------------------------------
# per-sequence CE and confidence at every exit

def seq_ce(logits, targets):
    """Mean CE per sequence (B,) of logits (B, T, V)."""
    B, T, V = logits.shape
    ce = F.cross_entropy(logits.float().reshape(-1, V), targets.reshape(-1), reduction='none')
    return ce.view(B, T).mean(1)


def policies(model):
    """The exit policies this model has: decoding.exits.EXIT_POLICIES, 'gate' only with a learned gate."""
    return [p for p in EXIT_POLICIES if p != 'gate' or model.config.exit_gate == 'learned']


@torch.no_grad()
def exit_stats(model, X, Y, n_loop, batch_size, clamp='none', bar=None):
    """Run every window through n_loop loops. Returns ce (N, n_loop) per-sequence CE at every exit,
    scores {policy: (N, n_loop)} per-sequence mean exit score (exits.score_at_exit; 'kl' is -inf at exit 1),
    norms (n_loop,) mean per-token ||h_k||. bar: a progress bar, advanced once per batch."""
    ce, norms, scores = [], [], {p: [] for p in policies(model)}
    for i in range(0, X.size(0), batch_size):
        idx, tgt = X[i:i + batch_size], Y[i:i + batch_size]
        states = clamped_states(model, idx, n_loop, clamp)
        c, s = [], {p: [] for p in scores}
        prev = dict.fromkeys(scores)  # what each policy's next score needs (exits.score_at_exit)
        for k, h in enumerate(states, start=1):
            z = model.coda_readout(h, k)
            logits = model.lm_head(z)  # (B, T, V)
            c.append(seq_ce(logits, tgt))
            for p in scores:
                score, prev[p] = score_at_exit(model, p, z, logits, prev[p])
                s[p].append(score.mean(1))
        ce.append(torch.stack(c, 1))
        for p in scores:
            scores[p].append(torch.stack(s[p], 1))
        norms.append(torch.stack([h.float().norm(dim=-1).sum() for h in states]))
        if bar is not None:
            bar.update()
    n_tok = X.numel()
    return (torch.cat(ce).double().cpu(), {p: torch.cat(v).double().cpu() for p, v in scores.items()},
            (torch.stack(norms).sum(0) / n_tok).cpu())

# -----------------------------------------------------------------------------
# adaptive exit and calibrated halting (pure functions of the per-sequence tables)

def ppl(ce):
    return math.exp(float(ce.mean()))


def exit_loops(scores, threshold):
    """Loops used per sequence (N,) long: the first exit k < R with score >= threshold, else R.
    scores (N, R) per-sequence confidence at exits 1..R (the last column is never consulted)."""
    N, R = scores.shape
    hit = scores[:, :R - 1] >= threshold  # (N, R-1)
    first = torch.where(hit.any(1), hit.float().argmax(1) + 1, torch.full((N,), R))  # argmax = first True
    return first.long()


def adaptive(ce, scores, threshold):
    """(average loops, PPL) when every sequence exits by `threshold` (ce, scores: (N, R))."""
    loops = exit_loops(scores, threshold)
    return float(loops.double().mean()), ppl(ce.gather(1, (loops - 1)[:, None]))


def quantile_thresholds(scores, qs):
    """Thresholds at quantiles qs of the scores of exits 1..R-1 (the only ones a threshold acts on)."""
    pooled = scores[:, :-1].reshape(-1).double()
    pooled = pooled[torch.isfinite(pooled)]  # kl's exit 1 (-inf): never an exit
    if pooled.numel() == 0:
        return [math.inf] * len(qs)  # no exit a threshold could open (kl at R = 2)
    return torch.quantile(pooled, torch.as_tensor(qs, dtype=torch.float64)).tolist()


def calibrate(ce, scores, tol=1.01):
    """The threshold with the fewest average loops whose PPL <= tol x the fixed-R PPL (ties: lower PPL).
    Candidates: every score value at exits 1..R-1, and +inf (never exit early, always feasible).
    Returns (threshold, average loops, PPL) on this split."""
    limit = tol * ppl(ce[:, -1])
    best = (math.inf, float(ce.size(1)), ppl(ce[:, -1]))
    for t in torch.unique(scores[:, :-1]).tolist():
        if not math.isfinite(t):
            continue
        loops, p = adaptive(ce, scores, t)
        if p <= limit and (loops, p) < (best[1], best[2]):
            best = (t, loops, p)
    return best

# -----------------------------------------------------------------------------
# real dynamic-depth batching

def sync(device):
    if device.type == 'cuda':
        torch.cuda.synchronize()


@torch.no_grad()
def depth_pass(model, X, Y, batch_size, threshold=None, policy='margin'):
    """One pass over the windows. threshold None: every sequence runs R loops and one readout (fixed depth).
    Else after every loop k < R the batch is read out, its sequences scored, and those with score >= threshold
    leave the batch (their CE is taken at exit k): the remaining loops run on fewer rows.
    Returns (total CE over sequences, total loops used)."""
    R = model.config.n_loop
    ce_sum, loops_sum = 0.0, 0
    for i in range(0, X.size(0), batch_size):
        tgt = Y[i:i + batch_size]
        h = e = model.begin(X[i:i + batch_size])
        for k in range(1, R + 1):
            h = model.loops(h, e, [k]).states[0]
            if threshold is None and k < R:
                continue
            logits = model.readout(h, k)
            out = torch.ones(h.size(0), dtype=torch.bool, device=h.device) if k == R else \
                exit_score(logits, policy).mean(1) >= threshold
            if bool(out.any()):
                ce_sum += float(seq_ce(logits[out], tgt[out]).sum())
                loops_sum += k * int(out.sum())
            # rows that exited leave the batch before the next loop
            h, tgt, e = h[~out], tgt[~out], e[~out]
            if tgt.size(0) == 0:
                break
    return ce_sum, loops_sum


def timed_pass(model, X, Y, batch_size, threshold, policy, repeats, bar=None):
    """Best-of-repeats wall time of depth_pass (after one warm-up), and its (PPL, average loops).
    bar: a progress bar, advanced after every pass (outside the timed part)."""
    tick = bar.update if bar is not None else lambda: None
    ce_sum, loops_sum = depth_pass(model, X, Y, batch_size, threshold, policy)  # warm-up
    tick()
    best = math.inf
    for _ in range(repeats):
        sync(X.device)
        t0 = time.perf_counter()
        depth_pass(model, X, Y, batch_size, threshold, policy)
        sync(X.device)
        best = min(best, time.perf_counter() - t0)
        tick()
    N = X.size(0)
    return dict(seconds=best, tok_per_s=X.numel() / best, ppl=math.exp(ce_sum / N), avg_loops=loops_sum / N)

# -----------------------------------------------------------------------------
# the whole evaluation

def val_windows(data_dir, meta, T, n_seqs):
    """n_seqs windows of T+1 tokens spread evenly over the validation split: (X, Y) long (n, T)."""
    path = os.path.join(data_dir, 'val.bin')
    if not os.path.isfile(path):
        missing_file(path, data_dir)
    data = np.memmap(path, dtype=np.dtype(meta['dtype']), mode='r')
    span = len(data) - (T + 1)
    if span < 0:
        die(f"{path} holds {len(data)} tokens, fewer than one window of {T + 1}")
    n = min(n_seqs, span + 1)
    starts = np.linspace(0, span, n).astype(np.int64)
    w = torch.from_numpy(np.stack([data[s:s + T + 1].astype(np.int64) for s in starts]))
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def adaptive_curves(ce, scores, quantiles):
    """Average loops vs PPL of every policy, thresholds at score quantiles (ce, scores (N, R))."""
    out = {}
    for p in scores:
        thr = quantile_thresholds(scores[p], quantiles)
        pts = [adaptive(ce, scores[p], t) for t in thr]
        out[p] = dict(quantile=list(quantiles), threshold=thr, avg_loops=[loops for loops, _ in pts],
                      ppl=[perplexity for _, perplexity in pts])
    return out


def flag_threshold(policy, score):
    """The --exit_threshold (sample.py, with --exit_policy=policy) that exits.score_threshold turns into
    this score: for kl the KL bound, -score (its scores are -KL); the score itself for the others."""
    return -score if policy == 'kl' else score


def calibrated_halting(ce, scores, tol, policy):
    """Every policy's threshold calibrated on the even windows, tested on the odd ones. threshold: what
    --exit_threshold takes (flag_threshold), +-inf (JSON null) for 'never exit early'."""
    cal, held = torch.arange(0, ce.size(0), 2), torch.arange(1, ce.size(0), 2)
    out = dict(tol=tol, policy=policy, fixed_ppl_cal=ppl(ce[cal, -1]), fixed_ppl_held=ppl(ce[held, -1]))
    for p in scores:
        t, loops, pc = calibrate(ce[cal], scores[p][cal], tol)
        lh, ph = adaptive(ce[held], scores[p][held], t)
        out[p] = dict(threshold=flag_threshold(p, t), cal_avg_loops=loops, cal_ppl=pc, held_avg_loops=lh,
                      held_ppl=ph, held_ppl_ratio=ph / out['fixed_ppl_held'])
    return out


def throughput(model, X, Y, batch_size, threshold, policy, repeats, bar=None):
    """Real dynamic-depth batching at the calibrated threshold against fixed depth, timed on (X, Y).
    A threshold of inf lets nobody exit early: its readouts still cost. bar: advanced after every pass."""
    fixed = timed_pass(model, X, Y, batch_size, None, policy, repeats, bar)
    dyn = timed_pass(model, X, Y, batch_size, threshold, policy, repeats, bar)
    return dict(policy=policy, threshold=threshold, batch_size=batch_size, fixed=fixed, dynamic=dyn,
                speedup=dyn['tok_per_s'] / fixed['tok_per_s'], device=str(X.device),
                threads=torch.get_num_threads() if X.device.type == 'cpu' else None)


PHASES = 8  # progress bars in evaluate()


def progress_bar(desc, total, unit='batch', show=True):
    """One phase's progress bar on stderr with its ETA (tqdm); stdout keeps the report."""
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit=unit, disable=not show, file=sys.stderr, mininterval=1.0,
                dynamic_ncols=True)


def grad_fractions(model, X, Y, batch_size, bar):
    """diagnostics.radial_gradient on (X, Y), one batch at a time so that the bar moves: the same sums in
    the same order, the same numbers."""
    R = model.config.n_loop
    readout, total, n = np.zeros(R), np.zeros(R), 0
    for i in range(0, X.size(0), batch_size):
        rf, tf = radial_gradient(model, X[i:i + batch_size], Y[i:i + batch_size], batch_size)
        readout, total, n = readout + rf, total + tf, n + 1
        bar.update()
    return (readout / n).tolist(), (total / n).tolist()


@torch.no_grad()
def evaluate(model, X, Y, batch_size=16, tol=1.01, policy='margin', n_grad_seqs=64, timing_repeats=3,
             quantiles=tuple(i / 20 for i in range(21)), exits=0, progress=False):
    """Every diagnostic of this file on the windows (X, Y); returns a JSON-able dict. exits: fixed-depth
    exits 1..exits (0: 4R, at least R). progress: a bar per phase on stderr."""
    model.eval()
    R = model.config.n_loop
    n_exits = max(exits or 4 * R, R)
    batches = lambda n: math.ceil(n / batch_size)
    phase = iter(range(1, PHASES + 1))
    bar = lambda desc, total, unit='batch': progress_bar(f"[{next(phase)}/{PHASES}] {desc}", total, unit,
                                                         progress)
    with bar(f'fixed-depth exits 1..{n_exits}', batches(X.size(0))) as b:
        ce, scores, norms = exit_stats(model, X, Y, n_exits, batch_size, bar=b)  # exits 1..n_exits
    res = dict(n_loop=R, n_seqs=X.size(0), seq_len=X.size(1))
    res['fixed'] = dict(exit=list(range(1, n_exits + 1)), ce=ce.mean(0).tolist(), ppl=[ppl(c) for c in ce.T],
                        norm=norms.tolist())
    # docs/papers.md §1: the PPL change from exit 1 to exit R; negative means the extra loops help
    res['dppl_1_to_R'] = res['fixed']['ppl'][R - 1] - res['fixed']['ppl'][0]
    ce, scores = ce[:, :R], {p: s[:, :R] for p, s in scores.items()}  # adaptive exit works within 1..R
    with bar('adaptive curves', 1, 'step') as b:
        curves = adaptive_curves(ce, scores, quantiles) if R > 1 else {}
        # thresholds as --exit_threshold takes them, like the calibrated ones (kl: the KL bound)
        res['adaptive'] = {p: dict(c, threshold=[flag_threshold(p, t) for t in c['threshold']])
                           for p, c in curves.items()}
        b.update()
    with bar('calibrated halting', 1, 'step') as b:
        res['calibrated'] = calibrated_halting(ce, scores, tol, policy)
        b.update()
    held = torch.arange(1, X.size(0), 2)
    threshold = res['calibrated'][policy]['threshold']  # a timed policy's flag value is its score
    with bar('timed passes, fixed and dynamic depth', 2 * (1 + timing_repeats), 'pass') as b:
        res['throughput'] = throughput(model, X[held], Y[held], batch_size, threshold, policy, timing_repeats,
                                       b)
    # radial clamp at inference: CE at every exit 1..R with each clamp, and the change against none
    res['clamp'] = {}
    for c in ('radial', 'freeze'):
        with bar(f'{c} clamp at inference', batches(X.size(0))) as b:
            cc, _, cnorms = exit_stats(model, X, Y, R, batch_size, clamp=c, bar=b)
        res['clamp'][c] = dict(ce=cc.mean(0).tolist(), dce=(cc.mean(0) - ce.mean(0)).tolist(),
                               norm=cnorms.tolist())
    # radial gradient fraction and visit alignment on the first n_grad_seqs windows
    Xg, Yg = X[:n_grad_seqs], Y[:n_grad_seqs]
    with bar('radial gradient fraction', batches(Xg.size(0))) as b:
        rf, tf = grad_fractions(model, Xg, Yg, batch_size, b)
    res['radial_frac'] = dict(readout=rf, total=tf)
    with bar('visit alignment', 1, 'step') as b:
        res['kappa'] = visit_alignment(model, Xg, Yg)
        b.update()
    return res


def print_report(res, title):
    R = res['n_loop']
    row = lambda name, vals, fmt: f"  {name:<28}" + ''.join(format(v, fmt).rjust(10) for v in vals)
    fx = res['fixed']
    print(title)
    print(f"fixed depth on {res['n_seqs']} val windows x {res['seq_len']} tokens (exits "
          f"{R + 1}..{len(fx['exit'])}: more loops than trained)")
    print(row('exit k', fx['exit'], 'd'))
    print(row('val CE', fx['ce'], '.4f'))
    print(row('val PPL', fx['ppl'], '.3f'))
    print(row('||h_k|| (mean per token)', fx['norm'], '.1f'))
    print(f"  PPL change exit 1 -> {R}: {res['dppl_1_to_R']:+.3f}  (negative: the extra loops help)")
    print("radial clamp at inference (CE at exit k; change against no clamp)")
    for c, name in (('radial', 'remove radial update'), ('freeze', "rescale to loop 1's RMS")):
        print(row(name, res['clamp'][c]['ce'], '.4f'))
        print(row('  change', res['clamp'][c]['dce'], '+.4f'))
    print("radial gradient fraction |<dL/dh,h>| / (|dL/dh| |h|), mean over tokens")
    print(row("exit k's CE via its readout", res['radial_frac']['readout'], '.1e'))
    print(row('training loss (total)', res['radial_frac']['total'], '.1e'))
    kap = res['kappa']
    if kap['mean'] is not None:
        print(f"visit alignment kappa_R = ||sum_r G_r||^2 / sum_r ||G_r||^2 of the shared matrices (R = {R}: "
              f"1 = orthogonal visits, {R} = aligned): mean {kap['mean']:.3f}, range "
              f"{min(v for v in kap['per_matrix'].values() if v is not None):.3f}.."
              f"{max(v for v in kap['per_matrix'].values() if v is not None):.3f}")
    cal = res['calibrated']
    if res['adaptive']:
        a = res['adaptive'][cal['policy']]
        print(f"adaptive exit, policy {cal['policy']}, thresholds at score quantiles (all windows)")
        print(row('quantile', a['quantile'][::4], '.2f'))
        print(row('avg loops', a['avg_loops'][::4], '.2f'))
        print(row('PPL', a['ppl'][::4], '.3f'))
    print(f"calibrated halting: fewest avg loops with PPL <= {cal['tol']} x fixed-{R} on the even windows, "
          f"tested on "
          f"the odd ones (fixed-{R} PPL {cal['fixed_ppl_cal']:.3f} / {cal['fixed_ppl_held']:.3f})")
    print("  threshold: sample.py's --exit_threshold for --exit_policy=<policy> (kl: the KL bound, exit when "
          "KL <= it; never: no exit before R)")
    print(f"  {'policy':<10}{'threshold':>12}{'cal loops':>11}{'cal PPL':>10}{'held loops':>12}"
          f"{'held PPL':>10}"
          f"{'x fixed':>9}")
    for p in EXIT_POLICIES:
        if p not in cal:
            continue
        c = cal[p]
        t = format(c['threshold'], '.4g') if math.isfinite(c['threshold']) else 'never'
        print(f"  {p:<10}{t:>12}{c['cal_avg_loops']:>11.2f}{c['cal_ppl']:>10.3f}"
              f"{c['held_avg_loops']:>12.2f}{c['held_ppl']:>10.3f}{c['held_ppl_ratio']:>9.4f}")
    tp = res['throughput']
    # a wall-clock ratio, not a property of the model: it moved from x6.90 to x2.98 with the thread count
    depends = (f"{tp['threads']} threads; timing depends on the thread count and the machine's load"
               if tp['threads'] else f"{tp['device']}; timing depends on the device and its load")
    print(f"dynamic-depth batching ({tp['policy']}, batch {tp['batch_size']}, {tp['device']}): "
          f"{tp['dynamic']['tok_per_s']:,.0f} tok/s at {tp['dynamic']['avg_loops']:.2f} avg loops "
          f"(PPL {tp['dynamic']['ppl']:.3f}) vs fixed-{R} {tp['fixed']['tok_per_s']:,.0f} tok/s "
          f"(PPL {tp['fixed']['ppl']:.3f}): x{tp['speedup']:.2f} ({depends})")


def json_safe(obj):
    """obj with every non-finite float as None (null): JSON has no Infinity or NaN. A calibrated threshold
    of +inf means 'never exit early'."""
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return None if isinstance(obj, float) and not math.isfinite(obj) else obj


def write_json(out, res):
    """res as JSON at out, written whole or not at all (a .tmp file, then a rename)."""
    with open(out + '.tmp', 'w', encoding='utf-8') as f:
        json.dump(json_safe(res), f, indent=1, allow_nan=False)
    os.replace(out + '.tmp', out)


def cpu_threads():
    """torch's threads on a CPU: OMP_NUM_THREADS where the user set it (on a shared machine more threads
    than free cores made a run 6x slower), else the cores this process may use (ablate.py pins them)."""
    value = os.environ.get('OMP_NUM_THREADS')
    if value is None:
        return len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else (os.cpu_count() or 1)
    first = value.split(',')[0].strip()  # OpenMP's nested form "4,2": the outer level is ours
    if not first.isdigit() or int(first) < 1:
        die(f"OMP_NUM_THREADS={value}: must be a positive integer (the CPU threads to use)")
    return int(first)


def open_checkpoint(out_dir, device, script):
    """(device, path, checkpoint) for a lab script's OUT_DIR argument (a folder holding ckpt.pt, or the
    file); device 'auto' is cuda where there is one. A missing checkpoint is one line and exit 1."""
    device = ('cuda' if torch.cuda.is_available() else 'cpu') if device == 'auto' else device
    if device == 'cpu':
        torch.set_num_threads(cpu_threads())
    path = checkpoint.path_of(out_dir)
    if not os.path.isfile(path):  # checkpoint.load's hint names train.py's --out_dir, which this lacks
        die(f"checkpoint {path} not found: pass {script} the folder holding ckpt.pt, or the file, "
            f"as its first argument (python lab/{script}.py OUT_DIR)")
    return device, path, checkpoint.load(path)


def main(argv=None):
    ap = Parser('lab/eval_depth.py', __doc__)
    ap.add_argument('out_dir', help='a folder holding ckpt.pt, or the checkpoint file')
    ap.add_argument('--data_dir', default=None, help="default: data/<the checkpoint's dataset>")
    ap.add_argument('--n_seqs', type=int, default=512, help='validation windows (half calibrate, half test)')
    ap.add_argument('--seq_len', type=int, default=0, help='tokens per window; 0 = the model block_size')
    ap.add_argument('--batch_size', type=int, default=16)
    ap.add_argument('--tol', type=float, default=1.01, help='calibrated halting: PPL <= tol x fixed-R PPL')
    ap.add_argument('--policy', default='margin', choices=TIMED_POLICIES,
                    help='policy of the timed batching')
    ap.add_argument('--n_grad_seqs', type=int, default=64, help='windows for the radial gradient fraction')
    ap.add_argument('--timing_repeats', type=int, default=3)
    ap.add_argument('--exits', type=int, default=0, help='fixed-depth exits 1..this (0: 4R)')
    ap.add_argument('--device', default='auto', help='auto | cpu | cuda | cuda:N')
    ap.add_argument('--json', default=None, help='output file; default <out_dir>/eval_depth.json')
    ap.add_argument('--progress', default=True, action=argparse.BooleanOptionalAction,
                    help='a progress bar with its ETA per phase on stderr')
    args = ap.parse_args(argv)
    if args.exits < 0:
        die(f"--exits={args.exits}: must be >= 0 (0 = 4R)")
    for name in ('n_seqs', 'batch_size', 'n_grad_seqs', 'timing_repeats'):
        if getattr(args, name) < 1:
            die(f"--{name}={getattr(args, name)}: must be >= 1")
    if not args.tol >= 1.0:
        die(f"--tol={args.tol}: must be >= 1")
    device, ckpt_path, ckpt = open_checkpoint(args.out_dir, args.device, 'eval_depth')
    model = checkpoint.build_model(ckpt).to(device)
    cfg = model.config
    data_dir = args.data_dir or os.path.join('data', ckpt.get('dataset', ''))
    meta = load_meta(data_dir)
    T = args.seq_len or cfg.block_size
    if T > cfg.block_size:
        die(f"--seq_len={T} is longer than the model's block_size {cfg.block_size}")
    X, Y = val_windows(data_dir, meta, T, args.n_seqs)
    if args.progress:
        print(f"eval_depth: {ckpt_path}, {X.size(0)} windows x {T} tokens on {device}"
              + (f", {torch.get_num_threads()} threads" if device == 'cpu' else ''), file=sys.stderr)
    t0 = time.time()
    res = evaluate(model, X.to(device), Y.to(device), args.batch_size, args.tol, args.policy,
                   args.n_grad_seqs, args.timing_repeats, exits=args.exits, progress=args.progress)
    res.update(checkpoint=ckpt_path, iter_num=ckpt.get('iter_num'), dataset=ckpt.get('dataset'),
               model_args=ckpt['model_args'], seconds=round(time.time() - t0, 2))
    print_report(res, f"eval_depth: {ckpt_path} (iter {ckpt.get('iter_num')}; {cfg.supervision} supervision, "
                      f"{cfg.readout} readout, {cfg.block} block, K={cfg.n_layer} R={cfg.n_loop})")
    out = args.json or os.path.join(os.path.dirname(ckpt_path) or '.', 'eval_depth.json')
    write_json(out, res)
    print(f"wrote {out} ({res['seconds']:.1f}s)")


if __name__ == '__main__':
    main()
