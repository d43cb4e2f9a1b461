"""
What the iso-depth reports say (lab/isodepth.py writes them; docs/isodepth.md): the paper's cases and its
numbers, the verdicts by the one rule (lab/verdict.py) over (budget, r) cells and over (budget, width) groups,
the cells and lines of <report_dir>/isodepth.md, its plots, and what --fit prints.
"""
import os

import numpy as np

from isodepth_fit import NAMES, PHI_CI_WIDTH
from reports import finish_plot, fmt, plt_or_none, save
from verdict import verdict, weakest

CASES = ('baseline', 'truncated', 'hyper')  # the paper's model and its two case studies (docs/papers.md §3)
PAPER_PHI = dict(baseline=0.459, truncated=0.380, hyper=0.646)  # the paper's point fits
PAPER_SUBSET_PHI = 0.453  # its baseline on the case studies' 4 budgets: the paper's delta phi starts here
CLAIMS = {'baseline': 'a loop is worth part of a unique block (0 < phi < 1)',
          'truncated': 'truncated backprop lowers phi', 'hyper': 'hyper-connections raise phi'}

GROUP_UNIT = '(budget, width) groups'
CELL_UNIT = '(budget, r) cells'

# -----------------------------------------------------------------------------
# the verdicts, by the one rule


def seeds_label(n):
    return f"{n} seed{'s' if n > 1 else ''}"


def phi_inside(phi, lo, hi, n, unit):
    """(word, why) of 0 < phi < 1 by the one rule: phi above 0 and 1 - phi above 0, the weaker of the two."""
    ends = [verdict(phi, lo, hi, n=n, unit=unit), verdict(1 - phi, 1 - hi, 1 - lo, n=n, unit=unit)]
    return weakest([w for w, _ in ends]), f"above 0: {ends[0][1]}; 1 - phi above 0: {ends[1][1]}"


def delta_verdict(case, delta, lo, hi, n, unit):
    """(word, why) of a case study's delta phi by the one rule, against the paper's delta from its subset
    baseline (truncated: lower, hyper: higher)."""
    paper = PAPER_PHI[case] - PAPER_SUBSET_PHI
    return verdict(delta, lo, hi, paper=paper, sign=-1 if case == 'truncated' else +1, n=n, unit=unit)


def grouped_verdicts(res):
    """[(key, word, seeds, why)] of the grouped analysis, each from the one rule (lab/verdict.py); seeds:
    the fewest any cell of its runs holds."""
    base, out = res['baseline'], []
    lo, hi = base['ci']
    n = base['n_groups']
    word, why = phi_inside(base['phi'], lo, hi, n, GROUP_UNIT)
    out.append((CLAIMS['baseline'], word, base['seeds'],
                f"phi {base['phi']:.3f} over {base['n_runs']} runs; {why}; wild bootstrap over the groups: "
                f"p {base['p_phi0']:.2g} for phi = 0, {base['p_phi1']:.2g} for phi = 1"))
    word, why = verdict(base['phi'], lo, hi, paper=PAPER_PHI['baseline'], n=n, unit=GROUP_UNIT)
    out.append(("phi at the paper's size", word, base['seeds'],
                f"the paper's phi {PAPER_PHI['baseline']}: {why}"))
    for case in [c for c in ('truncated', 'hyper') if c in res]:
        d = res[case]
        word, why = delta_verdict(case, d['delta_phi'], *d['ci'], n=d['n_groups'], unit=GROUP_UNIT)
        out.append((CLAIMS[case], word, d['seeds'],
                    f"delta phi on {d['n_runs']} matched runs (same budget, r, width, seed); phi "
                    f"{d['baseline_phi']:.3f} baseline, {d['case_phi']:.3f} {case}: {why}"))
    return out


def grouped_verdict_lines(res):
    return [f"- {key}: {word} ({seeds_label(n)}); {why}" for key, word, n, why in grouped_verdicts(res)]


def verdicts(cases):
    """{case: (claim, verdict, why)} by the one rule (lab/verdict.py) from the cases' fits, the CIs those of
    the bootstrap over (budget, r) cells; the tests of phi = 0 and 1 are stated beside it, not in the rule
    (they take the runs' errors as independent). --grouped's verdicts, over (budget, width) groups and on
    matched runs, supersede these."""
    base, out = cases.get('baseline', {}), {}
    if base.get('phi') is None:
        why = base.get('error') or 'its 95 % CI is wider than %g' % PHI_CI_WIDTH
        out['baseline'] = (CLAIMS['baseline'], 'not tested', f"phi is not identified: {why}")
    else:
        word, why = phi_inside(base['phi'], *base['phi_ci'], base.get('n_cells'), CELL_UNIT)
        tests = '; '.join(f"against phi = {phi}: objective x{fmt(t['objective_ratio'])}, likelihood ratio "
                          f"{fmt(t['statistic'], '.2f')}, p {fmt(t['p'], '.2g')}"
                          for phi, t in ((0, base['vs_phi0']), (1, base['vs_phi1'])))
        out['baseline'] = (CLAIMS['baseline'], word, f"phi {fmt(base['phi'])}; {why}; {tests}")
    for case in ('truncated', 'hyper'):
        res = cases.get(case, {})
        if res.get('delta_phi') is None:
            why = (res.get('delta') or {}).get('error') or res.get('error') or 'the case has not run'
            out[case] = (CLAIMS[case], 'not tested', why)
            continue
        n = res['delta']['n_cells']
        word, why = delta_verdict(case, res['delta_phi'], *res['delta_phi_ci'], n=n, unit=CELL_UNIT)
        out[case] = (CLAIMS[case], word, f"delta phi, paired over the cells both hold: {why}")
    return out


def verdict_lines(cases, seeds=1):
    """The "### Verdicts" block of the report; seeds: the fewest any (budget, r, width) cell holds."""
    return ["### Verdicts", ""] + [f"- {claim}: {word} ({seeds_label(seeds)}); {why}"
                                   for claim, word, why in verdicts(cases).values()] + [""]

# -----------------------------------------------------------------------------
# <report_dir>/isodepth.md: its cells, its lines, its plots


def runs_cell(res):
    """The report's count of a case's runs: finished of planned, and the earlier grids' runs fitted too."""
    earlier = f" + {res['earlier']} earlier" if res.get('earlier') else ''
    return f"{res['finished']}/{res['planned']}{earlier}"


def phi_cells(res):
    """The report's cells of one case: phi, its CI, the law, the p of the tests of phi = 0 and phi = 1 and
    the RMSE (one format for the markdown and the test that reads it back)."""
    if 'error' in res:
        return [f"not fitted: {res['error']}"] + [''] * 7
    lo, hi = res['phi_ci']
    phi = fmt(res['phi']) if res['identified'] else f"not identified ({fmt(res['phi_fit'])})"
    return [phi, f"[{fmt(lo)}, {fmt(hi)}]", fmt(res['alpha']), fmt(res['beta']), fmt(res['E']),
            fmt(res['vs_phi0']['p'], '.2g'), fmt(res['vs_phi1']['p'], '.2g'),
            fmt(res['fits']['free']['rmse'], '.4f')]


def test_cells(t):
    """A test's cells: the Huber objective against the free fit's, the likelihood ratio and its p, the
    bootstrap p of the objective's difference (phi_test)."""
    boot = 'n/a' if t['p_boot'] is None else \
        f"{fmt(t['p_boot'], '.2g')} ({t['boot_hits']} of {t['boot_resamples']} draws reach it)"
    return [f"x{fmt(t['objective_ratio'])}", f"x{fmt(t['ssr_ratio'])}", fmt(t['statistic'], '.2f'),
            fmt(t['p'], '.2g'), boot]


def delta_cells(res):
    """The report's cells of a case study against the baseline (delta_phi): the shared cells, both phis,
    their difference and its paired CI."""
    d = res.get('delta') or {}
    if 'error' in d or res.get('delta_phi') is None:
        return [f"not compared: {d.get('error') or res.get('error')}"] + [''] * 4
    lo, hi = res['delta_phi_ci']
    return [str(d['n_cells']), fmt(d['baseline_phi']), fmt(d['case_phi']), fmt(res['delta_phi'], '+.3f'),
            f"[{fmt(lo, '+.3f')}, {fmt(hi, '+.3f')}]"]



def report_lines(out, jobs):
    cfg = jobs[0]['cfg']
    n, sw = out['noise'], out['sweep']
    fitted = {case: res for case, res in out['cases'].items() if 'error' not in res}
    # a report of several training calls (one a seed, say) names the call that fitted them all
    fit_cmd = out.get('fit_command', out['command'])
    refit = f" by `{fit_cmd}`" if fit_cmd != out['command'] else ""
    lines = ["## The iso-depth law: phi of the paper's looped model and its two case studies", "",
             f"`{out['command']}`: preset {out['preset']}; {cfg['dataset']}, block {cfg['block_size']}, "
             f"batch {cfg['batch_size']}x{cfg['gradient_accumulation_steps']}, {cfg['lr_schedule']} lr "
             f"{cfg['learning_rate']:g}; runs trained at code {sw.get('commit', 'unknown')}, fitted at code "
             f"{out['commit']}{refit}. Wall time of the last training call: "
             f"{fmt(sw.get('wall_seconds', 0) / 60, '.1f')} min.", "",
             "<!-- from isodepth.json: each case fitted with lab/isodepth.py's fit; p of the "
             "likelihood-ratio tests of phi = 0 and phi = 1 -->",
             "| case | runs | phi | 95 % CI | alpha | beta | E (nats) | p, phi = 0 | p, phi = 1 | "
             "RMSE free | paper |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for case, res in out['cases'].items():
        lines.append(f"| {case} | {runs_cell(res)} | " + ' | '.join(phi_cells(res)) +
                     f" | {PAPER_PHI[case]} |")
    lines += ["", "Each case study against the baseline: both refitted to the (budget, r) cells they both "
              "hold, and a paired bootstrap of those cells (every draw refits both to the same cells; "
              "percentile 95 % CI).", "",
              "<!-- from isodepth.json: delta_phi, delta_phi_ci and delta of each case study -->",
              "| case | cells | phi, baseline | phi, case | delta phi | paired 95 % CI | paper |",
              "|---|---|---|---|---|---|---|"]
    for case in CASES[1:]:
        lines.append(f"| {case} | " + ' | '.join(delta_cells(out['cases'][case])) +
                     f" | {PAPER_PHI[case] - PAPER_SUBSET_PHI:+.3f} |")
    lines += ["", "phi fixed against phi free, by the objectives the fits minimise (docs/isodepth.md): the "
              "Huber objective of the fixed fit against the free fit's; the same for least squares on log L, "
              "whose likelihood ratio under the Gaussian model, n log(SSR fixed / SSR free), has the chi^2 "
              "tail of 1 dof; and the bootstrap p of the Huber objective's difference, tables drawn from "
              "the fixed fit with the free fit's residuals.", "",
              "<!-- from isodepth.json: vs_phi0, vs_phi1 of each fitted case -->",
              "| case | phi fixed at | Huber objective | least squares | likelihood ratio | "
              "p (chi^2, 1 dof) | p (bootstrap) |", "|---|---|---|---|---|---|---|"]
    for case, res in fitted.items():
        for phi in (0, 1):
            lines.append(f"| {case} | {phi} | " + ' | '.join(test_cells(res[f'vs_phi{phi}'])) + " |")
    lines += ["", "Fits that ended on an edge of the box, per parameter: the cell bootstrap's refits "
              "(low/high edge) and the three full fits. The box is the paper's; docs/isodepth.md says why it "
              "is not widened.", "",
              "<!-- from isodepth.json: box_edges and fits[...].on_edge of each fitted case -->",
              "| case | resamples | " + ' | '.join(NAMES) + " | on an edge: free / phi = 0 / phi = 1 |",
              "|---|---|" + "---|" * len(NAMES) + "---|"]
    for case, res in fitted.items():
        edges = [f"{res['box_edges'][k]['low']}/{res['box_edges'][k]['high']}" for k in NAMES]
        full = ' / '.join(', '.join(res['fits'][k]['on_edge']) or 'none' for k in ('free', 'phi=0', 'phi=1'))
        lines.append(f"| {case} | {res['resamples']} | " + ' | '.join(edges) + f" | {full} |")
    inside = ', '.join(f"{case} {res['interior_minima'][0]} of {res['interior_minima'][1]}"
                       for case, res in out['cases'].items())
    lines += ["", f"Run-to-run noise: {n['pairs']} seed pair(s), per-run std "
              f"{fmt(n['std'], '.4f')} nats (RMS of the pairs' differences / sqrt 2). (budget, r) groups "
              f"whose lowest loss lies strictly inside the widths tried (a bracketed minimum over width): "
              f"{inside}.", "",
              "<!-- from isodepth.json: the finished runs -->",
              "| run | n_once | n_rec | r | steps | tokens | val loss |", "|---|---|---|---|---|---|---|"]
    for row in out['runs']:
        lines.append(f"| {row['name']} | {row['n_once']:,} | {row['n_rec']:,} | {row['r']} | "
                     f"{row['steps']:,} | {row['tokens']:,} | {fmt(row['loss'], '.4f')} |")
    cell = {}
    for row in out['runs']:
        cell.setdefault((row['case'], row['budget'], row['r'], row['width']), set()).add(row['seed'])
    return lines + [""] + verdict_lines(out['cases'], min(map(len, cell.values()), default=1))


def plots(out, report_dir):
    """Loss against N_eff with the fitted law per r, the bootstrap distribution of phi, phi per case."""
    plt = plt_or_none()
    fitted = {c: res for c, res in out['cases'].items() if 'error' not in res}
    if plt is None or not fitted:
        return []
    names = []
    fig, axes = plt.subplots(1, len(fitted), figsize=(5 * len(fitted), 4), squeeze=False)
    for ax, (case, res) in zip(axes[0], fitted.items()):
        rows = [row for row in out['runs'] if case in row['cases']]
        phi = res['phi_fit']
        for i, r in enumerate(sorted({row['r'] for row in rows})):
            color = plt.cm.viridis(i / 3)
            for budget in sorted({row['budget'] for row in rows}):
                cell = sorted((row for row in rows if row['r'] == r and row['budget'] == budget),
                              key=lambda row: row['n_once'] + row['n_rec'])
                n_eff = np.array([row['n_once'] + r ** phi * row['n_rec'] for row in cell])
                ax.scatter(n_eff, [row['loss'] for row in cell], color=color, s=14,
                           label=f"r = {r}" if budget == rows[0]['budget'] else None)
                if len(cell) > 1:  # the law along the cell's iso-FLOP curve, log D interpolated in log N_eff
                    grid_n = np.geomspace(n_eff.min(), n_eff.max(), 40)
                    logD = np.log([row['tokens'] for row in cell])
                    d = np.exp(np.interp(np.log(grid_n), np.log(n_eff), logD))
                    law_L = res['E'] + res['A'] * grid_n ** -res['alpha'] + res['B'] * d ** -res['beta']
                    ax.plot(grid_n, law_L, color=color, lw=1)
        ax.set_xscale('log')
        ax.set_title(f"{case}: phi = {phi:.3f}", fontsize=9)
        ax.set_xlabel('N_eff = N_once + r^phi N_rec')
        ax.set_ylabel('final val loss (nats)')
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    names.append(save(fig, plt, report_dir, 'isodepth_loss.png'))
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for case, res in fitted.items():
        ax.hist(res['phi_boot'], bins=30, alpha=0.5, label=case)
    finish_plot(fig, ax, plt, 'phi of a bootstrap refit', 'resamples', os.path.join(report_dir,
                                                                                    'isodepth_phi_boot.png'))
    names.append('isodepth_phi_boot.png')
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for i, (case, res) in enumerate(fitted.items()):
        lo, hi = res['phi_ci']
        ax.errorbar([i], [res['phi_fit']], yerr=[[res['phi_fit'] - lo], [hi - res['phi_fit']]], fmt='o',
                    capsize=4, label=f"{case} (95 % CI)")
        ax.scatter([i], [PAPER_PHI[case]], marker='x', color='k', label='the paper' if i == 0 else None)
    ax.set_xticks(range(len(fitted)), list(fitted))
    finish_plot(fig, ax, plt, 'case', 'phi', os.path.join(report_dir, 'isodepth_phi.png'))
    names.append('isodepth_phi.png')
    return [f"![{n}]({n})" for n in names]

# -----------------------------------------------------------------------------
# --fit's printout


def report(res):
    lo, hi = res['phi_ci']
    ci = f"95 % CI [{lo:.3f}, {hi:.3f}] ({res['resamples']} resamples of {res['n_cells']} (budget, r) cells)"
    if res['identified']:
        print(f"phi = {res['phi']:.3f}, {ci}")
    else:
        print(f"phi: not identified: the {ci} is wider than {PHI_CI_WIDTH:g} (the point fit "
              f"{res['phi_fit']:.3f} is not a measurement); more runs, budgets or values of r needed")
    print(f"alpha {res['alpha']:.3f}, beta {res['beta']:.3f}, E {res['E']:.3f} nats, A {res['A']:.4g}, "
          f"B {res['B']:.4g}  ({res['n_runs']} runs, best of {res['starts']} starts)")
    print(f"{'fit':<10} {'Huber obj.':>11} {'SSR log L':>10} {'LR':>7} {'p (chi^2)':>10} {'p (boot)':>9} "
          f"{'RMSE (nats)':>12}  on the box's edge")
    for name, q in res['fits'].items():
        t = res.get('vs_' + name.replace('=', ''), {})
        boot = '' if t.get('p_boot') is None else f"{t['p_boot']:.2g}"
        lr = f"{t['statistic']:>7.2f} {t['p']:>10.2g}" if t else f"{'':>7} {'':>10}"
        print(f"{name:<10} {q['objective']:>11.4g} {q['ssr']:>10.4g} {lr} {boot:>9} {q['rmse']:>12.4f}  "
              f"{', '.join(q['on_edge']) or '-'}")
    edges = ', '.join(f"{k} {v['low']}/{v['high']}" for k, v in res['box_edges'].items()
                      if v['low'] + v['high'])
    print(f"bootstrap refits on the box's edge (low/high): {edges or 'none'}")


if __name__ == '__main__':  # a module the lab's commands import
    print("lab/isodepth_report.py: isodepth.py's reports, not a command; see python lab/isodepth.py --help")
