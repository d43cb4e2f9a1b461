"""
The iso-depth law's fit (docs/isodepth.md; lab/isodepth.py --fit, whose docstring says what each number is):
the runs' table and its (budget, r) cells, L = E + A (N_once + r^phi N_rec)^(-alpha) + B D^(-beta) fitted by
L-BFGS-B on a Huber loss of log L, phi's bootstrap CI over the cells, the tests of phi = 0 and phi = 1, a case
study's delta phi on the cells it shares with the baseline, and the refits by (budget, width) groups.
"""
import csv
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the core is one folder up
from configurator import die

COLUMNS = ('n_once', 'n_rec', 'r', 'tokens', 'loss')
HUBER_DELTA = 1e-3
# the paper's box for the random starts, in the order of a parameter vector (a, b, e, alpha, beta, phi)
NAMES = ('a', 'b', 'e', 'alpha', 'beta', 'phi')
BOX = ((-5, 35), (-5, 35), (-3, 2), (0, 2.5), (0, 2.5), (-3, 3))
SAME = 1.1  # budgets (or a width's token counts) within 10 % of each other are one
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


if __name__ == '__main__':  # a module the lab's commands import
    print("lab/isodepth_fit.py: isodepth.py's fit, not a command; see python lab/isodepth.py --help")
