r"""
Looped-MoE's sweep (docs/papers.md §5): the evaluation of one run and the report of the preset.

    python lab/ablate.py moe                       # 5 arms x 3 seeds, then this report in assets/moe.md
    python lab/moe.py out-ablate-moe/looped_moe-s1 # one run: CE at every loop boundary, routing vs chance

One run's evaluation (<run>/moe_eval.json) holds the val CE at every *boundary*: after each loop of a looped
model, and after the same number of layers (--boundary, the looped arms' K) of a unique one, read out by
the same readout norm and head (the paper's early-exit claim: loop boundaries against a standard model's
intermediate layers). For a looped model with experts it holds the routing divergence between its loops
too (lab/routing.py: overlap of the top-k sets against independent routing, kappa, kappa given the input
token, JS, distinct experts), and for every run the model's config, so that the records tell the shapes apart.

The report's verdicts, each from the one rule (lab/verdict.py) on a 95 % CI over the seeds, paired by seed:
  (a) experts close dense looping's gap: CE(dense_looped) - CE(looped_moe) over CE(dense_looped) -
      CE(dense_unique), the share of the gap closed (>= 1: reversed)
  (b) loop boundaries are better exits: looped_moe's CE below dense_unique's at every inner boundary
  (c) routing diverges more than chance: kappa < 0 in every layer and pair of loops
  (d) routing agrees more than chance: kappa > 0 in every layer and pair of loops (c's opposite reading)
  (e) tied routing loses what the experts gained: the share of looped_moe's gain over dense_looped that
      looped_moe_tied loses, claimed > 0 and the whole of it
  (f) forcing the loops apart helps: looped_moe_disjoint (loop k routes among its own E/R experts, a pool
      halved as well as kept apart) ends below looped_moe; with (e) the causal test has two sides:
      divergence helping predicts (f) and (e)
  (g) the same at a matched pool (the moe_pool preset): looped_moe_pooled, disjoint routing over R x E
      experts, so that each loop keeps E of its own, against looped_moe
"""
import dataclasses
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the core is one folder up
LAB = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, LAB)
from compute import kernels
from configurator import Parser, die
from run import checkpoint
from eval_depth import cpu_threads, val_windows, write_json
from prepare import load_meta
from reports import fmt, mean, plt_or_none, read_json, save, std, verdict_block
from routing import collect, divergence
from verdict import mean_ci, verdict

ARMS = ('dense_unique', 'moe_unique', 'dense_looped', 'looped_moe', 'looped_moe_tied', 'looped_moe_disjoint',
        'looped_moe_pooled')

# -----------------------------------------------------------------------------
# one run


@torch.no_grad()
def boundary_ce(model, X, Y, K):
    """The CE (n_boundaries,) of X -> Y at every boundary: each loop's exit of a looped model; after every
    K layers of a unique one (n_loop = 1), through the same readout norm and head."""
    if model.config.n_loop > 1:
        return model.exit_metrics(X, Y)[0]
    x, ces, W = model.begin(X), [], model.lm_head.weight
    rope = model.rope(0, X.size(1))
    for j, block in enumerate(model.transformer.h, start=1):
        x, _ = block(x, rope)
        if j % K == 0:
            ces.append(kernels.cross_entropy_chunked(model.coda_readout(x, 1, R=1), W, Y))
    return torch.stack(ces)


def evaluate(model, X, Y, K, batch_size):
    cfg = model.config
    ces = [boundary_ce(model, X[i:i + batch_size], Y[i:i + batch_size], K)
           for i in range(0, X.size(0), batch_size)]
    # config: the model's arguments (n_layer, n_loop, n_expert, top_k, ...), which the report's records carry
    res = dict(boundary_ce=torch.stack(ces).mean(0).tolist(), K=K, tokens=X.numel(),
               config=dataclasses.asdict(cfg))
    if cfg.n_expert and cfg.n_loop > 1:  # routing between loops: the shared layers' visits
        routes, tokens = collect(model, X, batch_size)
        res['routing'] = divergence(routes, cfg.n_expert, cfg.top_k, tokens)
    return res


def pairs_of(e):
    """(layer, loop a, loop b, its routing metrics) of one run's moe_eval.json."""
    return [(L['layer'], *p['loops'], p) for L in e.get('routing', {}).get('layers', []) for p in L['pairs']]


def main(argv=None):
    ap = Parser('lab/moe.py', __doc__)
    ap.add_argument('out_dir', help='a folder holding ckpt.pt')
    ap.add_argument('--boundary', type=int, default=0, help="a unique model's layers per boundary "
                    "(the looped arms' K); 0 = the model's own n_layer")
    ap.add_argument('--n_seqs', type=int, default=256, help='validation windows')
    ap.add_argument('--batch_size', type=int, default=32)
    ap.add_argument('--json', default=None, help='output file; default <out_dir>/moe_eval.json')
    args = ap.parse_args(argv)
    torch.set_num_threads(cpu_threads())
    path = os.path.join(args.out_dir, 'ckpt.pt')
    if not os.path.isfile(path):
        die(f"checkpoint {path} not found: pass the folder holding ckpt.pt (python lab/moe.py OUT_DIR)")
    ckpt = checkpoint.load(path)
    model = checkpoint.build_model(ckpt).eval()
    K = args.boundary or model.config.n_layer
    if model.config.n_loop == 1 and model.config.n_layer % K:
        die(f"--boundary={K} does not divide the model's {model.config.n_layer} layers")
    data_dir = os.path.join('data', ckpt.get('dataset', ''))
    X, Y = val_windows(data_dir, load_meta(data_dir), model.config.block_size, args.n_seqs)
    res = dict(evaluate(model, X, Y, K, args.batch_size), iter_num=ckpt.get('iter_num'))
    print(f"{path}: val CE at each boundary " + ' '.join(f"{c:.4f}" for c in res['boundary_ce']))
    for j, a, b, p in pairs_of(res):
        print(f"  layer {j} loops {a}-{b}: kappa {fmt(p['kappa'], '+.3f')} (given the input token "
              f"{fmt(p.get('kappa_given_token'), '+.3f')}), disjoint {p['overlap'][0]:.3f} "
              f"(chance {p['chance'][0]:.3f})")
    out = args.json or os.path.join(args.out_dir, 'moe_eval.json')
    write_json(out, res)
    print(f"wrote {out}")

# -----------------------------------------------------------------------------
# the report


def runs_of(arms):
    """{arm: {seed: moe_eval.json}} of the runs evaluated."""
    return {name: {r['seed']: e for r in runs
                   if (e := read_json(os.path.join(r['out_dir'], 'moe_eval.json')))}
            for name, runs in arms.items()}


def paired(ev, f, *names):
    """f(evals of names...) per seed that every arm of names has."""
    seeds = sorted(set.intersection(*(set(ev.get(n, {})) for n in names))) if names else []
    return [f(*(ev[n][s] for n in names)) for s in seeds]


def claim(values, how, **rule):
    # the one verdict rule (lab/verdict.py) on the per-seed values, each seed an independent unit
    if not values:
        return 'not tested', 0, how
    word, why = verdict(*mean_ci(values), n=len(values), spec='+.4f', **rule)
    return word, len(values), f"{how}: {why}"


def final(e):
    # an evaluation's val CE at full depth: its last boundary
    return e['boundary_ce'][-1]


def verdicts(ev):
    gap = paired(ev, lambda u, d, m: (final(d) - final(m)) / (final(d) - final(u)),
                 'dense_unique', 'dense_looped', 'looped_moe')
    inner = lambda e: e['boundary_ce'][:-1]  # the boundaries before full depth
    exits = paired(ev, lambda u, m: max(cm - cu for cm, cu in zip(inner(m), inner(u))),
                   'dense_unique', 'looped_moe')
    kappas = [[p['kappa'] for *_, p in pairs_of(e) if p['kappa'] is not None]
              for e in ev.get('looped_moe', {}).values()]
    kappa_max, kappa_min = [max(k) for k in kappas if k], [min(k) for k in kappas if k]
    cells = {}  # (layer, a, b) -> kappa per seed: how many cells lean each way, on the mean over seeds
    for e in ev.get('looped_moe', {}).values():
        for j, a, b, p in pairs_of(e):
            cells.setdefault((j, a, b), []).append(p['kappa'])
    signs = [mean(v) for v in cells.values() if None not in v]
    lean = (f"; on the mean over seeds kappa > 0 in {sum(x > 0 for x in signs)} of {len(signs)} "
            f"(layer, pair of loops) cells, < 0 in {sum(x < 0 for x in signs)}")
    lost = paired(ev, lambda d, m, t: (final(t) - final(m)) / (final(d) - final(m)),
                  'dense_looped', 'looped_moe', 'looped_moe_tied')
    out = [('experts close dense looping\'s gap to the unique model',
            *claim(gap, "computed: the share of CE(dense_looped) - CE(dense_unique) that looped_moe closes "
                   "per seed (>= 1: reversed), claimed > 0", sign=+1)),
           ('loop boundaries are better exits',
            *claim(exits, "computed: looped_moe's CE minus dense_unique's at the same depth, worst inner "
                   "boundary per seed, claimed < 0", sign=-1)),
           ('routing diverges more than chance',
            *claim(kappa_max, "computed: the largest kappa of the layers and pairs of loops per seed (0: "
                   "independent routing), claimed < 0 (kappa < 0 in every one)" + lean, sign=-1)),
           ('routing agrees more than chance',
            *claim(kappa_min, "computed: the smallest kappa of the layers and pairs of loops per seed, "
                   "claimed > 0 (kappa > 0 in every one)" + lean, sign=+1)),
           ('tied routing loses the experts\' gain',
            *claim(lost, "computed: the share of looped_moe's gain over dense_looped that looped_moe_tied "
                   "loses per seed, claimed > 0 and the whole of it (1)", sign=+1, paper=1.0)),
           ('forcing the loops apart helps', *forced_verdict(ev))]
    if ev.get('looped_moe_pooled'):  # the moe_pool preset: the same test at a matched pool
        out.append(('forcing the loops apart helps at a matched pool', *pooled_verdict(ev)))
    return out


def versus(ev, base, arm):
    # CE(arm) - CE(base) at full depth, per seed both ran
    return paired(ev, lambda b, a: final(a) - final(b), base, arm)


def side_ci(diffs, label):
    if len(diffs) < 2:
        return ''
    m, lo, hi = mean_ci(diffs)
    return f"; {label} {m:+.4f} nats, 95 % CI [{lo:+.4f}, {hi:+.4f}] over {len(diffs)} seeds"


def below_free(ev, arm, why, side):
    d = versus(ev, 'looped_moe', arm)
    each = f" ({', '.join(f'{x:+.4f}' for x in d)})" if d else ''
    return claim(d, f"computed: CE({arm}) - CE(looped_moe) at full depth per seed{each}, claimed < 0; {why}"
                 + side, sign=-1)


def forced_verdict(ev):
    # (f): the disjoint arm against free routing, paired by seed; the tied arm's side read the same way
    # (positive: above free routing), so both halves of the causal test are in the one line. Disjoint
    # routing also gives each loop E/R experts, not E: a smaller pool, so this is not divergence alone.
    return below_free(ev, 'looped_moe_disjoint', "each loop routes among E/R experts, so the pool halves too",
                      side_ci(versus(ev, 'looped_moe', 'looped_moe_tied'), 'tied - free'))


def pooled_verdict(ev):
    # (g): (f) with the pool kept: looped_moe_pooled routes loop k among its own E experts of R x E, so
    # each loop has as many to pick from as under free routing; beside it, what the pool adds to disjoint
    return below_free(ev, 'looped_moe_pooled', "each loop routes among E experts of its own, R x E in all",
                      side_ci(versus(ev, 'looped_moe_disjoint', 'looped_moe_pooled'),
                              'pooled - disjoint (what the pool adds)'))


def ce_table(ev):
    R = max((len(e['boundary_ce']) for runs in ev.values() for e in runs.values()), default=0)
    lines = ["### Val CE at every boundary", "",
             "Mean over seeds ± sd; a boundary is a loop's exit, or the same depth in a unique model's "
             f"layers, read out through the same norm and head. {R} boundaries; the last is full depth.", "",
             "| arm | seeds | " + ' | '.join(f"boundary {b}" for b in range(1, R + 1)) + " |",
             "|---|---|" + "---|" * R]
    for name, runs in ev.items():
        cols = np.array([e['boundary_ce'] for e in runs.values()]) if runs else np.zeros((0, R))
        cells = [f"{fmt(mean(cols[:, b]), '.4f')} ± {fmt(std(cols[:, b]), '.4f')}" if len(cols) else '–'
                 for b in range(R)]
        lines.append(f"| {name} | {len(runs)} | " + ' | '.join(cells) + " |")
    return lines + [""]


def paired_table(ev):
    at = lambda name, s: ev.get(name, {}).get(s, {}).get('boundary_ce', [None])[-1]  # None: no such run
    seeds = sorted({s for runs in ev.values() for s in runs})
    arms = [n for n in ARMS if ev.get(n)]  # the arms with runs: a preset may have a subset
    lines = ["### Paired by seed: full-depth CE and the shares the verdicts read", "",
             "gap closed = (dense_looped - looped_moe) / (dense_looped - dense_unique); tied keeps = "
             "(dense_looped - looped_moe_tied) / (dense_looped - looped_moe).", "",
             "| seed | " + ' | '.join(arms) + " | gap closed | tied keeps |",
             "|---|" + "---|" * (len(arms) + 2)]
    for s in seeds:
        u, m, d, t = (at(n, s) for n in ('dense_unique', 'looped_moe', 'dense_looped', 'looped_moe_tied'))
        share = lambda a, b: (a / b) if a is not None and b else None
        closed = share(d - m, d - u) if None not in (u, m, d) else None
        kept = share(d - t, d - m) if None not in (m, d, t) else None
        lines.append(f"| {s} | " + ' | '.join(fmt(at(n, s), '.4f') for n in arms)
                     + f" | {fmt(closed, '.2f')} | {fmt(kept, '.2f')} |")
    return lines + [""]


def exits_table(ev):
    """Per seed and inner boundary, verdict (b)'s reading split in two: what looping does to the dense
    model and what the experts add to the loop (the two sum to looped_moe - dense_unique)."""
    ce = lambda name, s: ev.get(name, {}).get(s, {}).get('boundary_ce')
    arms = ('dense_unique', 'dense_looped', 'looped_moe')
    seeds = sorted(set.intersection(*(set(ev.get(n, {})) for n in arms)))
    if not seeds:
        return []
    lines = ["### Paired by seed: the inner boundaries, looping and experts apart", "",
             "Val CE differences in nats at each boundary before full depth (below 0: the first arm is "
             "lower). looped_moe - dense_unique is what 'loop boundaries are better exits' reads; it is the "
             "sum of what looping does to the dense model (dense_looped - dense_unique) and what the experts "
             "add to the loop (looped_moe - dense_looped).", "",
             "| seed | boundary | looped_moe - dense_unique | dense_looped - dense_unique | "
             "looped_moe - dense_looped |", "|---|---|---|---|---|"]
    rows = {}  # boundary -> each seed's three differences, in the columns' order
    for s in seeds:
        u, d, m = (ce(n, s) for n in arms)
        for b in range(min(map(len, (u, d, m))) - 1):
            rows.setdefault(b + 1, []).append((m[b] - u[b], d[b] - u[b], m[b] - d[b]))
            lines.append(f"| {s} | {b + 1} | " + ' | '.join(f"{x:+.4f}" for x in rows[b + 1][-1]) + " |")
    for b, diffs in rows.items():  # over the seeds: a difference of the CE table's means
        lines.append(f"| mean | {b} | " + ' | '.join(f"{mean(col):+.4f}" for col in zip(*diffs)) + " |")
    return lines + [""]


def routing_table(ev, arm):
    runs = ev.get(arm, {})
    pairs = {}
    for e in runs.values():
        for j, a, b, p in pairs_of(e):
            pairs.setdefault((j, a, b), []).append(p)
    if not pairs:
        return []
    lines = [f"### {arm}: routing divergence between loops, against chance", "",
             "Per physical layer and pair of loops, mean over seeds: the share of tokens whose top-k sets "
             "share o experts (independent routing with each loop's own usage in brackets), mean Jaccard, "
             "kappa = (mean o - o_ind) / (k - o_ind) (0 independent, 1 identical), kappa given token (the "
             "same against the chance agreement within each input token: the agreement the token does not "
             "explain; n/a for a run evaluated before lab/routing.py measured it) and the Jensen-Shannon "
             "divergence of the loops' expert usage (bits).", "",
             "| layer | loops | o = 0 (chance) | o = k (chance) | Jaccard | kappa | kappa given token | JS |",
             "|---|---|---|---|---|---|---|---|"]
    for (j, a, b), ps in sorted(pairs.items()):
        m = lambda key, i=None: mean([p[key] if i is None else p[key][i] for p in ps
                                      if p.get(key) is not None])
        lines.append(f"| {j} | {a}-{b} | {m('overlap', 0):.3f} ({m('chance', 0):.3f}) | "
                     f"{m('overlap', -1):.3f} ({m('chance', -1):.3f}) | {m('jaccard'):.3f} | "
                     f"{fmt(m('kappa'), '+.3f')} | {fmt(m('kappa_given_token'), '+.3f')} | "
                     f"{m('js_bits'):.3f} |")
    return lines + [""]


def plot_overlap(plt, ev, report_dir, prefix):
    pairs = [p for e in ev.get('looped_moe', {}).values() for *_, p in pairs_of(e)]
    if plt is None or not pairs:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    o = np.arange(len(pairs[0]['overlap']))
    ax1.bar(o - 0.2, np.mean([p['overlap'] for p in pairs], 0), 0.4, label='looped_moe')
    ax1.bar(o + 0.2, np.mean([p['chance'] for p in pairs], 0), 0.4, label='independent (chance)')
    ax1.set(xlabel='overlap o of the top-k sets of two loops', ylabel='share of tokens', xticks=o)
    ax1.legend()
    for arm in ('looped_moe', 'looped_moe_tied'):
        ks = {}
        for e in ev.get(arm, {}).values():
            for j, a, b, p in pairs_of(e):
                ks.setdefault(f"L{j} {a}-{b}", []).append(p['kappa'])
        ks = {key: [x for x in v if x is not None] for key, v in ks.items()}
        ax2.plot(list(ks), [mean(v) if v else np.nan for v in ks.values()], 'o-', label=arm)
    ax2.axhline(0, color='gray', lw=0.8)
    ax2.set(ylabel='kappa (0 = chance)', xlabel='layer, loops')
    ax2.tick_params(axis='x', rotation=60)
    ax2.legend()
    fig.tight_layout()
    return save(fig, plt, report_dir, f'{prefix}_routing.png')


def moe_report(arms, header, report_dir, prefix):
    ev = runs_of(arms)
    lines = header + ce_table(ev) + paired_table(ev) + exits_table(ev)
    lines += routing_table(ev, 'looped_moe') + routing_table(ev, 'looped_moe_tied')
    plot = plot_overlap(plt_or_none(), ev, report_dir, prefix)
    lines += [f"![{plot}]({plot})", ""] if plot else []
    return lines + verdict_block(verdicts(ev))


if __name__ == '__main__':
    main()
