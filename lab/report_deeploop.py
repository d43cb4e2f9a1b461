"""
Paper 2, DeepLoop (docs/papers.md §2): the deeploop preset's report (escaped runs per variant x (R, lr),
the loss curves, each cell at its own best LR, and the verdicts on the paper's four claims), and the escape
presets' (the p-sweep's runs that leave the unigram floor, beside the paper's).
"""
import math
import os

from reports import (final_loss, finish_plot, fmt, mean, plt_or_none, runs_of, save, std, sweep_floor,
                     verdict_block)
from verdict import mean_ci, shares_ci, verdict, weakest

ESCAPE_MARGIN = 0.2  # nats: a run 'escaped' the unigram floor if its final val loss < floor - this

# -----------------------------------------------------------------------------
# the DeepLoop report: escaped runs per variant x (R, lr), and the loss curves

def floor_lines(floor):
    if floor is None:
        return ["(unigram floor unknown: the dataset's meta.json was not found)", ""]
    return [f"Unigram floor (cross-entropy on val of the train unigram distribution): **{floor:.4f} nats**. "
            f"A run *escaped* if its final val loss < floor - {ESCAPE_MARGIN} = "
            f"{floor - ESCAPE_MARGIN:.4f}.", ""]


def escaped(run, floor):
    v = final_loss(run)
    return v is not None and floor is not None and math.isfinite(v) and v < floor - ESCAPE_MARGIN


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

DEEPLOOP_BASE, DEEPLOOP = 'preln', 'sandwich_p0.5'   # lab/presets.py's DEEPLOOP_VARIANTS
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
    """verdict_block's lines, and `- KEY: no verdict; WHY` where a verdict is not issued
    (tests/lab/test_claims.py binds no doc verdict to such a line)."""
    lines = ["### Verdicts", ""]
    for key, word, n, how, _ in verdicts:
        lines += verdict_block([(key, word, n, how)])[2:3] if word else [f"- {key}: no verdict; {how}"]
    return lines + [""]


def write(arms, header, report_dir, prefix):
    floor = sweep_floor(arms)
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
# the escape report: runs that left the unigram floor per p, beside the paper's p-sweep

PAPER_ESCAPES = {0.30: '0/5', 0.40: '2/5', 0.50: '3/5', 0.60: '5/5'}  # docs/papers.md §2, GPT-2 small


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


def write_escape(arms, header, report_dir, prefix):
    floor = sweep_floor(arms)
    runs = [r for rs in arms.values() for r in rs]
    ps = sorted({r['arm']['tags']['p'] for r in runs})
    lines = header + floor_lines(floor) + escape_table(runs, ps, floor)
    plt = plt_or_none()
    if plt is not None:
        name = plot_escape(plt, runs, ps, floor, report_dir, prefix)
        lines.append(f"![{name}]({name})")
    return lines


if __name__ == '__main__':  # a module the lab's commands import
    print("lab/report_deeploop.py: a preset's report, not a command; see python lab/ablate.py --help")
