"""
The README's example eval block is this code's output. Its last eval is the committed record's,
assets/runs/readme_default/metrics.jsonl: `python train.py --dtype=float32`, the embedded default in fp32,
which assets/runs/readme_default/README.md says how to regenerate. Its first eval, step 0, is recomputed
here by train.py itself (--eval_only: the initial weights on the fixed validation batches), so that a
change to the model, the init or the data moves it and fails this file until the record is regenerated.
The spread the README states, the default bf16 arm against fp32, reads from the record's bf16 twin.
"""
import json
import re

import pytest

from conftest import REPO, real_data, run_train

RUN = REPO / 'assets' / 'runs' / 'readme_default'
FP32, BF16 = RUN / 'metrics.jsonl', RUN / 'metrics_bf16.jsonl'


def records(path):
    return [json.loads(line) for line in path.read_text(encoding='utf-8').splitlines()]


def eval_block(row):
    """The lines train.py's log_eval prints for one row of metrics.jsonl."""
    line = lambda name, vals, fmt: f"  {name:<10}" + ''.join(format(v, fmt).rjust(11) for v in vals)
    return [f"step {row['iter']}: train loss {row['train_loss']:.4f}, val loss {row['val_loss']:.4f} "
            f"(final exit), lr {row['lr']:.2e}",
            line('exit k', range(1, len(row['val_ce']) + 1), 'd'),
            line('train CE', row['train_ce'], '.4f'),
            line('val CE', row['val_ce'], '.4f'),
            line('||h_k||', row['norm'], '.1f') + "   (mean per-token L2 norm, val, before readout)"]


def readme():
    return (REPO / 'README.md').read_text(encoding='utf-8')


def readme_evals():
    """The README's example eval block, cut at its '...' line: (step 0's lines, the last eval's lines)."""
    block = re.search(r'```\n(step 0: .*?)```', readme(), re.S).group(1).splitlines()
    cut = block.index('...')
    return block[:cut], block[cut + 1:]



def test_readme_eval_block_is_the_committed_runs_first_and_last_eval():
    rows = records(FP32)
    first, last = readme_evals()
    max_iters = int(re.search(r'^max_iters = (\d+)', (REPO / 'train.py').read_text(encoding='utf-8'),
                              re.M).group(1))
    assert rows[0]['iter'] == 0 and rows[-1]['iter'] == max_iters  # a whole run of the embedded default
    assert first == eval_block(rows[0])
    assert last == eval_block(rows[-1])


def test_readme_states_the_bf16_arms_numbers_and_their_spread_from_fp32():
    fp32, bf16 = records(FP32), records(BF16)
    assert [r['iter'] for r in bf16] == [r['iter'] for r in fp32]
    text = ' '.join(readme().split('## Training', 1)[1].split('\n## ', 1)[0].split())
    for it in (0, -1):
        assert f"{bf16[it]['val_loss']:.4f}" in text, f"bf16's val loss at step {bf16[it]['iter']}"
    spread = abs(bf16[-1]['val_loss'] - fp32[-1]['val_loss'])
    assert f"{spread:.4f} nats" in text  # the spread the README states, as the records give it
    assert f"{bf16[-1]['norm'][-1]:.1f}" in text


def test_readme_step_0_eval_is_what_this_code_computes(tmp_path):
    cwd = real_data(tmp_path)
    if cwd is None:
        pytest.skip("step 0 needs the real shakespeare_char: set NANOLOOP_OFFLINE_DATA to a folder holding "
                    "tinyshakespeare/input.txt, or run python prepare.py shakespeare_char")
    code, out, err = run_train(['--dtype=float32', '--eval_only=True', f"--out_dir={tmp_path / 'out'}"], cwd)
    assert code == 0, err
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('step 0:'))
    assert lines[start:start + 5] == readme_evals()[0] == eval_block(records(FP32)[0])
