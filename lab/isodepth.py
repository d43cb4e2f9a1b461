r"""
The iso-depth scaling law of Schwethelm et al. 2026 (docs/isodepth.md, docs/papers.md §3): how much one
recurrence of a looped block is worth, in unique parameters, fitted to a table of training runs.

    python lab/isodepth.py --fit runs.csv                      # phi with its 95 % CI, the law, the tests
    python lab/isodepth.py --fit runs.csv --json fit.json      # the same numbers as JSON
    python lab/isodepth.py --fit runs.csv --starts=100 --resamples=50   # a quicker look

RUNS.csv holds one run a row, with the columns
    n_once   parameters run once: prelude + coda blocks (accounting.param_counts; no embedding, no head)
    n_rec    parameters of the looped block, the injection adapter included
    r        the recurrence count the run trained with
    tokens   training tokens D
    loss     the final validation loss, nats
    budget   (optional) the run's FLOP budget: runs of one iso-FLOP curve share the value. Without it a
             run's budget is 6 (n_once + r n_rec) tokens, and budgets within 10 % of each other are one
and the fit is
    L = E + A (N_once + r^phi N_rec)^(-alpha) + B D^(-beta)
    log L = LSE(a - alpha log N_eff, b - beta log D, e),  A = e^a, B = e^b, E = e^e
with a Huber loss (delta 1e-3) on the log residuals, L-BFGS-B from --starts random points in the paper's box
(a, b in [-5, 35], alpha, beta in [0, 2.5], e in [-3, 2], phi in [-3, 3]; the box bounds the search too),
the best of them kept: Chinchilla's "approach 3" with phi added. The same fit with phi fixed at 0 and at 1
says how much the free phi buys, by the objectives the fits minimise (vs_phi0, vs_phi1): the likelihood
ratio of the Gaussian model, n log(SSR_fixed / SSR_free) of least-squares refits, with its chi^2 p (1 dof),
and the bootstrap p of the Huber objective's difference. The CI of phi is the percentile interval of
--resamples bootstrap refits over the (budget, r) cells: whole cells are resampled, not rows, since the runs
of a cell share their training recipe and their errors. Each refit starts from the full fit's optimum and
--boot_starts random points; how many end on an edge of the box is counted per parameter. phi is reported
"not identified" when that CI is wider than 0.5 (PHI_CI_WIDTH).

The sweep trains such a table here, through lab/ablate.py's runners (local, or --executor=slurm):

    python lab/isodepth.py --dry_run                 # the laptop grid's runs and their CPU time
    python lab/isodepth.py --simulate=6              # its CI on phi, drawn from the law fitted in assets/
    python lab/isodepth.py                           # the paper's model (--case=baseline); report in assets/
    python lab/isodepth.py --case=truncated          # backprop through the last ceil(r/2) loops
    python lab/isodepth.py --case=hyper              # 2-lane hyper-connections (r = 1 shared)
    python lab/isodepth.py --preset=gpu --dry_run    # the paper's grid and its GPU-hours
    python lab/isodepth.py --case=baseline,truncated --seeds=1,2,3,4 --dry_run   # delta phi on 4 seeds a cell
    python lab/isodepth.py --grouped                 # refit the report's CSVs by (budget, width) groups:
                                                     # phi's CI, phi = 0 / 1, delta phi on matched runs
    python lab/isodepth.py --report_only             # refit the finished runs, training none (with the
                                                     # runs the report's CSVs recorded, when their folders
                                                     # are not here)

Iso-depth: prelude + (looped / r) blocks x r + coda, r in {1, 2, 4, 8}, the widths of each FLOP budget, one
seed per cell and a second on four baseline cells (the run-to-run noise), terminal supervision; a run's
steps are its budget over accounting.flops_per_token. A finished run is skipped on the next call. Each case is
fitted to its runs and the shared r = 1 runs, and each case study against the baseline on the cells both hold
(delta_phi, with a paired bootstrap CI): <report_dir>/isodepth.md, isodepth.json (the fits, the runs),
isodepth_<case>.csv (the --fit table of each case) and the plots. --widths, --budgets and --rs replace the
preset's grid; any other --key=value is a config override for every run.
"""
import csv
import json
import math
import os
import shlex
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the core is one folder up
import configurator
from ablate import (arm, code_version, dry_run, estimate, meta_model, repo_path, run_args, run_sweep,
                    runner_flags, slurm_options, train_defaults)
from configurator import Parser, die
from isodepth_fit import (COLUMNS, TEST_STARTS, delta_phi, fit, grouped_delta_phi, grouped_phi,
                          interior_minima, not_identified, read_runs, read_table, scipy_optimize)
from isodepth_report import (CASES, PAPER_PHI, PAPER_SUBSET_PHI, grouped_verdict_lines, plots, report,
                             report_lines, verdicts)
from run.accounting import param_counts
from reports import read_json, read_metrics, read_status

GROUPED = 'isodepth_grouped'  # --grouped's report under --report_dir (.md and .json)

# -----------------------------------------------------------------------------
# the sweep: the iso-depth grid, trained through lab/ablate.py's runners

# a preset: the base config, the effective depth prelude + looped + coda (looped = K r), heads of `head`
# channels, the widths of each FLOP budget, r, the seeds (the second on a few cells: the run-to-run noise),
# the evaluations after step 0 (the last gives the loss; more leave checkpoints to resume from)
SWEEPS = {
    # 4 widths x 3 budgets x 4 r = 48 runs (docs/isodepth.md: the design that constrains phi), + 4 noise runs.
    # Each budget's widths bracket the minimum over width that the first grid's fit puts at d 16-24 (that
    # grid, d 32-128 at 7.5e11-6e12, saw the loss rise with width in all 12 (budget, r) groups; its runs stay
    # in assets/isodepth_baseline.csv and in the fit). Chosen among four grids simulated from that fit for
    # the narrowest CI on phi (docs/isodepth.md, "Planning the grid"). cpu_gflops: the speeds measured on a
    # 2-vCPU EPYC, one core per run, at these widths; a narrower model's step is its ops' overhead, ~0.1 s
    'laptop': dict(base='config/laptop_isodepth.py', prelude=1, looped=8, coda=1, head=16,
                   grid={2.5e11: (8, 12, 16, 24), 7.5e11: (12, 16, 24, 32), 2.25e12: (16, 24, 32, 48)},
                   rs=(1, 2, 4, 8), seeds=(1, 2), evals=1,
                   cpu_gflops={32: 10, 48: 20, 64: 25, 128: 30}, min_step_s=0.1),
    # the paper's grid: d = 64 s (heads of 128), s per budget as its scripts (shells/scaling_laws), 2 + 16 + 2
    'gpu': dict(base='config/isodepth_gpu.py', prelude=2, looped=16, coda=2, head=128,
                grid={4.64e17: (384, 512, 640, 768), 1e18: (384, 512, 640, 768, 896),
                      2.15e18: (512, 640, 768, 896, 1024), 4.64e18: (640, 768, 896, 1024, 1152, 1280),
                      1e19: (768, 1024, 1152, 1280, 1536), 2.15e19: (1152, 1536, 1792, 2176)},
                rs=(1, 2, 4, 8), seeds=(1, 2), evals=10),
}


def case_arm(case, width, budget, r, sw):
    """The arm of one run: config/isodepth.py (+ the hyper-connections file), its sizes and its case's keys.
    r = 1 is the shared baseline of 20 (here prelude + looped + coda) unique blocks without injection."""
    files = ['config/isodepth.py'] + (['config/isodepth_hyper.py'] if case == 'hyper' and r > 1 else [])
    over = dict(n_embd=width, n_head=n_heads(width, sw['head']), n_prelude=sw['prelude'],
                n_layer=sw['looped'] // r, n_loop=r, n_coda=sw['coda'])
    if r == 1:
        over.update(injection='none', inter_loop_norm='none')
    elif case == 'truncated':
        over.update(backprop_loops=math.ceil(r / 2))  # gradients through the last ceil(r/2) loops
    case = 'baseline' if r == 1 else case
    return arm(f"{case}-d{width}-b{budget:.3g}-r{r}", *files,
               tags=dict(case=case, width=width, budget=budget, r=r), **over)


def n_heads(width, head):
    """The head count whose heads are nearest `head` channels, among those that split width into even heads
    (RoPE rotates pairs): d 24 with heads of 16 gets 2 heads of 12. None if width is odd."""
    counts = [n for n in range(1, width + 1) if width % n == 0 and (width // n) % 2 == 0]
    return min(counts, key=lambda n: (abs(width / n - head), n)) if counts else None


def grid(sw, args):
    """(width, budget) pairs of the sweep: the preset's, or --widths x --budgets."""
    budgets = args.budgets or list(sw['grid'])
    widths = lambda b: args.widths or sw['grid'].get(b) or next(iter(sw['grid'].values()))
    return [(w, b) for b in budgets for w in widths(b)]


def noise_cells(pairs, rs):
    """The cells with a second seed: the middle budget's two middle widths at the smallest and largest r."""
    budgets = sorted({b for _, b in pairs})
    mid = budgets[len(budgets) // 2]
    widths = sorted(w for w, b in pairs if b == mid)
    middle = widths[max(0, len(widths) // 2 - 1):len(widths) // 2 + 1]
    return {(w, mid, r) for w in middle for r in (rs[0], rs[-1])}


def check_grid(sw, args):
    """One line for a grid that cannot be trained or cannot identify phi."""
    looped = sw['looped']
    for r in args.rs:
        if r < 1 or looped % r:
            die(f"--rs: r = {r} does not divide the {looped} looped blocks of the {args.preset} preset "
                f"(effective depth {sw['prelude']} + {looped} + {sw['coda']}): choose r among "
                f"{', '.join(str(d) for d in range(1, looped + 1) if looped % d == 0)}")
    if len(set(args.rs)) < 2:
        die(f"--rs={','.join(map(str, args.rs))}: phi is the worth of a recurrence: give at least two values "
            f"of r")
    budgets = {b for _, b in grid(sw, args)}
    if len(budgets) < 2:
        die(f"--budgets={','.join(f'{b:g}' for b in budgets)}: one FLOP budget cannot identify phi (D is "
            f"then fixed by the model's size, collinear with width): give at least two")
    for w, _ in grid(sw, args):
        if n_heads(w, sw['head']) is None:
            die(f"--widths: {w} is odd: RoPE needs an even head size, so widths must be even")


def plan_sweep(sw, args, cases=CASES):
    """Every run of these cases (r = 1 once, shared), its config resolved as train.py resolves it and its
    steps set by its budget: steps = budget / (accounting.flops_per_token x tokens per step), rounded down."""
    base = args.base or [repo_path(sw['base'])]
    pairs = grid(sw, args)
    noisy = noise_cells(pairs, args.rs)
    defaults, jobs = train_defaults(), {}
    for case in cases:
        for width, budget in pairs:
            for r in args.rs:
                a = case_arm(case, width, budget, r, sw)
                noise_seed = (width, budget, r) in noisy and case == 'baseline'  # the noise of one case
                # --seeds: every cell at every seed given (a case study settled on its cells, not one seed)
                for seed in args.seeds or [sw['seeds'][0]] + ([sw['seeds'][1]] if noise_seed else []):
                    name = f"{a['name']}-s{seed}"
                    if name not in jobs:
                        jobs[name] = dict(name=name, arm=a, seed=seed, out_dir=os.path.join(args.out, name))
    for job in jobs.values():
        a, budget = job['arm'], job['arm']['tags']['budget']
        one = resolve_job(job, base, args, defaults, dict(max_iters=1))
        step_flops = estimate(one)[1]
        steps = int(budget // step_flops)
        if steps < 1:
            die(f"budget {budget:g} FLOPs is too small for one step of {a['name']} ({step_flops:.3g} FLOPs a "
                f"step): raise --budgets or lower the batch")
        evals = math.ceil(steps / sw['evals'])
        resolve_job(job, base, args, defaults, dict(max_iters=steps, lr_decay_iters=steps,
                                                    warmup_iters=steps // 20, eval_interval=evals))
        job['cases'] = CASES if a['tags']['r'] == 1 else (a['tags']['case'],)
    return list(jobs.values())


def resolve_job(job, base, args, defaults, steps):
    """job['args'] and job['cfg'] with these step keys set before the command line's overrides."""
    a = dict(job['arm'], overrides=dict(job['arm']['overrides'], **steps))
    job['args'] = run_args(base, a, job['seed'], job['out_dir'], args.overrides)
    job['cfg'] = configurator.configure(defaults, job['args'])[0]
    configurator.check(job['cfg'])  # a bad value dies here, as it would in train.py
    return job['cfg']

# -----------------------------------------------------------------------------
# planning a grid before training it: its CPU time, the CI it would give phi, where its minima lie


def cpu_hours(jobs, sw):
    """Core-hours of training at the preset's measured per-width speeds: a step takes its FLOPs at its
    width's rate (sw['cpu_gflops'], interpolated in log width, flat past the ends) and no less than
    sw['min_step_s'], the step time measured at d 32 and d 48 (a narrower step is its ops' overhead)."""
    widths, gflops = zip(*sorted(sw['cpu_gflops'].items()))
    seconds = 0.0
    for j in jobs:
        steps = j['cfg']['max_iters']
        rate = 1e9 * np.interp(math.log(j['arm']['tags']['width']), np.log(widths), gflops)
        seconds += steps * max(estimate(j['cfg'])[1] / steps / rate, sw['min_step_s'])
    return seconds / 3600


def design(jobs, case='baseline'):
    """The --fit columns of a case's planned runs, without losses: n_once, n_rec, r, tokens, budget, and the
    width (for the minima over width)."""
    cols = {c: [] for c in ('n_once', 'n_rec', 'r', 'tokens', 'budget', 'width')}
    for j in jobs:
        if case in j['cases']:
            t = j['arm']['tags']
            for c, v in zip(cols, (*param_counts(meta_model(j['cfg'])), t['r'], estimate(j['cfg'])[0],
                                   t['budget'], t['width'])):
                cols[c].append(v)
    return {c: np.array(v, float) for c, v in cols.items()}


def law_loss(truth, runs):
    """The law's loss (nats) at the runs' sizes; truth holds A, alpha, B, beta, E, phi (a fit's dict)."""
    n_eff = runs['n_once'] + runs['r'] ** truth['phi'] * runs['n_rec']
    return truth['E'] + truth['A'] * n_eff ** -truth['alpha'] + truth['B'] * runs['tokens'] ** -truth['beta']



def simulate(jobs, truth, noise_std, draws, starts, resamples, boot_starts, seed=0):
    """The baseline's planned runs drawn `draws` times from the law `truth` plus Gaussian noise of noise_std
    nats, each table fitted as a real one (docs/isodepth.md, "The fitter, tested"): the CI this grid would
    give phi, and its groups' minima over width, of the law and of the draws."""
    runs = design(jobs)
    clean = law_loss(truth, runs)
    rng = np.random.default_rng(seed)
    out = []
    for d in range(draws):
        noisy = dict(runs, loss=clean + noise_std * rng.standard_normal(len(clean)))
        res = fit(noisy, starts, resamples, boot_starts, seed + d, test_resamples=0)
        inside = sum(interior_minima(noisy, noisy['loss']).values())
        out.append(dict(phi=res['phi_fit'], phi_ci=res['phi_ci'], identified=res['identified'],
                        p_phi1=res['vs_phi1']['p'], interior=inside))
    return dict(n_runs=len(clean), law_interior=interior_minima(runs, clean), draws=out,
                ci_width=float(np.mean([d['phi_ci'][1] - d['phi_ci'][0] for d in out])))


def print_simulation(jobs, sw, args):
    """--simulate: the plan's CI on phi, drawn from the law the last report fitted, and its CPU time."""
    fitted = read_json(os.path.join(args.report_dir, 'isodepth.json'), {})
    truth, noise_std = fitted.get('cases', {}).get('baseline', {}), fitted.get('noise', {}).get('std')
    if truth.get('phi_fit') is None or noise_std is None:
        die(f"--simulate draws from the law fitted in {args.report_dir}/isodepth.json, which has no baseline "
            f"fit or no noise: run the sweep (or --report_only) first")
    truth = dict(truth, phi=args.simulate_phi if args.simulate_phi is not None else truth['phi_fit'])
    res = simulate(jobs, truth, noise_std, args.simulate, args.starts, args.resamples, args.boot_starts,
                   args.seed)
    print(f"{args.preset}: {res['n_runs']} baseline runs drawn {args.simulate} times from the law of "
          f"{args.report_dir}/isodepth.json (phi {truth['phi']:.3f}, alpha {truth['alpha']:.3f}, beta "
          f"{truth['beta']:.3f}, E {truth['E']:.3f} nats) + {noise_std:.4f} nats of noise, each fitted with "
          f"{args.starts} starts and {args.resamples} resamples:")
    for i, d in enumerate(res['draws'], 1):
        lo, hi = d['phi_ci']
        print(f"  draw {i}: phi {d['phi']:.3f}, 95 % CI [{lo:.3f}, {hi:.3f}] (width {hi - lo:.3f}); phi = 1 "
              f"p {d['p_phi1']:.2g}; {d['interior']} groups with an interior minimum")
    inside = [f"{b:.3g} r {r}" for (b, r), yes in res['law_interior'].items() if yes]
    print(f"mean CI width {res['ci_width']:.3f}; (budget, r) groups with an interior minimum over width: "
          f"{len(inside)} of {len(res['law_interior'])} in the law ({', '.join(inside) or 'none'}), "
          f"{np.mean([d['interior'] for d in res['draws']]):.1f} in the draws on average")
    if 'cpu_gflops' in sw:
        print(f"training: ~{cpu_hours(jobs, sw):.1f} core-hours at the preset's per-width speeds "
              f"(docs/isodepth.md)")
    return res

# -----------------------------------------------------------------------------
# the report of a sweep: its finished runs (and those its CSVs recorded) fitted, case by case


def run_table(jobs):
    """The finished runs, one dict each: case tags, n_once, n_rec, r, tokens, loss (the final val loss) and
    budget, the columns of --fit."""
    rows = []
    for j in jobs:
        metrics = read_metrics(j['out_dir'])
        if read_status(j['out_dir']).get('train') != 'done' or not metrics:
            continue
        cfg, t = j['cfg'], j['arm']['tags']
        n_once, n_rec = param_counts(meta_model(cfg))
        rows.append(dict(name=j['name'], cases=j['cases'], case=t['case'], width=t['width'], seed=j['seed'],
                         n_once=n_once, n_rec=n_rec, r=t['r'], tokens=estimate(cfg)[0],
                         loss=metrics[-1]['val_loss'], budget=t['budget'], steps=cfg['max_iters']))
    return rows


def recorded_runs(report_dir, found):
    """The runs the last report fitted, read back from its isodepth_<case>.csv tables, less those whose
    folder is here (`found`, by name): the committed tables are the record of runs trained on another
    machine or on a grid the preset no longer plans, so a refit keeps them."""
    rows, kinds = {}, dict(n_once=int, n_rec=int, r=int, tokens=int, loss=float, budget=float, width=int,
                           seed=int, steps=int)
    for case in CASES:
        path = os.path.join(report_dir, f'isodepth_{case}.csv')
        if not os.path.isfile(path):
            continue
        with open(path, newline='', encoding='utf-8') as f:
            for rec in csv.DictReader(f):
                row = {k: kind(float(rec[k])) if kind is int else kind(rec[k]) for k, kind in kinds.items()}
                row['case'] = rec['case']
                row['name'] = f"{row['case']}-d{row['width']}-b{row['budget']:.3g}-r{row['r']}-s{row['seed']}"
                row['cases'] = list(CASES) if row['r'] == 1 else [row['case']]
                if row['name'] not in found:
                    rows.setdefault(row['name'], row)
    return list(rows.values())


def fit_case(rows, args):
    """The fit of one case's runs (its own and the shared r = 1 runs), or why phi cannot be read: then the
    fields of a fit are there, null (phi, its CI and the two tests are not tested, not zero)."""
    runs = {c: np.array([row[c] for row in rows], float) for c in (*COLUMNS, 'budget')}
    why = not_identified(runs) if rows else 'no finished run'
    if why:
        untested = dict(statistic=None, p=None, why=f"not tested: {why}")
        return dict(error=why, n_runs=len(rows), phi=None, phi_ci=None, vs_phi0=untested, vs_phi1=untested)
    return fit(runs, args.starts, args.resamples, args.boot_starts, args.seed)


def noise(rows):
    """The run-to-run noise: the loss differences of the seed pairs, and the per-run std they imply."""
    by_cell = {}
    for row in rows:
        by_cell.setdefault((row['case'], row['width'], row['budget'], row['r']), []).append(row['loss'])
    diffs = [ls[1] - ls[0] for ls in by_cell.values() if len(ls) > 1]
    std = math.sqrt(sum(d * d for d in diffs) / (2 * len(diffs))) if diffs else None  # RMS of diffs / sqrt 2
    return dict(pairs=len(diffs), diffs=diffs, std=std)


def write_csv(path, rows, columns=(*COLUMNS, 'budget', 'case', 'width', 'seed', 'steps')):
    with open(path, 'w', newline='', encoding='utf-8') as f:
        w = csv.writer(f)
        w.writerow(columns)
        w.writerows([row[c] for c in columns] for row in rows)


def sweep_report(jobs, args, sweep_info):
    """<report_dir>/isodepth.md, isodepth.json, isodepth_<case>.csv (the --fit table of each case) and the
    plots, from the runs finished so far: those in <out>, and those the last report recorded
    (recorded_runs). Without <out>/sweep.json the last report's training call is kept."""
    os.makedirs(args.report_dir, exist_ok=True)
    previous = read_json(os.path.join(args.report_dir, 'isodepth.json'), {})
    sweep_info = sweep_info or previous.get('sweep', {})
    rows = run_table(jobs)
    rows += recorded_runs(args.report_dir, {row['name'] for row in rows})
    out = dict(preset=args.preset, command=sweep_info.get('command') or args.command, commit=code_version(),
               fit_command=args.command, sweep=sweep_info, cases={}, noise=noise(rows), runs=rows)
    for case in CASES:
        case_rows = [row for row in rows if case in row['cases']]
        write_csv(os.path.join(args.report_dir, f'isodepth_{case}.csv'), case_rows)
        planned = {j['name'] for j in jobs if case in j['cases']}
        finished = sum(row['name'] in planned for row in case_rows)
        table = {c: np.array([row[c] for row in case_rows], float) for c in ('budget', 'r', 'width', 'loss')}
        inside = interior_minima(table, table['loss']).values() if case_rows else []
        out['cases'][case] = dict(fit_case(case_rows, args), planned=len(planned), finished=finished,
                                  earlier=len(case_rows) - finished,
                                  interior_minima=[sum(inside), len(inside)])
    tables = {case: {c: np.array([row[c] for row in rows if case in row['cases']], float)
                     for c in (*COLUMNS, 'budget')} for case in CASES}
    for case in CASES[1:]:  # each case study against the baseline, on the cells both hold
        res = out['cases'][case]
        d = (delta_phi(tables['baseline'], tables[case], args.starts, args.resamples, args.boot_starts,
                       args.seed) if 'error' not in res else dict(error=res['error']))
        res.update(delta_phi=d.get('delta_phi'), delta_phi_ci=d.get('delta_phi_ci'), delta=d)
    for case, (claim, word, _) in verdicts(out['cases']).items():
        out['cases'][case].update(claim=claim, verdict=word)
    with open(os.path.join(args.report_dir, 'isodepth.json'), 'w', encoding='utf-8') as f:
        json.dump(out, f, indent=1)
    lines = report_lines(out, jobs) + plots(out, args.report_dir)
    path = os.path.join(args.report_dir, 'isodepth.md')
    with open(path, 'w', encoding='utf-8') as f:
        f.write('\n'.join(lines) + '\n')
    print(f"report: {path}")
    return out

# -----------------------------------------------------------------------------
# --grouped: the report's CSVs refitted by (budget, width) groups


def grouped(args):
    """--grouped: refit the report's CSVs by (budget, width) groups; writes assets/isodepth_grouped.md
    (under --report_dir)."""
    path = os.path.join(args.report_dir, 'isodepth_{}.csv')
    # the baseline's table, and each case study's that holds runs of its own (r > 1: r = 1 is shared)
    tables = {c: read_table(path.format(c)) for c in CASES
              if c == 'baseline' or os.path.isfile(path.format(c))}
    tables = {c: t for c, t in tables.items() if c == 'baseline' or (t['r'] > 1).any()}
    res = dict(baseline=grouped_phi(tables['baseline'], args.starts, args.resamples, args.boot_starts,
                                    args.seed))
    for case in [c for c in ('truncated', 'hyper') if c in tables]:
        res[case] = grouped_delta_phi(tables['baseline'], tables[case], args.starts, args.resamples,
                                      args.boot_starts, args.seed)
    b = res['baseline']
    lines = ["## The iso-depth law, resampled by (budget, width) groups", "",
             f"`{args.command}`: the runs of {args.report_dir}/isodepth_<case>.csv refitted, {args.starts} "
             "random starts "
             f"a fit, {args.resamples} resamples, {args.boot_starts} random starts a refit besides the fit's "
             "optimum. The runs of one (budget, width) group share their residuals' sign (docs/isodepth.md), "
             "so they are resampled together; the case studies are compared on the runs both tables hold at "
             "the same budget, r, width and seed.", "",
             "| case | runs | groups | phi | 95 % CI | p, phi = 0 (wild, groups) | "
             "p, phi = 1 (wild, groups) |",
             "|---|---|---|---|---|---|---|",
             f"| baseline | {b['n_runs']} | {b['n_groups']} | {b['phi']:.3f} | "
             f"[{b['ci'][0]:.3f}, {b['ci'][1]:.3f}] | {b['p_phi0']:.2g} | {b['p_phi1']:.2g} |", "",
             "| case | matched runs | groups | phi, baseline | phi, case | delta phi | 95 % CI | paper |",
             "|---|---|---|---|---|---|---|---|"]
    for case in [c for c in ('truncated', 'hyper') if c in res]:
        d = res[case]
        lines.append(f"| {case} | {d['n_runs']} | {d['n_groups']} | {d['baseline_phi']:.3f} | "
                     f"{d['case_phi']:.3f} | {d['delta_phi']:+.3f} | "
                     f"[{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}] | {PAPER_PHI[case] - PAPER_SUBSET_PHI:+.3f} |")
    lines += ["", "### Verdicts", ""] + grouped_verdict_lines(res)
    path = os.path.join(args.report_dir, GROUPED + '.md')
    with open(path, 'w', encoding='utf-8') as f:
        f.write('\n'.join(lines) + '\n')
    with open(os.path.join(args.report_dir, GROUPED + '.json'), 'w', encoding='utf-8') as f:
        json.dump(res, f, indent=1)
    print(f"report: {path}")
    return res

# -----------------------------------------------------------------------------
# the sweep: plan, train, report


def sweep(args):
    """Plan the grid, print it (--dry_run) or train what is not done (ablate.run_sweep: a finished run is
    skipped, an interrupted one resumed), then fit every case and write the report."""
    sw = SWEEPS[args.preset]
    args.rs = args.rs or list(sw['rs'])
    check_grid(sw, args)
    if args.simulate:
        return print_simulation(plan_sweep(sw, args, ('baseline',)), sw, args)
    jobs = plan_sweep(sw, args, args.case if args.dry_run else CASES)  # the report reads every case's runs
    todo = [j for j in jobs if set(j['cases']) & set(args.case)]
    launcher = shlex.split(args.launcher) if args.launcher else [sys.executable]
    if args.dry_run:
        print(f"{args.preset}: {len(todo)} runs of case(s) {', '.join(args.case)}")
        dry_run(todo, launcher, args)
        if 'cpu_gflops' in sw and not args.base:
            rates = ', '.join(f'{g:g} at d {w}' for w, g in sorted(sw['cpu_gflops'].items()))
            print(f"at the per-width speeds measured for this preset (docs/isodepth.md: {rates} GFLOP/s a "
                  f"core, a step no shorter than {sw['min_step_s']:g} s): ~{cpu_hours(todo, sw):.1f} "
                  f"core-hours")
        return None
    if not args.report_only:
        run_sweep(todo, dict(eval_depth=False), launcher, args)  # the final val loss is all the law needs
    return sweep_report(jobs, args, read_json(os.path.join(args.out, 'sweep.json'), {}))

# -----------------------------------------------------------------------------
# command line


def parser():
    ap = Parser('lab/isodepth.py', __doc__.split('\n\n')[0])
    ap.epilog = "Any other flag is a config override for every run of the sweep: --key=value."
    ap.add_argument('--fit', default='', metavar='RUNS.csv', help=f"fit a table of runs: {','.join(COLUMNS)}")
    ap.add_argument('--json', default='', metavar='OUT', help='--fit: also write the fit here')
    ap.add_argument('--preset', default='laptop', choices=sorted(SWEEPS), help='the sweep: its grid and base')
    ap.add_argument('--case', default='baseline',
                    help=f"the case(s) to train, comma-separated: {', '.join(CASES)}, or all")
    ap.add_argument('--widths', default='', help="comma-separated, replacing the preset's")
    ap.add_argument('--budgets', default='', help="FLOP budgets, comma-separated, replacing the preset's")
    ap.add_argument('--rs', default='', help="recurrence counts, comma-separated, replacing the preset's")
    ap.add_argument('--seeds', default='',
                    help="train every cell at each of these seeds (comma-separated), not the preset's one "
                         "seed a cell and a second on its noise cells")
    ap.add_argument('--base', action='append', default=[], help="config file(s) replacing the preset's base")
    ap.add_argument('--out', default=None, help='runs go to <out>/<run>; default out-isodepth-<preset>')
    ap.add_argument('--report_dir', default=None, help='default: assets/ for the laptop preset, else <out>')
    ap.add_argument('--report_only', action='store_true', help='fit the finished runs only, training none')
    ap.add_argument('--grouped', action='store_true',
                    help="refit <report_dir>/isodepth_<case>.csv resampling (budget, width) groups: phi's "
                         "CI, the tests of phi = 0 and 1, delta phi on matched runs "
                         "(assets/isodepth_grouped.md)")
    runner_flags(ap)
    ap.add_argument('--starts', type=int, default=500, help='random starts of each fit')
    ap.add_argument('--resamples', type=int, default=200, help='bootstrap resamples of the cells')
    ap.add_argument('--boot_starts', type=int, default=20,
                    help="random starts of each bootstrap refit, besides the full fit's optimum")
    ap.add_argument('--seed', type=int, default=0, help='of the random starts and the resampling')
    ap.add_argument('--simulate', type=int, default=0, metavar='DRAWS',
                    help="train nothing: draw the grid's baseline runs DRAWS times from the law fitted in "
                         "<report_dir>/isodepth.json, fit each: the CI on phi, the minima over width")
    ap.add_argument('--simulate_phi', type=float, default=None,
                    help="--simulate: draw at this phi instead of the fitted one")
    return ap


def numbers(flag, text, kind):
    try:
        return [kind(float(v)) if kind is int else kind(v) for v in text.split(',') if v]
    except ValueError:
        die(f"--{flag}={text}: expected comma-separated numbers")


def sweep_args(args, overrides, argv):
    """The sweep's flags checked, with defaults filled in (as lab/ablate.py's parse_args)."""
    for s in overrides:
        if not (s.startswith('--') and '=' in s):
            die(f"unrecognized arguments: {s}; a config override is written --key=value "
                f"(see python lab/isodepth.py --help)")
    args.overrides, args.command = overrides, 'python lab/isodepth.py ' + shlex.join(argv)
    args.case = list(CASES) if args.case == 'all' else [c for c in args.case.split(',') if c]
    for c in args.case:
        if c not in CASES:
            die(f"--case={c}: choose one of {', '.join(CASES)}, or all")
    args.widths, args.rs = numbers('widths', args.widths, int), numbers('rs', args.rs, int)
    args.seeds = numbers('seeds', args.seeds, int)
    args.budgets = numbers('budgets', args.budgets, float)
    args.out = args.out or f'out-isodepth-{args.preset}'
    args.report_dir = args.report_dir or ('assets' if args.preset == 'laptop' and not args.base else args.out)
    args.slurm_args = slurm_options(args.slurm_args)
    args.eval_args, args.reeval = '', False  # the runner's: no eval_depth.py here
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args, overrides = parser().parse_known_args(argv)
    if args.simulate < 0:
        die(f"--simulate={args.simulate}: must be >= 0")
    for flag in ('starts', 'resamples'):
        if getattr(args, flag) < 1:
            die(f"--{flag}={getattr(args, flag)}: must be >= 1")
    if args.boot_starts < 0:
        die(f"--boot_starts={args.boot_starts}: must be >= 0")
    if args.fit or not args.dry_run:
        scipy_optimize()  # the fit needs it: stop now, not after the sweep's training
    if args.grouped:
        return grouped(sweep_args(args, overrides, argv))
    if not args.fit:
        return sweep(sweep_args(args, overrides, argv))
    if overrides:
        die(f"unrecognized arguments: {' '.join(overrides)} (--fit takes a table, not config overrides)")
    runs = read_runs(args.fit)
    # the Huber and least-squares fits, the bootstrap's refits, and the tests' draws (two refits each)
    n_fits = 3 * (args.starts + args.starts // 5 + 2) + args.resamples * (1 + args.boot_starts) + \
        2 * args.resamples * (3 + 2 * TEST_STARTS)
    print(f"{args.fit}: {len(runs['loss'])} runs; {n_fits:,} L-BFGS-B fits (about 10 ms each on a CPU core)")
    res = fit(runs, args.starts, args.resamples, args.boot_starts, args.seed)
    report(res)
    if args.json:
        with open(args.json, 'w', encoding='utf-8') as f:
            json.dump(res, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == '__main__':
    main()
