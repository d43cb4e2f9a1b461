"""
Paper 2's visit alignment (docs/papers.md §2), the kappa preset's report: kappa_R vs R at a few points in
training and its exponent gamma, and the runs' final losses against the unigram floor.
"""
import math
import os

import numpy as np

from report_deeploop import floor_lines, loss_cell
from reports import finish_plot, fmt, mean, plt_or_none, runs_of, save, sweep_floor


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


def write(arms, header, report_dir, prefix):
    floor = sweep_floor(arms)
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


if __name__ == '__main__':  # a module the lab's commands import
    print("lab/report_kappa.py: a preset's report, not a command; see python lab/ablate.py --help")
