"""
Which of the project's functions one training step calls: train.py runs as it would from the command line,
under sys.setprofile, and every Python call into a file of this repository is recorded from get_lr(1) to
get_lr(2), i.e. exactly iteration 1 (after step 0's eval, before any log line). A reader's cost is how many
functions and files a step passes through (nanoGPT's: 5 functions in one file).

    python lab/step_trace.py                          # the embedded default (needs data/shakespeare_char)
    python lab/step_trace.py config/loop_raw.py       # train.py's arguments, as train.py takes them
"""
import collections
import os
import runpy
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # the core is one folder up

from configurator import Parser


def trace(train_args):
    """{(file, function): calls} of iteration 1 of `python train.py train_args`."""
    seen, state = collections.Counter(), dict(on=False)

    def profile(frame, event, arg):
        code = frame.f_code
        if event != 'call' or code.co_filename.startswith('<'):  # frozen modules, comprehensions' <...>
            return
        path = os.path.abspath(code.co_filename)
        if code.co_name == 'get_lr' and path == os.path.join(REPO, 'train.py'):
            state['on'] = frame.f_locals.get('it') == 1
        if state['on'] and path.startswith(REPO + os.sep) and not code.co_name.startswith('<'):
            seen[os.path.relpath(path, REPO), code.co_qualname] += 1
    with tempfile.TemporaryDirectory() as out:
        sys.argv = ['train.py', *train_args, '--max_iters=3', '--eval_interval=1000', '--eval_iters=1',
                    f'--out_dir={out}']
        sys.setprofile(profile)
        try:
            runpy.run_path(os.path.join(REPO, 'train.py'), run_name='__main__')
        finally:
            sys.setprofile(None)
    return seen


if __name__ == '__main__':
    ap = Parser('lab/step_trace.py', __doc__)
    ap.add_argument('train_args', nargs='*', help="train.py's config files and --key=value flags")
    args, rest = ap.parse_known_args()
    seen = trace(args.train_args + rest)
    files = collections.Counter(f for f, _ in seen)
    print(f"\none training step calls {len(seen)} project functions in {len(files)} files:")
    for f in sorted(files):
        print(f"  {f}: {', '.join(q for g, q in seen if g == f)}")
