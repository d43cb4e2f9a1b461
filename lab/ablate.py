r"""
Sweeps: a preset's config arms x seeds -> one train.py run each (own out_dir) -> lab/eval_depth.py -> a
report (markdown tables + PNG plots, lab/reports.py). The presets reproduce the papers' ablations
(docs/papers.md §1, §2, §3):

    python lab/ablate.py blindspot   # paper 1: 8 arms + inter-loop norm + 2 init=gpt2 arms; report in assets/
    python lab/ablate.py matched     # paper 1's matched-depth claim: 4 per-loop arms, 1,000 steps, 3 seeds
    python lab/ablate.py matched_long  # the same at 1,000, 3,000 and 10,000 steps of one run, 3 seeds
    python lab/ablate.py init_split  # the blind-spot pair under each init's embedding and block matrices
    python lab/ablate.py init_gpt2   # the blind-spot pair under GPT-2's init, 3 seeds
    python lab/ablate.py init_untied # the split's std 1 and 0.02 embeddings with a head of its own
    python lab/ablate.py deeploop    # paper 2: sandwich p 0, 1/4, 1/2 vs pre-norm, R 1-7, 4-5 LRs a block
    python lab/ablate.py recurrent   # the recurrent-depth family (§4): injection, random depth, Huginn, Ouro
    python lab/ablate.py growing     # paper 1's "still growing": per-loop RMSNorm vs raw readout, 10k steps
    python lab/ablate.py probes      # the radial-clamp cost vs length and LR, the inter-loop-norm arm
    python lab/ablate.py kappa       # paper 2's visit alignment kappa_R over training, R in {1, 2, 4, 8}
    python lab/ablate.py escape      # paper 2's p-sweep: runs that leave the unigram floor, R = 3, 5 seeds
    python lab/ablate.py escape_r7   # the same at R = 7, where the laptop model's small exponents fail
    python lab/ablate.py lr_transfer # loop-scaled residuals (§3): best LR per R with and without eps
    python lab/ablate.py moe         # Looped-MoE (§5): dense/MoE x unique/looped + tied routing, 3 seeds
    python lab/ablate.py retrofit    # retrofitted recurrence (§6): loop a pretrained model, 3 seeds
    python lab/ablate.py retrofit_gpt2 --dry_run   # the same from GPT-2's weights, on a GPU: the GPU-hours
    python lab/ablate.py deeploop --report_only          # rebuild the report from the finished runs
    python lab/ablate.py blindspot --only=loop_rmsnorm,loop_raw --seeds=1,2 --max_iters=100

Every flag that is not one of ablate.py's own (see --help) is a config override for every run, written as
train.py takes it: --key=value (--max_iters=100 above).

Without --base every run starts from the preset's laptop config, config/laptop_blindspot.py or
config/laptop_deeploop.py (shakespeare_char, d 128, K 2; on a 2-core CPU, one run per core). With --base the
same arms run on top of a GPU config file instead, unchanged:

    python lab/ablate.py blindspot --base config/paper_44m.py \
        --launcher "torchrun --standalone --nproc_per_node=8"
    python lab/ablate.py deeploop --base config/deeploop_small.py --max_iters=2700 --workers=8 \
        --gpus_per_worker=1
    python lab/ablate.py blindspot --base config/paper_44m.py --dry_run   # the commands and GPU-hours
    python lab/ablate.py deeploop --base config/deeploop_small.py --max_iters=2700 --executor=slurm \
        --partition=gpu --gpus_per_run=1 --time=240   # a Slurm job per run, requeued (docs/long_runs.md)

A run's train.py arguments are: the base config file(s), the arm's config files, the arm's --key=value
overrides, --seed and --out_dir, then the overrides of the command line. train.py itself resolves them
(--print_config=True), so ablate.py holds no copy of the config schema. Runs go to <out>/<arm>-s<seed>/
(train.log, eval.log, metrics.jsonl, eval_depth.json, status.json); a finished run (status.json says so) is
skipped on the next call, an interrupted one (a crash, or a signal that stopped train.py) is resumed. Each
finished run prints `[runs done/total, time so far, ETA]`. Paths (--out, --report_dir, data/) are relative to
the working directory, as for train.py: run it from the repository root.
"""
import contextlib
import io
import json
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the core is one folder up
import configurator
from configurator import Parser, die, gpt_config, model_keys
from run.ops import duration
from compute.hardware import auto_dtype
from run.accounting import flops_per_token
from model import GPT, GPTConfig
from prepare import HF_DATASETS, TEXT_DATASETS, WORD_VOCAB
from reports import fmt, read_json, read_metrics, read_status, write_report

LAB = os.path.dirname(os.path.abspath(__file__))  # this folder: eval_depth.py
REPO = os.path.dirname(LAB)                       # the repository: train.py, config/

# -----------------------------------------------------------------------------
# presets

def arm(name, *files, tags=None, **overrides):
    """One arm: config files (composed in order on top of the base) and --key=value overrides."""
    return dict(name=name, files=list(files), overrides=overrides, tags=tags or {})


DEEPLOOP_VARIANTS = [  # (name, block, depth_scaling): docs/papers.md §2's alpha = (2N)^p, beta = (8N)^-p
    ('preln', 'preln', 'none'),                  # the paper's baseline: pre-norm, no residual scaling
    ('sandwich_p0', 'sandwich', 'none'),         # p = 0: alpha = beta = 1
    ('sandwich_p0.25', 'sandwich', 'deepnorm'),  # p = 1/4 (DeepNorm's exponent)
    ('sandwich_p0.5', 'sandwich', 'deeploop'),   # p = 1/2 (DeepLoop)
]

DEEPLOOP_RS = (1, 3, 5, 7)    # the paper's loop counts at fixed K (docs/papers.md §2)
# each block's LR grid, wide enough that every (block, R) cell's best LR is inside it: pre-norm's best
# falls with R (3e-4 at R = 8 in lr_transfer), the sandwich blocks' lies higher (docs/results.md), but
# p = 1/4 at R = 7 leaves the floor only at 3e-4 on some seeds, so the sandwich grid reaches 1e-4 too
DEEPLOOP_LRS = dict(preln=(1e-4, 3e-4, 1e-3, 3e-3), sandwich=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2))
KAPPA_RS = (1, 2, 4, 8)       # loop counts of the kappa_R and LR-transfer sweeps (gamma from kappa_R vs R)
KAPPA_SEED = 11               # not a seed of the deeploop sweep, so its runs are other evidence
KAPPA_LR = 3e-3               # the deeploop sweep's LR where sandwich p = 0 stays on the floor at R >= 4
LR_TRANSFER_LRS = (3e-4, 1e-3, 3e-3, 1e-2)   # Wang et al.'s claim (docs/papers.md §3): with eps, one best LR
ESCAPE_PS = (0, 0.25, 0.30, 0.40, 0.50, 0.60)  # docs/papers.md §2's p-sweep at R = 3 (p = 0, 1/4 added)

PRESETS = {
    'blindspot': dict(
        title="Paper 1, the readout blind spot: eight arms + inter-loop norm + RMSNorm/raw under init=gpt2",
        laptop='config/laptop_blindspot.py', seeds=(1337,), eval_depth=True, report='blindspot',
        arms=[
            arm('terminal_rmsnorm', 'config/terminal_rmsnorm.py'),
            arm('terminal_raw', 'config/terminal_raw.py'),
            arm('loop_rmsnorm', 'config/loop_rmsnorm.py'),
            arm('loop_layernorm', 'config/loop_layernorm.py'),
            arm('loop_raw', 'config/loop_raw.py'),
            arm('loop_final_only', 'config/loop_final_only.py'),
            arm('terminal_penalty', 'config/terminal_penalty.py'),
            arm('loop_penalty', 'config/loop_penalty.py'),
            arm('loop_interloop_norm', 'config/loop_interloop_norm.py'),
            arm('loop_rmsnorm_gpt2', 'config/loop_rmsnorm.py', init='gpt2'),
            arm('loop_raw_gpt2', 'config/loop_raw.py', init='gpt2'),
        ]),
    'deeploop': dict(
        title="Paper 2, DeepLoop: sandwich p in {0, 1/4, 1/2} vs pre-norm, R in {1, 3, 5, 7}, "
              "LRs 1e-4 .. 3e-3 (pre-norm) and 1e-4 .. 1e-2 (sandwich)",
        laptop='config/laptop_deeploop.py', seeds=(1, 2, 3), eval_depth=False, report='deeploop',
        arms=[arm(f'{v}-R{R}-lr{lr:g}', block=block, depth_scaling=ds, n_loop=R, learning_rate=lr,
                  tags=dict(variant=v, R=R, lr=lr))
              for v, block, ds in DEEPLOOP_VARIANTS for lr in DEEPLOOP_LRS[block] for R in DEEPLOOP_RS]),
    'kappa': dict(
        title="Visit alignment kappa_R over training: pre-norm and sandwich p in {0, 1/4, 1/2}, "
              "R in {1, 2, 4, 8}",
        laptop='config/laptop_deeploop.py', seeds=(KAPPA_SEED,), eval_depth=False, report='kappa',
        arms=[arm(f'{v}-R{R}', block=block, depth_scaling=ds, n_loop=R, learning_rate=KAPPA_LR,
                  log_kappa=True, tags=dict(variant=v, R=R))
              for R in KAPPA_RS for v, block, ds in DEEPLOOP_VARIANTS]),
    'lr_transfer': dict(
        title="Loop-scaled residuals and LR transfer: final val loss vs LR per R, pre-norm with and without "
              "eps = 1/(R sqrt K)",
        laptop='config/laptop_deeploop.py', seeds=(1, 2), eval_depth=False, report='lr_transfer',
        arms=[arm(f'preln{"_eps" if eps else ""}-R{R}-lr{lr:g}', *(['config/loop_eps.py'] if eps else []),
                  n_loop=R, learning_rate=lr, eval_interval=100, eval_iters=16,  # few evals, less noisy
                  tags=dict(eps=eps, R=R, lr=lr))
              for eps in (False, True) for lr in LR_TRANSFER_LRS for R in KAPPA_RS]),
    'escape': dict(
        title="DeepLoop's escape fractions at laptop size: sandwich R = 3, p in {0, 1/4, 0.3, 0.4, 0.5, "
              "0.6}, lr 3e-3",
        laptop='config/laptop_deeploop.py', seeds=(1, 2, 3, 4, 5), eval_depth=False, report='escape',
        arms=[arm(f'sandwich_p{p:g}', block='sandwich', depth_scaling=p, n_loop=3, learning_rate=KAPPA_LR,
                  tags=dict(p=p))
              for p in ESCAPE_PS]),
}
# the same p-sweep at R = 7: at this laptop size the smaller exponents fail there, not at R = 3
PRESETS['escape_r7'] = dict(
    PRESETS['escape'], report='escape',
    title="DeepLoop's escape fractions at laptop size, R = 7: sandwich p in {0, 1/4, 0.3, 0.4, 0.5, 0.6}, "
          "lr 3e-3",
    arms=[dict(a, overrides=dict(a['overrides'], n_loop=7)) for a in PRESETS['escape']['arms']])

# the recurrent-depth family at the blind-spot sweep's size (docs/papers.md §4); each arm adds to the one
# before up to the random-depth arm; n_loop = 3 makes the sampled depth's mean 4 (n_loop + 1)
RANDOM_DEPTH = dict(loop_sampling='poisson_lognormal', n_loop=3, backprop_loops=2)
PRESETS['recurrent'] = dict(
    title="The recurrent-depth family: does the blind spot survive injection, random depth, a coda, a gate?",
    laptop='config/laptop_blindspot.py', seeds=(1337,), eval_depth=True, report='recurrent',
    eval_args=['--exits=16'],
    arms=[
        arm('loop_rmsnorm', 'config/loop_rmsnorm.py'),
        arm('inject_add', 'config/loop_rmsnorm.py', injection='add'),
        arm('random_depth', 'config/loop_rmsnorm.py', injection='add', **RANDOM_DEPTH),
        arm('recurrent_preln', 'config/loop_rmsnorm.py', 'config/recurrent_preln.py', n_loop=3),
        arm('huginn', 'config/loop_rmsnorm.py', 'config/huginn.py', n_loop=3),
        arm('ouro', 'config/loop_rmsnorm.py', 'config/ouro.py'),
    ])
GROWING = dict(max_iters=10_000, eval_interval=50)  # §1 "still growing": 16x the blind-spot sweep's length
PRESETS['growing'] = dict(
    title="Paper 1, \"still growing\": per-loop CE with an RMSNorm vs a raw readout, 10,000 steps",
    laptop='config/laptop_blindspot.py', seeds=(1337,), eval_depth=True, report='growing',
    arms=[arm('loop_rmsnorm', 'config/loop_rmsnorm.py', **GROWING),
          arm('loop_raw', 'config/loop_raw.py', **GROWING)])
# paper 1's abstract: scale-controlled variants reach a lower perplexity at matched inference depth. The
# per-loop arms, longer than the blind-spot sweep and on three seeds (docs/papers.md §1)
MATCHED = dict(max_iters=1000, eval_interval=50)
PRESETS['matched'] = dict(
    title="Paper 1, matched inference depth: per-loop RMSNorm vs the scale-controlled readouts, 1,000 steps",
    laptop='config/laptop_blindspot.py', seeds=(1, 2, 3), eval_depth=True, report='matched',
    arms=[arm(n, f'config/{n}.py', **MATCHED)
          for n in ('loop_rmsnorm', 'loop_raw', 'loop_final_only', 'loop_penalty')])
# the same claim as training grows: each run trained to 10,000 steps and evaluated at 1,000 and 3,000 on
# the way (at a constant LR the checkpoint at 1,000 steps is a 1,000-step run's)
PRESETS['matched_long'] = dict(
    PRESETS['matched'], report='matched_long', seeds=(1, 2, 3), lengths=(1000, 3000, 10000),
    title="Paper 1, matched inference depth as training grows: the four per-loop arms at 1,000, 3,000 and "
          "10,000 steps",
    arms=[arm(n, f'config/{n}.py', max_iters=10_000, eval_interval=50)
          for n in ('loop_rmsnorm', 'loop_raw', 'loop_final_only', 'loop_penalty')])
# the penalty's lead over RMSNorm at matched depth, its two arms alone: a rerun with every pair of a seed on
# one machine (a pair split across CPUs is no evidence)
PRESETS['matched_pairs'] = dict(
    PRESETS['matched_long'],
    title="Paper 1, matched inference depth: the norm penalty against per-loop RMSNorm, each seed's pair on "
          "one machine",
    arms=[a for a in PRESETS['matched_long']['arms'] if a['name'] in ('loop_rmsnorm', 'loop_penalty')])
# the same pairs on one CPU for the seeds whose 10,000-step pair ran on two CPUs in matched_long (seed 3's
# shared one): `--dtype=float32 --workers=2` keeps a seed's two runs side by side, ~35 min each on a Zen 4
PRESETS['matched_pairs_cpu'] = dict(
    PRESETS['matched_pairs'], seeds=(1, 2),
    title="Paper 1, matched inference depth: the norm penalty against per-loop RMSNorm, each seed's pair on "
          "one CPU")
# Looped-MoE (docs/papers.md §5): dense and MoE, unique (8 layers) and looped (2 layers x 4 loops), at
# matched active parameters per token (an expert is 4C/k wide) and the same FLOPs per token, on DeepLoop's
# laptop base with the paper's SwiGLU; each run then read out at every boundary of 2 layers (lab/moe.py)
MOE = dict(mlp='swiglu', max_iters=1000, eval_interval=100, learning_rate=1e-3)
EXPERTS = dict(n_expert=8, top_k=2)  # the paper's top-2 of 8
PRESETS['moe'] = dict(
    title="Looped-MoE: dense vs top-2-of-8 experts, unique vs looped, and tied routing, at matched active "
          "compute",
    laptop='config/laptop_deeploop.py', seeds=(1, 2, 3), eval_depth='moe.py', report='moe',
    eval_args=['--boundary=2'],
    arms=[arm('dense_unique', n_layer=8, n_loop=1, **MOE),
          arm('moe_unique', n_layer=8, n_loop=1, **EXPERTS, **MOE),
          arm('dense_looped', n_layer=2, n_loop=4, **MOE),
          arm('looped_moe', n_layer=2, n_loop=4, **EXPERTS, **MOE),
          arm('looped_moe_tied', n_layer=2, n_loop=4, tied_routing=True, **EXPERTS, **MOE)])
# the paper's shape (it runs 8 shared layers x 2 loops): 4 x 2 at the same active compute, read out every 4
# layers, with a second causal arm beside tied routing: disjoint routing forces the loops apart (loop k
# routes among its own 4 of the 8 experts), so that "divergence helps" predicts forced > free > tied
PRESETS['moe_4x2'] = dict(
    PRESETS['moe'], eval_args=['--boundary=4'],
    title="Looped-MoE at 4 layers x 2 loops: dense vs top-2-of-8 experts, unique vs looped, tied and "
          "disjoint (forced-divergence) routing",
    arms=[arm('dense_unique', n_layer=8, n_loop=1, **MOE),
          arm('moe_unique', n_layer=8, n_loop=1, **EXPERTS, **MOE),
          arm('dense_looped', n_layer=4, n_loop=2, **MOE),
          arm('looped_moe', n_layer=4, n_loop=2, **EXPERTS, **MOE),
          arm('looped_moe_tied', n_layer=4, n_loop=2, tied_routing=True, **EXPERTS, **MOE),
          arm('looped_moe_disjoint', n_layer=4, n_loop=2, disjoint_routing=True, **EXPERTS, **MOE)])
# moe_4x2's causal arms alone, free, tied and disjoint routing on one machine and paired by seed, for a
# machine that cannot run all six arms (a CPU: these are about an hour of cores)
PRESETS['moe_causal'] = dict(
    PRESETS['moe_4x2'], title="Looped-MoE at 4 layers x 2 loops, the causal arms: free, tied and disjoint "
                              "(forced-divergence) routing",
    arms=[a for a in PRESETS['moe_4x2']['arms'] if a['name'].startswith('looped_moe')])
# disjoint routing halves each loop's pool (E/R experts a loop): the same test at a matched pool, R x E
# experts in all so that each loop routes among E of its own, beside free and disjoint routing on one machine
PRESETS['moe_pool'] = dict(
    PRESETS['moe_causal'], title="Looped-MoE at 4 layers x 2 loops: forced divergence at a matched pool "
                                 "(disjoint routing over 2 x 8 experts) beside free and disjoint routing",
    arms=[a for a in PRESETS['moe_causal']['arms'] if a['name'] != 'looped_moe_tied']
    + [arm('looped_moe_pooled', n_layer=4, n_loop=2, disjoint_routing=True, n_expert=16, top_k=2, **MOE)])
# the blind-spot pair under GPT-2's init, where the order of the norms flips (three seeds)
PRESETS['init_gpt2'] = dict(
    title="Paper 1 under init=gpt2: per-loop RMSNorm vs raw readout, three seeds",
    laptop='config/laptop_blindspot.py', seeds=(1337, 1, 2), eval_depth=True, report='blindspot',
    arms=[arm('loop_rmsnorm_gpt2', 'config/loop_rmsnorm.py', init='gpt2'),
          arm('loop_raw_gpt2', 'config/loop_raw.py', init='gpt2')])
# the init confound split: the embedding std and the block matrices' init, each from either init, under
# the blind-spot pair (docs/papers.md §1); the four corners x RMSNorm/raw readout x three seeds
INITS = [('reference', 'reference', 0.0), ('reference_emb0.02', 'reference', 0.02),
         ('gpt2_emb1', 'gpt2', 1.0), ('gpt2', 'gpt2', 0.0)]
PRESETS['init_split'] = dict(
    title="Paper 1's init confound split: embedding std (1 | 0.02) x block init (reference | gpt2), "
          "per-loop RMSNorm vs raw readout, three seeds",
    laptop='config/laptop_blindspot.py', seeds=(1337, 1, 2), eval_depth=True, report='blindspot',
    arms=[arm(f'loop_{r}-{name}', f'config/loop_{r}.py', init=init, embd_std=std,
              tags=dict(init=name, readout=r))
          for name, init, std in INITS for r in ('rmsnorm', 'raw')])
# the split's caveat: a tied head makes embd_std the raw readout's logit scale too. The same embedding stds
# (reference blocks) with a head of its own, on the init's own scale (PyTorch's default, std ~0.05 at d 128)
PRESETS['init_untied'] = dict(
    PRESETS['init_split'], title="Paper 1's init split with an untied LM head: embedding std 1 | 0.02 under "
                                 "the reference blocks, per-loop RMSNorm vs raw readout, three seeds",
    arms=[arm(f'loop_{r}-{name}-untied', f'config/loop_{r}.py', init='reference', embd_std=std,
              tie_head=False, tags=dict(init=name, readout=r, head='untied'))
          for name, std in (('reference', 1.0), ('reference_emb0.02', 0.02)) for r in ('rmsnorm', 'raw')])
# retrofitted recurrence from GPT-2 (docs/papers.md §6), on a GPU: config/retrofit_gpt2.py against GPT-2
# itself trained on (every layer, no loop) for the same FLOPs: 3,500 steps of 12 layer visits a token
# against the retrofit's 2,000 of 4 + 4 x 4 + 4 = 24 at R = 4, the last 4 loops backpropagated (its
# sampled depth and the ramp aside: they shift its FLOPs by a few percent)
PRESETS['retrofit_gpt2'] = dict(
    title="Retrofitted recurrence from GPT-2 small: prelude 4 | loop 4 x R | coda 4 vs GPT-2 trained on",
    laptop='config/retrofit_gpt2.py', seeds=(1,), eval_depth=True, report='recurrent',
    arms=[arm('retrofit_4x4x4'),
          arm('gpt2_more', n_prelude=0, n_layer=12, n_coda=0, n_loop=1, injection='none',
              loop_sampling='fixed', backprop_loops=0, loop_schedule=0.0, max_iters=3500,
              lr_decay_iters=3500)])
LONG = dict(max_iters=2000, eval_interval=50)
PRESETS['probes'] = dict(  # cheap checks of two blind-spot findings (README, "Results at laptop scale")
    title="Probes: the radial-clamp cost vs training length and LR; the inter-loop-norm arm vs init and LR",
    laptop='config/laptop_blindspot.py', seeds=(1337,), eval_depth=True, report='blindspot',
    arms=[arm('loop_rmsnorm-2000', 'config/loop_rmsnorm.py', **LONG),
          arm('loop_rmsnorm-lr1e-3', 'config/loop_rmsnorm.py', learning_rate=1e-3),
          arm('loop_rmsnorm-2000-lr1e-3', 'config/loop_rmsnorm.py', learning_rate=1e-3, **LONG),
          arm('embedded_default', 'config/loop_rmsnorm.py', batch_size=8, learning_rate=1e-3, beta2=0.99,
              **LONG),  # train.py's own defaults: the laptop size with these four keys changed
          arm('loop_interloop_norm-gpt2', 'config/loop_interloop_norm.py', init='gpt2'),
          arm('loop_interloop_norm-lr1e-3', 'config/loop_interloop_norm.py', learning_rate=1e-3),
          arm('loop_interloop_norm-2000', 'config/loop_interloop_norm.py', **LONG)])

# -----------------------------------------------------------------------------
# planning: one job per (arm, seed), its config resolved by train.py itself

def repo_path(path):
    """A config file of this repo: as given if it exists from the working directory, else under the repo."""
    return path if os.path.isabs(path) or os.path.exists(path) else os.path.join(REPO, path)


def arg_value(v):
    return v if isinstance(v, str) else repr(v)


def run_args(base, a, seed, out_dir, overrides_all):
    """train.py's arguments for arm a: the base files, the arm's files and overrides, the seed, then the
    overrides of the command line (overrides_all: ['--key=value', ...])."""
    overrides = dict(a['overrides'], seed=seed, out_dir=out_dir)
    files = base + [repo_path(p) for p in a['files']]
    return files + [f'--{k}={arg_value(v)}' for k, v in overrides.items()] + overrides_all


def plan(args, preset):
    """The jobs of this call: name, arm, seed, out_dir and train.py arguments (no config yet: resolve())."""
    base = args.base or [repo_path(preset['laptop'])]
    jobs = []
    for a in preset['arms']:
        if args.only and a['name'] not in args.only:
            continue
        for seed in args.seeds:
            name = f"{a['name']}-s{seed}"
            out_dir = os.path.join(args.out, name)
            jobs.append(dict(name=name, arm=a, seed=seed, out_dir=out_dir,
                             args=run_args(base, a, seed, out_dir, args.overrides),
                             lengths=preset.get('lengths', ())))  # evaluated at each (run_lengths)
    return jobs


def train_defaults():
    """train.py's defaults, every key: what `python train.py --print_config=True` prints with no overrides."""
    cmd = [sys.executable, os.path.join(REPO, 'train.py'), '--print_config=True']
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS='1'))
    if proc.returncode != 0:
        die(f"train.py --print_config=True failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(proc.stdout)


def resolve(jobs):
    """Set job['cfg'] to the config train.py resolves from job['args']: its defaults (asked of train.py once),
    then the same configurator that train.py applies to its command line."""
    defaults = train_defaults()
    for job in jobs:
        job['cfg'] = configurator.configure(defaults, job['args'])[0]
        configurator.check(job['cfg'])  # a bad value dies here, as it would in train.py

# -----------------------------------------------------------------------------
# running

def write_status(run_dir, status):
    with open(os.path.join(run_dir, 'status.json'), 'w', encoding='utf-8') as fh:
        json.dump(status, fh)


def last_line(path):
    try:
        with open(path, encoding='utf-8', errors='replace') as fh:
            lines = [line.strip() for line in fh if line.strip()]
        return lines[-1] if lines else ''
    except OSError:
        return ''


def cpu_cores():
    """The CPU cores this process may run on."""
    if hasattr(os, 'sched_getaffinity'):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


class Slots:
    """Worker slots; each owns a share of the CPU cores (and optionally of the GPUs)."""

    def __init__(self, n, gpus_per_worker):
        cores = cpu_cores()
        per = max(1, len(cores) // n)
        self.cores = [cores[i * per:(i + 1) * per] or cores for i in range(n)]
        self.gpus = [list(range(i * gpus_per_worker, (i + 1) * gpus_per_worker)) if gpus_per_worker else None
                     for i in range(n)]
        self.free = queue.Queue()
        for i in range(n):
            self.free.put(i)

    def popen_kwargs(self, slot):
        env = dict(os.environ, OMP_NUM_THREADS=str(len(self.cores[slot])), PYTHONUNBUFFERED='1')
        if self.gpus[slot] is not None:
            env['CUDA_VISIBLE_DEVICES'] = ','.join(map(str, self.gpus[slot]))
        kw = dict(env=env)
        if hasattr(os, 'sched_setaffinity'):
            cores = self.cores[slot]
            kw['preexec_fn'] = lambda: os.sched_setaffinity(0, cores)  # train.py sizes its threads from this
        return kw


RUNNING = set()  # the train.py and eval_depth.py processes running now (SubmittedRun.checkpoint stops them)


def call_logged(cmd, log_path, mode, popen_kwargs):
    """Run cmd with the command line and then its output written to log_path; returns the exit code."""
    with open(log_path, mode, encoding='utf-8') as log:
        log.write('$ ' + shlex.join(cmd) + '\n')
        log.flush()
        with subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, **popen_kwargs) as proc:
            RUNNING.add(proc)
            try:
                return proc.wait()
            finally:
                RUNNING.discard(proc)


def train(job, launcher, popen_kwargs, max_iters=None):
    """Train one run, resuming from its checkpoint if there is one (init_from=auto); returns its new status:
    done, failed, or stopped (a signal stopped train.py early with a checkpoint: the next call resumes it).
    max_iters: train only to this step (a run evaluated as it grows), else to the run's own max_iters."""
    run_dir = job['out_dir']
    os.makedirs(run_dir, exist_ok=True)
    upto = [f'--max_iters={max_iters}'] if max_iters else []
    cmd = launcher + [os.path.join(REPO, 'train.py')] + job['args'] + upto + ['--init_from=auto']
    t0 = time.time()
    log_path = os.path.join(run_dir, 'train.log')
    rc = call_logged(cmd, log_path, 'a', popen_kwargs)
    rows = read_metrics(run_dir)
    finished = rc == 0 and bool(rows) and rows[-1].get('iter', -1) >= (max_iters or job['cfg']['max_iters'])
    return dict(train='done' if finished else 'stopped' if rc == 0 else 'failed', rc=rc,
                train_seconds=round(time.time() - t0, 1), error=None if finished else last_line(log_path))


def evaluate(run_dir, eval_args, popen_kwargs, script=True):
    """eval_depth.py (or the preset's own evaluator, a script of lab/) on a run's checkpoint; returns the
    status keys it sets."""
    t0 = time.time()
    script = script if isinstance(script, str) else 'eval_depth.py'
    cmd = [sys.executable, os.path.join(LAB, script), run_dir] + eval_args
    rc = call_logged(cmd, os.path.join(run_dir, 'eval.log'), 'w', popen_kwargs)
    return dict(eval='done' if rc == 0 else 'failed', eval_seconds=round(time.time() - t0, 1))


def run_summary(job, status):
    rows = read_metrics(job['out_dir'])
    msg = f"{job['name']}: train {status.get('train')}"
    if rows:
        last = rows[-1]
        msg += (f", iter {last['iter']}, val {fmt(last['val_loss'], '.4f')}, "
                f"||h_R|| {fmt(last['norm'][-1], '.1f')}")
    if status.get('error'):
        msg += f" ({status['error'][:120]})"
    return msg


def wants_eval(run_dir, status, do_eval, reeval):
    """Whether a run still needs eval_depth.py: trained (or failed) with a checkpoint, not evaluated yet."""
    return (do_eval and status.get('train') != 'stopped' and (status.get('eval') != 'done' or reeval)
            and os.path.exists(os.path.join(run_dir, 'ckpt.pt')))


def run_lengths(job, launcher, eval_args, popen_kwargs, upto=None):
    """A run evaluated as it grows: trained to each of job['lengths'] (up to `upto`) in turn, each a resume
    of the last (at a constant LR, one run stopped and continued), with eval_depth.py on the checkpoint at
    each length (eval_depth-<L>.json). status.json notes each length done, so a sweep killed mid-way
    continues from the run's last checkpoint when it is called again. Returns the status and whether there
    was work."""
    run_dir = job['out_dir']
    status, worked = read_status(run_dir), False
    done = status.setdefault('lengths', {})
    for L in job['lengths']:
        if upto and L > upto:
            break
        if done.get(str(L)) == 'done':
            continue
        spent = status.get('train_seconds', 0.0)  # the lengths before this one
        status.update(train(job, launcher, popen_kwargs, max_iters=L), eval=None)
        status['train_seconds'] = round(spent + status['train_seconds'], 1)
        worked = True
        if status['train'] == 'done':
            status['train'] = 'done' if L == job['lengths'][-1] else 'growing'
            out = os.path.join(run_dir, f'eval_depth-{L}.json')
            status.update(evaluate(run_dir, eval_args + [f'--json={out}'], popen_kwargs))
            done[str(L)] = 'done' if status['eval'] == 'done' else 'eval failed'
        write_status(run_dir, status)
        if done.get(str(L)) != 'done':
            break
    return status, worked


def run_job(job, launcher, do_eval, eval_args, popen_kwargs, reeval=False, upto=None):
    """Train one run (resuming an interrupted one), then evaluate it; writes run_dir/status.json. Returns
    the status and whether there was work to do (a finished run is skipped). upto: see run_lengths."""
    if job.get('lengths'):
        return run_lengths(job, launcher, eval_args, popen_kwargs, upto)
    run_dir = job['out_dir']
    status, worked = read_status(run_dir), False
    if status.get('train') != 'done':
        status, worked = train(job, launcher, popen_kwargs), True
        write_status(run_dir, status)
    if wants_eval(run_dir, status, do_eval, reeval):
        status.update(evaluate(run_dir, eval_args, popen_kwargs, do_eval))
        write_status(run_dir, status)
        worked = True
    return status, worked


def run_one(job, slots, launcher, do_eval, eval_args, log, reeval=False, upto=None):
    """run_job in a free worker slot, then the run's progress line."""
    slot = slots.free.get()
    t0 = time.time()
    try:
        status, worked = run_job(job, launcher, do_eval, eval_args, slots.popen_kwargs(slot), reeval, upto)
    finally:
        slots.free.put(slot)
    seconds = time.time() - t0
    log(job, run_summary(job, status) + f" [{seconds:.0f}s]", seconds if worked else None)
    return worked


def cost(job):
    """A run's relative cost: layer visits x iterations (to order the runs and to estimate the time left)."""
    cfg = job['cfg']
    visits = cfg.get('n_prelude', 0) + cfg.get('n_layer', 1) * cfg['n_loop'] + cfg.get('n_coda', 0)
    return visits * cfg['max_iters']


def progress_logger(jobs, n_workers, t0):
    """log(job, msg, seconds): one line per finished run, `[runs done/total, time so far, ETA]`, safe to
    call from the worker threads. seconds: what the run took, None if an earlier call had finished it. The
    ETA spreads the cost of the runs not finished over the workers, at the seconds per unit of cost that
    the runs of this call took (runs in progress count as not started, so it errs on the long side)."""
    lock, done, left = threading.Lock(), [0], [sum(cost(j) for j in jobs)]
    spent = [0.0, 0]  # seconds and cost of the runs this call ran

    def log(job, msg, seconds):
        with lock:
            done[0] += 1
            left[0] -= cost(job)
            if seconds is not None:
                spent[0], spent[1] = spent[0] + seconds, spent[1] + cost(job)
            eta = ''
            if spent[1] and left[0]:
                eta = f", ETA {duration(left[0] * spent[0] / spent[1] / n_workers)}"
            print(f"[{done[0]}/{len(jobs)} runs, {duration(time.time() - t0)}{eta}] {msg}", flush=True)
    return log


def default_workers(args):
    """One run per CPU core on a CPU; one at a time with a launcher (torchrun) or a GPU."""
    return len(cpu_cores()) if not args.launcher and not torch.cuda.is_available() else 1


def write_sweep(args, t0, n_workers, cores, jobs):
    """<out>/sweep.json: the call's command, its wall time so far, its workers, commit and dtype."""
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, 'sweep.json'), 'w', encoding='utf-8') as fh:
        json.dump(dict(command=args.command, wall_seconds=round(time.time() - t0, 1), workers=n_workers,
                       cores_per_run=cores, commit=code_version(), dtype=resolved_dtype(jobs[0]['cfg'])), fh)


def run_sweep(jobs, preset, launcher, args):
    """Train (and evaluate) every job not finished yet, here n_workers at a time, or each as a job of a
    scheduler (submit); writes <out>/sweep.json, unless every job was finished already (the last call
    that worked keeps its wall time)."""
    t0 = time.time()
    eval_args = preset.get('eval_args', []) + shlex.split(args.eval_args)
    if args.executor != 'local':
        n_workers = submit(jobs, preset, launcher, args, eval_args, t0)
        write_sweep(args, t0, n_workers, args.cpus_per_run or '?', jobs)
        return
    n_workers = args.workers or default_workers(args)
    slots = Slots(n_workers, args.gpus_per_worker)
    cores = len(slots.cores[0])
    order = sorted(jobs, key=lambda j: -cost(j))  # the most expensive first: the workers finish together
    print(f"{args.preset}: {len(jobs)} runs, {n_workers} at a time, cores per run {cores}; "
          f"runs in {args.out}/", flush=True)
    # runs evaluated as they grow go length by length: every run reaches 1,000 steps before any goes on to
    # 3,000, and sweep.json is written after each length, so a sweep cut short reports what it reached
    worked = False
    for upto in preset.get('lengths') or [None]:
        log = progress_logger(jobs, n_workers, time.time())

        def run(job):
            return run_one(job, slots, launcher, preset['eval_depth'], eval_args, log, args.reeval, upto)
        if upto:
            print(f"{args.preset}: every run to {upto} steps", flush=True)
        with ThreadPoolExecutor(n_workers) as pool:
            worked = any(list(pool.map(run, order))) or worked
        if worked:
            write_sweep(args, t0, n_workers, cores, jobs)
    if not worked:
        print(f"{args.preset}: every run was finished already; {args.out}/sweep.json kept", flush=True)

# -----------------------------------------------------------------------------
# running through a scheduler: a job per run, submitted with submitit (Slurm, or its local executor)

MAX_REQUEUES = 100  # time limits a run may reach, each followed by a requeue that resumes it (preemptions
                    # are not counted)


class SubmittedRun:
    """One run as a submitit job: run_job on the node it gets. Before a preemption or the time limit
    submitit's signal (SIGUSR2, 90 s ahead) calls checkpoint(): train.py stops with a checkpoint and the
    same call is requeued, which resumes the run (--init_from=auto)."""

    def __call__(self, job, launcher, do_eval, eval_args, reeval):
        t0 = time.time()
        # the scheduler may signal every process of the job: train.py ignores SIGUSR2, waits for SIGUSR1
        kw = dict(env=dict(os.environ, PYTHONUNBUFFERED='1'),
                  preexec_fn=lambda: signal.signal(signal.SIGUSR2, signal.SIG_IGN))
        status, worked = run_job(job, launcher, do_eval, eval_args, kw, reeval)
        return status, time.time() - t0 if worked else None

    def checkpoint(self, *args):
        for proc in list(RUNNING):
            proc.send_signal(signal.SIGUSR1)  # train.py saves and exits 0; eval_depth.py just ends (rerun)
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited; call_logged's wait reaps it
        import submitit
        return submitit.helpers.DelayedSubmission(self, *args)


def executor(args):
    """The submitit executor of --executor: a job per run with --gpus_per_run GPUs, --cpus_per_run cores,
    --time minutes each, on --partition, at most --workers at once."""
    try:
        import submitit
    except ImportError:
        die(f"--executor={args.executor} needs submitit: pip install submitit")
    try:  # <out>/submitit/ holds each job's pickles and logs
        ex = submitit.AutoExecutor(os.path.join(args.out, 'submitit'), cluster=args.executor.split('_')[-1],
                                   slurm_max_num_timeout=MAX_REQUEUES)
    except RuntimeError as e:  # no srun: not a Slurm login node
        die(f"--executor={args.executor}: {e}")
    ex.update_parameters(name=f'nanoloop-{args.preset}', timeout_min=args.time,
                         gpus_per_node=args.gpus_per_run or None, cpus_per_task=args.cpus_per_run or None,
                         slurm_partition=args.partition or None, slurm_array_parallelism=args.workers or None,
                         slurm_additional_parameters=args.slurm_args)
    return ex


def submit(jobs, preset, launcher, args, eval_args, t0):
    """Submit every run not finished yet as a job of its own, then wait for them, printing a progress line
    as each ends. Returns the runs at once asked for."""
    ex = executor(args)
    import submitit
    before = {j['name']: read_status(j['out_dir']) for j in jobs}
    todo = [j for j in jobs if before[j['name']].get('train') != 'done'
            or wants_eval(j['out_dir'], before[j['name']], preset['eval_depth'], args.reeval)]
    n_workers = args.workers or max(1, len(todo))
    log = progress_logger(jobs, n_workers, t0)
    print(f"{args.preset}: {len(jobs)} runs, {len(todo)} to submit ({args.executor}); runs in {args.out}/, "
          f"job logs in {os.path.join(args.out, 'submitit')}/", flush=True)
    for job in jobs:
        if job not in todo:
            log(job, run_summary(job, before[job['name']]), None)
    if not todo:
        return n_workers
    # a job unpickles SubmittedRun: it imports ablate.py's folder and the core one folder up
    path = [LAB, REPO] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]
    os.environ['PYTHONPATH'] = os.pathsep.join(path)
    with ex.batch():
        subs = [ex.submit(SubmittedRun(), j, launcher, preset['eval_depth'], eval_args, args.reeval)
                for j in todo]
    for sub in submitit.helpers.as_completed(subs, poll_frequency=1):
        job = todo[subs.index(sub)]
        try:
            status, seconds = sub.result()
        except Exception as e:  # the job died or was cancelled: status.json says how far the run got
            status = dict(read_status(job['out_dir']), error=(str(e).strip().splitlines() or ['?'])[-1])
            seconds = None
        log(job, run_summary(job, status) + f" [job {sub.job_id}]", seconds)
    return n_workers


def code_version():
    """The commit the sweep ran (with '+local changes' if the code differed from it), for the report. The
    reports in assets/ do not count: a sweep rewrites them."""
    def git(*a):
        proc = subprocess.run(['git', '-C', REPO, *a], capture_output=True, text=True)
        return proc.stdout.strip() if proc.returncode == 0 else ''
    commit = git('rev-parse', '--short=12', 'HEAD') or 'unknown'
    changed = git('status', '--porcelain', '--untracked-files=no', '--', '.', ':(exclude)assets')
    return commit + (' + local changes' if changed else '')


def resolved_dtype(cfg):
    """The dtype the runs trained in: dtype='auto' resolved the way train.py resolves it."""
    if cfg['dtype'] != 'auto':
        return cfg['dtype']
    device = cfg['device'] if cfg['device'] != 'auto' else 'cuda' if torch.cuda.is_available() else 'cpu'
    dtype, why = auto_dtype(device.split(':')[0])
    return f"{dtype} (auto: {why})"

# -----------------------------------------------------------------------------
# compute estimates

SHAKESPEARE_CHARS = 65  # tinyshakespeare's distinct characters: shakespeare_char's vocabulary (prepare.py)
# the training FLOP/s of one laptop run on one CPU core, evaluations and start-up included: the median of the
# 269 runs in assets/*.json, flops_per_token x tokens / train_seconds (quartiles 27 and 40, presets'
# medians 25-85; bf16 on AVX512-BF16 EPYC cores shared by 2 runs). Another CPU: --cpu_gflops
CPU_GFLOPS = 34


def run_vocab_size(cfg):
    """The vocabulary train.py will use: --print_config shows GPTConfig's default where no config set
    vocab_size, and then train.py takes data/<dataset>/meta.json's (if the data is not prepared here: the
    word tokenizer's 20,000 for a dataset prepare.py writes with it, else GPT-2's BPE padded to 50304)."""
    if cfg['vocab_size'] != GPTConfig.vocab_size:
        return cfg['vocab_size']
    unprepared = WORD_VOCAB if HF_DATASETS.get(cfg['dataset']) == 'word' else \
        SHAKESPEARE_CHARS if TEXT_DATASETS.get(cfg['dataset']) == 'char' else 50304
    return read_json(os.path.join('data', cfg['dataset'], 'meta.json'), {}).get('vocab_size', unprepared)


def meta_model(cfg):
    """The model of a run's resolved config on the meta device: its shapes and counts, no weights."""
    model_args = {k: cfg[k] for k in model_keys()}
    model_args['vocab_size'] = run_vocab_size(cfg)
    with contextlib.redirect_stdout(io.StringIO()), torch.device('meta'):  # no parameter count printed
        return GPT(gpt_config(model_args))


def estimate(cfg):
    """(tokens, training FLOPs) of a run: accounting.flops_per_token x tokens (eval passes not counted)."""
    model = meta_model(cfg)
    tokens = cfg['max_iters'] * cfg['batch_size'] * cfg['gradient_accumulation_steps'] * cfg['block_size']
    return tokens, flops_per_token(model, cfg['block_size']) * tokens


def dry_run(jobs, launcher, args):
    """Print every run's train.py command and its estimated tokens, FLOPs and compute time: for a CPU run
    (the laptop presets) core-minutes at --cpu_gflops, else GPU-hours at --mfu of --peak_tflops."""
    if not args.cpu_gflops > 0:
        die(f"--cpu_gflops={args.cpu_gflops:g}: must be > 0")
    shown = ['python' if c == sys.executable else c for c in launcher]
    cpu, gpu = [], []  # hours per run
    for j in jobs:
        tokens, flops = estimate(j['cfg'])
        if j['cfg']['device'] == 'cpu':
            cpu.append(flops / (args.cpu_gflops * 1e9) / 3600)
            size = (f"{tokens / 1e6:.2f}M tokens, {flops / 1e12:.1f} TFLOP, ~{duration(3600 * cpu[-1])} on "
                    f"a CPU core")
        else:
            gpu.append(flops / (args.peak_tflops * 1e12 * args.mfu) / 3600)
            size = f"{tokens / 1e9:.2f}B tokens, {flops / 1e18:.2f} EFLOP, ~{gpu[-1]:.2f} GPU-h"
        print(f"{j['name']}: {size}")
        print('  ' + shlex.join(shown + ['train.py'] + j['args']))
    if cpu:
        workers = min(args.workers or default_workers(args), len(cpu))
        rate = ("the median of the laptop runs in assets/*.json (FLOPs / train time; half of them 27-40 "
                "with the machine's load; --cpu_gflops to change)" if args.cpu_gflops == CPU_GFLOPS
                else "--cpu_gflops")
        print(f"total: {len(cpu)} CPU runs, ~{duration(3600 * sum(cpu))} of CPU-core time training, "
              f"~{duration(3600 * sum(cpu) / workers)} at {workers} run(s) at a time (train.py's evaluations "
              f"counted, eval_depth.py not), assuming {args.cpu_gflops:g} GFLOP/s per core: {rate}")
    if gpu or not cpu:
        print(f"total: {len(gpu)} runs, ~{sum(gpu):.1f} GPU-hours of training at {args.mfu:.0%} MFU of "
              f"{args.peak_tflops:g} TFLOP/s (evaluation not counted)")


# -----------------------------------------------------------------------------
# command line

def parser():
    ap = Parser('lab/ablate.py', __doc__.split('\n\n')[0])
    ap.epilog = "Any other flag is a config override for every run: --key=value, e.g. --max_iters=100."
    ap.add_argument('preset', choices=sorted(PRESETS) + ['retrofit'])
    ap.add_argument('--base', action='append', default=[], help='config file(s) replacing the laptop config')
    ap.add_argument('--only', default='', help='comma-separated arm names')
    ap.add_argument('--seeds', default='', help="comma-separated seeds (default: the preset's)")
    ap.add_argument('--out', default=None, help='runs go to <out>/<arm>-s<seed>; default out-ablate-<preset>')
    ap.add_argument('--report_dir', default=None, help='default: assets/ for the laptop sweep, else <out>')
    runner_flags(ap)
    ap.add_argument('--eval_args', default='', help='extra eval_depth.py arguments, e.g. "--n_seqs=256"')
    ap.add_argument('--report_only', action='store_true', help='only rebuild the report from finished runs')
    ap.add_argument('--reeval', action='store_true', help='run eval_depth.py again on finished runs')
    return ap


def runner_flags(ap):
    """The flags of the runners (local, submitit/Slurm) and of --dry_run, shared with lab/isodepth.py."""
    ap.add_argument('--workers', type=int, default=0,
                    help='runs at once (0: one per CPU core on a CPU, else 1)')
    ap.add_argument('--gpus_per_worker', type=int, default=0,
                    help='give each worker its own GPUs (CUDA_VISIBLE_DEVICES)')
    ap.add_argument('--launcher', default='',
                    help='e.g. "torchrun --standalone --nproc_per_node=8" (default: python)')
    ap.add_argument('--executor', default='local', choices=('local', 'slurm', 'submitit_local'),
                    help='local: runs here, --workers at a time; slurm: a Slurm job per run (submitit); '
                         "submitit_local: submitit's local executor, a job per run here, all at once")
    ap.add_argument('--partition', default='', help="--executor=slurm: partition (default: the cluster's)")
    ap.add_argument('--gpus_per_run', type=int, default=1, help='--executor=slurm: GPUs per job')
    ap.add_argument('--cpus_per_run', type=int, default=0,
                    help="--executor=slurm: CPU cores per job (0: the cluster's default)")
    ap.add_argument('--time', type=int, default=240,
                    help='--executor=slurm: time limit per job in minutes (then requeued: the run resumes)')
    ap.add_argument('--slurm_args', default='', help='more sbatch options, e.g. "account=lab qos=normal"')
    ap.add_argument('--dry_run', action='store_true',
                    help='print the commands and the estimated compute, run nothing')
    ap.add_argument('--mfu', type=float, default=0.4, help='assumed model flops utilisation for --dry_run')
    ap.add_argument('--peak_tflops', type=float, default=989.0, help='--dry_run: GPU bf16 peak (H100: 989)')
    ap.add_argument('--cpu_gflops', type=float, default=CPU_GFLOPS,
                    help='--dry_run: training FLOP/s of one CPU run per core, in GFLOP/s (measured: assets/)')


def slurm_options(text):
    """--slurm_args as a dict of sbatch options."""
    try:
        return dict(kv.split('=', 1) for kv in text.split())
    except ValueError:
        die(f"--slurm_args {text}: expected sbatch options key=value, e.g. 'account=lab qos=high'")


def parse_args(argv):
    """The parsed flags, checked, with defaults filled in: the config overrides (every flag not ablate.py's
    own) as ['--key=value', ...], --only and --seeds as lists, --out and --report_dir set, and the command
    line itself (for the report)."""
    args, overrides = parser().parse_known_args(argv)
    args.overrides = overrides
    args.command = 'python lab/ablate.py ' + shlex.join(argv)
    args.out = args.out or f'out-ablate-{args.preset}'
    args.report_dir = args.report_dir or (args.out if args.base else 'assets')
    for s in args.overrides:
        if not (s.startswith('--') and '=' in s):
            die(f"unrecognized arguments: {s}; a config override is written --key=value "
                f"(see python lab/ablate.py --help)")
    args.only = [a for a in args.only.split(',') if a]
    names = [a['name'] for a in PRESETS[args.preset]['arms']]
    for a in args.only:
        if a not in names:
            die(f"--only {a}: not an arm of {args.preset} ({', '.join(names)})")
    args.slurm_args = slurm_options(args.slurm_args)
    try:
        args.seeds = [int(s) for s in args.seeds.split(',') if s] or list(PRESETS[args.preset]['seeds'])
    except ValueError:
        die(f"--seeds {args.seeds}: expected comma-separated integers")
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ['retrofit']:  # runs that start from other runs' checkpoints: lab/retrofit_sweep.py
        from retrofit_sweep import main as retrofit_main
        return retrofit_main(argv[1:])
    args = parse_args(argv)
    preset = PRESETS[args.preset]
    jobs = plan(args, preset)
    finished = lambda st: st.get('train') == 'done' or 'done' in st.get('lengths', {}).values()
    if args.report_only and not any(finished(read_status(j['out_dir'])) for j in jobs):
        # an empty report would overwrite the committed one (the runs' folders are not committed)
        die(f"--report_only: no finished run of {args.preset} under {args.out}/; "
            f"{os.path.join(args.report_dir, args.preset + '.md')} is left as it is")
    resolve(jobs[:1] if args.report_only else jobs)  # a report needs only the first run's config
    launcher = shlex.split(args.launcher) if args.launcher else [sys.executable]
    if args.dry_run:
        dry_run(jobs, launcher, args)
        return
    if not args.report_only:
        run_sweep(jobs, preset, launcher, args)
    write_report(args.preset, preset, jobs, args, read_json(os.path.join(args.out, 'sweep.json'), {}))


if __name__ == '__main__':
    main()
