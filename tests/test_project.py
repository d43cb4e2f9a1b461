"""
The project as a user receives it: a clone that stands alone, one recurrence, a README whose commands are
the ones CI runs, and code a reader can take in one line at a time.
"""
import ast
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def tracked(*patterns):
    """The repository's files matching patterns (this file left out: it names what it looks for)."""
    out = subprocess.run(['git', 'ls-files', *patterns], cwd=REPO, capture_output=True, text=True)
    files = [REPO / f for f in out.stdout.split()] if out.returncode == 0 else []
    files = files or [p for pat in patterns for p in REPO.glob(pat) if '.git' not in p.parts]
    return [p for p in files if p.name != 'test_project.py']


def python_files(include_tests=True):
    return [p for p in tracked('*.py') if include_tests or p.parts[len(REPO.parts)] != 'tests']


def recurrences(path):
    """Where a file runs blocks in a loop over loops: a `for` whose body holds a `for` over blocks that
    feeds each block's output back into the state (x = block(x, ...))."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding='utf-8'))):
        for inner in (n for n in ast.walk(node) if isinstance(node, ast.For) and isinstance(n, ast.For)):
            if inner is node or not isinstance(inner.target, (ast.Name, ast.Tuple)):
                continue
            names = {n.id for n in ast.walk(inner.target) if isinstance(n, ast.Name)}
            for a in ast.walk(inner):
                if isinstance(a, ast.Assign) and isinstance(a.value, ast.Call) and \
                        isinstance(a.value.func, ast.Name) and a.value.func.id in names:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return sorted(set(found))


def test_the_recurrence_is_written_once():
    # training, decoding, early exit and every diagnostic reach the loop through GPT.loops; the one other
    # recurrence is bench's plain yardstick, an independent implementation on purpose
    found = [f for p in python_files(include_tests=False) for f in recurrences(p)]
    assert [f.split(':')[0] for f in found] == ['lab/bench.py', 'model.py'], found
    for name in ('engine.py', 'diagnostics.py', 'lab/eval_depth.py'):
        assert 'model.loops(' in (REPO / name).read_text(encoding='utf-8'), name


def test_readme_test_command_is_the_one_ci_runs():
    readme = (REPO / 'README.md').read_text(encoding='utf-8')
    quick = readme.split('## Quick start', 1)[1].split('```sh', 1)[1].split('```', 1)[0]
    commands = [line for line in quick.splitlines() if line and not line.startswith('#')]
    assert len(commands) == 2, commands
    assert commands[0].startswith('pip install torch==2.13.0') and commands[0].endswith('python train.py')
    assert commands[1].endswith('python -m pytest -q tests')
    ci = (REPO / '.ci' / 'run').read_text(encoding='utf-8').splitlines()
    assert commands[1] in ci  # verbatim


def test_nothing_outside_ci_and_tests_depends_on_a_sibling_folder():
    for path in tracked('*.py', '*.md', '*.sh', '*.txt', 'config/*'):
        if path.parts[len(REPO.parts)] in ('tests', '.ci'):
            continue
        assert '../shared' not in path.read_text(encoding='utf-8'), path


def test_every_cited_file_and_section_exists():
    papers = (REPO / 'docs' / 'papers.md').read_text(encoding='utf-8')
    sections = set(re.findall(r'^## (§\d+)', papers, re.M))
    for path in tracked('*.py', '*.md', '*.sh', 'config/*'):
        text = path.read_text(encoding='utf-8')
        in_tests = path.parts[len(REPO.parts)] == 'tests'  # tests name missing files on purpose
        cited = r'(?<![/\w])((?:docs|assets|config|tests)/[\w./-]+\.(?:md|png|json|py))\b'
        for ref in [] if in_tests else re.findall(cited, text):
            assert (REPO / ref).exists(), f"{path.name} cites {ref}"
        for section in re.findall(r'docs/papers\.md,? (§\d+)', text):
            assert section in sections, f"{path.name} cites docs/papers.md {section}"
        assert not re.search(r'(?<![/\w])papers\.md', text.replace('docs/papers.md', '')), \
            f"{path.name} cites papers.md without its folder"


def test_the_project_speaks_only_of_itself():
    # tracker numbers and talk of work sessions (spelled in pieces so this line does not match itself)
    words = re.compile(r'\b(?:iss)ues? \d+\b|\bth(?:is) sess(?:ion)\b', re.I)
    for path in tracked('*.py', '*.md', '*.sh', 'config/*'):
        assert not words.search(path.read_text(encoding='utf-8')), path


def test_python_lines_stay_under_110_characters():
    long = [f"{p.relative_to(REPO)}:{i}" for p in python_files()
            for i, line in enumerate(p.read_text(encoding='utf-8').splitlines(), 1) if len(line) > 110]
    assert not long, long
