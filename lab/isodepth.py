r"""
The iso-depth scaling law of Schwethelm et al. 2026 (docs/isodepth.md, docs/papers.md §3): how much one
recurrence of a looped block is worth, in unique parameters, fitted to a table of training runs.

    python lab/isodepth.py --fit runs.csv                      # phi with its 95 % CI, the law, fit quality
    python lab/isodepth.py --fit runs.csv --json fit.json      # the same numbers as JSON
    python lab/isodepth.py --fit runs.csv --starts=100 --resamples=50   # a quicker look

RUNS.csv holds one run a row, with the columns
    n_once   parameters run once: prelude + coda blocks (model.param_counts; no embedding, no head)
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
says how much the free phi buys. The CI of phi is the percentile interval of --resamples bootstrap refits
over the (budget, r) cells: whole cells are resampled, not rows, since the runs of a cell share their
training recipe and their errors. Each refit starts from the full fit's optimum and --boot_starts random
points. phi is reported "not identified" when that CI is wider than 0.5 (PHI_CI_WIDTH).

The sweep that produces such a table (the paper's grid through lab/ablate.py's runners) is not built yet;
`python lab/isodepth.py` without --fit says so.
"""
import csv
import json
import math
import os
import sys

import numpy as np
from scipy.optimize import minimize

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the core is one folder up
from errors import Parser, die

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


def huber(res):
    """Huber loss of the residuals (summed) and its derivative, delta = HUBER_DELTA."""
    small = np.abs(res) <= HUBER_DELTA
    loss = np.where(small, 0.5 * res ** 2, HUBER_DELTA * (np.abs(res) - 0.5 * HUBER_DELTA))
    return loss.sum(), np.where(small, res, HUBER_DELTA * np.sign(res))


def fit_once(x, logL, starts, bounds):
    """The best of L-BFGS-B from each start: (theta, objective)."""
    def objective(theta):
        pred, grad = predict(theta, *x)
        loss, dres = huber(pred - logL)
        # divided by delta: the same minimum, gradients of order one for the optimizer's tolerances
        return loss / HUBER_DELTA, grad @ dres / HUBER_DELTA
    best = None
    for theta0 in starts:
        out = minimize(objective, theta0, jac=True, method='L-BFGS-B', bounds=bounds,
                       options=dict(maxiter=1000, ftol=1e-10))
        if best is None or out.fun < best.fun:
            best = out
    return best.x, best.fun


def random_starts(rng, n, phi=None):
    lo, hi = np.array(BOX, float).T
    starts = rng.uniform(lo, hi, size=(n, len(BOX)))
    if phi is not None:
        starts[:, -1] = phi
    return starts


def quality(theta, x, loss):
    """R^2 and RMSE (nats) of the fit, on the loss itself."""
    pred = np.exp(predict(theta, *x)[0])
    ss = ((pred - loss) ** 2).sum()
    return dict(r2=float(1 - ss / ((loss - loss.mean()) ** 2).sum()), rmse=float(math.sqrt(ss / len(loss))))


def law(theta):
    named = dict(zip(NAMES, map(float, theta)))
    return dict(named, A=math.exp(named['a']), B=math.exp(named['b']), E=math.exp(named['e']))


def bootstrap_phi(runs, x, logL, free, resamples, boot_starts, rng):
    """phi of each refit to a resample of the (budget, r) cells, and how many resamples held one budget's
    or one r's cells only. Each refit starts from the full fit's optimum `free` and boot_starts random
    points."""
    ids, budgets, rs = cells(runs)
    rows = [np.flatnonzero(ids == c) for c in range(len(rs))]
    phis, degenerate = [], 0
    for _ in range(resamples):
        drawn = rng.integers(len(rs), size=len(rs))
        # such a resample cannot identify phi: its phi is arbitrary and widens the CI, as it should, since
        # the design then rests on few cells. Counted, not dropped
        degenerate += len(set(budgets[drawn])) < 2 or len(set(rs[drawn])) < 2
        take = np.concatenate([rows[c] for c in drawn])
        theta, _ = fit_once(x[:, take], logL[take], [free, *random_starts(rng, boot_starts)], BOX)
        phis.append(theta[-1])
    return np.array(phis), degenerate


def fit(runs, starts=500, resamples=200, boot_starts=20, seed=0):
    """The law fitted to runs (read_runs' dict): a dict of the free fit's parameters, phi's bootstrap CI,
    and the quality of the free and the phi = 0 / phi = 1 fits. Stops with one line if phi is not
    identifiable from these runs at all."""
    why = not_identified(runs)
    if why:
        die(f"phi is not identified: {why}")
    rng = np.random.default_rng(seed)
    x = np.log(np.stack([runs['n_once'], runs['n_rec'], runs['r'], runs['tokens']]))
    logL = np.log(runs['loss'])
    thetas, fits = {}, {}
    for name, phi in (('free', None), ('phi=0', 0.0), ('phi=1', 1.0)):
        bounds = BOX if phi is None else (*BOX[:-1], (phi, phi))  # equal bounds: L-BFGS-B holds phi fixed
        thetas[name], _ = fit_once(x, logL, random_starts(rng, starts, phi), bounds)
        fits[name] = dict(quality(thetas[name], x, runs['loss']), **law(thetas[name]))
    phis, degenerate = bootstrap_phi(runs, x, logL, thetas['free'], resamples, boot_starts, rng)
    lo, hi = (float(v) for v in np.percentile(phis, [2.5, 97.5]))
    out = dict(law(thetas['free']), phi_ci=[lo, hi], identified=hi - lo <= PHI_CI_WIDTH, fits=fits,
               n_runs=len(logL), n_cells=len(cells(runs)[2]), degenerate_resamples=degenerate,
               starts=starts, resamples=resamples, boot_starts=boot_starts, seed=seed)
    out['phi_fit'] = out['phi']
    if not out['identified']:
        out['phi'] = None  # a number here would be read as a measurement
    return out

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
    print(f"{'fit':<10} {'R^2':>8} {'RMSE (nats)':>12}")
    for name, q in res['fits'].items():
        print(f"{name:<10} {q['r2']:>8.4f} {q['rmse']:>12.4f}")


def parser():
    ap = Parser('lab/isodepth.py', __doc__.split('\n\n')[0])
    ap.add_argument('--fit', default='', metavar='RUNS.csv', help=f"a table of runs: {','.join(COLUMNS)}")
    ap.add_argument('--json', default='', metavar='OUT', help='also write the fit here')
    ap.add_argument('--starts', type=int, default=500, help='random starts of each fit')
    ap.add_argument('--resamples', type=int, default=200, help='bootstrap resamples of the cells')
    ap.add_argument('--boot_starts', type=int, default=20,
                    help="random starts of each bootstrap refit, besides the full fit's optimum")
    ap.add_argument('--seed', type=int, default=0, help='of the random starts and the resampling')
    return ap


def main(argv=None):
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    if not args.fit:
        die("the iso-depth sweep (the paper's grid through lab/ablate.py) is not built yet: train the runs "
            "elsewhere and fit them with --fit RUNS.csv (see python lab/isodepth.py --help)")
    for flag in ('starts', 'resamples'):
        if getattr(args, flag) < 1:
            die(f"--{flag}={getattr(args, flag)}: must be >= 1")
    if args.boot_starts < 0:
        die(f"--boot_starts={args.boot_starts}: must be >= 0")
    runs = read_runs(args.fit)
    n_fits = 3 * args.starts + args.resamples * (1 + args.boot_starts)
    print(f"{args.fit}: {len(runs['loss'])} runs; {n_fits:,} L-BFGS-B fits (about 10 ms each on a CPU core)")
    res = fit(runs, args.starts, args.resamples, args.boot_starts, args.seed)
    report(res)
    if args.json:
        with open(args.json, 'w', encoding='utf-8') as f:
            json.dump(res, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == '__main__':
    main()
