"""
A sweep's run folders and its report. What the runs left in their folders: metrics.jsonl (train.py),
eval_depth.json (lab/eval_depth.py) and status.json (the runner); the numbers, plots and verdict lines every
report is made of; and write_report, which heads the preset's own report (the function its preset names:
lab/report_blindspot.py, report_matched.py, report_recurrent.py, report_deeploop.py, report_kappa.py,
report_lr_transfer.py, moe.py) with the sweep's command and sizes, and writes it beside a .json of the
runs' records. matplotlib is optional: without it the plots are skipped with a message.
"""
import json
import math
import os

import numpy as np

# -----------------------------------------------------------------------------
# reading a run's folder (the runner reads it too: finished runs are skipped)

def read_json(path, default=None):
    try:
        with open(path, encoding='utf-8') as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return default


def read_metrics(run_dir):
    rows = []
    try:
        with open(os.path.join(run_dir, 'metrics.jsonl'), encoding='utf-8') as fh:
            for line in fh:
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    pass
    except OSError:
        pass
    return rows


def read_status(run_dir):
    return read_json(os.path.join(run_dir, 'status.json'), {})


def runs_by_arm(jobs):
    out = {}
    for j in jobs:
        run = dict(j, rows=read_metrics(j['out_dir']), status=read_status(j['out_dir']),
                   depth=read_json(os.path.join(j['out_dir'], 'eval_depth.json')))
        out.setdefault(j['arm']['name'], []).append(run)
    return out


def depths(runs):
    return [r['depth'] for r in runs if r['depth']]


def final_loss(run):
    return run['rows'][-1]['val_loss'] if run['rows'] and run['status'].get('train') == 'done' else None


def runs_of(runs, **tags):
    # the runs of one cell of a report: those whose arm carries every given tag, e.g. variant=v, R=4
    return [r for r in runs if all(r['arm']['tags'].get(k) == v for k, v in tags.items())]

# -----------------------------------------------------------------------------
# the data's unigram floor (the DeepLoop, kappa_R and escape reports)

def unigram_floor(data_dir):
    """Cross-entropy (nats/token) on val.bin of the unigram distribution of train.bin (add-1/2 smoothing):
    the loss of a model that predicts token frequencies and nothing else (docs/papers.md §2's 'unigram
    floor')."""
    meta = read_json(os.path.join(data_dir, 'meta.json'))
    if meta is None:
        return None
    dt, V = np.dtype(meta['dtype']), meta['vocab_size']
    counts = {}
    for split in ('train', 'val'):
        data = np.memmap(os.path.join(data_dir, f'{split}.bin'), dtype=dt, mode='r')
        c = np.zeros(V, dtype=np.float64)
        for i in range(0, len(data), 1 << 24):
            c += np.bincount(data[i:i + (1 << 24)], minlength=V)[:V]
        counts[split] = c
    p = (counts['train'] + 0.5) / (counts['train'].sum() + 0.5 * V)
    return float(-(counts['val'] * np.log(p)).sum() / counts['val'].sum())


def sweep_floor(arms):
    """The unigram floor of a sweep's data, data/<dataset> of its first run: the run a --report_only call
    resolves the config of (lab/ablate.py)."""
    cfg = next(iter(arms.values()))[0]['cfg']
    return unigram_floor(os.path.join('data', cfg['dataset']))

# -----------------------------------------------------------------------------
# numbers for the reports: eval_depth.json holds null for every inf or nan (a calibrated threshold of
# +inf, 'never exit early', an overflowing PPL), metrics.jsonl may hold NaN

def mean(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else None


def std(xs):
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else None


def fmt(x, spec='.3f', none='n/a'):
    """A number for a table: `none` for None (missing, or JSON's null for inf/nan), inf and nan spelled
    out."""
    if x is None:
        return none
    if isinstance(x, float) and (math.isinf(x) or math.isnan(x)):
        return str(x)
    if spec.endswith('f') and abs(x) >= 1e5:  # e.g. the PPL of an untrained early exit
        return format(x, spec[:-1].split('.')[0] + '.2e')
    return format(x, spec)


def vec(xs, spec):
    return ' / '.join(fmt(x, spec) for x in xs) if xs else 'n/a'


def mean_vec(vs):
    vs = [v for v in vs if v]
    return [mean(col) for col in zip(*vs)] if vs else []


def floats(xs):
    """A JSON list of numbers as a float array, null as nan (matplotlib leaves nan out)."""
    return np.asarray(xs, dtype=float)


def row_near(rows, it):
    return min(rows, key=lambda r: abs(r['iter'] - it)) if rows else None

# -----------------------------------------------------------------------------
# plots and verdict lines

def plt_or_none():
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print("matplotlib is not installed: skipping the plots (pip install matplotlib)")
        return None


def save(fig, plt, report_dir, name):
    fig.savefig(os.path.join(report_dir, name), dpi=90)
    plt.close(fig)
    return name


def finish_plot(fig, ax, plt, xlabel, ylabel, path):
    """Axis labels, grid, legend and layout of a one-panel report plot, saved to path."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return save(fig, plt, *os.path.split(path))


def verdict_block(verdicts):
    """A report's "### Verdicts": one line per claim, `- KEY: VERDICT (N seeds); how`, which
    tests/lab/test_claims.py binds every verdict of the README and docs to (KEY occurs in the doc's
    sentence)."""
    return ["### Verdicts", ""] + [f"- {key}: {verdict} ({n} seed{'s' if n != 1 else ''}); {how}"
                                   for key, verdict, n, how in verdicts] + [""]

# -----------------------------------------------------------------------------
# writing the report

def arm_shapes(jobs):
    """'K n' when every arm has the same K, else None and a line with each arm's K x R and experts (the moe
    sweep: unique 8 x 1 beside looped 2 x 4, where one K would misstate the looped arms). A job not resolved
    (a --report_only call resolves the first) reads its arm's overrides on top of the first job's config."""
    cfg0, cfgs = jobs[0]['cfg'], {}
    for j in jobs:
        cfgs.setdefault(j['arm']['name'], j.get('cfg') or {**cfg0, **j['arm']['overrides']})
    if len({cfg['n_layer'] for cfg in cfgs.values()}) == 1:
        return f"K {cfg0['n_layer']}", None

    def shape(cfg):
        experts = f", top-{cfg['top_k']} of {cfg['n_expert']} experts" if cfg.get('n_expert') else ', dense'
        tied = ', tied routing' if cfg.get('tied_routing') else \
            ', disjoint routing' if cfg.get('disjoint_routing') else ''
        return f"{cfg['n_layer']} x {cfg['n_loop']}{experts}{tied}"
    return None, "Each arm's shape, K layers x R loops: " + '; '.join(f"{name} {shape(cfg)}"
                                                                      for name, cfg in cfgs.items()) + "."


def report_header(preset, jobs, n_arms, args, sweep):
    cfg0 = jobs[0]['cfg']
    K, shapes = arm_shapes(jobs)
    sizes = (f"{cfg0['dataset']}, d {cfg0['n_embd']}, {K or 'K per arm below'}, block {cfg0['block_size']}, "
             f"batch {cfg0['batch_size']}x{cfg0['gradient_accumulation_steps']}, {cfg0['max_iters']} steps, "
             f"{cfg0['lr_schedule']} lr, init {cfg0['init']}")
    seeds = sorted({j['seed'] for j in jobs})
    rebuilt = not sweep and ' --report_only' in args.command  # from run records with no sweep.json
    command = sweep.get('command') or (args.command if rebuilt
                                       else args.command.replace(' --report_only', ''))
    train_minutes = sum(read_status(j['out_dir']).get('train_seconds', 0) for j in jobs) / 60
    if rebuilt:  # the training calls' wall time, code and dtype are not on record: say so, not '?'
        out = getattr(args, 'out', '?')
        readme = os.path.join(out, 'README.md')
        about = f", which {readme} describes" if os.path.exists(readme) else ''
        run_lines = [f"Wall time of the sweep calls: not on record (no sweep.json under {out}: this report "
                     f"is rebuilt from the finished runs' records{about}); train time summed over runs: "
                     f"{train_minutes:.1f} min.",
                     "Code and dtype: not on record in the run folders; each run's train.log prints "
                     "its dtype."]
    else:
        run_lines = [f"Wall time of the last sweep call: {fmt(sweep.get('wall_seconds', 0) / 60, '.1f')} min "
                     f"with {sweep.get('workers', '?')} run(s) at a time, "
                     f"{sweep.get('cores_per_run', '?')} CPU core(s) each; "
                     f"train time summed over runs: {train_minutes:.1f} min.",
                     f"Code: commit {sweep.get('commit', '?')}; dtype {sweep.get('dtype', '?')}."]
    return [f"## {preset['title']}", "",
            f"`{command}`: {n_arms} arms x {len(seeds)} seed(s) ({', '.join(map(str, seeds))}); {sizes}"
            + (f"; base {' '.join(args.base)}" if args.base else '') + ".",
            *([shapes] if shapes else []), *run_lines, ""]


def summary(arms):
    """<prefix>.json: per arm and seed, the status, the last metrics row and eval_depth's main results."""
    keys = ('fixed', 'dppl_1_to_R', 'calibrated', 'clamp', 'radial_frac', 'throughput')

    def record(r):
        rec = dict(seed=r['seed'], status=r['status'], final=r['rows'][-1] if r['rows'] else None,
                   depth={k: r['depth'][k] for k in keys} if r['depth'] else None)
        if r['status'].get('lengths'):  # matched_long: eval_depth at each length the run reached
            at = {L: read_json(os.path.join(r['out_dir'], f'eval_depth-{L}.json'))
                  for L in r['status']['lengths']}
            rec['lengths'] = {L: {k: d[k] for k in keys} for L, d in at.items() if d}
        moe = read_json(os.path.join(r['out_dir'], 'moe_eval.json'))  # lab/moe.py's evaluation
        if moe:
            rec['config'] = moe.pop('config', None)  # the model's arguments: each arm's shape, on the record
            rec['moe_eval'] = moe
        return rec
    return {name: [record(r) for r in runs] for name, runs in arms.items()}


def write_report(preset_name, preset, jobs, args, sweep):
    arms = runs_by_arm(jobs)
    os.makedirs(args.report_dir, exist_ok=True)
    header = report_header(preset, jobs, len(arms), args, sweep)
    prefix = preset_name
    lines = preset['report'](arms, header, args.report_dir, prefix)  # the preset's own report function
    path = os.path.join(args.report_dir, f'{prefix}.md')
    with open(path, 'w', encoding='utf-8') as fh:
        fh.write('\n'.join(lines) + '\n')
    with open(os.path.join(args.report_dir, f'{prefix}.json'), 'w', encoding='utf-8') as fh:
        json.dump(summary(arms), fh, indent=1)
    print(f"report: {path}")
    return path


if __name__ == '__main__':  # a module the lab's commands import
    print("lab/reports.py: ablate.py's report helpers, not a command; see python lab/ablate.py --help")
