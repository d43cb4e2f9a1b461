"""
A run survives its cluster: preemption signals, automatic resume, a dead or stalled rank, a full disk.
Each test pins one guarantee of the README's "Long runs" section.

Signals are sent at a known point without sleeping: tests/train_hooks.py's `signals` hook runs the real
train.py in a real process and sends the signal from inside the k-th optimizer step (or kills or stalls that
rank there).
"""
import errno
import os
import signal
import socket
import subprocess
import time

import pytest
import torch

from conftest import (TINY, cli_env, read_metrics, run_train, run_train_process, skip_without_torchrun,
                      train_command, write_data)
from test_reliability import assert_clean_error, model_tensors_equal, snapshot

from run import checkpoint
from run.ops import duration


def run_signalled(args, cwd, action, step, **env):
    """train.py in a real process, HOOK_ACTION at optimizer step `step` (1-based): train_hooks.signals."""
    return run_train_process(args, cwd, 'signals', HOOK_ACTION=action, HOOK_STEP=str(step), **env)


def stop_lines(out):
    return [line for line in out.splitlines() if line.startswith('stopped by')]


def drop_time(rows):
    return [{k: v for k, v in r.items() if k != 'time'} for r in rows]


def losses(out):
    return [line.split(', time')[0] for line in out.splitlines() if line.startswith('iter ')]

# -----------------------------------------------------------------------------
# preemption and requeue

@pytest.mark.parametrize('sig,step,stop_iter', [('SIGTERM', 3, 4), ('SIGUSR1', 4, 5), ('SIGINT', 2, 3)])
def test_a_signal_stops_after_the_step_and_the_same_command_continues_bit_for_bit(tmp_path, sig, step,
                                                                                   stop_iter):
    # the signal arrives in optimizer step `step` (1-based), after that step's all-reduce: the next step's
    # all-reduce sees it, so the run stops with stop_iter = step + 1 iterations done. Iter 4 is an eval
    # iteration (eval_interval=2) the stopped run did not evaluate: the resumed run must, as the uninterrupted
    # run did; iter 5 is not.
    write_data(tmp_path)
    args = [*TINY, '--dropout=0.1', '--gradient_accumulation_steps=2', '--eval_interval=2', '--max_iters=8',
            '--init_from=auto']
    code, ref_out, err = run_train([*args, '--out_dir=a'], tmp_path)  # uninterrupted, in this process
    first = run_signalled([*args, '--out_dir=b'], tmp_path, sig, step)
    assert code == 0 and first.returncode == 0, err + first.stderr
    assert stop_lines(first.stdout) == [f"stopped by {sig} at iter {stop_iter}: checkpoint b/ckpt.pt; "
                                        f"continue with the same command and --init_from=auto (or resume)"]
    assert first.stderr == ''
    assert torch.load(tmp_path / 'b' / 'ckpt.pt', weights_only=True)['iter_num'] == stop_iter
    second = run_train_process([*args, '--out_dir=b'], tmp_path)  # the requeued job: the very same command
    assert second.returncode == 0, second.stderr
    assert f"resuming from b/ckpt.pt at iter {stop_iter}" in second.stdout
    rows_a, rows_b = (read_metrics(tmp_path / d / 'metrics.jsonl') for d in 'ab')
    assert [r['iter'] for r in rows_a] == [0, 2, 4, 6, 8]
    assert drop_time(rows_a) == drop_time(rows_b)  # every exit's CE and every loop norm, bit for bit
    assert losses(ref_out) == losses(first.stdout) + losses(second.stdout)
    ca, cb = (torch.load(tmp_path / d / 'ckpt.pt', weights_only=True) for d in 'ab')
    assert ca['iter_num'] == cb['iter_num'] == 8 and model_tensors_equal(ca['model'], cb['model'])


def test_sigusr1_from_outside_stops_a_running_process_with_exit_0(tmp_path):
    # the signal as a scheduler sends it, to a process that would otherwise run for minutes
    write_data(tmp_path)
    p = subprocess.Popen(train_command([*TINY, '--max_iters=100000', '--eval_interval=100000',
                                        '--log_interval=1', '--out_dir=out']), cwd=tmp_path, text=True,
                         env=cli_env(PYTHONUNBUFFERED='1'), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for line in p.stdout:
            if line.startswith('iter 2:'):
                break
        t0 = time.time()
        p.send_signal(signal.SIGUSR1)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    seconds = time.time() - t0
    assert p.returncode == 0 and err == '', err
    (stop,) = stop_lines(out)
    n = int(stop.split(' at iter ')[1].split(':')[0])
    assert stop.startswith('stopped by SIGUSR1') and 'checkpoint out/ckpt.pt' in stop
    assert checkpoint.load(str(tmp_path / 'out' / 'ckpt.pt'))['iter_num'] == n
    print(f"SIGUSR1 to exit: {seconds:.2f}s")


def test_ctrl_c_stops_with_one_line_and_a_second_ctrl_c_ends_the_process_at_once(tmp_path):
    # Ctrl-C is a stop signal like SIGTERM (the parametrized test above resumes from it bit for bit): one
    # line, no KeyboardInterrupt traceback, exit 0, a checkpoint of the iteration it stopped at
    write_data(tmp_path)
    args = [*TINY, '--max_iters=50', '--eval_interval=2', '--out_dir=out']
    r = run_signalled(args, tmp_path, 'SIGINT', 3)
    assert r.returncode == 0 and r.stderr == '', r.stderr
    assert stop_lines(r.stdout) == ["stopped by SIGINT at iter 4: checkpoint out/ckpt.pt; continue with the "
                                    "same command and --init_from=auto (or resume)"]
    assert 'Traceback' not in r.stdout and 'KeyboardInterrupt' not in r.stdout
    assert checkpoint.load(str(tmp_path / 'out' / 'ckpt.pt'))['iter_num'] == 4
    # a second Ctrl-C does not wait for the step to end: the process dies of it, and the checkpoint written
    # at the last eval (iter 6 of this resumed run) stays as it was
    r = run_signalled([*args, '--init_from=resume'], tmp_path, 'SIGINT SIGINT', 3)
    assert r.returncode == -signal.SIGINT and 'Traceback' not in r.stderr, (r.returncode, r.stderr)
    assert stop_lines(r.stdout) == []
    assert checkpoint.load(str(tmp_path / 'out' / 'ckpt.pt'))['iter_num'] == 6


def test_a_second_signal_during_the_save_leaves_a_checkpoint_that_loads_and_resumes(tmp_path):
    # the stop save itself receives SIGTERM and SIGUSR1 halfway through writing: it completes, exit 0
    write_data(tmp_path)
    args = [*TINY, '--eval_interval=100', '--max_iters=12', '--out_dir=out', '--init_from=auto']
    r = run_signalled(args, tmp_path, 'SIGTERM', 3, HOOK_SAVE_SIGNALS='1')
    assert r.returncode == 0 and r.stderr == '', r.stderr
    assert len(stop_lines(r.stdout)) == 1 and r.stdout.count('saving checkpoint') == 1
    assert checkpoint.load(str(tmp_path / 'out' / 'ckpt.pt'))['iter_num'] == 4
    assert not (tmp_path / 'out' / 'ckpt.pt.tmp').exists()
    code, out, err = run_train(args, tmp_path)
    assert code == 0, err
    assert torch.load(tmp_path / 'out' / 'ckpt.pt', weights_only=True)['iter_num'] == 12


def test_init_from_auto_starts_from_scratch_then_resumes(tmp_path):
    write_data(tmp_path)
    (tmp_path / 'out').mkdir()  # a job script made the folder for its logs: no ckpt.pt, nothing to resume
    args = [*TINY, '--eval_interval=2', '--out_dir=out', '--init_from=auto']
    code, out, err = run_train([*args, '--max_iters=2'], tmp_path)
    assert code == 0, err
    assert 'init_from=auto: no out/ckpt.pt yet, starting from scratch' in out and 'resuming' not in out
    code, out, err = run_train([*args, '--max_iters=4'], tmp_path)
    assert code == 0, err
    assert 'resuming from out/ckpt.pt at iter 2' in out and 'starting from scratch' not in out
    assert [r['iter'] for r in read_metrics(tmp_path / 'out' / 'metrics.jsonl')] == [0, 2, 4]

# -----------------------------------------------------------------------------
# a dead or stalled rank under torchrun (2 CPU processes on gloo)

def run_torchrun(tmp_path, args, action, step, hook_rank):
    """The signals hook under torchrun on 2 processes, rank hook_rank hooked; each rank's stdout and stderr
    go to files. Returns (exit code, seconds, {rank: stdout}, {rank: stderr}, torchrun's own output)."""
    write_data(tmp_path)
    t0 = time.time()
    r = run_train_process([*TINY, *args], tmp_path, 'signals', nproc=2,
                          torchrun=['--log-dir=logs', '--redirects=3'],
                          HOOK_ACTION=action, HOOK_STEP=str(step), HOOK_RANK=str(hook_rank))
    seconds = time.time() - t0
    skip_without_torchrun(r)
    read = lambda name: {int(p.parent.name): p.read_text() for p in (tmp_path / 'logs').glob(f'**/{name}')}
    return r.returncode, seconds, read('stdout.log'), read('stderr.log'), r.stdout + r.stderr


def test_ddp_ranks_signalled_at_different_times_stop_after_the_same_step(tmp_path):
    # only rank 1 receives SIGTERM: rank 0 learns of it in the step's all-reduce, saves, and both exit 0
    code, seconds, outs, errs, log = run_torchrun(
        tmp_path, ['--max_iters=50', '--eval_interval=2', '--out_dir=out'], 'SIGTERM', 5, hook_rank=1)
    assert code == 0, log[-3000:]
    assert errs == {0: '', 1: ''}, errs
    assert stop_lines(outs[0]) == ["stopped by a stop signal to another rank at iter 6: checkpoint "
                                   "out/ckpt.pt; continue with the same command and --init_from=auto "
                                   "(or resume)"]
    assert stop_lines(outs[1]) == []
    ckpt = checkpoint.load(str(tmp_path / 'out' / 'ckpt.pt'))
    assert ckpt['iter_num'] == 6 and ckpt['world_size'] == 2 and len(ckpt['data_rng']) == 2


def one_error_line(err, *fragments):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('error: '), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_ddp_a_killed_rank_ends_the_job_with_one_line_and_an_intact_checkpoint(tmp_path):
    # rank 0, the one that writes checkpoints, is killed at its 4th step, after the checkpoint at iter 2:
    # rank 1's next collective fails at once (gloo: connection closed), it prints one line and exits 1, and
    # torchrun ends the job. (Rank 0 surviving a stalled rank 1 is the next test.)
    code, seconds, outs, errs, log = run_torchrun(
        tmp_path, ['--max_iters=50', '--eval_interval=2', '--out_dir=out'], 'SIGKILL', 4, hook_rank=0)
    assert code != 0 and seconds < 120, (code, seconds)
    one_error_line(errs[1], 'error: rank 1: a collective failed at iter 4', 'Connection',
                   'collective_timeout=600s', 'out/ckpt.pt (iter 2) is intact', '--init_from=auto')
    assert errs[0] == ''
    assert checkpoint.load(str(tmp_path / 'out' / 'ckpt.pt'))['iter_num'] == 2
    print(f"rank 0 killed: the job ended {seconds:.1f}s after torchrun started")


def test_ddp_a_stalled_rank_stops_the_others_after_collective_timeout(tmp_path):
    # rank 1 stops responding at its 4th step: rank 0's next collective times out after collective_timeout
    # seconds, then it exits 1 with one line. Two processes started by hand (torchrun's env:// variables),
    # so the test measures train.py alone: torchrun would then kill the stalled rank 30 s later.
    write_data(tmp_path)
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    args = [*TINY, '--max_iters=50', '--eval_interval=2', '--out_dir=out', '--collective_timeout=2']
    procs = [subprocess.Popen(train_command(args, 'signals'), cwd=tmp_path, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=cli_env('signals', HOOK_ACTION='stall', HOOK_STEP='4', HOOK_RANK='1',
                                          RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE='2',
                                          MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port)))
             for r in (0, 1)]
    t0 = time.time()
    try:
        out, err = procs[0].communicate(timeout=120)
        seconds = time.time() - t0
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    assert procs[0].returncode == 1 and seconds < 120
    one_error_line(err, 'error: rank 0: a collective failed at iter 4', 'Timed out', 'collective_timeout=2s',
                   'out/ckpt.pt (iter 2) is intact')
    assert checkpoint.load(str(tmp_path / 'out' / 'ckpt.pt'))['iter_num'] == 2
    print(f"stalled rank: rank 0 exited {seconds:.1f}s after the start")

# -----------------------------------------------------------------------------
# a full disk or an unwritable out_dir

def failing_saves(monkeypatch, fail):
    """torch.save (inside checkpoint.save) writes part of a file and then fails with ENOSPC on the save
    numbers (1-based) in `fail`; records ckpt.pt's bytes before and after each failed save."""
    real, n, seen = torch.save, [0], []

    def save(obj, f, *a, **k):
        n[0] += 1
        if n[0] in fail:
            before = snapshot('out/ckpt.pt') if os.path.exists('out/ckpt.pt') else None
            f.write(b'PK\x03\x04 half a checkpoint')
            seen.append(before)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(obj, f, *a, **k)
    monkeypatch.setattr(checkpoint.torch, 'save', save)
    return seen


def test_a_failed_save_says_so_keeps_the_previous_checkpoint_and_is_retried(tmp_path, monkeypatch):
    # saves at iters 2 (ok), 4 and 6 (disk full), 8 and 10 (ok): training goes on between them
    write_data(tmp_path)
    befores = failing_saves(monkeypatch, {2, 3})
    code, out, err = run_train([*TINY, '--max_iters=10', '--eval_interval=2', '--out_dir=out'], tmp_path)
    assert code == 0, err
    failed = [line for line in out.splitlines() if 'could not save' in line]
    assert failed == [f"iter {i}: could not save out/ckpt.pt (OSError: [Errno 28] No space left on device); "
                      f"out/ckpt.pt still holds iter 2; training goes on and retries at the next eval "
                      f"({k} of max_failed_saves=3 in a row)" for i, k in ((4, 1), (6, 2))]
    assert befores[0] == befores[1]  # the iter-2 checkpoint, untouched by both failed writes
    assert not (tmp_path / 'out' / 'ckpt.pt.tmp').exists()  # the partial file is removed
    assert torch.load(tmp_path / 'out' / 'ckpt.pt', weights_only=True)['iter_num'] == 10
    assert [r['iter'] for r in read_metrics(tmp_path / 'out' / 'metrics.jsonl')] == [0, 2, 4, 6, 8, 10]


@pytest.mark.parametrize('fail,max_iters,says', [({2, 3}, 10, '2 failed saves in a row (max_failed_saves=2)'),
                                                  ({2}, 4, 'this was the final save')])
def test_failed_saves_stop_the_run_with_one_line_and_the_last_good_checkpoint(tmp_path, monkeypatch, fail,
                                                                              max_iters, says):
    write_data(tmp_path)
    befores = failing_saves(monkeypatch, fail)
    code, out, err = run_train([*TINY, f'--max_iters={max_iters}', '--eval_interval=2', '--out_dir=out',
                                '--max_failed_saves=2'], tmp_path)
    assert_clean_error(code, err, 'could not save out/ckpt.pt (OSError: [Errno 28]', 'still holds iter 2',
                       says, '--init_from=auto')
    assert snapshot(tmp_path / 'out' / 'ckpt.pt') == befores[-1]
    assert torch.load(tmp_path / 'out' / 'ckpt.pt', weights_only=True)['iter_num'] == 2


def test_a_failed_save_on_a_stop_signal_exits_non_zero_naming_the_last_good_checkpoint(tmp_path):
    # the stop save fails (out_dir's ckpt.pt.tmp path is a folder, so the write cannot even start)
    write_data(tmp_path)
    (tmp_path / 'out' / 'ckpt.pt.tmp').mkdir(parents=True)
    r = run_signalled([*TINY, '--max_iters=50', '--eval_interval=100', '--out_dir=out'], tmp_path,
                      'SIGTERM', 2)
    assert_clean_error(r.returncode, r.stderr, 'iter 3: could not save out/ckpt.pt (IsADirectoryError',
                       'no checkpoint yet', 'stopping: stopped by SIGTERM at iter 3')
    assert not (tmp_path / 'out' / 'ckpt.pt').exists()


def test_an_unwritable_out_dir_stops_before_training_with_one_line(tmp_path):
    # a file where out_dir's parent should be (tests run as root, so a read-only mode would not stop writes)
    write_data(tmp_path)
    (tmp_path / 'blocker').write_text('a file')
    code, out, err = run_train([*TINY, '--max_iters=2', '--out_dir=blocker/out'], tmp_path)
    assert_clean_error(code, err, "cannot write to out_dir='blocker/out'", 'NotADirectoryError')
    assert 'iter 0' not in out

# -----------------------------------------------------------------------------
# progress

def test_log_lines_carry_tokens_per_second_and_an_eta_to_max_iters(tmp_path):
    write_data(tmp_path)
    code, out, err = run_train([*TINY, '--max_iters=6', '--eval_interval=3', '--out_dir=out'], tmp_path)
    assert code == 0, err
    lines = [line for line in out.splitlines() if line.startswith('iter ')]
    assert len(lines) == 6 and all(', ETA ' in line and 'k tok/s' in line for line in lines)
    assert lines[-1].endswith(', ETA 0s')  # only the final eval is left, a fraction of a second here
    assert [duration(s) for s in (0, 42.4, 250, 11_100)] == ['0s', '42s', '4m10s', '3h05m']


def eta_seconds(it, max_iters, eval_interval, step_time, eval_time):
    from run import ops
    eta = ops.ETA(0, max_iters, eval_interval)
    eta.step_time, eta.eval_time = step_time, eval_time
    return eta.left(it)


@pytest.mark.parametrize('max_iters,eval_interval', [(10, 4), (12, 4), (7, 1), (5, 10)])
def test_eta_is_the_steps_left_times_the_step_time_plus_the_evals_left_times_the_eval_time(max_iters,
                                                                                          eval_interval):
    # after step it: steps it+1 .. max_iters-1 are left, and an eval at every multiple of eval_interval in
    # (it, max_iters] plus the final one at max_iters
    for it in range(max_iters):
        evals = len({j for j in range(it + 1, max_iters + 1) if j % eval_interval == 0} | {max_iters})
        expect = (max_iters - it - 1) * 0.25 + evals * 3.0
        assert eta_seconds(it, max_iters, eval_interval, 0.25, 3.0) == pytest.approx(expect), it
    assert eta_seconds(0, 10, 4, 0.0, 0.0) == 0.0
