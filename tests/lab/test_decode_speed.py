"""lab/decode_speed.py: batch-1 decoding's ms/token per tree, fixed depth and adaptive exit, tiny sizes."""
import subprocess
import sys

import decode_speed

TINY = ['--n_layer=1', '--n_loop=2', '--n_head=2', '--n_embd=16', '--block_size=32', '--prompt_len=4',
        '--lengths=2,6', '--rounds=2', '--repeats=1']


def test_decode_speed_times_each_tree_in_its_own_process_every_round(repo_dir, capsys):
    rows = decode_speed.main(TINY)  # this tree (the default)
    out = capsys.readouterr().out
    assert list(rows) == [str(repo_dir)] and len(rows[str(repo_dir)]) == 2  # one per round
    for r in rows[str(repo_dir)]:
        assert r['fixed'] > 0 and r['adaptive'] > 0 and 1 <= r['adaptive loops'] <= 2
    assert out.startswith('batch 1, d 16, K 1 x R 2, ') and 'median of 2 rounds' in out
    assert f"{repo_dir}: fixed " in out and 'adaptive loops/token' in out


def test_decode_speed_help_and_a_typo(repo_dir):
    run = lambda *a: subprocess.run([sys.executable, str(repo_dir / 'lab' / 'decode_speed.py'), *a],
                                    capture_output=True, text=True, timeout=120)
    r = run('--help')
    assert r.returncode == 0 and '--trees' in r.stdout and '--kv_policy' in r.stdout
    r = run('--round=2')
    assert r.returncode == 1 and r.stderr.count('\n') == 1 and 'did you mean --rounds?' in r.stderr
