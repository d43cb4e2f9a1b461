"""
ablate.py: the sweep runner end to end on two 5-iteration arms, the DeepLoop report's escape rule, the unigram
floor, and the paper-scale dry run.
"""
import json
import math
import os

import numpy as np
import pytest

import ablate

TINY = dict(dataset='tiny_char', n_layer=1, n_loop=2, n_head=2, n_embd=16, block_size=16, batch_size=4,
            max_iters=5, eval_interval=5, eval_iters=1, log_interval=1, device='cpu', compile=False)


def test_sweep_runs_two_arms_end_to_end(tiny_data, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # train.py and eval_depth.py read data/<dataset> from the working directory
    monkeypatch.setitem(ablate.PRESETS, 'tiny', dict(
        title='tiny', laptop=TINY, seeds=(7,), eval_depth=True, report='blindspot',
        arms=[ablate.arm('loop_rmsnorm', 'config/loop_rmsnorm.py'),
              ablate.arm('loop_raw', 'config/loop_raw.py')]))
    argv = ['tiny', '--out', 'runs', '--report_dir', 'rep', '--workers=2',
            '--eval_args=--n_seqs=8 --batch_size=4 --timing_repeats=1 --n_grad_seqs=4']
    ablate.main(argv)
    for name in ('loop_rmsnorm-s7', 'loop_raw-s7'):
        status = json.loads((tmp_path / 'runs' / name / 'status.json').read_text())
        assert status['train'] == 'done' and status['eval'] == 'done', status
        rows = [json.loads(l) for l in (tmp_path / 'runs' / name / 'metrics.jsonl').read_text().splitlines()]
        assert rows[-1]['iter'] == 5 and len(rows[-1]['norm']) == 2
        cfg = json.loads((tmp_path / 'runs' / name / 'eval_depth.json').read_text())['model_args']
        assert cfg['readout'] == name.split('_')[1].split('-')[0]  # the arm's config file was applied
    md = (tmp_path / 'rep' / 'tiny.md').read_text()
    assert '| loop_rmsnorm | 1 | 5 |' in md and '| loop_raw | 1 | 5 |' in md
    assert 'radial grad.' in md and 'n/a' not in md
    try:
        import matplotlib  # noqa: F401
        assert (tmp_path / 'rep' / 'tiny_norms.png').stat().st_size > 1000
    except ImportError:
        pass
    # a second call skips the finished runs and rebuilds the same report
    capsys.readouterr()
    ablate.main(argv)
    assert 'train done, iter 5' in capsys.readouterr().out
    assert (tmp_path / 'rep' / 'tiny.md').read_text().split('Wall time')[0] == md.split('Wall time')[0]


def write_run(d, val_losses, status='done'):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, 'metrics.jsonl'), 'w') as f:
        for i, v in enumerate(val_losses):
            f.write(json.dumps(dict(iter=10 * i, val_loss=v, val_ce=[v], norm=[1.0])) + '\n')
    with open(os.path.join(d, 'status.json'), 'w') as f:
        json.dump(dict(train=status), f)


def test_deeploop_report_counts_runs_below_the_unigram_floor(tiny_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    arms = [ablate.arm(f'{v}-R2', n_loop=2, tags=dict(variant=v, R=2, lr=1e-3)) for v in ('good', 'stuck')]
    monkeypatch.setitem(ablate.PRESETS, 'tinyloop', dict(title='t', laptop=TINY, seeds=(1,), eval_depth=False,
                                                         report='deeploop', arms=arms))
    floor = ablate.unigram_floor(str(tiny_data))
    write_run('runs/good-R2-s1', [4.0, floor - 1.0])
    write_run('runs/stuck-R2-s1', [4.0, floor])
    ablate.main(['tinyloop', '--out', 'runs', '--report_dir', 'rep', '--report_only'])
    md = (tmp_path / 'rep' / 'tinyloop.md').read_text()
    assert f'{floor:.4f} nats' in md
    assert f'| good | {floor - 1.0:.3f} (1/1) |' in md
    assert f'| stuck | {floor:.3f} (0/1) |' in md


def test_unigram_floor_of_uniform_tokens_is_log_v(tmp_path):
    d = tmp_path / 'u'
    d.mkdir()
    np.tile(np.arange(4, dtype=np.uint16), 1000).tofile(d / 'train.bin')
    np.tile(np.arange(4, dtype=np.uint16), 100).tofile(d / 'val.bin')
    (d / 'meta.json').write_text(json.dumps(dict(vocab_size=4, dtype='uint16')))
    assert ablate.unigram_floor(str(d)) == pytest.approx(math.log(4), rel=1e-6)


def test_paper_scale_dry_run_composes_the_base_config(repo_dir, monkeypatch, capsys):
    monkeypatch.chdir(repo_dir)
    ablate.main(['blindspot', '--base', 'config/paper_44m.py', '--only=loop_raw', '--dry_run',
                 '--launcher', 'torchrun --standalone --nproc_per_node=8'])
    out = capsys.readouterr().out
    assert 'torchrun --standalone --nproc_per_node=8 train.py config/paper_44m.py' in out
    assert 'loop_raw.py' in out and '--n_embd' not in out  # the laptop sizes do not apply over a base
    assert 'GPU-hours' in out


def test_unknown_arm_dies_with_one_line(capsys):
    with pytest.raises(SystemExit):
        ablate.main(['blindspot', '--only=loop_softmax', '--dry_run'])
    err = capsys.readouterr().err
    assert err.startswith('error: --only loop_softmax: not an arm') and err.count('\n') == 1
