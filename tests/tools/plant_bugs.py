"""
Planted bugs ("mutants"): realistic one-line mistakes in decoding, the retrofit, the loop schedule,
checkpoints and the lab's statistics, each planted alone in a scratch copy of the repository and checked
against the few tests that should catch it. A mutant the tests miss (a survivor) is either caught by a
new test or argued harmless beside it (its `harmless` field): the table says which.

    python tests/tools/plant_bugs.py --list                    # the mutants, and whether each still applies
    python tests/tools/plant_bugs.py --out tests/tools/plant_bugs.md     # all of them (~5 min, one core)
    python tests/tools/plant_bugs.py --only probs_times_temperature,verdict_weakest_order

The working tree is never edited: the tracked files are copied to a temporary folder once, and each mutant
is written there, tested (OMP_NUM_THREADS=1 python -m pytest -x -q <its tests>) under a timeout, and undone.
caught: a test failed (or the tests timed out); survived: all passed; broken: the original text does not
occur exactly once in the file (the code moved on: update the mutant), or its test selection ran nothing.
"""
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import namedtuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # configurator, from any working directory
from configurator import Parser  # noqa: E402

Mutant = namedtuple('Mutant', 'name file original replacement what tests harmless', defaults=(None,))

E, X, B = 'decoding/engine.py', 'decoding/exits.py', 'decoding/batching.py'
RF, CK, VD, FIT = 'run/retrofit.py', 'run/checkpoint.py', 'lab/verdict.py', 'lab/isodepth_fit.py'
T_ENGINE, T_BATCH, T_RETRO = 'tests/test_engine.py', 'tests/test_batching.py', 'tests/test_retrofit.py'
T_VERDICT, T_CLAIMS = 'tests/lab/test_verdict.py', 'tests/lab/test_claims.py'
T_ISO = 'tests/lab/test_isodepth.py'
T_REL, T_REC = 'tests/test_reliability.py', 'tests/test_recurrent.py'
GPT2_SPEC = 'unrolled_gpt2_logits_equal_gpt2_written_out'

MUTANTS = [
    # ---- decoding/engine.py: sampling
    Mutant('probs_times_temperature', E, "logits = logits / temperature", "logits = logits * temperature",
           "sampling temperature multiplied instead of divided", [T_ENGINE, '-k', 'sampling_distribution']),
    Mutant('topk_drops_the_kth', E, "logits[logits < v[:, [-1]]]", "logits[logits <= v[:, [-1]]]",
           "top-k crops the k-th largest logit too (<= for <)", [T_ENGINE, '-k', 'sampling_distribution']),
    Mutant('softmax_wrong_axis', E, "return F.softmax(logits, dim=-1)", "return F.softmax(logits, dim=0)",
           "the sampling softmax over the batch axis", [T_ENGINE, '-k', 'sampling_distribution']),
    # ---- engine: the cache
    Mutant('row_mask_excludes_own_position', E, "torch.arange(n, device=pos.device) <= pos[:, None]",
           "torch.arange(n, device=pos.device) < pos[:, None]",
           "a depth-batched row's key mask hides its own token (< for <=)",
           [T_BATCH, '-k', 'as_at_batch_1']),
    Mutant('history_one_short', E,
           "every row has the whole history 0..pos+T-1\n            return self.key[r, :, :pos + T]",
           "every row has the whole history 0..pos+T-1\n            return self.key[r, :, :pos + T - 1]",
           "cached keys read one position short", [T_ENGINE, '-k', 'past_the_block_size']),
    Mutant('shared_slot_index_off_by_one', E, "(k - 1) % self.n * self.K + j", "k % self.n * self.K + j",
           "loop k's slot is slot k mod n, not (k-1) mod n", [T_ENGINE, '-k', 'middle_loop or shared']),
    Mutant('entry_forgets_batch_stride', E, "return (k - 1) % self.n * self.K * self.B + rows",
           "return (k - 1) % self.n * self.K + rows",
           "depth batching's index into every loop's slots drops the B stride",
           [T_BATCH, '-k', 'as_at_batch_1']),
    Mutant('fill_skips_first_skipped_slot', E, "t[exit_k:last, :, r, :, pos] = new",
           "t[exit_k + 1:last, :, r, :, pos] = new", "an exit at loop k leaves loop k+1's slot unfilled",
           [T_ENGINE, '-k', 'middle_loop']),
    Mutant('copy_from_the_wrong_loop', E, "new = t[exit_k - 1, :, r, :, pos] if new is None",
           "new = t[exit_k, :, r, :, pos] if new is None", "kv_policy copy copies loop k+1's slot, not k's",
           [T_ENGINE, '-k', 'middle_loop']),
    Mutant('batched_fill_overwrites_exit_loop', E, "(loops > exit_k[:, None])[..., None",
           "(loops >= exit_k[:, None])[..., None",
           "depth batching's fill overwrites the exit loop's own slot (>= for >)",
           [T_BATCH, '-k', 'skipped_slot_is_filled or as_at_batch_1']),
    # ---- engine: decoding and speculation
    Mutant('decode_step_one_loop_short', E,
           "h = model.loops(e, e, range(1, R + 1), cache, pos).states[-1]\n    return model.exit(h, R",
           "h = model.loops(e, e, range(1, R), cache, pos).states[-1]\n    return model.exit(h, R",
           "fixed-depth decoding runs R-1 loops", [T_ENGINE, '-k', 'past_the_block_size']),
    Mutant('verify_skips_loop_k_plus_1', E,
           "range(k + 1, R + 1), cache, pos).states[-1]\n    return model.readout",
           "range(k + 2, R + 1), cache, pos).states[-1]\n    return model.readout",
           "verification starts one loop late", [T_ENGINE, '-k', 'greedy_self_speculative']),
    Mutant('acceptance_ratio_inverted', E, "ok = torch.rand_like(px_R) * px_k < px_R",
           "ok = torch.rand_like(px_R) * px_R < px_k", "speculative acceptance min(1, p_k / p_R), inverted",
           [T_ENGINE, '-k', 'speculative_sampling_follows']),
    Mutant('residual_sign_flipped', E, "rest = (p_R - p_k).clamp(min=0)", "rest = (p_k - p_R).clamp(min=0)",
           "a rejected draft resamples from max(0, p_k - p_R)",
           [T_ENGINE, '-k', 'speculative_sampling_follows']),
    Mutant('round_goes_on_past_a_rejection', E, "if not bool(ok.all()):", "if not bool(ok.any()):",
           "a round keeps drafts after a row rejected (any for all)",
           [T_ENGINE, '-k', 'speculative_sampling_follows or greedy_self_speculative']),
    Mutant('window_slides_a_token_early', E, "if n - start > block_size else start",
           "if n - start >= block_size else start", "the window slides one token early (>= for >)",
           [T_ENGINE, '-k', 'past_the_block_size or refills_come']),
    Mutant('from_flags_wrong_off_value', E, "exit_threshold=-1, kv_slots=0", "exit_threshold=0, kv_slots=0",
           "sample.py's 'off' value of exit_threshold changed from -1 to 0",
           ['tests/test_sample.py', '-k', 'from_flags']),
    # ---- decoding/exits.py
    Mutant('kl_threshold_sign', X, "return -threshold if policy == 'kl' else threshold", "return threshold",
           "the kl policy's bound used as a score without its sign",
           [T_ENGINE, 'tests/test_sample.py', '-k', 'exit_score or gate_and_kl']),
    Mutant('margin_sign', X, "return top2[..., 0] - top2[..., 1]", "return top2[..., 1] - top2[..., 0]",
           "the margin score top2 - top1", [T_ENGINE, '-k', 'exit_score']),
    Mutant('entropy_normalised_on_wrong_axis', X, "H / math.log(logits.size(-1))",
           "H / math.log(logits.size(0))", "the entropy score normalised by log B, not log V",
           [T_ENGINE, '-k', 'exit_score']),
    Mutant('kl_direction_swapped', X, "-(prev.exp() * (prev - logp)).sum(-1)",
           "-(logp.exp() * (logp - prev)).sum(-1)", "KL(p_k || p_{k-1}) for KL(p_{k-1} || p_k)",
           [T_ENGINE, '-k', 'exit_score']),
    Mutant('gate_score_not_cumulative', X, "return 1 - stay, stay", "return lam, stay",
           "the gate scores this loop's exit probability, not the cumulative one",
           [T_ENGINE, '-k', 'exit_score']),
    Mutant('exit_at_strictly_above', X, "else score >= threshold", "else score > threshold",
           "an exit needs a score above the threshold, not at it (> for >=)",
           [T_ENGINE, 'tests/test_sample.py', '-k',
            'exit_score or policy or adaptive_exit or exactly_exits']),
    Mutant('recompute_at_the_next_position', X, "model.rope(pos, 1)", "model.rope(pos + 1, 1)",
           "recompute fills the skipped slots with keys rotated for the next position",
           [T_ENGINE, '-k', 'middle_loop']),
    Mutant('active_hides_one_loop_too_few', X, "for later, j in itertools.product(range(k + 1, R + 1)",
           "for later, j in itertools.product(range(k + 2, R + 1)",
           "kv_policy active leaves loop k+1 seeing an exited position", [T_ENGINE, '-k', 'active'],
           "equivalent: a cache position is written once (a slid window starts a new cache; kv_policy "
           "active is refused with drafts, which rewrite positions, and with depth batching), so the "
           "skipped loops' reach at pos is still False when the token exits, and hide() only restates "
           "it. It guards a position reused by a future path"),
    Mutant('coda_from_the_last_state', X, "model.untied('coda', h_exit, view(every), pos)",
           "model.untied('coda', h, view(every), pos)",
           "the coda's slots written from the last rows' state, not each row's exit state",
           [T_ENGINE, '-k', 'policy or middle_loop']),
    # ---- decoding/batching.py
    Mutant('fresh_and_later_scores_swapped', B, "return pick_fresh(fresh, later), pick_fresh(fresh_prev",
           "return pick_fresh(later, fresh), pick_fresh(fresh_prev",
           "rows at exit 1 take the continued score and the others a fresh one",
           [T_BATCH, '-k', 'gate_exits_as_at_batch_1 or as_at_batch_1']),
    Mutant('first_loop_flag_off_by_one', B, "first, loops = f.loops == 0, f.loops + 1",
           "first, loops = f.loops == 1, f.loops + 1", "a token is taken to start at loop 2",
           [T_BATCH, '-k', 'gate_exits_as_at_batch_1 or as_at_batch_1']),
    Mutant('next_position_off_by_one', B, "return len(self.tokens[r]) - 1 - self.start[c]",
           "return len(self.tokens[r]) - self.start[c]", "a row's next token placed one position on",
           [T_BATCH, '-k', 'unreachable_threshold']),
    Mutant('prompt_pass_reads_past_the_prompt', B, "last = torch.tensor([len(w) - 1 for w in windows]",
           "last = torch.tensor([len(w) for w in windows]",
           "a prompt pass samples from the padding after the prompt's last token",
           [T_BATCH, '-k', 'unreachable_threshold or freed_row']),
    Mutant('pending_fill_not_flushed_before_a_pass', B,
           "pending = fill_pending(model, cache, pending, R)  # before a pass",
           "pass  # before a pass", "a finished row's pending fill lands on the next prompt's keys",
           [T_BATCH, '-k', 'skipped_slot_is_filled']),
    Mutant('admit_ignores_the_waiting_rows', B, "[:max(0, B - len(self.waiting))]", "[:B]",
           "a prompt pass takes up to B new rows besides the waiting ones",
           [T_BATCH, '-k', 'a_batch_at_a_time or freed_row or unreachable_threshold or at_most_batch_size']),
    # ---- run/retrofit.py
    Mutant('loop_takes_the_first_middle_layers', RF, "loop = list(range(n - C - L, n - C))",
           "loop = list(range(P, P + L))", "the loop takes the layers right after the prelude",
           [T_RETRO, '-k', 'loop_takes_the_layers']),
    Mutant('split_that_fits_exactly_refused', RF, "if P + L + C > n:", "if P + L + C >= n:",
           "a split using every layer is refused (>= for >)",
           [T_RETRO, '-k', 'loop_takes_the_layers or non_looped or split_that_does_not_fit']),
    Mutant('square_conv1d_not_transposed', RF, "CONV1D = ('attn.c_attn.weight', 'attn.c_proj.weight', ",
           "CONV1D = ('attn.c_attn.weight', ", "GPT-2's square attention projection left untransposed",
           [T_RETRO, '-k', GPT2_SPEC]),
    Mutant('final_norm_bias_dropped', RF,
           "'transformer.ln_out.weight': sd['transformer.ln_f.weight'],\n"
           "            'transformer.ln_out.bias': sd['transformer.ln_f.bias']}",
           "'transformer.ln_out.weight': sd['transformer.ln_f.weight']}",
           "GPT-2's final LayerNorm bias not carried over", [T_RETRO, '-k', GPT2_SPEC]),
    Mutant('gelu_new_as_exact_gelu', RF, "tanh = {'gelu_new': 'gelu_tanh',", "tanh = {'gelu_new': 'gelu',",
           "GPT-2's tanh GELU mapped to the exact one", [T_RETRO, '-k', GPT2_SPEC]),
    Mutant('positions_cropped_from_the_end', RF, "given['transformer.wpe.weight'][:args['block_size']]",
           "given['transformer.wpe.weight'][-args['block_size']:]",
           "a shorter context keeps the last positions' embeddings",
           [T_RETRO, '-k', 'gpt2 or shorter_context']),
    Mutant('nanoloop_source_prelude_after_loop', RF,
           "(('prelude', 'n_prelude'), ('h', 'n_layer'),", "(('h', 'n_layer'), ('prelude', 'n_prelude'),",
           "a nanoloop source's layers read loop first, prelude second",
           [T_RETRO, '-k', 'non_looped or in_that_order']),
    # ---- the loop schedule
    Mutant('ramp_from_0_not_1', 'run/ops.py', "1 + (cfg.n_loop - 1) * it / ramp_iters",
           "1 + cfg.n_loop * it / ramp_iters",
           "the curriculum's mean overshoots: n_loop * t instead of 1 + (R-1) t",
           [T_RETRO, '-k', 'curriculum or ramps_each_step']),
    Mutant('ramp_ends_a_step_late', 'run/ops.py', "if it >= ramp_iters:", "if it > ramp_iters:",
           "the curriculum's last step at it == ramp_iters (> for >=)", [T_RETRO, '-k', 'curriculum']),
    Mutant('fixed_depth_floored', 'model.py', "max(1, round(mean))", "max(1, int(mean))",
           "a fixed-depth curriculum floors the mean instead of rounding it", [T_RETRO, '-k', 'curriculum']),
    Mutant('lognormal_mean_sign', 'model.py', "math.log(mean or self.n_loop) - LOOP_SIGMA ** 2 / 2",
           "math.log(mean or self.n_loop) + LOOP_SIGMA ** 2 / 2",
           "Huginn's lognormal centred at +sigma^2/2: mean depth too high", [T_REC, '-k', 'sampled_depth']),
    Mutant('sampled_depth_without_plus_one', 'model.py', "generator=generator).item()) + 1, self.loop_cap)",
           "generator=generator).item()), self.loop_cap)", "the sampled depth drops its + 1 (may be 0)",
           [T_REC, '-k', 'sampled_depth']),
    Mutant('schedule_as_steps_not_share', 'train.py', "iter_num, loop_schedule * max_iters)",
           "iter_num, loop_schedule)", "loop_schedule read as a step count instead of a share of max_iters",
           [T_RETRO, '-k', 'ramps_each_step']),
    # ---- run/checkpoint.py
    Mutant('only_scratch_refused_over_a_checkpoint', CK, "if init_from != 'resume' and os.path.exists(path)",
           "if init_from == 'scratch' and os.path.exists(path)",
           "init_from=gpt2 or a folder may write over an earlier run", [T_RETRO, '-k', 'init_from_kind']),
    Mutant('auto_looks_at_the_folder', CK, "config['init_from'] = 'resume' if os.path.exists(path)",
           "config['init_from'] = 'resume' if os.path.exists(config['out_dir'])",
           "init_from=auto resumes whenever out_dir exists, ckpt.pt or not",
           ['tests/test_cluster.py', '-k', 'init_from_auto']),
    Mutant('one_wrapper_prefix_stripped', CK, "while k.startswith(('_orig_mod.', 'module.')):",
           "if k.startswith(('_orig_mod.', 'module.')):",
           "a compiled DDP model's keys keep one of their two prefixes", [T_REL, '-k', 'compiled_or_ddp']),
    Mutant('renamed_keys_not_renamed', CK, "args = {RENAMED_KEYS.get(k, k): v for k, v in args.items()}",
           "args = {k: v for k, v in args.items()}", "a checkpoint's loop_eps no longer read as loop_lambda",
           [T_REL, '-k', 'previous_version or retired_setting']),
    Mutant('stopped_checkpoint_taken_as_evaluated', CK, "ckpt.get('evaluated', True) and not eval_only",
           "ckpt.get('evaluated', False) and not eval_only",
           "checkpoints without the flag taken as not evaluated: the resumed run evaluates again",
           [T_REL, '-k', 'bit_exact or previous_version']),
    Mutant('save_not_atomic', CK, "    tmp = path + '.tmp'\n", "    tmp = path\n",
           "save writes the checkpoint in place (a kill mid-write tears it)",
           [T_REL, 'tests/test_cluster.py', '-k', 'atomic_save or failed_save']),
    # ---- lab/verdict.py
    Mutant('weakest_order_swapped', VD,
           "('does not reproduce', 'inconclusive', 'direction only', 'reproduces')",
           "('inconclusive', 'does not reproduce', 'direction only', 'reproduces')",
           "an undecided cell ranked below a failing one", [T_VERDICT]),
    Mutant('ci_with_population_std', VD, "np.std(xs, ddof=1)", "np.std(xs, ddof=0)",
           "the seeds' CI from the population std (ddof 0)", [T_CLAIMS, '-k', 'n_decides or same_sign']),
    Mutant('t_quantile_off_by_one_dof', VD, "return T975[df - 1] if df <= len(T975)",
           "return T975[df] if df <= len(T975)", "Student t at n degrees of freedom instead of n - 1",
           [T_CLAIMS, '-k', 'n_decides or same_sign or t975 or student']),
    Mutant('other_sign_tested_on_the_wrong_end', VD, "if s_hi < 0:", "if s_lo < 0:",
           "a CI that merely crosses 0 is called the other sign", [T_VERDICT]),
    Mutant('n_to_decide_inverted', VD, "(half_width / needed) ** 2", "(needed / half_width) ** 2",
           "the n that decides scales the wrong way", [T_CLAIMS, '-k', 'n_decides or names_the_n']),
    Mutant('wilson_half_width_term', VD, "z2 / (4 * n * n)", "z2 / (4 * n)",
           "Wilson's interval with z^2/4n for z^2/4n^2", [T_CLAIMS, '-k', 'stuck_shares or newcombe']),
    Mutant('bootstrap_90_percent', VD, "np.percentile(boot, [2.5, 97.5])", "np.percentile(boot, [5, 95])",
           "the bootstrap CI at 90 %", [T_CLAIMS, '-k', 'correlated_groups or normal_95']),
    # ---- lab/isodepth_fit.py
    Mutant('budget_ignores_r', FIT, "6 * (runs['n_once'] + runs['r'] * runs['n_rec'])",
           "6 * (runs['n_once'] + runs['n_rec'])", "a run's 6ND budget counts the loop once, not r times",
           [T_ISO, '-k', 'budget_column']),
    Mutant('lr_ratio_inverted', FIT, "n * math.log(ssr[phi] / ssr[None])",
           "n * math.log(ssr[None] / ssr[phi])",
           "the likelihood ratio's SSRs swapped (always clamped to 0)", [T_ISO, '-k', 'likelihood_ratio']),
    Mutant('on_edge_uses_max', FIT, "if min(v - lo, hi - v) < EDGE]", "if max(v - lo, hi - v) < EDGE]",
           "a parameter on the box's edge needs to be near both edges", [T_ISO, '-k', 'edge_of_the_box']),
    Mutant('groups_gap_inverted', FIT, "> math.log(SAME)", "< math.log(SAME)",
           "budgets within 10 % split and far ones merged", [T_ISO, '-k', 'budget_column or single_budget']),
]

# -----------------------------------------------------------------------------
# planting


def applies(mutant, root=ROOT):
    # how many times the mutant's original text occurs in its file (1: it applies)
    path = os.path.join(root, mutant.file)
    if not os.path.isfile(path):
        return 0
    with open(path, encoding='utf-8') as f:
        return f.read().count(mutant.original)


def scratch_copy():
    """A temporary folder holding the working tree's tracked files (as they are now), for the mutants."""
    files = subprocess.run(['git', 'ls-files', '-z'], cwd=ROOT, capture_output=True, check=True).stdout
    where = tempfile.mkdtemp(prefix='plant_bugs_')
    for rel in filter(None, files.decode().split('\0')):
        src = os.path.join(ROOT, rel)
        if os.path.isfile(src) and not os.path.islink(src):
            os.makedirs(os.path.join(where, os.path.dirname(rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(where, rel))
    return where


def run_tests(where, tests, timeout):
    """(result, seconds, the last lines of output) of pytest on `tests` (pytest's arguments) in `where`."""
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONDONTWRITEBYTECODE='1')
    cmd = [sys.executable, '-m', 'pytest', '-x', '-q', '-p', 'no:cacheprovider', *tests]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, cwd=where, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 'caught', time.time() - t0, f'timed out after {timeout} s'
    lines = (p.stdout + p.stderr).strip().splitlines()
    failed = [line.split(' ')[1] for line in lines if line.startswith(('FAILED ', 'ERROR '))]
    tail = failed[:1] or lines[-1:] or ['']  # the test that caught it, or pytest's summary
    # 0: all passed; 1: a test failed; 2: a collection error (the mutant broke an import); 5: no test ran
    result = {0: 'survived', 1: 'caught', 2: 'caught'}.get(p.returncode, 'broken')
    return result, time.time() - t0, tail[0]


def plant(mutant, where, timeout):
    """Plant one mutant in the scratch copy, run its tests, undo it: (result, seconds, note)."""
    path = os.path.join(where, mutant.file)
    with open(path, encoding='utf-8') as f:
        clean = f.read()
    if clean.count(mutant.original) != 1:
        return 'broken', 0.0, f'the original text occurs {clean.count(mutant.original)} times'
    try:
        with open(path, 'w', encoding='utf-8') as f:
            f.write(clean.replace(mutant.original, mutant.replacement))
        return run_tests(where, mutant.tests, timeout)
    finally:
        with open(path, 'w', encoding='utf-8') as f:
            f.write(clean)

# -----------------------------------------------------------------------------
# the table

HISTORY = """The first run (62 planted) caught 51. Of its 11 survivors, 10 are now caught by tests written as
specifications, each seen failing under its bug: an exit at a score equal to the threshold (test_engine),
recompute's fill with rotary positions (test_engine, a rope case of the middle-loop test), a prompt pass
of at most batch_size rows beside slid windows (test_batching), a shorter context keeping the first
positions and a source's prelude, loop and coda in that order (test_retrofit), init_from=auto in an
out_dir without ckpt.pt (test_cluster), loop_eps read as loop_lambda and a previous version's checkpoint
taken as evaluated (test_reliability), Newcombe's published intervals and the bootstrap's 95 % (lab's
test_claims). One is argued harmless below (an equivalent mutant)."""


def row(mutant, result, note):
    word = 'survived (harmless)' if result == 'survived' and mutant.harmless else result
    tests = ' '.join(mutant.tests).replace('|', '/')
    why = f" Harmless: {mutant.harmless}." if mutant.harmless and result == 'survived' else ''
    by = note.split('::')[-1] if result == 'caught' else ''
    return f"| {mutant.name} | {mutant.file} | {word} | {mutant.what}.{why} | `{tests}` | {by} |"


def read_results(path):
    # {name: (result, the test that caught it)} of an earlier table, to update it mutant by mutant (--only)
    out = {}
    if os.path.isfile(path):
        with open(path, encoding='utf-8') as f:
            for line in f:
                cells = [c.strip() for c in line.split('|')]
                if len(cells) > 4 and cells[3] in ('caught', 'survived', 'survived (harmless)', 'broken'):
                    out[cells[1]] = cells[3].split(' ')[0], cells[6] if len(cells) > 7 else ''
    return out


def table(results):
    """The markdown: counts, then one line per mutant (in MUTANTS' order)."""
    done = [m for m in MUTANTS if m.name in results]
    count = lambda word, harmless=None: sum(results[m.name][0] == word and (harmless is None or
                                                                         bool(m.harmless) == harmless)
                                            for m in done)
    lines = ["# Planted bugs", "",
             "Written by `python tests/tools/plant_bugs.py --out tests/tools/plant_bugs.md` (the script's",
             "docstring says how); each mutant is one realistic mistake, planted alone in a scratch copy and",
             "checked against the tests named beside it.", "",
             f"- planted: {len(done)}", f"- caught: {count('caught')}",
             f"- survived: {count('survived')} (argued harmless: {count('survived', True)}, "
             f"unexplained: {count('survived', False)})", f"- broken (no longer applies): {count('broken')}",
             "", HISTORY, "", "| mutant | file | result | the bug | tests | caught by |",
             "|---|---|---|---|---|---|"]
    return '\n'.join(lines + [row(m, *results[m.name]) for m in done]) + '\n'


def main(argv=None):
    parser = Parser('tests/tools/plant_bugs.py', __doc__)
    parser.add_argument('--list', action='store_true',
                        help="list the mutants and how often each one's original text occurs (1: it applies)")
    parser.add_argument('--only', default='', help="comma-separated mutant names (default: all)")
    parser.add_argument('--out', default='', help="the markdown table to write (with --only: updated)")
    parser.add_argument('--timeout', type=int, default=300, help="seconds per mutant's tests")
    parser.add_argument('--baseline', action='store_true',
                        help="run each chosen mutant's tests on the clean copy instead: all must pass")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(',') if n]
    unknown = [n for n in names if n not in {m.name for m in MUTANTS}]
    if unknown:
        parser.error(f"--only: no mutant named {', '.join(unknown)} (see --list)")
    chosen = [m for m in MUTANTS if not names or m.name in names]
    if args.list:
        for m in chosen:
            print(f"{m.name}\t{m.file}\t{applies(m)}\t{m.what}")
        return 0 if all(applies(m) == 1 for m in chosen) else 1
    where = scratch_copy()
    if args.baseline:  # a selection failing (or running nothing) on clean code: every mutant 'caught'
        try:
            runs = {tuple(m.tests): run_tests(where, m.tests, args.timeout) for m in chosen}
        finally:
            shutil.rmtree(where, ignore_errors=True)
        bad = {t: r for t, r in runs.items() if r[0] != 'survived'}
        for t, (result, seconds, note) in runs.items():
            print(f"{'ok ' if t not in bad else 'BAD'} {' '.join(t)} ({seconds:.0f} s; {note})", flush=True)
        return 1 if bad else 0
    results = read_results(args.out) if args.out and names else {}
    try:
        for i, m in enumerate(chosen, 1):
            result, seconds, note = plant(m, where, args.timeout)
            results[m.name] = result, note
            print(f"[{i}/{len(chosen)}] {m.name}: {result} ({seconds:.0f} s; {note})", flush=True)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    text = table(results)
    if args.out:
        with open(args.out, 'w', encoding='utf-8') as f:
            f.write(text)
    print(text)
    return 0


if __name__ == '__main__':
    sys.exit(main())
