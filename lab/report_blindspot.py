"""
Paper 1, the readout blind spot (docs/papers.md §1): the report of the blindspot, init_gpt2, init_split,
init_untied and probes presets (three tables, three plots and the verdicts on paper 1's claims), and the
growing preset's ("still growing": ||h_k|| and CE at fixed steps of a long run).
"""
import math

import numpy as np

from reports import depths, floats, fmt, mean, mean_vec, plt_or_none, row_near, save, vec, verdict_block
from verdict import mean_ci, verdict, weakest

# -----------------------------------------------------------------------------
# the blind-spot report: three tables and three plots

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


def write(arms, header, report_dir, prefix):
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


# the probes preset (lab/presets.py) asks two things of single arms: when does the clamp cost little (the
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
# the "still growing" report: ||h_R|| and CE at fixed steps of a long run, both over training in one plot

GROWING_STEPS = (150, 600, 1000, 2000, 3000, 5000, 7500, 10_000)  # the growing report's table rows


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


def write_growing(arms, header, report_dir, prefix):
    lines = header + scale_table(arms) + [""] + growing_table(arms) + [""] + depth_table(arms) + [""] \
        + radial_table(arms)
    plt = plt_or_none()
    if plt is not None:
        name = plot_growing(plt, arms, report_dir, prefix)
        lines += ["", f"![{name}]({name})"]
    return lines


if __name__ == '__main__':  # a module the lab's commands import
    print("lab/report_blindspot.py: a preset's report, not a command; see python lab/ablate.py --help")
