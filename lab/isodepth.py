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
from run.accounting import param_counts
from reports import finish_plot, fmt, plt_or_none, read_json, read_metrics, read_status, save
from verdict import verdict, weakest

COLUMNS = ('n_once', 'n_rec', 'r', 'tokens', 'loss')
HUBER_DELTA = 1e-3
# the paper's box for the random starts, in the order of a parameter vector (a, b, e, alpha, beta, phi)
NAMES = ('a', 'b', 'e', 'alpha', 'beta', 'phi')
BOX = ((-5, 35), (-5, 35), (-3, 2), (0, 2.5), (0, 2.5), (-3, 3))
SAME = 1.1  # budgets (or a width's token counts) within 10 % of each other are one
GROUPED = 'isodepth_grouped'  # --grouped's report under --report_dir (.md and .json)
# the law has 6 free parameters: at least twice as many runs, so the fit has as many residual degrees of
# freedom as parameters
MIN_RUNS = 12
# the bootstrap resamples cells, so the cells are its sample: at least as many as the law has parameters.
# 6 cells give 462 distinct resamples (4 would give 35)
MIN_CELLS = 6
# phi is read between 0 (a loop adds no capacity) and 1 (a loop is worth a unique block): a 95 % CI wider
# than half of that range cannot tell a loop worth a quarter of a block from one worth three quarters.
# The paper's simulations: 48 runs at 0.01 nats of noise give about +-0.05, 24 runs no constraint at all
PHI_CI_WIDTH = 0.5
EDGE = 1e-4  # a parameter this close to a bound of BOX is on the box's edge
TEST_STARTS = 2  # random starts of each refit of the tests' bootstrap, besides the two fits' optima

# -----------------------------------------------------------------------------
# the runs


def read_runs(path):
    """The CSV as float arrays, one per column; any bad input stops with one line."""
    if not os.path.isfile(path):
        die(f"--fit {path}: no such file")
    with open(path, newline='', encoding='utf-8') as f:
        reader = csv.DictReader(f)
        rows, header = list(reader), reader.fieldnames or []
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        die(f"--fit {path}: missing column(s) {', '.join(missing)}; expected {','.join(COLUMNS)}[,budget]")
    runs = {}
    for c in [*COLUMNS, *(['budget'] if 'budget' in header else [])]:
        for line, row in enumerate(rows, start=2):  # line 1 is the header
            try:
                value = float(row[c])
            except (TypeError, ValueError):
                value = None
            if value is None or not (value > 0 and math.isfinite(value)):
                die(f"--fit {path}: {c} = {row[c]} on line {line}: every {c} must be a positive number")
        runs[c] = np.array([float(row[c]) for row in rows])
    return runs


def groups(values):
    """Labels 0, 1, ... for values, one label for values within SAME of their neighbour (sorted)."""
    order = np.argsort(values)
    gaps = np.diff(np.log(values[order])) > math.log(SAME)
    labels = np.empty(len(values), int)
    labels[order] = np.concatenate([[0], np.cumsum(gaps)])
    return labels


def cells(runs):
    """The cell of every run (an integer id), and each cell's budget label and r: the cells are the
    (budget, r) pairs."""
    budget = runs['budget'] if 'budget' in runs else 6 * (runs['n_once'] + runs['r'] * runs['n_rec']) * \
        runs['tokens']
    keys, ids = np.unique(np.stack([groups(budget), runs['r']]), axis=1, return_inverse=True)
    return ids.ravel(), keys[0].astype(int), keys[1]


def not_identified(runs):
    """Why phi cannot be fitted from these runs at all (a line), or None."""
    n = len(runs['loss'])
    if n < MIN_RUNS:
        return (f"{n} runs: the law has 6 free parameters, so the fit needs at least {MIN_RUNS} runs "
                f"(the paper's simulations constrain phi from about 48)")
    rs = np.unique(runs['r'])
    if len(rs) < 2:
        return f"every run has r = {rs[0]:g}: phi, the worth of a recurrence, needs at least two values of r"
    ids, budgets, _ = cells(runs)
    if budgets.max() < 1:
        return ("every run is at one FLOP budget, so D is fixed by the model's size (collinear with width) "
                "and the data term cannot be told from the parameter term: runs at >= 2 budgets needed")
    model = np.unique(np.stack([runs['n_once'], runs['n_rec']]), axis=1, return_inverse=True)[1].ravel()
    if all(groups(runs['tokens'][model == m]).max() == 0 for m in np.unique(model)):
        return ("each model (n_once, n_rec) trained on one token count, so D moves with width and the data "
                "term cannot be told from the parameter term: train some model at two or more token counts")
    if ids.max() + 1 < MIN_CELLS:
        return (f"{ids.max() + 1} (budget, r) cells: the bootstrap resamples cells and needs at least "
                f"{MIN_CELLS} (e.g. 2 budgets x 3 values of r)")
    return None

# -----------------------------------------------------------------------------
# the fit


def predict(theta, logN_once, logN_rec, logr, logD):
    """log L of the law at parameters theta (a, b, e, alpha, beta, phi), and its gradient (6, n)."""
    a, b, e, alpha, beta, phi = theta
    # N_eff = N_once + r^phi N_rec, in logs: log N_eff = logaddexp(log N_once, phi log r + log N_rec)
    looped = phi * logr + logN_rec
    logN = np.logaddexp(logN_once, looped)
    t1, t2 = a - alpha * logN, b - beta * logD
    top = np.maximum(np.maximum(t1, t2), e)
    w1, w2, w3 = np.exp(t1 - top), np.exp(t2 - top), np.exp(e - top)
    total = w1 + w2 + w3
    pred = top + np.log(total)
    w1, w2, w3 = w1 / total, w2 / total, w3 / total  # the softmax weights: d pred / d term
    dphi = -alpha * w1 * np.exp(looped - logN) * logr  # d log N_eff / d phi = (r^phi N_rec / N_eff) log r
    return pred, np.stack([w1, w2, w3, -w1 * logN, -w2 * logD, dphi])


def huber(res, delta=HUBER_DELTA):
    """Huber loss of the residuals (summed) and its derivative; delta = inf: least squares, 0.5 sum res^2."""
    small = np.abs(res) <= delta
    loss = np.where(small, 0.5 * res ** 2, delta * (np.abs(res) - 0.5 * delta))
    return loss.sum(), np.where(small, res, delta * np.sign(res))


def scipy_optimize():
    # scipy is a lab extra (requirements-dev.txt), imported here so that --help and --dry_run work without it
    try:
        import scipy.optimize
        import scipy.stats
    except ImportError:
        die("lab/isodepth.py fits the law with scipy, which is not installed: pip install scipy")
    return scipy


def fit_once(x, logL, starts, bounds, delta=HUBER_DELTA):
    """The best of L-BFGS-B from each start: (theta, the objective at theta, sum huber(log residuals))."""
    minimize = scipy_optimize().optimize.minimize
    def objective(theta):
        pred, grad = predict(theta, *x)
        loss, dres = huber(pred - logL, delta)
        # divided by delta: the same minimum, gradients of order one for the optimizer's tolerances
        return loss / HUBER_DELTA, grad @ dres / HUBER_DELTA
    best = None
    for theta0 in starts:
        out = minimize(objective, theta0, jac=True, method='L-BFGS-B', bounds=bounds,
                       options=dict(maxiter=1000, ftol=1e-10))
        if best is None or out.fun < best.fun:
            best = out
    return best.x, float(best.fun * HUBER_DELTA)


def random_starts(rng, n, phi=None):
    lo, hi = np.array(BOX, float).T
    starts = rng.uniform(lo, hi, size=(n, len(BOX)))
    if phi is not None:
        starts[:, -1] = phi
    return starts


def bounds_at(phi):
    """The box, with phi held at a value (equal bounds: L-BFGS-B holds it fixed) unless phi is None."""
    return BOX if phi is None else (*BOX[:-1], (phi, phi))


def on_edge(theta):
    """The names of the parameters that end on an edge of the box: the box, not the data, stopped them."""
    return [name for name, v, (lo, hi) in zip(NAMES, theta, BOX) if min(v - lo, hi - v) < EDGE]


def quality(theta, x, loss):
    """R^2 and RMSE (nats) of the fit, on the loss itself: descriptive only (the fit minimises neither)."""
    pred = np.exp(predict(theta, *x)[0])
    ss = ((pred - loss) ** 2).sum()
    return dict(r2=float(1 - ss / ((loss - loss.mean()) ** 2).sum()), rmse=float(math.sqrt(ss / len(loss))))


def law(theta):
    named = dict(zip(NAMES, map(float, theta)))
    return dict(named, A=math.exp(named['a']), B=math.exp(named['b']), E=math.exp(named['e']))


def bootstrap(runs, x, logL, free, resamples, boot_starts, rng):
    """The parameters of each refit to a resample of the (budget, r) cells (resamples x 6), and how many
    resamples held one budget's or one r's cells only. Each refit starts from the full fit's optimum `free`
    and boot_starts random points."""
    ids, budgets, rs = cells(runs)
    rows = [np.flatnonzero(ids == c) for c in range(len(rs))]
    thetas, degenerate = [], 0
    for _ in range(resamples):
        drawn = rng.integers(len(rs), size=len(rs))
        # such a resample cannot identify phi: its phi is arbitrary and widens the CI, as it should, since
        # the design then rests on few cells. Counted, not dropped
        degenerate += len(set(budgets[drawn])) < 2 or len(set(rs[drawn])) < 2
        take = np.concatenate([rows[c] for c in drawn])
        thetas.append(fit_once(x[:, take], logL[take], [free, *random_starts(rng, boot_starts)], BOX)[0])
    return np.array(thetas), degenerate


def box_edges(thetas):
    """How many refits ended on each edge of the box, per parameter."""
    lo, hi = np.array(BOX, float).T
    low, high = (thetas - lo < EDGE).sum(0), (hi - thetas < EDGE).sum(0)
    return {name: dict(low=int(low[i]), high=int(high[i])) for i, name in enumerate(NAMES)}


def objective_bootstrap(x, logL, fitted, phi, observed, resamples, rng):
    """p of the Huber objective's difference (phi fixed minus free) under the phi-fixed law: tables drawn from
    the phi-fixed fit plus the free fit's log residuals resampled with replacement (the noise as the free
    fit sees it), each refitted both ways from the two optima and TEST_STARTS random points."""
    null, free = fitted[phi], fitted[None]
    pred = predict(null, *x)[0]
    noise = logL - predict(free, *x)[0]
    hits = 0  # draws whose difference reaches the observed one
    for _ in range(resamples):
        y = pred + rng.choice(noise, size=len(noise))
        t0, h0 = fit_once(x, y, [null, *random_starts(rng, TEST_STARTS, phi)], bounds_at(phi))
        _, h1 = fit_once(x, y, [free, t0, *random_starts(rng, TEST_STARTS)], BOX)
        hits += int(h0 - h1 >= observed)
    return (hits + 1) / (resamples + 1), hits  # the observed table counts as one draw: p is never 0


def phi_test(x, logL, fitted, objective, ssr, phi, resamples, rng):
    """phi = `phi` against the free fit, by the objectives the fits minimise (docs/isodepth.md):
    statistic: the likelihood ratio of the Gaussian model, n log(SSR_fixed / SSR_free), least-squares refits
    of log L; p: its chi^2 tail, 1 dof (Wilks); p_boot: the bootstrap p of the Huber objective's
    difference, the fit's own objective (objective_bootstrap)."""
    n = len(logL)
    lr = max(0.0, n * math.log(ssr[phi] / ssr[None]))  # >= 0: the free fits start from the fixed optima
    observed = objective[phi] - objective[None]
    p_boot, hits = (objective_bootstrap(x, logL, fitted, phi, observed, resamples, rng) if resamples
                    else (None, None))
    return dict(statistic=lr, p=float(scipy_optimize().stats.chi2.sf(lr, 1)), dof=1,
                objective_ratio=objective[phi] / objective[None], ssr_ratio=ssr[phi] / ssr[None],
                p_boot=p_boot, boot_hits=hits, boot_resamples=resamples)


def fit(runs, starts=500, resamples=200, boot_starts=20, seed=0, test_resamples=None):
    """The law fitted to runs (read_runs' dict): a dict of the free fit's parameters, phi's bootstrap CI and
    how many refits ended on the box's edges, the tests of phi = 0 and phi = 1 against the free fit
    (vs_phi0, vs_phi1: phi_test, whose bootstrap draws test_resamples tables, by default `resamples`; 0
    skips it), and the free and fixed fits' parameters, objectives and (descriptive) R^2 and RMSE. Stops
    with one line if phi is not identifiable from these runs at all."""
    why = not_identified(runs)
    if why:
        die(f"phi is not identified: {why}")
    rng = np.random.default_rng(seed)
    x = np.log(np.stack([runs['n_once'], runs['n_rec'], runs['r'], runs['tokens']]))
    logL = np.log(runs['loss'])
    thetas, objective = {}, {}
    for phi in (None, 0.0, 1.0):
        thetas[phi], objective[phi] = fit_once(x, logL, random_starts(rng, starts, phi), bounds_at(phi))
    # the free fit is no worse than a fixed one: released from their optima too. No random draws here, so the
    # bootstrap below draws what it drew before the tests existed
    released = fit_once(x, logL, [thetas[0.0], thetas[1.0]], BOX)
    if released[1] < objective[None]:
        thetas[None], objective[None] = released
    boot, degenerate = bootstrap(runs, x, logL, thetas[None], resamples, boot_starts, rng)
    phis = boot[:, -1]
    lo, hi = (float(v) for v in np.percentile(phis, [2.5, 97.5]))
    # the tests draw from a stream of their own. The Gaussian model of the same law, for the likelihood
    # ratio: least squares on log L, from the Huber optimum (and, free, from the fixed least-squares optima)
    # and a fifth as many random starts
    rng = np.random.default_rng([seed, 1])
    ls, ssr = {}, {}
    for phi in (0.0, 1.0, None):
        seeds = [thetas[phi]] + ([] if phi is not None else [ls[0.0], ls[1.0]])
        ls[phi], half = fit_once(x, logL, [*seeds, *random_starts(rng, max(1, starts // 5), phi)],
                                 bounds_at(phi), delta=np.inf)
        ssr[phi] = 2 * half
    fits = {name: dict(quality(thetas[phi], x, runs['loss']), objective=objective[phi], ssr=ssr[phi],
                       on_edge=on_edge(thetas[phi]), **law(thetas[phi]))
            for name, phi in (('free', None), ('phi=0', 0.0), ('phi=1', 1.0))}
    draws = resamples if test_resamples is None else test_resamples
    tests = {f'vs_phi{phi:g}': phi_test(x, logL, thetas, objective, ssr, phi, draws, rng)
             for phi in (0.0, 1.0)}
    out = dict(law(thetas[None]), phi_ci=[lo, hi], identified=hi - lo <= PHI_CI_WIDTH, **tests, fits=fits,
               box_edges=box_edges(boot), n_runs=len(logL), n_cells=len(cells(runs)[2]),
               degenerate_resamples=degenerate, phi_boot=[round(float(p), 4) for p in phis],
               starts=starts, resamples=resamples, boot_starts=boot_starts, seed=seed)
    out['phi_fit'] = out['phi']
    if not out['identified']:
        out['phi'] = None  # a number here would be read as a measurement
    return out


def shared_cells(base, case):
    """Each table's rows in the (budget, r) cells that both tables hold: {cell key: row indices} per table.
    Budgets are labelled over both tables at once, so that a cell means the same budget in each."""
    budget = np.concatenate([t['budget'] for t in (base, case)])
    label = groups(budget)
    keyed = []
    for t, lab in ((base, label[:len(base['r'])]), (case, label[len(base['r']):])):
        keys = {}
        for i, key in enumerate(zip(lab, t['r'])):
            keys.setdefault(key, []).append(i)
        keyed.append(keys)
    common = sorted(set(keyed[0]) & set(keyed[1]))
    return common, [{k: np.array(keys[k]) for k in common} for keys in keyed]


def delta_phi(base, case, starts=500, resamples=200, boot_starts=20, seed=0):
    """phi of a case study minus the baseline's (read_runs' dicts, each with its budget column), both fitted
    to the (budget, r) cells they share, and the paired bootstrap's 95 % CI: every draw resamples those cells
    once and refits both tables to the same draw, so the r = 1 runs the cases share, and the budgets' luck,
    cancel in the difference. Also the baseline's phi on those cells (its own fit may hold more)."""
    common, rows = shared_cells(base, case)
    logs = []  # each table's log n_once, n_rec, r, tokens and log L
    for t, idx in zip((base, case), rows):
        sub = {c: t[c][np.concatenate([idx[k] for k in common] or [[]]).astype(int)]
               for c in (*COLUMNS, 'budget')}
        why = not_identified(sub)
        if why:
            return dict(error=f"on the {len(common)} cells both cases hold: {why}", n_cells=len(common))
        logs.append(np.log(np.stack([t[c] for c in COLUMNS])))

    def refit(x, idx, keys, starts):
        take = np.concatenate([idx[k] for k in keys])
        return fit_once(x[:4, take], x[4, take], starts, BOX)[0]
    rng = np.random.default_rng([seed, 2])
    point = [refit(x, idx, common, random_starts(rng, starts)) for x, idx in zip(logs, rows)]
    deltas, degenerate = [], 0
    for _ in range(resamples):
        drawn = [common[i] for i in rng.integers(len(common), size=len(common))]
        degenerate += len({b for b, _ in drawn}) < 2 or len({r for _, r in drawn}) < 2
        phis = [refit(x, idx, drawn, [theta, *random_starts(rng, boot_starts)])[-1]
                for x, idx, theta in zip(logs, rows, point)]
        deltas.append(phis[1] - phis[0])
    lo, hi = (float(v) for v in np.percentile(deltas, [2.5, 97.5]))
    return dict(delta_phi=float(point[1][-1] - point[0][-1]), delta_phi_ci=[lo, hi], n_cells=len(common),
                baseline_phi=float(point[0][-1]), case_phi=float(point[1][-1]), resamples=resamples,
                degenerate_resamples=degenerate, delta_boot=[round(float(d), 4) for d in deltas])

# -----------------------------------------------------------------------------
# the grouped analysis: the runs of one (budget, width) share their width's recipe and their residuals
# correlate (docs/isodepth.md), so the resampling unit is the (budget, width) group, not the run or the cell

def read_table(path):
    """A report's CSV (write_csv's columns) as float arrays, budget, width and seed included."""
    if not os.path.isfile(path):
        die(f"{path}: no such file (lab/isodepth.py --report_only writes it)")
    with open(path, newline='', encoding='utf-8') as f:
        rows = list(csv.DictReader(f))
    return {c: np.array([float(row[c]) for row in rows]) for c in (*COLUMNS, 'budget', 'width', 'seed')}


def matched(base, case):
    """Row indices (base, case) of the runs both tables hold at the same budget, r, width and seed, and the
    (budget, width) group of each matched pair."""
    def key(t, i):
        return round(math.log(t['budget'][i]), 2), t['r'][i], t['width'][i], t['seed'][i]
    at = {key(case, i): i for i in range(len(case['r']))}
    pairs = [(i, at[key(base, i)]) for i in range(len(base['r'])) if key(base, i) in at]
    ib, ic = (np.array(v, int) for v in zip(*pairs))
    group = [(round(math.log(base['budget'][i]), 2), base['width'][i]) for i in ib]
    return ib, ic, np.unique(group, axis=0, return_inverse=True)[1].ravel()


def fewest_seeds(t, idx):
    """The fewest seeds any (budget, r, width) cell holds among the runs idx of table t: what a verdict on
    those runs rests on, a cell at a time."""
    cell = {}
    for i in idx:
        key = round(math.log(t['budget'][i]), 2), t['r'][i], t['width'][i]
        cell.setdefault(key, set()).add(t['seed'][i])
    return min(len(v) for v in cell.values())


def seeds_label(n):
    return f"{n} seed{'s' if n > 1 else ''}"


def logs_of(t, idx):
    return np.log(np.stack([t[c][idx] for c in COLUMNS]))  # log n_once, n_rec, r, tokens, L


def grouped_delta_phi(base, case, starts, resamples, boot_starts, seed=0):
    """phi(case) - phi(baseline), both fitted to the runs they hold at the same budget, r, width and seed,
    and its 95 % CI by a paired bootstrap over those runs' (budget, width) groups: every draw refits both
    tables to the same groups."""
    ib, ic, g = matched(base, case)
    xs = [logs_of(base, ib), logs_of(case, ic)]
    rng = np.random.default_rng([seed, 3])
    point = [fit_once(x[:4], x[4], random_starts(rng, starts), BOX)[0] for x in xs]
    rows = [np.flatnonzero(g == k) for k in range(g.max() + 1)]
    deltas = []
    for _ in range(resamples):
        take = np.concatenate([rows[k] for k in rng.integers(len(rows), size=len(rows))])
        phis = [fit_once(x[:4, take], x[4, take], [theta, *random_starts(rng, boot_starts)], BOX)[0][-1]
                for x, theta in zip(xs, point)]
        deltas.append(phis[1] - phis[0])
    lo, hi = (float(v) for v in np.percentile(deltas, [2.5, 97.5]))
    return dict(delta_phi=float(point[1][-1] - point[0][-1]), ci=[lo, hi], n_runs=len(ib), n_groups=len(rows),
                seeds=fewest_seeds(base, ib), baseline_phi=float(point[0][-1]), case_phi=float(point[1][-1]))


def grouped_phi(t, starts, resamples, boot_starts, seed=0):
    """phi of one table with its 95 % CI by a bootstrap over the (budget, width) groups, and the p of
    phi = 0 and phi = 1 by a wild bootstrap over the groups: tables drawn from the phi-fixed fit plus the
    free fit's log residuals, each group's flipped in sign together (Rademacher), so that the residuals
    of a group stay as correlated as they are; each draw refitted both ways."""
    x = logs_of(t, np.arange(len(t['r'])))
    g = np.unique(np.stack([groups(t['budget']), t['width']]), axis=1, return_inverse=True)[1].ravel()
    rows = [np.flatnonzero(g == k) for k in range(g.max() + 1)]
    rng = np.random.default_rng([seed, 4])
    fitted = {phi: fit_once(x[:4], x[4], random_starts(rng, starts, phi), bounds_at(phi))
              for phi in (None, 0.0, 1.0)}
    free = fitted[None][0]
    boot = []
    for _ in range(resamples):
        take = np.concatenate([rows[k] for k in rng.integers(len(rows), size=len(rows))])
        boot.append(fit_once(x[:4, take], x[4, take], [free, *random_starts(rng, boot_starts)], BOX)[0][-1])
    out = dict(phi=float(free[-1]), ci=[float(v) for v in np.percentile(boot, [2.5, 97.5])], n_runs=len(g),
               n_groups=len(rows), seeds=fewest_seeds(t, range(len(g))))
    noise = x[4] - predict(free, *x[:4])[0]
    for phi in (0.0, 1.0):
        null, observed = fitted[phi][0], fitted[phi][1] - fitted[None][1]
        pred, hits = predict(null, *x[:4])[0], 0
        for _ in range(resamples):
            y = pred + noise * rng.choice([-1.0, 1.0], size=len(rows))[g]
            t0, h0 = fit_once(x[:4], y, [null, *random_starts(rng, TEST_STARTS, phi)], bounds_at(phi))
            _, h1 = fit_once(x[:4], y, [free, t0, *random_starts(rng, TEST_STARTS)], BOX)
            hits += int(h0 - h1 >= observed)
        out[f'p_phi{phi:g}'] = (hits + 1) / (resamples + 1)  # the observed table is one draw: p is never 0
    return out


GROUP_UNIT = '(budget, width) groups'


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
# the sweep: the iso-depth grid, trained through lab/ablate.py's runners

CASES = ('baseline', 'truncated', 'hyper')  # the paper's model and its two case studies (docs/papers.md §3)
PAPER_PHI = dict(baseline=0.459, truncated=0.380, hyper=0.646)  # the paper's point fits
PAPER_SUBSET_PHI = 0.453  # its baseline on the case studies' 4 budgets: the paper's delta phi starts here
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


def interior_minima(runs, loss):
    """{(budget, r): whether the lowest loss over width lies strictly inside the widths tried}: where it
    does, the iso-FLOP curve is bracketed and its parameter term seen from both sides."""
    inside = {}
    for budget, r in sorted({(b, r) for b, r in zip(runs['budget'], runs['r'])}):
        at = (runs['budget'] == budget) & (runs['r'] == r)
        widths = runs['width'][at]
        best = widths[np.argmin(loss[at])]
        inside[(float(budget), int(r))] = bool(widths.min() < best < widths.max())
    return inside


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


CLAIMS = {'baseline': 'a loop is worth part of a unique block (0 < phi < 1)',
          'truncated': 'truncated backprop lowers phi', 'hyper': 'hyper-connections raise phi'}


CELL_UNIT = '(budget, r) cells'


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
