"""
Paper 1's matched inference depth (its abstract, docs/papers.md §1): the best val PPL an arm reaches within
a budget of average loops, against per-loop RMSNorm's, paired by seed. The matched preset's report (then
the blind-spot tables) and matched_long's (the same at each training length a run was evaluated at).
"""
import os

import report_blindspot
from report_blindspot import HOLD_MARGIN, depth_table, exit_gain
from reports import (depths, floats, fmt, mean, mean_vec, plt_or_none, read_json, row_near, save, vec,
                     verdict_block)
from verdict import mean_ci, verdict, weakest

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


def write(arms, header, report_dir, prefix):
    return header + matched_tables(arms) + report_blindspot.write(arms, [], report_dir, prefix)


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


def write_long(arms, header, report_dir, prefix):
    """matched_long_report at the lengths the runs were evaluated at (every job carries its preset's)."""
    return matched_long_report(arms, header, next(iter(arms.values()))[0]['lengths'], report_dir, prefix)

def depth_gain_verdict(runs, L):
    """Paper 1's "a normalised readout gains nothing from depth" (its ΔPPL exit 1 -> R is +0.01): an
    equivalence claim on the gain val CE exit 1 minus exit R, per seed, within HOLD_MARGIN nats."""
    xs = [exit_gain(d) for d in depths(runs)]
    word, why = verdict(*mean_ci(xs), margin=HOLD_MARGIN, n=len(xs))
    return (f"a normalised readout gains nothing from depth at {L:,} steps", word, len(xs),
            f"computed: {BASELINE_ARM}'s val CE at exit 1 minus at exit R, per seed; {why}")


if __name__ == '__main__':  # a module the lab's commands import
    print("lab/report_matched.py: a preset's report, not a command; see python lab/ablate.py --help")
