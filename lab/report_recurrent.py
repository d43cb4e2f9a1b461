"""
The recurrent-depth family (docs/papers.md §4), the recurrent and retrofit_gpt2 presets' report: test-time
depth, scale over training, halting by margin / KL / gate, and whether more loops than trained hold.
"""
import math

from report_blindspot import HOLD_MARGIN, plot_exit_ce, plot_norms, scale_table
from reports import depths, fmt, mean, mean_vec, plt_or_none, verdict_block
from verdict import mean_ci, verdict

TEST_LOOPS = (1, 2, 4, 8, 16)  # the recurrent report's test-time depths
HALT_POLICIES = ('margin', 'kl', 'gate')  # ... and its exits


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


def write(arms, header, report_dir, prefix):
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


if __name__ == '__main__':  # a module the lab's commands import
    print("lab/report_recurrent.py: a preset's report, not a command; see python lab/ablate.py --help")
