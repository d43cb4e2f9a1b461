"""
ablate.py through a scheduler (submitit): a tiny preset through submitit's local executor gives the local
runner's report and skips its finished runs on the next call; a job signalled as before a preemption stops
train.py with a checkpoint, is requeued and resumes the run; the Slurm job's sbatch options; one-line errors.
"""
import json
import os
import re
import signal
import sys
import threading
import time

import pytest

import ablate
import report_blindspot
from test_ablate import TINY

submitit = pytest.importorskip('submitit')

@pytest.fixture
def tiny_preset(tiny_data, tmp_path, monkeypatch):
    """The 'tiny' preset: two 5-iteration arms on tiny_char; tmp_path is the working directory. For the tests'
    time: no eval_depth.py, no plots, and train.py asked for its defaults once."""
    monkeypatch.chdir(tmp_path)  # train.py reads data/<dataset> from the working directory
    monkeypatch.setattr(report_blindspot, 'plt_or_none', lambda: None)
    defaults = ablate.train_defaults()
    monkeypatch.setattr(ablate, 'train_defaults', lambda: defaults)
    monkeypatch.setenv('PYTHONPATH', os.environ.get('PYTHONPATH', ''))  # submit() adds to it: undone after
    (tmp_path / 'tiny.py').write_text(TINY, encoding='utf-8')
    monkeypatch.setitem(ablate.PRESETS, 'tiny', dict(
        title='tiny', laptop='tiny.py', seeds=(7,), eval_depth=False, report=report_blindspot.write,
        arms=[ablate.arm('loop_rmsnorm', 'config/loop_rmsnorm.py'),
              ablate.arm('loop_raw', 'config/loop_raw.py')]))
    return tmp_path


def report(path, *flags):
    """A report's text without the wall-time line, and with the command line's differing flags removed."""
    text = path.read_text()
    for f in flags:
        text = text.replace(' ' + f, '')
    return [line for line in text.splitlines() if not line.startswith('Wall time')]


def test_a_sweep_through_submitits_local_executor_reports_as_the_local_runner(tiny_preset, capsys):
    tmp = tiny_preset
    ablate.main(['tiny', '--out=here', '--report_dir=rep_here', '--workers=2'])
    capsys.readouterr()
    sub = ['tiny', '--out=jobs', '--report_dir=rep_jobs', '--executor=submitit_local']
    ablate.main(sub)
    out = capsys.readouterr().out
    assert 'tiny: 2 runs, 2 to submit (submitit_local)' in out and out.count('train done, iter 5') == 2
    for name in ('loop_rmsnorm-s7', 'loop_raw-s7'):
        assert json.loads((tmp / 'jobs' / name / 'status.json').read_text())['train'] == 'done'
    md = report(tmp / 'rep_jobs' / 'tiny.md', '--out=jobs --report_dir=rep_jobs --executor=submitit_local')
    assert '| loop_rmsnorm | 1 | 5 |' in '\n'.join(md)
    assert md == report(tmp / 'rep_here' / 'tiny.md', '--out=here --report_dir=rep_here --workers=2')
    # the second call submits nothing and trains nothing: the files of the finished runs stay as they were
    files = [tmp / 'jobs' / n / f for n in ('loop_rmsnorm-s7', 'loop_raw-s7')
             for f in ('ckpt.pt', 'metrics.jsonl')]
    mtimes, md = [f.stat().st_mtime_ns for f in files], report(tmp / 'rep_jobs' / 'tiny.md')
    ablate.main(sub)
    out = capsys.readouterr().out
    assert 'tiny: 2 runs, 0 to submit' in out and out.count('train done, iter 5') == 2
    assert [f.stat().st_mtime_ns for f in files] == mtimes and report(tmp / 'rep_jobs' / 'tiny.md') == md


def processes(cwd, *words):
    """pids of the processes running in folder cwd whose command line holds every word."""
    pids = []
    for pid in filter(str.isdigit, os.listdir('/proc')):
        try:
            with open(f'/proc/{pid}/cmdline', 'rb') as fh:
                cmd = fh.read().decode(errors='replace')
            if os.readlink(f'/proc/{pid}/cwd') == str(cwd) and all(w in cmd for w in words):
                pids.append(int(pid))
        except OSError:
            continue
    return pids


@pytest.mark.skipif(not os.path.isdir('/proc'), reason='finds the job processes in /proc (Linux)')
def test_a_job_signalled_before_a_preemption_is_requeued_and_resumes_the_run(tiny_preset):
    # what Slurm does before a preemption or the time limit: submitit's signal (SIGUSR2) to every process of
    # the job; train.py ignores it, the job stops train.py with a checkpoint (SIGUSR1), submitit requeues it
    # and the requeued job resumes the run (--init_from=auto)
    tmp = tiny_preset
    log = tmp / 'jobs' / 'loop_raw-s7' / 'train.log'
    sent = []

    def preempt():
        t0 = time.time()
        while time.time() - t0 < 60 and not sent:
            if log.exists() and 'iter 3:' in log.read_text():
                train_py = processes(tmp, 'train.py', '--out_dir=jobs/loop_raw-s7')
                job = processes(tmp, 'submitit.core._submit')
                for pid in train_py + job:
                    os.kill(pid, signal.SIGUSR2)
                sent.append((train_py, job))
            time.sleep(0.02)
    thread = threading.Thread(target=preempt)
    thread.start()
    ablate.main(['tiny', '--out=jobs', '--report_dir=rep', '--executor=submitit_local', '--only=loop_raw',
                 '--max_iters=100', '--eval_interval=50'])
    thread.join()
    assert sent and len(sent[0][0]) == 1 and len(sent[0][1]) == 1, sent
    text = log.read_text()
    assert 'stopped by SIGUSR1 at iter' in text, text[-2000:]
    stopped = int(text.split('stopped by SIGUSR1 at iter ')[1].split(':')[0])
    assert 3 <= stopped < 100 and text.count('\n$ ') == 1  # two train.py calls
    first, second = text.split('\n$ ')
    assert 'step 0:' in first and 'resuming' not in first
    # the requeued call resumed from the stop's checkpoint: it says so, its step count continues from there,
    # and the eval at iter 0 (the first call's) is not redone
    assert f"resuming from jobs/loop_raw-s7/ckpt.pt at iter {stopped}" in second, second[:2000]
    iters = [int(n) for n in re.findall(r'^iter (\d+):', second, re.M)]
    assert iters and min(iters) >= stopped and max(iters) == 99 and 'step 0:' not in second
    rows = [json.loads(line) for line in (log.parent / 'metrics.jsonl').read_text().splitlines()]
    assert [r['iter'] for r in rows] == [0, 50, 100]
    assert json.loads((log.parent / 'status.json').read_text())['train'] == 'done'


def test_slurm_jobs_ask_for_the_partition_gpus_time_and_the_requeue_signal(tmp_path, monkeypatch):
    # no cluster here: a stand-in srun on PATH lets submitit build the Slurm executor; its sbatch text is
    # what ablate.py would submit
    (tmp_path / 'srun').write_text('#!/bin/sh\nexit 1\n')
    (tmp_path / 'srun').chmod(0o755)
    monkeypatch.setenv('PATH', f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    args = ablate.parse_args(['blindspot', '--executor=slurm', '--partition=gpu', '--gpus_per_run=2',
                              '--cpus_per_run=8', '--time=240', '--workers=4',
                              '--slurm_args=account=lab qos=high'])
    ex = ablate.executor(args)
    sbatch = ex._executor._make_submission_file_text('python -u -m submitit.core._submit folder', 'uid')
    for line in ('--partition=gpu', '--gpus-per-node=2', '--cpus-per-task=8', '--time=240',
                 '--signal=USR2@90', '--job-name=nanoloop-blindspot', '--account=lab', '--qos=high'):
        assert f'#SBATCH {line}\n' in sbatch, sbatch
    assert ex._executor.max_num_timeout == ablate.MAX_REQUEUES
    assert ex._executor.parameters['array_parallelism'] == 4
    assert ex.folder == tmp_path / 'out-ablate-blindspot' / 'submitit'
    # the job is checkpointable: submitit requeues it (the same call) instead of ending it
    run = ablate.SubmittedRun()
    assert run.checkpoint('job').function is run and run.checkpoint('job').args == ('job',)


@pytest.mark.parametrize('argv, err', [
    (['--executor=pbs'], "error: argument --executor: invalid choice: 'pbs'"),
    (['--executor=slurm', '--slurm_args=account'], 'error: --slurm_args account: expected sbatch options'),
])
def test_bad_executor_flags_die_with_one_line(argv, err, capsys):
    with pytest.raises(SystemExit):
        ablate.parse_args(['blindspot'] + argv)
    msg = capsys.readouterr().err
    assert msg.startswith(err) and msg.count('\n') == 1


def test_slurm_without_submitit_or_srun_dies_with_one_line(tmp_path, monkeypatch, capsys):
    args = ablate.parse_args(['blindspot', '--executor=slurm', f'--out={tmp_path}'])
    monkeypatch.setitem(sys.modules, 'submitit', None)  # as if not installed: import submitit fails
    with pytest.raises(SystemExit):
        ablate.executor(args)
    assert capsys.readouterr().err == 'error: --executor=slurm needs submitit: pip install submitit\n'
    monkeypatch.setitem(sys.modules, 'submitit', submitit)
    monkeypatch.setenv('PATH', str(tmp_path))  # no srun: not a Slurm login node
    with pytest.raises(SystemExit):
        ablate.executor(args)
    msg = capsys.readouterr().err
    assert msg.startswith('error: --executor=slurm: Could not detect "srun"') and msg.count('\n') == 1
