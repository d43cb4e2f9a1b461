"""lab/step_trace.py counts the project functions of exactly one training step."""
import subprocess
import sys

from conftest import REPO


def test_the_trace_holds_one_step_and_no_eval(tiny_data):
    flags = ['--dataset=tiny_char', '--n_layer=1', '--n_loop=2', '--n_embd=16', '--n_head=2',
             '--block_size=16', '--batch_size=2', '--dtype=float32', '--device=cpu']
    r = subprocess.run([sys.executable, str(REPO / 'lab' / 'step_trace.py'), *flags],
                       cwd=tiny_data.parent.parent, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    listing = r.stdout.split('one training step calls ', 1)[1]
    n, files = int(listing.split()[0]), dict(line.strip().split(': ', 1) for line in listing.splitlines()[1:])
    functions = [f for names in files.values() for f in names.split(', ')]
    assert n == len(functions) and len(files) == int(listing.split(' in ')[1].split()[0])
    assert 'get_lr' in files['train.py'] and 'get_batch' in files['train.py']
    assert 'GPT.loops' in files['model.py'] and 'GPT.loss' in files['model.py']
    assert 'estimate_loss' not in files['train.py'] and 'GPT.exit_metrics' not in files['model.py']  # no eval
