"""
The reports of lab/ablate.py's sweeps: markdown tables and PNG plots made from what the runs left in their
folders, metrics.jsonl (train.py), eval_depth.json (lab/eval_depth.py) and status.json (the runner), and
from the data's unigram floor. One report per kind of preset: blindspot and growing (docs/papers.md §1),
deeploop, kappa and escape (docs/papers.md §2), lr_transfer (docs/papers.md §3), recurrent
(docs/papers.md §4). matplotlib is optional: without it the plots are skipped with a message.
"""
import json
import math
import os

import numpy as np

from verdict import mean_ci, shares_ci, verdict, weakest

TEST_LOOPS = (1, 2, 4, 8, 16)  # the recurrent report's test-time depths
HALT_POLICIES = ('margin', 'kl', 'gate')  # ... and its exits
GROWING_STEPS = (150, 600, 1000, 2000, 3000, 5000, 7500, 10_000)  # the growing report's table rows
ESCAPE_MARGIN = 0.2  # nats: a run 'escaped' the unigram floor if its final val loss < floor - this
PAPER_ESCAPES = {0.30: '0/5', 0.40: '2/5', 0.50: '3/5', 0.60: '5/5'}  # docs/papers.md §2, GPT-2 small

# -----------------------------------------------------------------------------
# reading a run's folder (the runner reads it too: finished runs are skipped)

def read_json(path, default=None):
    try:
        with open(path, encoding='utf-8') as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return default


def read_metrics(run_dir):
    rows = []
    try:
        with open(os.path.join(run_dir, 'metrics.jsonl'), encoding='utf-8') as fh:
            for line in fh:
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    pass
    except OSError:
        pass
    return rows


def read_status(run_dir):
    return read_json(os.path.join(run_dir, 'status.json'), {})

# -----------------------------------------------------------------------------
# the data's unigram floor (the DeepLoop, kappa_R and escape reports)

def unigram_floor(data_dir):
    """Cross-entropy (nats/token) on val.bin of the unigram distribution of train.bin (add-1/2 smoothing):
    the loss of a model that predicts token frequencies and nothing else (docs/papers.md §2's 'unigram
    floor')."""
    meta = read_json(os.path.join(data_dir, 'meta.json'))
    if meta is None:
        return None
    dt, V = np.dtype(meta['dtype']), meta['vocab_size']
    counts = {}
    for split in ('train', 'val'):
        data = np.memmap(os.path.join(data_dir, f'{split}.bin'), dtype=dt, mode='r')
        c = np.zeros(V, dtype=np.float64)
        for i in range(0, len(data), 1 << 24):
            c += np.bincount(data[i:i + (1 << 24)], minlength=V)[:V]
        counts[split] = c
    p = (counts['train'] + 0.5) / (counts['train'].sum() + 0.5 * V)
    return float(-(counts['val'] * np.log(p)).sum() / counts['val'].sum())

# -----------------------------------------------------------------------------
# numbers for the reports: eval_depth.json holds null for every inf or nan (a calibrated threshold of
# +inf, 'never exit early', an overflowing PPL), metrics.jsonl may hold NaN

def mean(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else None


def fmt(x, spec='.3f'):
    """A number for a table: 'n/a' for None (missing, or JSON's null for inf/nan), inf and nan spelled out."""
    if x is None:
        return 'n/a'
    if isinstance(x, float) and (math.isinf(x) or math.isnan(x)):
        return str(x)
    if spec.endswith('f') and abs(x) >= 1e5:  # e.g. the PPL of an untrained early exit
        return format(x, spec[:-1].split('.')[0] + '.2e')
    return format(x, spec)


def vec(xs, spec):
    return ' / '.join(fmt(x, spec) for x in xs) if xs else 'n/a'


def mean_vec(vs):
    vs = [v for v in vs if v]
    return [mean(col) for col in zip(*vs)] if vs else []


def floats(xs):
    """A JSON list of numbers as a float array, null as nan (matplotlib leaves nan out)."""
    return np.asarray(xs, dtype=float)


def row_near(rows, it):
    return min(rows, key=lambda r: abs(r['iter'] - it)) if rows else None

# -----------------------------------------------------------------------------
# the blind-spot report: three tables and three plots

def runs_by_arm(jobs):
    out = {}
    for j in jobs:
        run = dict(j, rows=read_metrics(j['out_dir']), status=read_status(j['out_dir']),
                   depth=read_json(os.path.join(j['out_dir'], 'eval_depth.json')))
        out.setdefault(j['arm']['name'], []).append(run)
    return out


def depths(runs):
    return [r['depth'] for r in runs if r['depth']]


def scale_row(name, runs):
    ok = [r for r in runs if r['rows']]
    last = [r['rows'][-1] for r in ok]
    half = [row_near(r['rows'], r['rows'][-1]['iter'] / 2) for r in ok]
    hR_end, hR_half = mean([row['norm'][-1] for row in last]), mean([row['norm'][-1] for row in half])
    peaks = [max(r['rows'], key=lambda row: row['norm'][-1]) for r in ok]
    peak = 'n/a'
    if ok:
        peak_steps = '/'.join(str(p['iter']) for p in peaks)
        peak = f"{fmt(mean([p['norm'][-1] for p in peaks]), '.1f')} ({peak_steps})"
    fails = sum(r['status'].get('train') == 'failed' for r in runs)
    growth = hR_end / hR_half if hR_end and hR_half else None
    return (f"| {name} | {len(runs)}{f' ({fails} failed)' if fails else ''} | "
            f"{vec([row['iter'] for row in last[:1]], 'd')} | "
            f"{fmt(mean([row['val_loss'] for row in last]), '.4f')} | "
            f"{vec(mean_vec([row['norm'] for row in last]), '.1f')} | {peak} | "
            f"{fmt(hR_half, '.1f')} / {fmt(hR_end, '.1f')} | x{fmt(growth, '.2f')} |")


def scale_table(arms):
    return (["### Scale: ||h_k|| at the end of training (mean per-token L2 norm of each loop state, val, "
             "before readout and before any inter-loop norm)", "",
             "| arm | seeds | iters | val CE (exit R) | ‖h_k‖ k = 1..R | peak ‖h_R‖ (step) | "
             "‖h_R‖ at half / end | growth, 2nd half |", "|---|---|---|---|---|---|---|---|"]
            + [scale_row(name, runs) for name, runs in arms.items()])


def depth_row(name, d):
    if not d:
        return f"| {name} | n/a | n/a | n/a | n/a | n/a | n/a |"
    R = d[0]['n_loop']
    ce = mean_vec([x['fixed']['ce'] for x in d])
    cal = [x['calibrated'][x['calibrated']['policy']] for x in d]  # its threshold may be null: never exit
    return (f"| {name} | {vec(ce[:R], '.3f')} | {vec(ce[R:2 * R], '.3f')} | "
            f"{fmt(mean([x['dppl_1_to_R'] for x in d]), '+.3f')} | "
            f"{fmt(mean([c['held_avg_loops'] for c in cal]), '.2f')} | "
            f"{fmt(mean([c['held_ppl_ratio'] for c in cal]), '.4f')} | "
            f"x{fmt(mean([x['throughput']['speedup'] for x in d]), '.2f')} |")


def depth_table(arms):
    return (["### Depth: val CE at every exit (eval_depth, fixed depth) and what adaptive depth buys", "",
             "| arm | val CE exit 1..R | CE exits R+1..2R (extrapolation) | ΔPPL exit 1→R | "
             "calibrated avg loops (margin, held-out) | held-out PPL / fixed-R | "
             "dynamic batching tok/s vs fixed-R |",
             "|---|---|---|---|---|---|---|"]
            + [depth_row(name, depths(runs)) for name, runs in arms.items()])


def radial_row(name, d):
    if not d:
        return f"| {name} | n/a | n/a | n/a | n/a |"
    return (f"| {name} | {vec(mean_vec([x['radial_frac']['readout'] for x in d]), '.1e')} | "
            f"{vec(mean_vec([x['radial_frac']['total'] for x in d]), '.1e')} | "
            f"{fmt(mean([x['clamp']['radial']['dce'][-1] for x in d]), '+.4f')} | "
            f"{fmt(mean([x['clamp']['freeze']['dce'][-1] for x in d]), '+.4f')} |")


def radial_table(arms):
    title = "### Does the loss see the scale? Radial gradient fraction and the inference-time radial clamp"
    return ([title, "",
             "| arm | radial grad. fraction, exit-k CE via its readout (k = 1..R) | radial grad. fraction, "
             "training loss (k = 1..R) | ΔCE exit R, radial part of updates removed | ΔCE exit R, states "
             "rescaled to loop 1's RMS |", "|---|---|---|---|---|"]
            + [radial_row(name, depths(runs)) for name, runs in arms.items()])


def blindspot_report(arms, header, report_dir, prefix):
    lines = header + scale_table(arms) + [""] + depth_table(arms) + [""] + radial_table(arms)
    plt = plt_or_none()
    plots = [] if plt is None else [plot_norms(plt, arms, report_dir, prefix),
                                    plot_pareto(plt, arms, report_dir, prefix),
                                    plot_exit_ce(plt, arms, report_dir, prefix)]
    verdicts = blindspot_verdicts(arms) if all(a in arms for a in BLINDSPOT_ARMS) else []
    verdicts += probes_verdicts(arms)
    lines += [""] + [f"![{p}]({p})" for p in plots]
    return lines + ([""] + verdict_block(verdicts) if verdicts else [])


# paper 1's claims (docs/papers.md §1) judged by the rule of lab/verdict.py on per-seed numbers: each a
# function of one run -> a number, the arms it is computed on, the paper's sign (the sizes are bounds, "in
# the thousands", "in the tens": the effect is the distance to the bound) and, for "costs little" and "~0",
# the equivalence margin stated beside it. A CE's size does not carry over: its scale is the tokenizer's.
FIXES = ('loop_raw', 'loop_final_only', 'loop_penalty')  # the scale-visible readout and the penalty
BLINDSPOT_ARMS = ('loop_rmsnorm', 'terminal_rmsnorm') + FIXES
THOUSANDS = 1000.0     # "into the thousands": the claim's own size, the lower end of it (the paper: 39,207)
TENS = 100.0           # "in the tens": a final-loop norm below 100 (a unit-RMS state at d 128 has norm 11.3)
RADIAL_MARGIN = 1e-6   # "~0": the readout's radial gradient fraction within 1e-6 (the paper's is about 1e-8)
CLAMP_MARGIN = 0.01    # "costs little": the radial clamp's CE cost within 0.01 nats (the paper's <= 0.0055)
HOLD_MARGIN = 0.02     # "holds", "nothing from depth": nats, about a run's eval noise here (DeepLoop's
                       # "neutral" margin)


def exit_gain(d):
    """What depth buys in an eval_depth record d: val CE at exit 1 minus at exit R. A report's .json keeps
    no n_loop, but its clamp record has one entry per trained exit."""
    R = d.get('n_loop') or len(d['clamp']['radial']['dce'])
    return d['fixed']['ce'][0] - d['fixed']['ce'][R - 1]


def clamp_cost(d):
    """The radial clamp's CE cost at exit R: each loop's update less its radial part (docs/papers.md §1)."""
    return d['clamp']['radial']['dce'][-1]


def hR_end(r):
    return r['rows'][-1]['norm'][-1] if r['rows'] else None


def per_seed(arms, name, f):
    return {r['seed']: f(r) for r in arms[name] if r['depth'] and r['rows']}


def seed_diffs(arms, a, b, f):
    """a's f minus b's, paired by seed."""
    fa, fb = per_seed(arms, a, f), per_seed(arms, b, f)
    return [fa[s] - fb[s] for s in fa if s in fb]


def blindspot_verdicts(arms):
    """[(key, word, seeds, how)] of paper 1's headline claims, each the rule on its per-seed numbers."""
    growth = lambda r: math.log(hR_end(r) / row_near(r['rows'], r['rows'][-1]['iter'] / 2)['norm'][-1])
    useless = lambda r: exit_gain(r['depth'])
    radial = lambda r: r['depth']['radial_frac']['readout'][-1]
    clamp = lambda r: clamp_cost(r['depth'])
    claims = [
        ("inflates the norm", seed_diffs(arms, 'loop_rmsnorm', 'loop_raw', hR_end), dict(spec='+.1f'),
         "loop_rmsnorm's ‖h_R‖ minus loop_raw's, paired by seed"),
        ("into the thousands", [x - THOUSANDS for x in per_seed(arms, 'loop_rmsnorm', hR_end).values()],
         dict(spec='+.1f'), f"loop_rmsnorm's ‖h_R‖ minus {THOUSANDS:g}"),
        ("still growing at the end", list(per_seed(arms, 'loop_rmsnorm', growth).values()), dict(sign=+1),
         "log of loop_rmsnorm's ‖h_R‖ at the end over its value at half the steps"),
        ("early exits useless", list(per_seed(arms, 'terminal_rmsnorm', useless).values()), dict(sign=+1),
         "terminal_rmsnorm's val CE at exit 1 minus at exit R"),
        ("radial gradient", list(per_seed(arms, 'loop_rmsnorm', radial).values()),
         dict(margin=RADIAL_MARGIN, spec='+.1e'), "loop_rmsnorm's radial fraction of exit R's CE gradient"),
        ("radial clamp costs little", list(per_seed(arms, 'loop_rmsnorm', clamp).values()),
         dict(margin=CLAMP_MARGIN, spec='+.4f'), "loop_rmsnorm's CE change at exit R, radial part removed"),
    ]
    out = [(key, *verdict(*mean_ci(xs), n=len(xs), **kw), what) for key, xs, kw, what in claims]
    # "the fixes end in the tens" must hold for each fix: the weakest verdict of the three arms, and among
    # equal words the fix whose CI comes closest to TENS
    cis = {fix: mean_ci([x - TENS for x in per_seed(arms, fix, hR_end).values()]) for fix in FIXES}
    tens = [(fix, *verdict(*cis[fix], sign=-1, n=len(per_seed(arms, fix, hR_end)), spec='+.1f'))
            for fix in sorted(FIXES, key=lambda f: -(cis[f][2] if cis[f][2] is not None else math.inf))]
    word = weakest([w for _, w, _ in tens])
    fix, _, why = next(t for t in tens if t[1] == word)
    out.append(("fixes end in the tens", word, why, f"‖h_R‖ minus {TENS:g} per seed, weakest fix {fix}"))
    n = len(per_seed(arms, 'loop_rmsnorm', hR_end))
    return [(key, word, n, f"computed: {what}; {why}") for key, word, why, what in out]


# the probes preset (lab/ablate.py) asks two things of single arms: when does the clamp cost little (the
# paper's models were trained for 4 epochs), and does depth cost the inter-loop-norm arm only under the
# reference init? A key names the arm's setting, so that the docs can say which one a verdict is on.
CLAMP_PROBES = {'loop_rmsnorm-lr1e-3': "600 steps, lr 1e-3", 'loop_rmsnorm-2000': "2,000 steps, lr 3e-4",
                'loop_rmsnorm-2000-lr1e-3': "2,000 steps, lr 1e-3", 'embedded_default': "train.py's defaults"}
INTERLOOP_PROBES = {'loop_interloop_norm-gpt2': "under init gpt2", 'loop_interloop_norm-lr1e-3': "at lr 1e-3",
                    'loop_interloop_norm-2000': "after 2,000 steps"}


def probes_verdicts(arms):
    """The probes' claims on their arms' eval_depth records: a sweep's runs, or the report's .json."""
    claims = ([(f"the radial clamp costs little at {setting}", name, clamp_cost, CLAMP_MARGIN,
                "CE change at exit R, radial part removed")
               for name, setting in CLAMP_PROBES.items()]
              + [(f"depth costs the inter-loop norm nothing {setting}", name, lambda d: -exit_gain(d),
                  HOLD_MARGIN, "val CE at exit R minus at exit 1")
                 for name, setting in INTERLOOP_PROBES.items()])
    out = []
    for key, name, f, margin, what in claims:
        xs = [f(r['depth']) for r in arms.get(name, []) if r.get('depth')]
        if xs:
            word, why = verdict(*mean_ci(xs), margin=margin, n=len(xs), spec='+.4f')
            out.append((key, word, len(xs), f"computed: {name}'s {what}, per seed; {why}"))
    return out


def plt_or_none():
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print("matplotlib is not installed: skipping the plots (pip install matplotlib)")
        return None


def save(fig, plt, report_dir, name):
    fig.savefig(os.path.join(report_dir, name), dpi=90)
    plt.close(fig)
    return name


def plot_norms(plt, arms, report_dir, prefix):
    """||h_k|| vs step, one panel per arm, log y."""
    names = list(arms)
    ncol = min(5, len(names))
    nrow = math.ceil(len(names) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(3 * ncol, 2.6 * nrow), sharex=True, sharey=True,
                             squeeze=False)
    for ax, name in zip(axes.flat, names):
        for r in arms[name]:
            rows = r['rows']
            n_exits = len(rows[0]['norm']) if rows else 0
            for k in range(n_exits):
                ax.plot([x['iter'] for x in rows], [x['norm'][k] for x in rows],
                        color=plt.cm.viridis(k / max(1, n_exits - 1)), lw=1.2,
                        label=f'k={k + 1}' if r is arms[name][0] else None)
        ax.set_yscale('log')
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3, which='both')
    for ax in axes.flat[len(names):]:
        ax.axis('off')
    axes.flat[0].legend(fontsize=7, title='loop', title_fontsize=7)
    fig.supxlabel('training step')
    fig.supylabel('||h_k|| (mean per-token L2, val)')
    fig.tight_layout()
    return save(fig, plt, report_dir, f'{prefix}_norms.png')


def plot_pareto(plt, arms, report_dir, prefix):
    """PPL vs average loops: the adaptive-exit curve (margin policy) and the fixed exits."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ymax, ymin = [], []
    for i, name in enumerate(arms):
        d = depths(arms[name])
        if not d:
            continue
        x = d[0]
        R, color = x['n_loop'], plt.cm.tab10(i % 10)
        fixed_ppl = floats(x['fixed']['ppl'][:R])  # null (an overflowing PPL) -> nan, not drawn
        ax.plot(range(1, R + 1), fixed_ppl, 'o', color=color, ms=4)
        curve = x['adaptive'].get('margin')
        if curve:
            order = np.argsort(curve['avg_loops'])
            ax.plot(floats(curve['avg_loops'])[order], floats(curve['ppl'])[order], '-', color=color, lw=1.2,
                    label=name)
        ymax.append(fixed_ppl[-1])
        ymin.append(np.concatenate([fixed_ppl, floats(curve['ppl'] if curve else [])]))
    ax.set_yscale('log')
    lo, hi = np.concatenate(ymin or [[]]), np.array(ymax)
    if np.isfinite(lo).any() and np.isfinite(hi).any():
        ax.set_ylim(0.9 * np.nanmin(lo), 3 * np.nanmax(hi))
    ax.set_xlabel('average loops per sequence')
    ax.set_ylabel('val PPL')
    ax.set_title('adaptive exit (margin, lines) and fixed exits (dots): lower-left is better', fontsize=9)
    ax.grid(alpha=0.3, which='both')
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return save(fig, plt, report_dir, f'{prefix}_pareto.png')


def plot_exit_ce(plt, arms, report_dir, prefix):
    """Val CE at every exit eval_depth measured (1..4R by default), a dashed line after exit R."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    R = None
    for i, name in enumerate(arms):
        d = depths(arms[name])
        if not d:
            continue
        R = d[0]['n_loop']
        ce = floats(mean_vec([x['fixed']['ce'] for x in d]))
        ax.plot(range(1, len(ce) + 1), ce, 'o-', ms=3, lw=1.2, color=plt.cm.tab10(i % 10), label=name)
    if R:
        ax.axvline(R + 0.5, color='k', ls='--', lw=0.8)
        ax.text(R + 0.6, ax.get_ylim()[1], 'more loops than trained', va='top', fontsize=7)
    ax.set_yscale('log')
    ax.set_xlabel('exit k')
    ax.set_ylabel('val CE (nats)')
    ax.grid(alpha=0.3, which='both')
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return save(fig, plt, report_dir, f'{prefix}_exit_ce.png')

# -----------------------------------------------------------------------------
# the recurrent-depth report: test-time depth, scale over training, halting by margin / KL / gate

def trained_loops(d):
    """The loops a run trained at: n_loop, or the mean n_loop + 1 of a sampled depth."""
    return d['n_loop'] + (d['model_args'].get('loop_sampling', 'fixed') != 'fixed')


def extrapolation_row(name, runs):
    d = depths(runs)
    if not d:
        return f"| {name} | n/a |" + " n/a |" * (len(TEST_LOOPS) + 1)
    ce = mean_vec([x['fixed']['ce'] for x in d])
    at = [ce[n - 1] if n <= len(ce) else None for n in TEST_LOOPS]
    best = min(range(len(ce)), key=lambda i: ce[i] if ce[i] is not None else math.inf) + 1
    sampled = d[0]['model_args'].get('loop_sampling', 'fixed') != 'fixed'
    trained = f"{trained_loops(d[0])} (mean, sampled)" if sampled else str(d[0]['n_loop'])
    return f"| {name} | {trained} | " + " | ".join(fmt(c, '.3f') for c in at) + f" | {best} |"


def halting_row(name, runs):
    cal = [x['calibrated'] for x in depths(runs)]
    cells = []
    for p in HALT_POLICIES:
        got = [c[p] for c in cal if p in c]
        cells.append(f"{fmt(mean([g['held_avg_loops'] for g in got]), '.2f')} / "
                     f"{fmt(mean([g['held_ppl_ratio'] for g in got]), '.4f')}" if got else "n/a")
    return f"| {name} | " + " | ".join(cells) + " |"


# -----------------------------------------------------------------------------
# matched inference depth (paper 1's abstract): the best val PPL an arm reaches within a loop budget

MATCHED_BUDGETS = (1, 1.5, 2, 2.5, 3, 4)  # average loops per sequence
BASELINE_ARM = 'loop_rmsnorm'             # the scale-invariant readout the fixes are compared with
POLICY_NAMES = dict(maxprob='max-prob', kl='KL')  # the exit scores' names in the matched-depth captions


def ppl_within(d, budget):
    """The lowest val PPL among an eval_depth run's operating points with at most `budget` average loops:
    the fixed exits 1..R and every adaptive-exit threshold of every score (thresholds over all windows)."""
    R = d['n_loop']
    pts = list(zip(range(1, R + 1), d['fixed']['ppl'][:R]))
    for curve in d['adaptive'].values():
        pts += list(zip(curve['avg_loops'], curve['ppl']))
    ok = [ppl for loops, ppl in pts if ppl is not None and loops <= budget + 1e-9]
    return min(ok) if ok else None


def by_seed(runs):
    return {r['seed']: r['depth'] for r in runs if r['depth']}


def matched_verdict(deltas):
    """Paper 1's claim for one arm, a lower PPL than the baseline at every budget: the rule of
    lab/verdict.py at each budget on the seed-paired differences (lower claimed: sign -1), and the arm
    holds the claim as well as its weakest budget. deltas: per budget, the per-seed PPL differences."""
    cells = [(b, verdict(*mean_ci(dd), sign=-1, n=len(dd))) for b, dd in zip(MATCHED_BUDGETS, deltas) if dd]
    if not cells:
        return 'not tested'
    word = weakest([w for _, (w, _) in cells])
    b, (_, why) = next(c for c in cells if c[1][0] == word)
    return f"{word} (weakest at ≤ {b:g} loops: {why})"


def delta_cell(dd):
    """A budget's paired PPL difference: the mean and its 95 % CI over seeds (lab/verdict.py's mean_ci)."""
    m, lo, hi = mean_ci(dd)
    return fmt(m, '+.3f') + (f" [{lo:+.3f}, {hi:+.3f}]" if lo is not None else "")


def verdict_block(verdicts):
    """A report's "### Verdicts": one line per claim, `- KEY: VERDICT (N seeds); how`, which
    tests/test_claims.py binds every verdict of the README and docs to (KEY occurs in the doc's sentence)."""
    return ["### Verdicts", ""] + [f"- {key}: {verdict} ({n} seed{'s' if n != 1 else ''}); {how}"
                                   for key, verdict, n, how in verdicts] + [""]


def matched_claim(arm_verdicts):
    # paper 1's claim holds as well as its weakest scale-controlled arm: every arm must reach a lower PPL
    words = [v.split(' (')[0] for v in arm_verdicts]
    return 'not tested' if 'not tested' in words else weakest(words)


def matched_tables(arms, key='scale-controlled variants', missing=None):
    # missing: {arm: seeds} of the arms left out, not evaluated on two seeds yet. Any of them could
    # still be the weakest arm, so the claim stays not tested; the arms shown keep their own verdicts.
    cols = ' | '.join(f'≤ {b:g}' for b in MATCHED_BUDGETS)
    # the exit policies ppl_within counts: every one eval_depth scored, named from the runs themselves
    scores = dict.fromkeys(p for runs in arms.values() for d in depths(runs) for p in d['adaptive'])
    lines = ["### Matched inference depth: the lowest val PPL within a budget of average loops", "",
             "Operating points: the fixed exits and every adaptive-exit threshold ("
             + ', '.join(POLICY_NAMES.get(p, p) for p in scores) + "; thresholds at score quantiles over "
             "all validation windows, so not calibrated). Mean over seeds (each seed in brackets).", "",
             f"| arm | seeds | {cols} |", "|---|---|" + "---|" * len(MATCHED_BUDGETS)]
    for name, runs in arms.items():
        ds = by_seed(runs)
        cells = []
        for b in MATCHED_BUDGETS:
            vals = [ppl_within(d, b) for d in ds.values()]
            cells.append(f"{fmt(mean(vals), '.3f')} ({' / '.join(fmt(v, '.3f') for v in vals)})")
        lines.append(f"| {name} | {len(ds)} | " + ' | '.join(cells) + " |")
    base = by_seed(arms.get(BASELINE_ARM, []))
    lines += ["", f"PPL minus {BASELINE_ARM}'s at the same budget, paired by seed: mean "
              "[95 % CI over seeds], and the verdict on paper 1's claim (scale-controlled variants reach a "
              "lower PPL at matched depth) by the rule of lab/verdict.py, at the arm's weakest budget:", "",
              f"| arm | {cols} | verdict |", "|---|" + "---|" * (len(MATCHED_BUDGETS) + 1)]
    verdicts = []
    for name, runs in arms.items():
        if name == BASELINE_ARM:
            continue
        ds, deltas, cells = by_seed(runs), [], []
        for b in MATCHED_BUDGETS:
            pairs = [(ppl_within(d, b), ppl_within(base[s], b)) for s, d in ds.items() if s in base]
            dd = [x - y for x, y in pairs if x is not None and y is not None]
            deltas.append(dd)
            cells.append(delta_cell(dd))
        verdicts.append(matched_verdict(deltas))
        lines.append(f"| {name} | " + ' | '.join(cells) + f" | {verdicts[-1]} |")
    seeds = len(by_seed(arms.get(BASELINE_ARM, [])))
    claim, how = matched_claim(verdicts), ("computed: a lower PPL at matched depth? the rule per budget on "
                                           f"the seed-paired differences against {BASELINE_ARM}; the "
                                           "weakest budget of the weakest arm")
    if missing:
        claim, seeds = 'not tested', min(missing.values())
        how = "not reached on two seeds by " + ", ".join(f"{n} ({k} of 2)" for n, k in missing.items())
    return lines + [""] + verdict_block([(key, claim, seeds, how)])


def matched_report(arms, header, report_dir, prefix):
    return header + matched_tables(arms) + blindspot_report(arms, [], report_dir, prefix)


def norms_at(at, L):
    """||h_k|| at step L (train.py's eval at that step), mean over the runs that reached it."""
    lines = [f"‖h_k‖ at step {L:,} (mean per-token L2 norm of each loop state, val, mean over seeds):", "",
             "| arm | seeds | ‖h_k‖ k = 1..R |", "|---|---|---|"]
    for name, runs in at.items():
        rows = [row_near(r['rows'], L) for r in runs if r['depth']]
        rows = [row for row in rows if row and row['iter'] == L]
        lines.append(f"| {name} | {len(rows)} | {vec(mean_vec([row['norm'] for row in rows]), '.1f')} |")
    return lines


def plot_matched_long(plt, per_length, report_dir, prefix):
    """One panel per length reached: each arm's lowest val PPL within a budget of average loops (mean
    over seeds), the curve the matched-depth verdict compares."""
    fig, axes = plt.subplots(1, len(per_length), figsize=(4 * len(per_length), 3.6), squeeze=False)
    names = list(dict.fromkeys(n for at in per_length.values() for n in at))  # one color per arm
    for ax, (L, at) in zip(axes[0], per_length.items()):
        for name, runs in at.items():
            i = names.index(name)
            ppl = [mean([ppl_within(d, b) for d in depths(runs)]) for b in MATCHED_BUDGETS]
            ax.plot(MATCHED_BUDGETS, floats(ppl), 'o-', ms=3, color=plt.cm.tab10(i % 10), label=name)
        ax.set_title(f'{L:,} steps', fontsize=9)
        ax.set_xlabel('budget: average loops per sequence')
        ax.grid(alpha=0.3, which='both')
    axes[0][0].set_ylabel('lowest val PPL within the budget')  # each panel its own scale: PPL falls
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    return save(fig, plt, report_dir, f'{prefix}_ppl.png')


def matched_long_report(arms, header, lengths, report_dir, prefix):
    """The matched-depth tables at each training length a run was evaluated at (eval_depth-<L>.json),
    for the arms a length reached on at least two seeds (the baseline and one more at least); the
    claim's verdict needs every arm there, and a length short of that is listed as not reached.
    At a constant LR the checkpoint at L steps is an L-step run's, so each length is its own experiment."""
    lines, summary_rows, reached = [], [], {}
    for L in lengths:
        at = {name: [dict(r, depth=read_json(os.path.join(r['out_dir'], f'eval_depth-{L}.json')))
                     for r in runs] for name, runs in arms.items()}
        n_seeds = {name: len(depths(runs)) for name, runs in at.items()}
        seeds = min(n_seeds.values())
        key = f'scale-controlled variants at {L:,} steps'
        lines += [f"## {L:,} steps", ""]
        # the arms on two seeds are shown as soon as the baseline and one more have them
        missing = {n: k for n, k in n_seeds.items() if k < 2}
        if BASELINE_ARM in missing or len(missing) >= len(at) - 1:
            lines += [f"Not reached: {sum(n_seeds.values())} of "
                      f"{sum(len(r) for r in at.values())} runs evaluated at this length (a verdict needs "
                      f"two seeds of every arm).", ""]
            lines += verdict_block([(key, 'not tested', seeds, "not reached on two seeds of every arm")])
            summary_rows.append(f"| {L:,} | {seeds} | not tested |")
            continue
        if missing:
            lines += [f"Reached on two seeds by {len(at) - len(missing)} of {len(at)} arms; "
                      f"{', '.join(missing)} not yet, so the claim is not tested here.", ""]
        at = {n: runs for n, runs in at.items() if n not in missing}
        tables = matched_tables(at, key=key, missing=missing)
        gain = verdict_block([depth_gain_verdict(at[BASELINE_ARM], L)])[2]  # its one "- key: ..." line
        tables.insert(len(tables) - 1, gain)
        lines += [t.replace('### Matched inference depth', f'### {L:,} steps, matched inference depth', 1)
                  for t in tables]
        lines += [t.replace('### Depth', f'### {L:,} steps, depth', 1) for t in depth_table(at)]
        lines += [""] + norms_at(at, L) + [""]
        reached[L] = at
        said = next(t for t in tables if t.startswith(f'- {key}: '))
        summary_rows.append(f"| {L:,} | {seeds} | {said.split(': ', 1)[1].split(' (')[0]} |")
    plt, plot = plt_or_none() if reached else None, []
    if plt:
        path = plot_matched_long(plt, reached, report_dir, prefix)
        plot = [f"![lowest val PPL within each budget of loops, per training length]({path})", ""]
    table = ["### The verdict per training length", "",
             "| steps | seeds (fewest of any arm) | scale-controlled variants lower at matched depth? |",
             "|---|---|---|"] + summary_rows + [""]
    return header + table + plot + lines


def depth_gain_verdict(runs, L):
    """Paper 1's "a normalised readout gains nothing from depth" (its ΔPPL exit 1 -> R is +0.01): an
    equivalence claim on the gain val CE exit 1 minus exit R, per seed, within HOLD_MARGIN nats."""
    xs = [exit_gain(d) for d in depths(runs)]
    word, why = verdict(*mean_ci(xs), margin=HOLD_MARGIN, n=len(xs))
    return (f"a normalised readout gains nothing from depth at {L:,} steps", word, len(xs),
            f"computed: {BASELINE_ARM}'s val CE at exit 1 minus at exit R, per seed; {why}")


def recurrent_report(arms, header, report_dir, prefix):
    lines = header + [
        "### Test-time depth: val CE (eval_depth, fixed depth) at loops "
        + ", ".join(map(str, TEST_LOOPS)), "",
        "| arm | trained loops | " + " | ".join(f"CE @ {n}" for n in TEST_LOOPS) + " | best loop |",
        "|---|---|" + "---|" * (len(TEST_LOOPS) + 1)] + [extrapolation_row(n, r) for n, r in arms.items()]
    lines += [""] + scale_table(arms) + ["", "### Calibrated halting (held-out half): average loops / PPL "
              "relative to fixed depth R, per exit policy", "",
              "| arm | " + " | ".join(HALT_POLICIES) + " |", "|---|" + "---|" * len(HALT_POLICIES)]
    lines += [halting_row(n, r) for n, r in arms.items()]
    plt = plt_or_none()
    plots = [] if plt is None else [plot_norms(plt, arms, report_dir, prefix),
                                    plot_exit_ce(plt, arms, report_dir, prefix)]
    lines += [""] + [f"![{p}]({p})" for p in plots]
    return lines + ([""] + verdict_block(recurrent_verdicts(arms)) if HOLDS.keys() <= arms.keys() else [])


# Huginn's claim (docs/papers.md §4): more test-time loops than trained hold the loss, an equivalence claim
# with its margin, judged per seed on CE at the deepest test depth minus CE at the trained depth; the same
# pieces on pre-norm blocks are the control the blind spot acts on
HOLDS = {'huginn': "more test-time loops hold", 'recurrent_preln': "pre-norm blocks hold too"}


def recurrent_verdicts(arms):
    out = []
    for name, key in HOLDS.items():
        d = depths(arms[name])
        xs = [x['fixed']['ce'][TEST_LOOPS[-1] - 1] - x['fixed']['ce'][trained_loops(x) - 1] for x in d]
        word, why = verdict(*mean_ci(xs), margin=HOLD_MARGIN, n=len(xs))
        out.append((key, word, len(xs), f"computed: {name}'s val CE at {TEST_LOOPS[-1]} loops minus at "
                                        f"the trained depth, per seed; {why}"))
    return out

# -----------------------------------------------------------------------------
# the "still growing" report: ||h_R|| and CE at fixed steps of a long run, both over training in one plot

def growing_row(name, run, step):
    row = row_near(run['rows'], step)
    if row is None or abs(row['iter'] - step) > 25:
        return f"| {name} | {step} | n/a | n/a | n/a |"
    return (f"| {name} | {row['iter']} | {vec(row['norm'], '.1f')} | {vec(row['val_ce'], '.3f')} | "
            f"{vec(row['train_ce'], '.3f')} |")


def growing_table(arms):
    lines = ["### ||h_k|| and CE over training (first seed of each arm; train CE on its eval batches)", "",
             "| arm | step | ‖h_k‖ k = 1..R | val CE exit 1..R | train CE exit 1..R |",
             "|---|---|---|---|---|"]
    for name, runs in arms.items():
        for run in runs[:1]:
            last = run['rows'][-1]['iter'] if run['rows'] else -1
            lines += [growing_row(name, run, s) for s in GROWING_STEPS if s <= last]
    return lines


def plot_growing(plt, arms, report_dir, prefix):
    """Top: ||h_k|| vs step (log y), one color per arm, one shade per loop. Bottom: val CE at exit R."""
    fig, (ax_n, ax_ce) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    ces = [x[f'{split}_ce'][-1] for runs in arms.values() for r in runs[:1] for x in r['rows']
           for split in ('val', 'train')]
    for i, (name, runs) in enumerate(arms.items()):
        rows = runs[0]['rows'] if runs else []
        if not rows:
            continue
        steps, R = [x['iter'] for x in rows], len(rows[0]['norm'])
        cmap = (plt.cm.Reds, plt.cm.Blues, plt.cm.Greens)[i % 3]
        for k in range(R):
            ax_n.plot(steps, [x['norm'][k] for x in rows], color=cmap(0.4 + 0.6 * k / max(1, R - 1)), lw=1.1,
                      label=f'{name}, k={k + 1}')
        ax_ce.plot(steps, [x['val_ce'][-1] for x in rows], color=cmap(0.9), lw=1.2, label=f'{name}, val')
        ax_ce.plot(steps, [x['train_ce'][-1] for x in rows], color=cmap(0.9), lw=0.8, ls=':',
                   label=f'{name}, train')
    ax_n.set_yscale('log')
    ax_n.set_ylabel('||h_k|| (mean per-token L2, val)')
    ax_n.legend(fontsize=7, ncol=2)
    ax_ce.set_ylabel('CE at exit R (nats)')
    if ces:
        ax_ce.set_ylim(min(ces) - 0.1, min(4.0, max(ces)) + 0.1)  # the first evals' CE is off the scale
    ax_ce.set_xlabel('training step')
    ax_ce.legend(fontsize=7)
    for ax in (ax_n, ax_ce):
        ax.grid(alpha=0.3, which='both')
    fig.tight_layout()
    return save(fig, plt, report_dir, f'{prefix}.png')


def growing_report(arms, header, report_dir, prefix):
    lines = header + scale_table(arms) + [""] + growing_table(arms) + [""] + depth_table(arms) + [""] \
        + radial_table(arms)
    plt = plt_or_none()
    if plt is not None:
        name = plot_growing(plt, arms, report_dir, prefix)
        lines += ["", f"![{name}]({name})"]
    return lines

# -----------------------------------------------------------------------------
# the DeepLoop report: escaped runs per variant x (R, lr), and the loss curves

def floor_lines(floor):
    if floor is None:
        return ["(unigram floor unknown: the dataset's meta.json was not found)", ""]
    return [f"Unigram floor (cross-entropy on val of the train unigram distribution): **{floor:.4f} nats**. "
            f"A run *escaped* if its final val loss < floor - {ESCAPE_MARGIN} = "
            f"{floor - ESCAPE_MARGIN:.4f}.", ""]


def final_loss(run):
    return run['rows'][-1]['val_loss'] if run['rows'] and run['status'].get('train') == 'done' else None


def escaped(run, floor):
    v = final_loss(run)
    return v is not None and floor is not None and math.isfinite(v) and v < floor - ESCAPE_MARGIN


def runs_of(runs, **tags):
    # the runs of one cell of a report: those whose arm carries every given tag, e.g. variant=v, R=4
    return [r for r in runs if all(r['arm']['tags'].get(k) == v for k, v in tags.items())]


def loss_cell(rs, floor):
    if not rs:
        return ''
    vals = ' / '.join('failed' if r['status'].get('train') == 'failed' else fmt(final_loss(r), '.3f')
                      for r in rs)
    return f"{vals} ({sum(escaped(r, floor) for r in rs)}/{len(rs)})"


def loss_table(runs, variants, Rs, lrs, floor):
    lines = ["Final val loss (exit R) per seed, and escaped runs / seeds:", "",
             "| variant | " + " | ".join(f"R={R}, lr={lr:g}" for lr in lrs for R in Rs) + " |",
             "|---|" + "---|" * (len(Rs) * len(lrs))]
    for v in variants:
        cells = [loss_cell(runs_of(runs, variant=v, R=R, lr=lr), floor) for lr in lrs for R in Rs]
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    return lines + [""]


def plot_losses(plt, runs, variants, Rs, lrs, floor, report_dir, prefix):
    """Val loss vs step, one panel per (lr, R), one color per variant, the unigram floor dotted."""
    fig, axes = plt.subplots(len(lrs), len(Rs), figsize=(3.4 * len(Rs), 2.8 * len(lrs)), sharex=True,
                             sharey=True, squeeze=False)
    for i, lr in enumerate(lrs):
        for j, R in enumerate(Rs):
            ax = axes[i][j]
            for c, v in enumerate(variants):
                for s, r in enumerate(runs_of(runs, variant=v, R=R, lr=lr)):
                    if r['rows']:
                        ax.plot([x['iter'] for x in r['rows']], [x['val_loss'] for x in r['rows']],
                                color=plt.cm.tab10(c), lw=1.1, ls='-' if s == 0 else '--',
                                label=v if s == 0 else None)
            if floor is not None:
                ax.axhline(floor, color='k', lw=0.8, ls=':')
            ax.set_title(f'R={R}, lr={lr:g}', fontsize=9)
            ax.grid(alpha=0.3)
    top = max([r['rows'][0]['val_loss'] for r in runs if r['rows']] + [floor or 0])
    axes[0][0].set_ylim(max(0.0, min([x['val_loss'] for r in runs for x in r['rows']] + [top]) - 0.1),
                        min(top, (floor or top) + 1.5) + 0.1)
    from matplotlib.lines import Line2D
    axes[0][-1].legend([Line2D([], [], color=plt.cm.tab10(c)) for c in range(len(variants))], variants,
                       fontsize=7)
    fig.supxlabel('training step (dotted: unigram floor; dashed: later seeds)')
    fig.supylabel('val loss (exit R)')
    fig.tight_layout()
    return save(fig, plt, report_dir, f'{prefix}_loss.png')


def std(xs):
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else None


def versus_baseline(runs, variants, Rs, lrs):
    """Each variant's mean final loss and its difference from the first variant (the baseline) at the same
    R and LR, paired by seed: the paper's claim is "neutral at R = 1, better once blocks are revisited"."""
    base = variants[0]
    lines = [f"Mean ± sd over seeds, and the difference from {base} paired by seed (seeds where the variant "
             "is lower):", "",
             "| variant | " + " | ".join(f"R={R}, lr={lr:g}" for lr in lrs for R in Rs) + " |",
             "|---|" + "---|" * (len(Rs) * len(lrs))]
    for v in variants:
        cells = []
        for lr in lrs:
            for R in Rs:
                own = {r['seed']: final_loss(r) for r in runs_of(runs, variant=v, R=R, lr=lr)}
                ref = {r['seed']: final_loss(r) for r in runs_of(runs, variant=base, R=R, lr=lr)}
                cell = f"{fmt(mean(list(own.values())), '.3f')} ± {fmt(std(list(own.values())), '.3f')}"
                if v != base:
                    dd = [own[s] - ref[s] for s in own if s in ref and None not in (own[s], ref[s])]
                    cell += f", {fmt(mean(dd), '+.3f')} ({sum(x < 0 for x in dd)}/{len(dd)})"
                cells.append(cell)
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    return lines + [""]


def outcome(run):
    """A run's final val loss for the best-LR search: None while it has not finished, inf if it failed or
    ended non-finite (an LR at which a seed diverges is never a block's best)."""
    if run['status'].get('train') == 'failed':
        return math.inf
    v = final_loss(run)
    return None if v is None else v if math.isfinite(v) else math.inf


def best_cell(runs, v, R, lrs):
    """Variant v at R at its own best LR: the LR of its grid (the LRs of lrs it was run at) with the lowest
    mean final loss over seeds. edge: that LR is the grid's lowest or highest, so the optimum may lie outside
    it; left: runs of the cell's grid not finished yet, so the best LR may still move."""
    grid = [lr for lr in lrs if runs_of(runs, variant=v, R=R, lr=lr)]
    got = {lr: {r['seed']: outcome(r) for r in runs_of(runs, variant=v, R=R, lr=lr)} for lr in grid}
    left = sum(x is None for seeds in got.values() for x in seeds.values())
    means = {lr: mean([x for x in seeds.values() if x is not None]) for lr, seeds in got.items()}
    means = {lr: m for lr, m in means.items() if m is not None}
    cell = dict(variant=v, R=R, grid=grid, left=left, total=sum(len(s) for s in got.values()), lr=None,
                mean=None, sd=None, losses={}, edge=False)
    if means:
        lr = min(means, key=means.get)
        losses = {s: x for s, x in got[lr].items() if x is not None}
        cell.update(lr=lr, mean=means[lr], sd=std(list(losses.values())), losses=losses,
                    edge=lr in (grid[0], grid[-1]))
    return cell


def at_best_lr(runs, variants, Rs, lrs):
    """Each variant at its own best LR per R (the lowest mean final loss over seeds), and its difference from
    the baseline at the baseline's best LR: the comparison that does not favour either block's LR."""
    lines = [f"Each variant at its best LR (mean over seeds), and minus {variants[0]} at its best LR; "
             "*edge*: the best LR is the lowest or highest tried, so the optimum may lie outside the grid "
             "and no verdict rests on that cell; *partial*: runs of the cell still to finish:", "",
             "| variant | " + " | ".join(f"R={R}" for R in Rs) + " |", "|---|" + "---|" * len(Rs)]
    for v in variants:
        cells = []
        for R in Rs:
            c, c0 = best_cell(runs, v, R, lrs), best_cell(runs, variants[0], R, lrs)
            if c['lr'] is None:
                cells.append('n/a')
                continue
            diff = '' if v == variants[0] or c0['lr'] is None else f", {fmt(c['mean'] - c0['mean'], '+.3f')}"
            at = f"lr {c['lr']:g}" + (", *edge*" if c['edge'] else "") + (", *partial*" if c['left'] else "")
            cells.append(f"{fmt(c['mean'], '.3f')} ({at}){diff}")
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    return lines + [""]


def trainable_cell(runs, v, R, lrs, floor):
    """Variant v at R, read free of where its LR grid's best lies: the highest LR of its grid at which every
    seed left the floor (lr None: at none), whether that is the grid's top (the limit may lie above it), each
    LR above it with its stuck and finished runs, the lower LRs where a seed stayed on the floor, and the
    runs still to finish (a stuck run: stuck(); an unfinished one counts as neither)."""
    grid = [lr for lr in lrs if runs_of(runs, variant=v, R=R, lr=lr)]
    at = {lr: runs_of(runs, variant=v, R=R, lr=lr) for lr in grid}
    ok = [lr for lr in grid if all(escaped(r, floor) for r in at[lr])]
    lr = max(ok) if ok else None
    done = lambda x: [r for r in at[x] if outcome(r) is not None]
    return dict(variant=v, R=R, grid=grid, lr=lr, top=lr is not None and lr == grid[-1],
                above=[(x, sum(stuck(r, floor) for r in at[x]), len(done(x)))
                       for x in grid if lr is None or x > lr],
                stuck_below=[x for x in grid
                             if lr is not None and x < lr and any(stuck(r, floor) for r in at[x])],
                left=sum(outcome(r) is None for x in grid for r in at[x]))


def trainable_text(c):
    if not c['grid']:
        return 'n/a'
    if c['lr'] is None:
        text = 'none'
    elif c['top']:
        text = f"{c['lr']:g}, *top*"
    else:
        text = f"{c['lr']:g}; stuck " + ', '.join(f"{k}/{n} at {x:g}" for x, k, n in c['above'])
    if c['stuck_below']:
        text += f"; a seed stuck below it too, at {' / '.join(f'{x:g}' for x in c['stuck_below'])}"
    return text + (", *partial*" if c['left'] else "")


def trainable_table(runs, variants, Rs, lrs, floor):
    """Per variant and R, the highest LR at which every seed trains: trainability read free of the LR grid's
    best cell, which a seed stuck at a higher LR moves down."""
    if floor is None:
        return []
    lines = ["Trainability free of the best LR: per variant and R, the highest LR of its grid at which every "
             f"seed left the floor (final val loss < {floor - ESCAPE_MARGIN:.4f}), then at each LR above it "
             "the seeds stuck on the floor / the seeds finished (stuck 1/3 at 0.001: one seed of three at lr "
             "1e-3); *top*: every seed trains at the grid's highest LR, so the limit lies at or above it; "
             "*partial*: runs of the cell still to finish:", "",
             "| variant | " + " | ".join(f"R={R}" for R in Rs) + " |", "|---|" + "---|" * len(Rs)]
    for v in variants:
        lines.append(f"| {v} | " + " | ".join(trainable_text(trainable_cell(runs, v, R, lrs, floor))
                                             for R in Rs) + " |")
    return lines + [""]

# -----------------------------------------------------------------------------
# the DeepLoop verdicts (docs/papers.md §2), computed from each (variant, R) cell at its own best LR

DEEPLOOP_BASE, DEEPLOOP = 'preln', 'sandwich_p0.5'   # lab/ablate.py's DEEPLOOP_VARIANTS
SMALLER_P = ('sandwich_p0', 'sandwich_p0.25')          # the exponents below DeepLoop's 1/2
NEUTRAL, REVISITED, REASON, TRAINABILITY = (
    "DeepLoop is neutral at R = 1", "better once blocks are revisited",
    "p = 1/2 as the reason, at each block's best LR", "p = 1/2 as trainability (smaller p stop training)")
PAPER_SIZE = dict(n_embd=768, max_iters=100_000)    # docs/papers.md §2: GPT-2 small, 100K steps
NEUTRAL_MARGIN = 0.02  # nats: 'neutral at R = 1' is |DeepLoop - pre-norm| within this, ~ a run's eval noise


def paired(a, b):
    """Per seed, cell a's final loss minus cell b's, each at its own best LR (the seeds both finished)."""
    return [a['losses'][s] - b['losses'][s] for s in sorted(a['losses']) if s in b['losses']]


def no_verdict(cells):
    """Why no verdict may rest on these cells (None if one may): a cell with runs still to finish, else a
    best LR at the grid's edge (the optimum may lie outside the grid), naming every such cell."""
    def name(c):
        return f"{c['variant']}, R = {c['R']}"
    if not cells:
        return "no cell of the sweep holds the claim's R"
    empty = [name(c) for c in cells if not c['grid']]
    if empty:
        return f"no runs of cell {', '.join(empty)}"
    left = [f"{name(c)} ({c['left']} of {c['total']} runs)" for c in cells if c['left']]
    if left:
        return f"runs still to finish in cell {', '.join(left)}"
    edge = [f"{name(c)} (lr {c['lr']:g} of {' / '.join(f'{lr:g}' for lr in c['grid'])})"
            for c in cells if c['edge']]
    return f"best LR at the grid's edge in cell {', '.join(edge)}" if edge else None


def neutral_verdict(d):
    # docs/papers.md §2: neutral at R = 1 (the paper's gaps are 0.0004 and 0.0011 nats): an equivalence
    # claim, so the paired CI over seeds must lie within the margin (lab/verdict.py)
    return verdict(*mean_ci(d), margin=NEUTRAL_MARGIN, n=len(d))


def lower_verdict(d):
    # d: a cell's per-seed differences (negative: DeepLoop lower); lower is claimed, no size
    return verdict(*mean_ci(d), sign=-1, n=len(d))


def stuck(run, floor):
    """A finished run that did not leave the unigram floor (a failed run included)."""
    return outcome(run) is not None and not escaped(run, floor)


def trainability_verdict(counts, totals):
    # docs/papers.md §2: p = 1/4 (DeepNorm) too weak once blocks are revisited, p = 1/2 trains. counts and
    # totals: {variant: stuck runs, runs} at its grid's interior LRs. Each smaller p's share stuck minus
    # p = 1/2's, claimed > 0, with a CI over the runs (each run its own init and data order); the claim
    # holds as well as its weakest p: ([(variant, word, why)], word)
    each = [(v, *verdict(*shares_ci(counts[v], totals[v], counts[DEEPLOOP], totals[DEEPLOOP]),
                         n=totals[v] + totals[DEEPLOOP], unit='runs')) for v in SMALLER_P]
    return each, weakest([w for _, w, _ in each])


def diffs(d):
    return f"{' / '.join(fmt(x, '+.3f') for x in d)} (mean {fmt(mean(d), '+.3f')}, sd {fmt(std(d), '.3f')})"


def deeploop_verdicts(runs, Rs, lrs, floor):
    """([(key, verdict or None, seeds, how, cells)], {(variant, R): best_cell}): the four DeepLoop claims of
    docs/papers.md §2 and the cells they rest on; verdict None (no verdict) when one of those cells has runs
    to finish or its best LR at its grid's edge."""
    cell = {(v, R): best_cell(runs, v, R, lrs) for v in (DEEPLOOP_BASE, DEEPLOOP) + SMALLER_P for R in Rs}
    later = [R for R in Rs if R > 1]
    out = []

    def claim(key, cells, rule, how):
        why = no_verdict(cells)
        if why:
            out.append((key, None, None, why, cells))
        else:
            word, n, text = rule()
            out.append((key, word, n, f"{text}; {how}", cells))

    def neutral():
        d = paired(cell[DEEPLOOP, 1], cell[DEEPLOOP_BASE, 1])
        word, why = neutral_verdict(d)
        return word, len(d), f"{DEEPLOOP} minus {DEEPLOOP_BASE} at R = 1: {diffs(d)}; {why}"
    claim(NEUTRAL, [cell[DEEPLOOP_BASE, 1], cell[DEEPLOOP, 1]] if 1 in Rs else [], neutral,
          f"an equivalence claim, margin ±{NEUTRAL_MARGIN:g} nats (about one run's eval noise)")

    for R in later:  # one claim per R: a solid R does not carry a weak one
        def revisited(R=R):
            d = paired(cell[DEEPLOOP, R], cell[DEEPLOOP_BASE, R])
            word, why = lower_verdict(d)
            return word, len(d), f"{DEEPLOOP} minus {DEEPLOOP_BASE}: {diffs(d)}; {why}"
        claim(f"{REVISITED} at R = {R}", [cell[v, R] for v in (DEEPLOOP_BASE, DEEPLOOP)], revisited,
              "claimed < 0, a CI over the seeds")

    def reason():
        pairs = [(v, R, paired(cell[DEEPLOOP, R], cell[v, R])) for v in SMALLER_P for R in later]
        words = [(v, R, d, *lower_verdict(d)) for v, R, d in pairs]
        text = '; '.join(f"minus {v} at R = {R}: {diffs(d)}, {w}: {why}" for v, R, d, w, why in words)
        return weakest([w for *_, w, _ in words]), min(len(d) for _, _, d in pairs), f"{DEEPLOOP} {text}"
    claim(REASON, [cell[v, R] for R in later for v in SMALLER_P + (DEEPLOOP,)], reason,
          "p = 1/2 claimed lower than every smaller p at every R > 1: the weakest of those verdicts")

    sandwich = [(v, R, lr) for v in SMALLER_P + (DEEPLOOP,) for R in Rs
                for lr in lrs if runs_of(runs, variant=v, R=R, lr=lr)]
    left = sum(outcome(r) is None for v, R, lr in sandwich for r in runs_of(runs, variant=v, R=R, lr=lr))
    narrow = [v for v in SMALLER_P + (DEEPLOOP,) if len({lr for u, _, lr in sandwich if u == v}) < 3]
    if floor is None or left or narrow:
        why = ("the unigram floor is unknown" if floor is None else f"{left} runs still to finish" if left
               else f"fewer than three LRs, so no interior LR, for {', '.join(narrow)}")
        out.append((TRAINABILITY, None, None, why, []))
    else:
        interior, totals, every, where = {}, {}, {}, {}
        for v in SMALLER_P + (DEEPLOOP,):
            grid = sorted({lr for u, _, lr in sandwich if u == v})
            rs = runs_of(runs, variant=v)
            every[v] = f"{sum(stuck(r, floor) for r in rs)}/{len(rs)}"
            inner = [r for r in rs if r['arm']['tags']['lr'] not in (grid[0], grid[-1])]
            interior[v], totals[v] = sum(stuck(r, floor) for r in inner), len(inner)
            at = ', '.join(f"R = {r['arm']['tags']['R']} lr {r['arm']['tags']['lr']:g} seed {r['seed']}"
                           for r in rs if stuck(r, floor))
            where[v] = (f"{every[v]} over the grid{f' ({at})' if at else ''}, {interior[v]}/{len(inner)} "
                        "at lr " + ' / '.join(f'{lr:g}' for lr in grid[1:-1]))
        seeds = len({r['seed'] for r in runs_of(runs, variant=DEEPLOOP)})
        highest = '; '.join(f"{v} " + ' / '.join(fmt(trainable_cell(runs, v, R, lrs, floor)['lr'], 'g')
                                                 for R in Rs) for v in every)
        how = ("runs stuck on the floor (final val loss ≥ " f"{floor - ESCAPE_MARGIN:.4f}, or failed): "
               + '; '.join(f"{v} {where[v]}" for v in every)
               + "; counted at each grid's interior LRs (at its edges an LR may be too small to leave the "
               "floor in time or too large to train, whatever p). Each smaller p's share stuck there minus "
               "p = 1/2's, claimed > 0, the weakest of: ")
        each, word = trainability_verdict(interior, totals)
        how += '; '.join(f"{v} {w}: {why}" for v, w, why in each)
        how += ". Free of the grid, the highest LR at which every seed trains, R = " \
            + f"{' / '.join(map(str, Rs))}: "
        out.append((TRAINABILITY, word, seeds, how + highest, []))
    cfgs = [r['cfg'] for r in runs if r.get('cfg')]
    if cfgs and any(cfgs[0].get(k, 0) < n for k, n in PAPER_SIZE.items()):
        out.append(("the paper's sizes", 'not tested', len({r['seed'] for r in runs}),
                    f"d {cfgs[0].get('n_embd')} and {cfgs[0].get('max_iters')} steps here, against GPT-2 "
                    "small and medium at 100K steps", []))
    return out, cell


def verdict_cells_table(verdicts, cell):
    """Every (variant, R) cell at its best LR, and the verdicts that rest on it."""
    uses = {}
    for key, _, _, _, cells in verdicts:
        for c in cells:
            uses.setdefault((c['variant'], c['R']), []).append(key)
    lines = ["The cells the verdicts rest on: each variant at its own best LR (lowest mean final loss over "
             "seeds; a failed run counts as infinite), with the mean and sd over seeds at that LR; *edge*: "
             "the best LR is its grid's lowest or highest, so no verdict rests on the cell:", "",
             "| variant | R | best LR | LR grid | mean | sd | seeds | edge | runs to finish | verdicts |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (v, R), c in cell.items():
        if not c['grid']:
            continue
        edge = 'n/a' if c['lr'] is None else '*edge*' if c['edge'] else 'no'
        lines.append(f"| {v} | {R} | {fmt(c['lr'], 'g')} | {' / '.join(f'{lr:g}' for lr in c['grid'])} | "
                     f"{fmt(c['mean'], '.3f')} | {fmt(c['sd'], '.3f')} | {len(c['losses'])} | {edge} | "
                     f"{c['left']} of {c['total']} | {'; '.join(uses.get((v, R), [])) or '-'} |")
    return lines + [""]


def deeploop_verdict_block(verdicts):
    """verdict_block's lines, and `- KEY: no verdict; WHY` where a verdict is not issued (tests/test_claims.py
    binds no doc verdict to such a line)."""
    lines = ["### Verdicts", ""]
    for key, word, n, how, _ in verdicts:
        lines += verdict_block([(key, word, n, how)])[2:3] if word else [f"- {key}: no verdict; {how}"]
    return lines + [""]


def deeploop_report(arms, header, report_dir, prefix, floor):
    runs = [r for rs in arms.values() for r in rs]
    variants = list(dict.fromkeys(r['arm']['tags']['variant'] for r in runs))
    Rs = sorted({r['arm']['tags']['R'] for r in runs})
    lrs = sorted({r['arm']['tags']['lr'] for r in runs})
    lines = (header + floor_lines(floor) + loss_table(runs, variants, Rs, lrs, floor)
             + versus_baseline(runs, variants, Rs, lrs) + at_best_lr(runs, variants, Rs, lrs)
             + trainable_table(runs, variants, Rs, lrs, floor))
    plt = plt_or_none()
    if plt is not None:
        name = plot_losses(plt, runs, variants, Rs, lrs, floor, report_dir, prefix)
        lines += [f"![{name}]({name})", ""]
    verdicts, cell = deeploop_verdicts(runs, Rs, lrs, floor)
    return lines + verdict_cells_table(verdicts, cell) + deeploop_verdict_block(verdicts)

# -----------------------------------------------------------------------------
# the kappa_R report: visit alignment vs R at a few points in training, and its exponent gamma

def kappa_series(run):
    """[(iter, kappa_R)] of a run's metrics rows that hold a kappa (train.py's log_kappa)."""
    return [(x['iter'], x['kappa']) for x in run['rows'] if x.get('kappa') is not None]


def kappa_at(runs, it):
    """kappa_R at the eval nearest step `it`, mean over the runs (seeds) that logged one."""
    series = [kappa_series(r) for r in runs]
    return mean([min(s, key=lambda p: abs(p[0] - it))[1] for s in series if s])


def kappa_late(runs):
    """kappa_R averaged over the evals of the second half of training (less noisy than one eval's batch),
    mean over the runs (seeds)."""
    series = [kappa_series(r) for r in runs]
    return mean([mean([k for it, k in s if it >= s[-1][0] / 2]) for s in series if s])


def fit_gamma(Rs, kappas, min_R=2):
    """gamma of kappa_R ~ c R^gamma: the least-squares slope of log kappa_R on log R over R >= min_R
    (docs/papers.md §2). None with fewer than two usable points (missing or kappa <= 0)."""
    pts = [(math.log(R), math.log(k)) for R, k in zip(Rs, kappas) if R >= min_R and k is not None and k > 0]
    if len(pts) < 2:
        return None
    x, y = np.array(pts).T
    return float(np.polyfit(x, y, 1)[0])


def kappa_steps(runs, n=4):
    """n training points: step 0, the last eval, and evenly spaced evals in between."""
    last = max((r['rows'][-1]['iter'] for r in runs if r['rows']), default=0)
    return sorted({round(last * i / (n - 1)) for i in range(n)})


def kappa_table(runs, variants, Rs, steps):
    by = {(v, R): runs_of(runs, variant=v, R=R) for v in variants for R in Rs}
    lines = ["kappa_R (mean over the shared matrices, one fixed training batch; R when the visits' gradients "
             "align, 1 when orthogonal), and gamma of kappa_R ~ c R^gamma fitted on log-log by least squares "
             "over R >= 2 (kappa_1 = 1 by definition) and over all R:", "",
             "| variant | step | " + " | ".join(f"κ R={R}" for R in Rs) + " | γ (R ≥ 2) | γ (all R) |",
             "|---|---|" + "---|" * (len(Rs) + 2)]
    for v in variants:
        for it in steps:
            ks = [kappa_at(by[v, R], it) for R in Rs]
            lines.append(f"| {v} | {it} | " + " | ".join(fmt(k, '.3f') for k in ks)
                         + f" | {fmt(fit_gamma(Rs, ks), '+.3f')} | {fmt(fit_gamma(Rs, ks, 1), '+.3f')} |")
        ks = [kappa_late(by[v, R]) for R in Rs]
        lines.append(f"| {v} | mean, 2nd half | " + " | ".join(fmt(k, '.3f') for k in ks)
                     + f" | {fmt(fit_gamma(Rs, ks), '+.3f')} | {fmt(fit_gamma(Rs, ks, 1), '+.3f')} |")
    return lines + [""]


def final_loss_table(runs, variants, Rs, floor):
    lines = ["Final val loss (exit R) per seed, and escaped runs / seeds (unigram floor rule):", "",
             "| variant | " + " | ".join(f"R={R}" for R in Rs) + " |", "|---|" + "---|" * len(Rs)]
    for v in variants:
        cells = [loss_cell(runs_of(runs, variant=v, R=R), floor) for R in Rs]
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    return lines + [""]


def plot_kappa(plt, runs, variants, Rs, report_dir, prefix):
    """kappa_R vs step, one panel per variant, one line per R (dashed: further seeds)."""
    fig, axes = plt.subplots(1, len(variants), figsize=(3.4 * len(variants), 3.2), sharey=True, squeeze=False)
    for ax, v in zip(axes[0], variants):
        for c, R in enumerate(Rs):
            for s, r in enumerate(runs_of(runs, variant=v, R=R)):
                pts = kappa_series(r)
                if pts:
                    ax.plot(*zip(*pts), color=plt.cm.viridis(c / max(1, len(Rs) - 1)), lw=1.2,
                            ls='-' if s == 0 else '--', label=f'R={R}' if s == 0 else None)
        ax.set_yscale('log', base=2)
        ax.set_title(v, fontsize=9)
        ax.grid(alpha=0.3, which='both')
    axes[0][0].legend(fontsize=7)
    fig.supxlabel('training step')
    fig.supylabel('κ_R (log2)')
    fig.suptitle('κ_R = ‖Σ_r G_r‖² / Σ_r ‖G_r‖²: 1 when the R visits are orthogonal, R when aligned',
                 fontsize=9)
    fig.tight_layout()
    return save(fig, plt, report_dir, f'{prefix}_over_training.png')


def plot_gamma(plt, runs, variants, Rs, report_dir, prefix):
    """gamma (fit over R >= 2) at every eval step, one line per variant; 0 and 1 dotted."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for c, v in enumerate(variants):
        vruns = runs_of(runs, variant=v)
        steps = sorted({it for r in vruns for it, _ in kappa_series(r)})
        gammas = [fit_gamma(Rs, [kappa_at(runs_of(vruns, R=R), it) for R in Rs])
                  for it in steps]
        ax.plot(steps, [np.nan if g is None else g for g in gammas], 'o-', ms=2.5, lw=1.2,
                color=plt.cm.tab10(c), label=v)
    for y in (0, 1):
        ax.axhline(y, color='k', lw=0.8, ls=':')
    ax.set_title('γ = 0: visits decorrelate (p = 1/4 suffices); γ = 1: visits align (p = 1/2)', fontsize=9)
    return finish_plot(fig, ax, plt, 'training step', 'γ of κ_R ≈ c R^γ (fit over R = 2, 4, 8)',
                       os.path.join(report_dir, f'{prefix}_gamma.png'))


def finish_plot(fig, ax, plt, xlabel, ylabel, path):
    """Axis labels, grid, legend and layout of a one-panel report plot, saved to path."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return save(fig, plt, *os.path.split(path))


def kappa_report(arms, header, report_dir, prefix, floor):
    runs = [r for rs in arms.values() for r in rs]
    variants = list(dict.fromkeys(r['arm']['tags']['variant'] for r in runs))
    Rs = sorted({r['arm']['tags']['R'] for r in runs})
    lines = (header + kappa_table(runs, variants, Rs, kappa_steps(runs)) + floor_lines(floor)
             + final_loss_table(runs, variants, Rs, floor))
    plt = plt_or_none()
    if plt is not None:
        for name in (plot_kappa(plt, runs, variants, Rs, report_dir, prefix),
                     plot_gamma(plt, runs, variants, Rs, report_dir, prefix)):
            lines.append(f"![{name}]({name})")
    return lines

# -----------------------------------------------------------------------------
# the LR-transfer report: final val loss vs LR, one curve per R, with and without loop-scaled residuals

def lr_losses(runs, eps, R, lr):
    """Final val losses of the finished seeds of one cell (nan where a run diverged)."""
    return [final_loss(r) for r in runs_of(runs, eps=eps, R=R, lr=lr) if final_loss(r) is not None]


def lr_mean(runs, eps, R, lr):
    vals = [v for v in lr_losses(runs, eps, R, lr) if math.isfinite(v)]
    return sum(vals) / len(vals) if vals else None


def best_lr(runs, eps, R, lrs):
    means = {lr: lr_mean(runs, eps, R, lr) for lr in lrs}
    means = {lr: m for lr, m in means.items() if m is not None}
    return min(means, key=means.get) if means else None


def lr_table(runs, eps, Rs, lrs):
    what = "with eps = 1/(R sqrt K) (config/loop_eps.py)" if eps else "without eps (plain pre-norm)"
    lines = [f"Final val loss (exit R), mean of seeds (each seed in brackets), {what}; best LR in bold:", "",
             "| R | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | best LR |",
             "|---|" + "---|" * (len(lrs) + 1)]
    for R in Rs:
        best, cells = best_lr(runs, eps, R, lrs), []
        for lr in lrs:
            m, seeds = lr_mean(runs, eps, R, lr), lr_losses(runs, eps, R, lr)
            cell = f"{fmt(m, '.3f')} ({' / '.join(fmt(v, '.3f') for v in seeds)})"
            cells.append(f"**{cell}**" if lr == best else cell)
        lines.append(f"| {R} | " + " | ".join(cells) + f" | {fmt(best, 'g')} |")
    return lines + [""]


def plot_lr_transfer(plt, runs, Rs, lrs, report_dir, prefix):
    """Final val loss vs LR (log x), one curve per R; left without eps, right with."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8), sharey=True)
    for ax, eps in zip(axes, (False, True)):
        for c, R in enumerate(Rs):
            ys = [lr_mean(runs, eps, R, lr) for lr in lrs]
            ax.plot(lrs, [np.nan if y is None else y for y in ys], 'o-', lw=1.2,
                    color=plt.cm.viridis(c / max(1, len(Rs) - 1)), label=f'R={R}')
        ax.set_xscale('log')
        ax.set_title('pre-norm + eps = 1/(R√K)' if eps else 'pre-norm, no eps', fontsize=9)
        ax.set_xlabel('learning rate')
        ax.grid(alpha=0.3, which='both')
    axes[0].set_ylabel('final val loss (exit R), mean of seeds')
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    return save(fig, plt, report_dir, f'{prefix}.png')


def lr_transfer_report(arms, header, report_dir, prefix):
    runs = [r for rs in arms.values() for r in rs]
    Rs = sorted({r['arm']['tags']['R'] for r in runs})
    lrs = sorted({r['arm']['tags']['lr'] for r in runs})
    lines = header + lr_table(runs, False, Rs, lrs) + lr_table(runs, True, Rs, lrs)
    plt = plt_or_none()
    if plt is not None:
        name = plot_lr_transfer(plt, runs, Rs, lrs, report_dir, prefix)
        lines.append(f"![{name}]({name})")
    return lines

# -----------------------------------------------------------------------------
# the escape report: runs that left the unigram floor per p, beside the paper's p-sweep

def escape_table(runs, ps, floor):
    lines = ["| p | escaped here | final val loss per seed | paper (GPT-2 small, R = 3, ~2,700 steps) |",
             "|---|---|---|---|"]
    for p in ps:
        rs = runs_of(runs, p=p)
        vals = ' / '.join('failed' if r['status'].get('train') == 'failed' else fmt(final_loss(r), '.3f')
                          for r in rs)
        lines.append(f"| {p:g} | {sum(escaped(r, floor) for r in rs)}/{len(rs)} | {vals} | "
                     f"{PAPER_ESCAPES.get(p, 'not run')} |")
    return lines + [""]


def plot_escape(plt, runs, ps, floor, report_dir, prefix):
    """Val loss vs step, one color per p (every seed drawn), the unigram floor dotted."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for c, p in enumerate(ps):
        for s, r in enumerate(runs_of(runs, p=p)):
            if r['rows']:
                ax.plot([x['iter'] for x in r['rows']], [x['val_loss'] for x in r['rows']], lw=1,
                        color=plt.cm.plasma(c / max(1, len(ps) - 1)), label=f'p={p:g}' if s == 0 else None)
    if floor is not None:
        ax.axhline(floor, color='k', lw=0.8, ls=':')
        ax.set_ylim(min([x['val_loss'] for r in runs for x in r['rows']] + [floor]) - 0.1, floor + 1.0)
    return finish_plot(fig, ax, plt, 'training step (dotted: unigram floor)', 'val loss (exit R)',
                       os.path.join(report_dir, f'{prefix}_loss.png'))


def escape_report(arms, header, report_dir, prefix, floor):
    runs = [r for rs in arms.values() for r in rs]
    ps = sorted({r['arm']['tags']['p'] for r in runs})
    lines = header + floor_lines(floor) + escape_table(runs, ps, floor)
    plt = plt_or_none()
    if plt is not None:
        name = plot_escape(plt, runs, ps, floor, report_dir, prefix)
        lines.append(f"![{name}]({name})")
    return lines

# -----------------------------------------------------------------------------
# writing the report

def arm_shapes(jobs):
    """'K n' when every arm has the same K, else None and a line with each arm's K x R and experts (the moe
    sweep: unique 8 x 1 beside looped 2 x 4, where one K would misstate the looped arms). A job not resolved
    (a --report_only call resolves the first) reads its arm's overrides on top of the first job's config."""
    cfg0, cfgs = jobs[0]['cfg'], {}
    for j in jobs:
        cfgs.setdefault(j['arm']['name'], j.get('cfg') or {**cfg0, **j['arm']['overrides']})
    if len({cfg['n_layer'] for cfg in cfgs.values()}) == 1:
        return f"K {cfg0['n_layer']}", None

    def shape(cfg):
        experts = f", top-{cfg['top_k']} of {cfg['n_expert']} experts" if cfg.get('n_expert') else ', dense'
        tied = ', tied routing' if cfg.get('tied_routing') else \
            ', disjoint routing' if cfg.get('disjoint_routing') else ''
        return f"{cfg['n_layer']} x {cfg['n_loop']}{experts}{tied}"
    return None, "Each arm's shape, K layers x R loops: " + '; '.join(f"{name} {shape(cfg)}"
                                                                      for name, cfg in cfgs.items()) + "."


def report_header(preset, jobs, n_arms, args, sweep):
    cfg0 = jobs[0]['cfg']
    K, shapes = arm_shapes(jobs)
    sizes = (f"{cfg0['dataset']}, d {cfg0['n_embd']}, {K or 'K per arm below'}, block {cfg0['block_size']}, "
             f"batch {cfg0['batch_size']}x{cfg0['gradient_accumulation_steps']}, {cfg0['max_iters']} steps, "
             f"{cfg0['lr_schedule']} lr, init {cfg0['init']}")
    seeds = sorted({j['seed'] for j in jobs})
    rebuilt = not sweep and ' --report_only' in args.command  # from run records with no sweep.json
    command = sweep.get('command') or (args.command if rebuilt
                                       else args.command.replace(' --report_only', ''))
    train_minutes = sum(read_status(j['out_dir']).get('train_seconds', 0) for j in jobs) / 60
    if rebuilt:  # the training calls' wall time, code and dtype are not on record: say so, not '?'
        out = getattr(args, 'out', '?')
        readme = os.path.join(out, 'README.md')
        about = f", which {readme} describes" if os.path.exists(readme) else ''
        run_lines = [f"Wall time of the sweep calls: not on record (no sweep.json under {out}: this report "
                     f"is rebuilt from the finished runs' records{about}); train time summed over runs: "
                     f"{train_minutes:.1f} min.",
                     "Code and dtype: not on record in the run folders; each run's train.log prints "
                     "its dtype."]
    else:
        run_lines = [f"Wall time of the last sweep call: {fmt(sweep.get('wall_seconds', 0) / 60, '.1f')} min "
                     f"with {sweep.get('workers', '?')} run(s) at a time, "
                     f"{sweep.get('cores_per_run', '?')} CPU core(s) each; "
                     f"train time summed over runs: {train_minutes:.1f} min.",
                     f"Code: commit {sweep.get('commit', '?')}; dtype {sweep.get('dtype', '?')}."]
    return [f"## {preset['title']}", "",
            f"`{command}`: {n_arms} arms x {len(seeds)} seed(s) ({', '.join(map(str, seeds))}); {sizes}"
            + (f"; base {' '.join(args.base)}" if args.base else '') + ".",
            *([shapes] if shapes else []), *run_lines, ""]


def summary(arms):
    """<prefix>.json: per arm and seed, the status, the last metrics row and eval_depth's main results."""
    keys = ('fixed', 'dppl_1_to_R', 'calibrated', 'clamp', 'radial_frac', 'throughput')

    def record(r):
        rec = dict(seed=r['seed'], status=r['status'], final=r['rows'][-1] if r['rows'] else None,
                   depth={k: r['depth'][k] for k in keys} if r['depth'] else None)
        if r['status'].get('lengths'):  # matched_long: eval_depth at each length the run reached
            at = {L: read_json(os.path.join(r['out_dir'], f'eval_depth-{L}.json'))
                  for L in r['status']['lengths']}
            rec['lengths'] = {L: {k: d[k] for k in keys} for L, d in at.items() if d}
        moe = read_json(os.path.join(r['out_dir'], 'moe_eval.json'))  # lab/moe.py's evaluation
        if moe:
            rec['config'] = moe.pop('config', None)  # the model's arguments: each arm's shape, on the record
            rec['moe_eval'] = moe
        return rec
    return {name: [record(r) for r in runs] for name, runs in arms.items()}


def write_report(preset_name, preset, jobs, args, sweep):
    arms = runs_by_arm(jobs)
    os.makedirs(args.report_dir, exist_ok=True)
    header = report_header(preset, jobs, len(arms), args, sweep)
    prefix = preset_name
    floor = unigram_floor(os.path.join('data', jobs[0]['cfg']['dataset'])) \
        if preset['report'] in ('deeploop', 'kappa', 'escape') else None
    if preset['report'] == 'blindspot':
        lines = blindspot_report(arms, header, args.report_dir, prefix)
    elif preset['report'] == 'matched_long':
        lines = matched_long_report(arms, header, preset['lengths'], args.report_dir, prefix)
    elif preset['report'] == 'matched':
        lines = matched_report(arms, header, args.report_dir, prefix)
    elif preset['report'] == 'recurrent':
        lines = recurrent_report(arms, header, args.report_dir, prefix)
    elif preset['report'] == 'growing':
        lines = growing_report(arms, header, args.report_dir, prefix)
    elif preset['report'] == 'kappa':
        lines = kappa_report(arms, header, args.report_dir, prefix, floor)
    elif preset['report'] == 'lr_transfer':
        lines = lr_transfer_report(arms, header, args.report_dir, prefix)
    elif preset['report'] == 'moe':
        from moe import moe_report  # lab/moe.py: the Looped-MoE sweep's evaluation and report
        lines = moe_report(arms, header, args.report_dir, prefix)
    elif preset['report'] == 'escape':
        lines = escape_report(arms, header, args.report_dir, prefix, floor)
    else:
        lines = deeploop_report(arms, header, args.report_dir, prefix, floor)
    path = os.path.join(args.report_dir, f'{prefix}.md')
    with open(path, 'w', encoding='utf-8') as fh:
        fh.write('\n'.join(lines) + '\n')
    with open(os.path.join(args.report_dir, f'{prefix}.json'), 'w', encoding='utf-8') as fh:
        json.dump(summary(arms), fh, indent=1)
    print(f"report: {path}")
    return path
