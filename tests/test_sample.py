"""sample.py: decodes text from a checkpoint with fixed and adaptive exit; every bad input is one clean
line."""
import contextlib
import hashlib
import io
import json
import os
import re
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import sample
from conftest import save_tiny_checkpoint

# float32: the exact numbers these tests compare (--dtype=auto is bf16 autocast on a CPU with bf16 units)
FAST = ['--num_samples=2', '--max_new_tokens=12', '--device=cpu', '--dtype=float32']


def run_main(argv):
    """sample.main in-process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            sample.main(argv)
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def mean_loops(stdout):
    m = re.search(r'mean loops used per token: ([\d.]+) of (\d+)', stdout)
    return float(m.group(1)), int(m.group(2))


def test_sample_decodes_text_from_a_checkpoint(tiny_data, tiny_ckpt, repo_dir):
    # the real command line, from the folder holding data/ (the default meta.json is data/<dataset>/meta.json)
    r = subprocess.run([sys.executable, str(repo_dir / 'sample.py'), f'--out_dir={tiny_ckpt}',
                        '--start=ROMEO:', *FAST], cwd=tiny_data.parent.parent, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    itos = json.loads((tiny_data / 'meta.json').read_text(encoding='utf-8'))['itos']
    samples = re.findall(r'(ROMEO:[\s\S]*?)\n---------------\n', r.stdout)
    assert len(samples) == 2
    for text in samples:                                                 # the prompt, then 12 new characters
        assert len(text) == len('ROMEO:') + 12 and set(text) <= set(itos)
    assert 'mean loops' not in r.stdout                                  # fixed exit: nothing to report


def test_adaptive_exit_reports_mean_loops_per_token(tiny_data, tiny_ckpt, monkeypatch):
    monkeypatch.chdir(tiny_data.parent.parent)
    base = [f'--out_dir={tiny_ckpt}', *FAST]
    # threshold 0: every token is confident enough at loop 1 (except, at most, the first new token of a
    # sample, whose logits come from the prompt's pass through all R loops); an unreachable threshold: every
    # token runs R
    code, out, _ = run_main(base + ['--exit_threshold=0'])
    loops, R = mean_loops(out)
    assert code == 0 and R == 2 and 1.0 <= loops <= round((11 * 1 + 2) / 12, 2)
    code, out, _ = run_main(base + ['--exit_threshold=1.0'])              # maxprob never reaches 1 here
    assert code == 0 and mean_loops(out) == (2.0, 2)
    code, _, err = run_main(base + ['--exit_threshold=1.5'])              # beyond maxprob's range
    assert code == 1 and err.strip().endswith("--exit_threshold=1.5 is outside [0, 1], the range of "
                                              "exit_policy='maxprob'")
    code, out, _ = run_main(base + ['--exit_threshold=1e9', '--exit_policy=margin', '--n_loop=3'])
    assert code == 0 and mean_loops(out) == (3.0, 3)                     # at most --n_loop loops


def test_same_seed_same_samples_and_n_loop_override(tiny_data, tiny_ckpt, monkeypatch):
    monkeypatch.chdir(tiny_data.parent.parent)
    base = [f'--out_dir={tiny_ckpt}/ckpt.pt', *FAST]                   # a checkpoint file works as --out_dir
    texts = lambda argv: run_main(argv)[1].rsplit('---------------', 1)[0]  # without the tokens/s line
    assert texts(base + ['--seed=7']) == texts(base + ['--seed=7'])
    assert texts(base + ['--seed=7']) != texts(base + ['--seed=8'])
    code, out, _ = run_main(base + ['--n_loop=4', '--temperature=0'])   # extrapolation past the trained R=2
    assert code == 0 and 'fixed exit at loop 4' in out


def greedy_by_hand(model, ids, n_new, n_loop):
    """Greedy decoding from readout(h_R') of loop_states(x, R'), recomputed from scratch for every token."""
    import torch
    x = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n_new):
            h = model.run(x[:, -model.config.block_size:], n_loop).states[-1]
            x = torch.cat((x, model.readout(h[:, -1:], n_loop).argmax(-1)), dim=1)
    return x[0].tolist()


def test_n_loop_sets_the_depth_every_generated_token_is_read_at(tiny_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tiny_data.parent.parent)
    meta = json.loads((tiny_data / 'meta.json').read_text(encoding='utf-8'))
    # seed 2: an untrained R=2 model whose greedy text differs at 1, 2 and 4 loops (at seed 0 all are ':::')
    model = save_tiny_checkpoint(str(tmp_path / 'deep' / 'ckpt.pt'), meta['vocab_size'], seed=2,
                                 meta=meta).eval()
    itos = meta['itos']
    prompt = [itos.index(c) for c in 'ROMEO:']
    texts = {}
    for n_loop in (1, 2, 4):  # early exit, the trained R, extrapolation
        code, out, err = run_main([f'--out_dir={tmp_path / "deep"}', *FAST, '--temperature=0',
                                   '--start=ROMEO:', f'--n_loop={n_loop}'])
        assert code == 0, err
        texts[n_loop] = ''.join(itos[i] for i in greedy_by_hand(model, prompt, 12, n_loop))
        assert out.count(texts[n_loop] + '\n---------------\n') == 2, (n_loop, texts[n_loop], out)
    assert len(set(texts.values())) == 3, texts


def test_meta_flag_and_start_file(tiny_data, tiny_ckpt, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path / 'out')                                  # no data/ here: --meta is needed
    prompt = tmp_path / 'prompt.txt'
    prompt.write_text('JULIET:\nSweet', encoding='utf-8')
    code, out, err = run_main([f'--out_dir={tiny_ckpt}', f'--meta={tiny_data}/meta.json',
                               f'--start=FILE:{prompt}', *FAST])
    assert code == 0, err
    assert out.count('JULIET:\nSweet') == 2


def test_without_data_the_checkpoint_copy_of_the_tokenizer_decodes(tiny_ckpt, tmp_path, monkeypatch):
    (tmp_path / 'elsewhere').mkdir()
    monkeypatch.chdir(tmp_path / 'elsewhere')                            # no data/ here, no --meta
    code, out, err = run_main([f'--out_dir={tiny_ckpt}', '--start=ROMEO:', *FAST])
    assert code == 0, err
    assert out.count('ROMEO:') == 2


def test_gpt2_checkpoint_with_padded_vocab_decodes(offline_data, tmp_path, monkeypatch):
    # GPT-2 BPE data (vocab 50257) and a model padded to 50304 as nanoGPT does: accepted, and decodable
    from prepare import prepare
    (tmp_path / 'bpe.txt').write_text('To be, or not to be, that is the question.\n' * 40, encoding='utf-8')
    meta = prepare('bpe', input_path=str(tmp_path / 'bpe.txt'), tokenizer='gpt2',
                   out_dir=str(tmp_path / 'data'))
    save_tiny_checkpoint(str(tmp_path / 'out' / 'ckpt.pt'), 50304, dataset='bpe', meta=meta)
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(['--out_dir=out', '--start=To be, or', '--exit_threshold=0.5', *FAST])
    assert code == 0, err
    assert out.count('To be, or') == 2 and 'mean loops used per token' in out


# ---- bad input: one line on stderr, non-zero exit, no traceback, the checkpoint untouched ----

def bad_setups(tmp_path, tiny_ckpt):
    good = (tiny_ckpt / 'ckpt.pt').read_bytes()
    (tmp_path / 'truncated.pt').write_bytes(good[:len(good) // 2])
    (tmp_path / 'notes.pt').write_text('these are my notes, not a checkpoint')
    (tmp_path / 'list.pt').write_bytes(b'')
    meta = json.loads((tiny_ckpt.parent / 'data' / 'tiny_char' / 'meta.json').read_text(encoding='utf-8'))
    other = {**meta, 'vocab_size': 65, 'itos': [chr(33 + i) for i in range(65)]}
    for name, text in [('other', json.dumps(other)),
                       ('reordered', json.dumps({**meta, 'itos': meta['itos'][::-1]})),
                       ('broken', '{"tokenizer": ')]:
        (tmp_path / name).mkdir()
        (tmp_path / name / 'meta.json').write_text(text)
    (tmp_path / 'notes.json').write_text('{}')
    # a checkpoint without train.py's copy of the meta: only the vocab_size can be checked
    save_tiny_checkpoint(str(tmp_path / 'bare' / 'ckpt.pt'), 50, dataset='tiny_char')


@pytest.mark.parametrize('args, says', [
    (['--out_dir=nowhere'], 'nowhere/ckpt.pt'),
    (['--out_dir=truncated.pt'], 'truncated.pt'),
    (['--out_dir=notes.pt'], 'notes.pt'),
    (['--out_dir=list.pt'], 'list.pt'),
    (['--start=FILE:missing_prompt.txt'], '--start FILE:missing_prompt.txt'),
    (['--meta=other/meta.json'], 'other/meta.json disagrees with'),
    (['--meta=reordered'], 'disagrees with'),
    (['--meta=broken'], 'broken/meta.json is not a prepare.py meta.json'),
    (['--meta=notes.json'], 'give a meta.json'),
    (['--meta=absent/meta.json'], 'absent/meta.json not found'),
    (['--out_dir=bare', '--meta=data/tiny_char'], 'the model 50'),
    (['--start=ROMEO: \u20ac'], 'not in the tiny_char vocabulary'),
    (['--start='], 'prompt is empty'),
    (['--temprature=0.5'], "unknown config key 'temprature'; did you mean temperature?"),
    (['--top_k=many'], "--top_k='many': expected int, like the default 200"),
    (['--temperature=hot'], "--temperature='hot': expected float"),
    (['--num_samples=0'], '--num_samples=0: must be >= 1'),
    (['--n_loop=-1'], '--n_loop=-1: must be >= 0'),
    (['--exit_policy=confidence'], "--exit_policy='confidence': choose one of maxprob, margin"),
    (['--exit_threshold=-0.5'], "--exit_threshold=-0.5 is outside [0, 1]"),
    (['--top_k'], "--top_k: expected --key=value"),
    (['--device=gpu0'], '--device=gpu0: not a torch device'),
    (['--dtype=fp8'], "--dtype='fp8': choose one of auto, float32, bfloat16, float16"),
])
def test_bad_input_is_one_line_error(tmp_path, tiny_ckpt, monkeypatch, args, says):
    monkeypatch.chdir(tmp_path)
    bad_setups(tmp_path, tiny_ckpt)
    ckpt = tiny_ckpt / 'ckpt.pt'
    before = (hashlib.sha256(ckpt.read_bytes()).hexdigest(), os.stat(ckpt).st_mtime_ns)
    code, out, err = run_main([f'--out_dir={tiny_ckpt}', *FAST, *args])
    assert code not in (0, None)
    assert err.startswith('error: ') and err.count('\n') == 1, err
    assert says in err
    assert (hashlib.sha256(ckpt.read_bytes()).hexdigest(), os.stat(ckpt).st_mtime_ns) == before


def test_cli_errors_have_no_traceback(tmp_path, tiny_ckpt, repo_dir):
    bad_setups(tmp_path, tiny_ckpt)
    for args in (['--out_dir=truncated.pt'],
                 [f'--out_dir={tiny_ckpt}', '--start=FILE:missing.txt', '--bogus=1']):
        r = subprocess.run([sys.executable, str(repo_dir / 'sample.py'), *args], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and r.stderr.count('\n') == 1 and 'Traceback' not in r.stderr, r.stderr


@pytest.mark.parametrize('flag', ['--help', '-h'])
def test_help_lists_every_flag_with_its_default_and_comment(flag, tmp_path, repo_dir):
    # no checkpoint here: --help answers before anything is loaded
    r = subprocess.run([sys.executable, str(repo_dir / 'sample.py'), flag], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and 'error' not in r.stderr, r.stderr
    assert r.stdout.startswith('usage: python sample.py ')
    lines = {line.split(' = ')[0].strip(): line for line in r.stdout.splitlines()
             if line.startswith('  ') and not line.lstrip().startswith('#')}  # the key lines
    assert sorted(lines) == sorted(sample.defaults)  # sample.py's flags, and not the model's keys
    assert lines['exit_threshold'].split('#')[0].strip() == 'exit_threshold = -1.0'
    assert '# adaptive exit at the first loop whose score reaches this (-1 = off)' in lines['exit_threshold']
    assert '# what an exit leaves in skipped slots: recompute | copy | shared | active' in lines['kv_policy']


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(blob=st.binary(max_size=2048))
def test_random_bytes_as_checkpoint_give_a_clean_error(tmp_path, blob):
    path = tmp_path / 'random.pt'
    path.write_bytes(blob)
    code, _, err = run_main([f'--out_dir={path}', *FAST])
    assert code not in (0, None) and err.startswith('error: ') and err.count('\n') == 1, err


FLAGS = sample.config_keys
VALUES = st.one_of(st.sampled_from(['0', '1', '-1', '3', '0.5', '1e9', 'nan', 'inf', '', 'cpu', 'cuda',
                                    'auto', 'margin', 'ROMEO:', 'FILE:', 'FILE:nope.txt', 'out',
                                    'data/tiny_char']),
                   st.text(max_size=8))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pairs=st.lists(st.tuples(st.one_of(st.sampled_from(FLAGS), st.text(min_size=1, max_size=10)), VALUES),
                      max_size=3))
def test_random_flags_either_sample_or_give_a_clean_error(tiny_ckpt, monkeypatch, pairs):
    monkeypatch.chdir(tiny_ckpt.parent)
    argv = [f'--{k.lstrip("-")}={v}' for k, v in pairs]
    # the random flags are parsed and checked; the fixed ones after them (last wins) keep each run short
    code, out, err = run_main(argv + ['--max_new_tokens=4', '--num_samples=1', '--n_loop=2'])
    assert code in (0, None) or (err.startswith('error: ') and err.count('\n') == 1), err


def test_exit_policy_gate_and_kl_sample_end_to_end_with_the_loops_their_scores_promise(tiny_data, tmp_path,
                                                                                     monkeypatch):
    monkeypatch.chdir(tiny_data.parent.parent)
    meta = json.loads((tiny_data / 'meta.json').read_text(encoding='utf-8'))
    save_tiny_checkpoint(str(tmp_path / 'gate' / 'ckpt.pt'), meta['vocab_size'], meta=meta, n_loop=3,
                         exit_gate='learned')
    base = [f'--out_dir={tmp_path / "gate"}', *FAST, '--temperature=0']
    # 12 new tokens per sample, the first always at R = 3 (it is read off the prompt's pass)
    # gate: the cumulative exit probability is >= 0 at exit 1 and never reaches 1 before the last exit
    code, out, err = run_main(base + ['--exit_policy=gate', '--exit_threshold=0'])
    assert code == 0, err
    assert 'adaptive exit (gate >= 0.0' in out and mean_loops(out) == (round((3 + 11 * 1) / 12, 2), 3)
    code, out, err = run_main(base + ['--exit_policy=gate', '--exit_threshold=1'])
    assert code == 0 and mean_loops(out) == (3.0, 3), err
    # kl: KL(p_{k-1} || p_k) <= a huge bound from exit 2 on (never at exit 1); <= 0 only at the last exit
    code, out, err = run_main(base + ['--exit_policy=kl', '--exit_threshold=1e9'])
    assert code == 0 and mean_loops(out) == (round((3 + 11 * 2) / 12, 2), 3), err
    code, out, err = run_main(base + ['--exit_policy=kl', '--exit_threshold=0'])
    assert code == 0 and mean_loops(out) == (3.0, 3), err
    # the text is what the policy decodes: the same greedy tokens as generate with that policy and threshold
    import torch
    from run import checkpoint
    model = checkpoint.build_model(checkpoint.load(str(tmp_path / 'gate' / 'ckpt.pt'))).eval()
    code, out, err = run_main(base + ['--exit_policy=kl', '--exit_threshold=0.01', '--start=ROMEO:'])
    x = torch.tensor([[meta['itos'].index(c) for c in 'ROMEO:']])
    from decoding import engine
    y, _, _ = engine.generate(model, x, 12, engine.Decoding(temperature=0, exit_threshold=0.01,
                                                            exit_policy='kl'))
    assert out.count(''.join(meta['itos'][i] for i in y[0].tolist()) + '\n---------------\n') == 2


def test_exit_policy_gate_on_a_model_without_a_gate_is_one_line(tiny_ckpt, repo_dir):
    for run in ('in-process', 'command line'):
        args = [f'--out_dir={tiny_ckpt}', *FAST, '--exit_policy=gate', '--exit_threshold=0.5']
        if run == 'in-process':
            code, out, err = run_main(args)
        else:
            r = subprocess.run([sys.executable, str(repo_dir / 'sample.py'), *args], cwd=tiny_ckpt,
                               capture_output=True, text=True, timeout=120)
            code, out, err = r.returncode, r.stdout, r.stderr
        assert code == 1 and err.startswith('error: ') and err.count('\n') == 1, err
        assert 'this model has none' in err and 'Traceback' not in err and '---------------' not in out


# ---- one source per option: the flags make the Decoding, --dtype is train.py's, the words read opts ----

def test_from_flags_turns_each_off_value_into_none_and_keeps_speculate_only_when_given():
    from decoding.engine import Decoding
    flags = dict(sample.defaults)
    assert Decoding.from_flags(flags) == Decoding(temperature=0.8, top_k=200)  # every other flag: off
    for key, off in (('top_k', 0), ('n_loop', 0), ('exit_threshold', -1.0), ('kv_slots', 0)):
        on = 0.0 if key == 'exit_threshold' else 3  # a threshold of 0 is on: every token exits at loop 1
        assert getattr(Decoding.from_flags({**flags, key: off}), key) is None, key
        assert getattr(Decoding.from_flags({**flags, key: on}), key) == on, key
    assert Decoding.from_flags({**flags, 'speculate': 6}).speculate is None  # not given: not a choice
    assert Decoding.from_flags({**flags, 'speculate': 6}, {'speculate'}).speculate == 6
    given = dict(temperature=0.0, exit_policy='kl', kv_policy='copy', draft_loops=2, batch_size=8,
                 compile=True)
    assert Decoding.from_flags({**flags, **given}) == Decoding(top_k=200, **given)


def test_dtype_follows_train_py_rule_and_float32_runs_without_autocast():
    import torch
    from run import ops
    for dtype in ('auto', 'float32', 'bfloat16', 'float16'):
        resolved, note = ops.resolve_dtype(dtype, 'cpu')
        ctx, words = sample.precision(dtype, 'cpu')
        assert words == resolved + note
        with ctx:
            assert torch.is_autocast_enabled('cpu') == (resolved != 'float32')
            assert resolved == 'float32' or torch.get_autocast_dtype('cpu') == getattr(torch, resolved)


def test_header_names_the_dtype_and_float32_decodes_as_before(tiny_ckpt, monkeypatch):
    monkeypatch.chdir(tiny_ckpt.parent)
    code, out, err = run_main([f'--out_dir={tiny_ckpt}', *FAST, '--start=ROMEO:', '--temperature=0'])
    assert code == 0 and out.splitlines()[0].endswith(', fixed exit at loop 2, trained with n_loop=2, cpu, '
                                                     'float32'), err
    from run import ops
    resolved, note = ops.resolve_dtype('auto', 'cpu')
    code, out, err = run_main([f'--out_dir={tiny_ckpt}', *FAST[:-1], '--start=ROMEO:', '--temperature=0'])
    assert code == 0 and out.splitlines()[0].endswith(f', cpu, {resolved}{note}'), err


def test_mode_and_summary_read_the_options_not_the_flags(monkeypatch):
    import torch
    from decoding.engine import Decoding
    for key, value in dict(exit_policy='kl', exit_threshold=0.9, draft_loops=3, speculate=9,
                           kv_policy='shared', kv_slots=5, batch_size=7, compile=True).items():
        monkeypatch.setattr(sample, key, value)  # flags that disagree with the options below
    assert sample.mode(Decoding(), 4) == 'fixed exit at loop 4'
    assert sample.mode(Decoding(exit_threshold=0.5, kv_policy='copy'), 4) == \
        'adaptive exit (maxprob >= 0.5, at most 4 loops), kv_policy=copy'
    assert sample.mode(Decoding(draft_loops=1), 2) == \
        'fixed exit at loop 2, self-speculative (drafts of 4 tokens from loop 1)'
    used = torch.tensor([1.0, 2.0])
    assert sample.summary(used, 0.5, 2, Decoding(), dict(accepted=1, checked=2)) == \
        '2 tokens in 0.50 s (4.0 tokens/s), 2 loops per token'


def test_compiled_rate_leaves_out_the_compilation_and_reports_it_apart(tiny_ckpt, monkeypatch):
    # --compile=True compiles the step inside the timed decoding: its tokens/s must be the steady-state rate,
    # not "compile is 25x slower" (15.6 tokens/s with 51.3 s of compiling in). serve times the calls that
    # compiled (the first at each batch shape), here a stand-in that takes 1 s at its first call, 20 ms after
    import time
    import torch
    from decoding import batching
    from decoding.engine import Decoding
    line = sample.summary(torch.full((800,), 4.0), 1.23, 4, Decoding(compile=True), dict(compiling=14.1))
    assert line == '800 tokens in 1.23 s (650.4 tokens/s; compiling took 14.10 s), 4 loops per token'
    assert 'compiling' not in sample.summary(torch.full((800,), 4.0), 2.0, 4, Decoding(), dict(compiling=0))
    calls = []  # the batch size of each call

    def compiled(device_type):  # batching.compiled's stand-in: the eager step, slow at its first call
        def run(*args):
            time.sleep(0.02 if calls else 1.0)
            calls.append(args[2].rows.numel())
            return batching.step(*args)
        return run
    monkeypatch.setattr(batching, 'compiled', compiled)
    code, out, err = run_main([f'--out_dir={tiny_ckpt}', *FAST, '--start=ROMEO:', '--compile=True'])
    n, seconds, rate, took = re.search(r'(\d+) tokens in ([\d.]+) s \(([\d.]+) tokens/s; compiling took '
                                       r'([\d.]+) s\)', out.splitlines()[-1]).groups()
    assert code == 0 and calls and int(n) == 24, err
    later = 0.02 * (len(calls) - 1)  # the calls that did not compile: they are the decoding's time
    assert 1.0 <= float(took) < 1.0 + later / 2 and later <= float(seconds) < 1.0 + later
    low, high = float(seconds) - 0.005, float(seconds) + 0.005  # (printed to 2 decimals)
    assert int(n) / high - 0.05 <= float(rate) <= int(n) / max(low, 1e-9) + 0.05  # the rate of those seconds


def test_a_prompts_file_without_a_prompt_is_one_line(tiny_ckpt, tmp_path):
    for name, text in (('empty.txt', ''), ('blank.txt', '\n\n')):
        (tmp_path / name).write_text(text, encoding='utf-8')
        code, out, err = run_main([f'--out_dir={tiny_ckpt}', '--device=cpu', f'--prompts={tmp_path / name}'])
        assert code == 1 and err.count('\n') == 1 and out == '', (name, out, err)
        assert err == f"error: --prompts {tmp_path / name}: no prompt in the file (one a line, blank lines " \
                      "skipped)\n"
