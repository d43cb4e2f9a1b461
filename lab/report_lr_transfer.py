"""
Loop-scaled residuals and LR transfer (docs/papers.md §3), the lr_transfer preset's report: final val loss
vs LR, one curve per R, with and without eps = 1/(R sqrt K).
"""
import math

import numpy as np

from reports import final_loss, fmt, plt_or_none, runs_of, save


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


def write(arms, header, report_dir, prefix):
    runs = [r for rs in arms.values() for r in rs]
    Rs = sorted({r['arm']['tags']['R'] for r in runs})
    lrs = sorted({r['arm']['tags']['lr'] for r in runs})
    lines = header + lr_table(runs, False, Rs, lrs) + lr_table(runs, True, Rs, lrs)
    plt = plt_or_none()
    if plt is not None:
        name = plot_lr_transfer(plt, runs, Rs, lrs, report_dir, prefix)
        lines.append(f"![{name}]({name})")
    return lines


if __name__ == '__main__':  # a module the lab's commands import
    print("lab/report_lr_transfer.py: a preset's report, not a command; see python lab/ablate.py --help")
