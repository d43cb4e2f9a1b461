"""
The sweeps' presets (docs/papers.md §1-§6): each a title, the laptop config its arms run on, its seeds,
its arms (config files and --key=value overrides on top of the base), the evaluator of a finished run
(eval_depth: lab/eval_depth.py, or a script of lab/) and its report: the function that makes the report's
lines from the finished runs, report(arms, header, report_dir, prefix) (lab/report_*.py, lab/moe.py), which
lab/reports.py's write_report calls. lab/ablate.py runs them: python lab/ablate.py PRESET.
"""
import moe
import report_blindspot
import report_deeploop
import report_kappa
import report_lr_transfer
import report_matched
import report_recurrent


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
        laptop='config/laptop_blindspot.py', seeds=(1337,), eval_depth=True, report=report_blindspot.write,
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
        laptop='config/laptop_deeploop.py', seeds=(1, 2, 3), eval_depth=False, report=report_deeploop.write,
        arms=[arm(f'{v}-R{R}-lr{lr:g}', block=block, depth_scaling=ds, n_loop=R, learning_rate=lr,
                  tags=dict(variant=v, R=R, lr=lr))
              for v, block, ds in DEEPLOOP_VARIANTS for lr in DEEPLOOP_LRS[block] for R in DEEPLOOP_RS]),
    'kappa': dict(
        title="Visit alignment kappa_R over training: pre-norm and sandwich p in {0, 1/4, 1/2}, "
              "R in {1, 2, 4, 8}",
        laptop='config/laptop_deeploop.py', seeds=(KAPPA_SEED,), eval_depth=False, report=report_kappa.write,
        arms=[arm(f'{v}-R{R}', block=block, depth_scaling=ds, n_loop=R, learning_rate=KAPPA_LR,
                  log_kappa=True, tags=dict(variant=v, R=R))
              for R in KAPPA_RS for v, block, ds in DEEPLOOP_VARIANTS]),
    'lr_transfer': dict(
        title="Loop-scaled residuals and LR transfer: final val loss vs LR per R, pre-norm with and without "
              "eps = 1/(R sqrt K)",
        laptop='config/laptop_deeploop.py', seeds=(1, 2), eval_depth=False, report=report_lr_transfer.write,
        arms=[arm(f'preln{"_eps" if eps else ""}-R{R}-lr{lr:g}', *(['config/loop_eps.py'] if eps else []),
                  n_loop=R, learning_rate=lr, eval_interval=100, eval_iters=16,  # few evals, less noisy
                  tags=dict(eps=eps, R=R, lr=lr))
              for eps in (False, True) for lr in LR_TRANSFER_LRS for R in KAPPA_RS]),
    'escape': dict(
        title="DeepLoop's escape fractions at laptop size: sandwich R = 3, p in {0, 1/4, 0.3, 0.4, 0.5, "
              "0.6}, lr 3e-3",
        laptop='config/laptop_deeploop.py', seeds=(1, 2, 3, 4, 5), eval_depth=False,
        report=report_deeploop.write_escape,
        arms=[arm(f'sandwich_p{p:g}', block='sandwich', depth_scaling=p, n_loop=3, learning_rate=KAPPA_LR,
                  tags=dict(p=p))
              for p in ESCAPE_PS]),
}
# the same p-sweep at R = 7: at this laptop size the smaller exponents fail there, not at R = 3
PRESETS['escape_r7'] = dict(
    PRESETS['escape'], report=report_deeploop.write_escape,
    title="DeepLoop's escape fractions at laptop size, R = 7: sandwich p in {0, 1/4, 0.3, 0.4, 0.5, 0.6}, "
          "lr 3e-3",
    arms=[dict(a, overrides=dict(a['overrides'], n_loop=7)) for a in PRESETS['escape']['arms']])

# the recurrent-depth family at the blind-spot sweep's size (docs/papers.md §4); each arm adds to the one
# before up to the random-depth arm; n_loop = 3 makes the sampled depth's mean 4 (n_loop + 1)
RANDOM_DEPTH = dict(loop_sampling='poisson_lognormal', n_loop=3, backprop_loops=2)
PRESETS['recurrent'] = dict(
    title="The recurrent-depth family: does the blind spot survive injection, random depth, a coda, a gate?",
    laptop='config/laptop_blindspot.py', seeds=(1337,), eval_depth=True, report=report_recurrent.write,
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
    laptop='config/laptop_blindspot.py', seeds=(1337,), eval_depth=True,
    report=report_blindspot.write_growing,
    arms=[arm('loop_rmsnorm', 'config/loop_rmsnorm.py', **GROWING),
          arm('loop_raw', 'config/loop_raw.py', **GROWING)])
# paper 1's abstract: scale-controlled variants reach a lower perplexity at matched inference depth. The
# per-loop arms, longer than the blind-spot sweep and on three seeds (docs/papers.md §1)
MATCHED = dict(max_iters=1000, eval_interval=50)
PRESETS['matched'] = dict(
    title="Paper 1, matched inference depth: per-loop RMSNorm vs the scale-controlled readouts, 1,000 steps",
    laptop='config/laptop_blindspot.py', seeds=(1, 2, 3), eval_depth=True, report=report_matched.write,
    arms=[arm(n, f'config/{n}.py', **MATCHED)
          for n in ('loop_rmsnorm', 'loop_raw', 'loop_final_only', 'loop_penalty')])
# the same claim as training grows: each run trained to 10,000 steps and evaluated at 1,000 and 3,000 on
# the way (at a constant LR the checkpoint at 1,000 steps is a 1,000-step run's)
PRESETS['matched_long'] = dict(
    PRESETS['matched'], report=report_matched.write_long, seeds=(1, 2, 3), lengths=(1000, 3000, 10000),
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
    laptop='config/laptop_deeploop.py', seeds=(1, 2, 3), eval_depth='moe.py', report=moe.moe_report,
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
    laptop='config/laptop_blindspot.py', seeds=(1337, 1, 2), eval_depth=True, report=report_blindspot.write,
    arms=[arm('loop_rmsnorm_gpt2', 'config/loop_rmsnorm.py', init='gpt2'),
          arm('loop_raw_gpt2', 'config/loop_raw.py', init='gpt2')])
# the init confound split: the embedding std and the block matrices' init, each from either init, under
# the blind-spot pair (docs/papers.md §1); the four corners x RMSNorm/raw readout x three seeds
INITS = [('reference', 'reference', 0.0), ('reference_emb0.02', 'reference', 0.02),
         ('gpt2_emb1', 'gpt2', 1.0), ('gpt2', 'gpt2', 0.0)]
PRESETS['init_split'] = dict(
    title="Paper 1's init confound split: embedding std (1 | 0.02) x block init (reference | gpt2), "
          "per-loop RMSNorm vs raw readout, three seeds",
    laptop='config/laptop_blindspot.py', seeds=(1337, 1, 2), eval_depth=True, report=report_blindspot.write,
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
    laptop='config/retrofit_gpt2.py', seeds=(1,), eval_depth=True, report=report_recurrent.write,
    arms=[arm('retrofit_4x4x4'),
          arm('gpt2_more', n_prelude=0, n_layer=12, n_coda=0, n_loop=1, injection='none',
              loop_sampling='fixed', backprop_loops=0, loop_schedule=0.0, max_iters=3500,
              lr_decay_iters=3500)])
LONG = dict(max_iters=2000, eval_interval=50)
PRESETS['probes'] = dict(  # cheap checks of two blind-spot findings (docs/results.md, the claims)
    title="Probes: the radial-clamp cost vs training length and LR; the inter-loop-norm arm vs init and LR",
    laptop='config/laptop_blindspot.py', seeds=(1337,), eval_depth=True, report=report_blindspot.write,
    arms=[arm('loop_rmsnorm-2000', 'config/loop_rmsnorm.py', **LONG),
          arm('loop_rmsnorm-lr1e-3', 'config/loop_rmsnorm.py', learning_rate=1e-3),
          arm('loop_rmsnorm-2000-lr1e-3', 'config/loop_rmsnorm.py', learning_rate=1e-3, **LONG),
          arm('embedded_default', 'config/loop_rmsnorm.py', batch_size=8, learning_rate=1e-3, beta2=0.99,
              **LONG),  # train.py's own defaults: the laptop size with these four keys changed
          arm('loop_interloop_norm-gpt2', 'config/loop_interloop_norm.py', init='gpt2'),
          arm('loop_interloop_norm-lr1e-3', 'config/loop_interloop_norm.py', learning_rate=1e-3),
          arm('loop_interloop_norm-2000', 'config/loop_interloop_norm.py', **LONG)])


if __name__ == '__main__':  # a module the lab's commands import
    print("lab/presets.py: ablate.py's presets, not a command; see python lab/ablate.py --help")
