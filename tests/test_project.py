"""
The project as a user receives it: a clone that stands alone, one recurrence, a README whose commands are
the ones CI runs, and code a reader can take in one line at a time.
"""
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import REPO


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


def shared_blocks(path):
    """Where a file names the shared blocks (`<x>.transformer.h`), and which of those are a loop's iterable
    (a for, or a comprehension: a list of them, an enumerate or a zip over them alike)."""
    tree = ast.parse(path.read_text(encoding='utf-8'))
    named = lambda node: [n for n in ast.walk(node) if isinstance(n, ast.Attribute) and n.attr == 'h'
                          and isinstance(n.value, ast.Attribute) and n.value.attr == 'transformer']
    loops = [n.iter for n in ast.walk(tree) if isinstance(n, (ast.For, ast.comprehension)) and named(n.iter)]
    return [n.lineno for n in named(tree)], [n.lineno for n in loops]


def test_the_recurrence_is_written_once():
    # the K shared blocks run in one loop body (GPT.visit), which the recurrence (GPT.loops) and depth
    # batching's rows at other loops (GPT.advance) both call: model.py names the shared blocks in that loop
    # alone. Training, decoding, early exit and every diagnostic reach the loop through GPT.loops; the one
    # recurrence written out elsewhere is bench's plain yardstick, an independent implementation on purpose
    named, loops = shared_blocks(REPO / 'model.py')
    assert len(loops) == 1 and named == loops, (named, loops)
    found = [f for p in python_files(include_tests=False) for f in recurrences(p)]
    assert [f.split(':')[0] for f in found] == ['lab/bench_train.py'], found
    for name in ('decoding/engine.py', 'run/diagnostics.py', 'lab/eval_depth.py'):
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

# -----------------------------------------------------------------------------
# the README's links: a label says where its link goes

LINK = re.compile(r'(!?)\[([^\]]*)\]\(([^)\s]+)\)')


def prose_lines(text):
    """The lines of markdown text outside ``` fences, as (line number, line)."""
    fence, out = False, []
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith('```'):
            fence = not fence
        elif not fence:
            out.append((n, line))
    return out


def anchors(path):
    """{anchor: heading text} of a markdown file's headings, anchors as GitHub makes them: the text without
    markup, lower case, without punctuation, spaces as '-', '-1', '-2'... after a repeat."""
    found = {}
    for _, line in prose_lines(path.read_text(encoding='utf-8')):
        m = re.match(r'^#{1,6} (.+?)\s*#*$', line)
        if m:
            text = re.sub(r'\[([^\]]*)\]\([^)]*\)', r'\1', m.group(1)).replace('`', '').replace('**', '')
            slug = re.sub(r'[^\w\- ]', '', text.lower()).replace(' ', '-')
            n = sum(1 for a in found if re.fullmatch(rf'{re.escape(slug)}(-\d+)?', a))
            found[slug if n == 0 else f'{slug}-{n}'] = text
    return found


def link_problems(text, folder, name='README.md'):
    """One message per relative link of markdown text (a file in folder) whose target or #anchor does not
    exist, or whose label names another file or section than the one it goes to. A label names a file when
    it is a path (`docs/papers.md`: the target as written, or from the repository's root) or a bare name
    (blindspot, for assets/blindspot.md: the file's stem); a link to a section names it as
    `PATH § SECTION`, SECTION the beginning of the heading the anchor goes to. Other labels (prose, images)
    are free."""
    out = []
    for n, line in prose_lines(text):
        for image, label, target in LINK.findall(line):
            if re.match(r'^[a-z]+:', target):
                continue  # http(s), mailto: not the repository's
            where, (path, _, anchor) = f"{name}:{n} [{label}]({target})", target.partition('#')
            file = (folder / path) if path else folder / name
            if not file.exists():
                out.append(f"{where}: {path} does not exist")
                continue
            heads = anchors(file) if anchor and file.suffix == '.md' else {}
            if anchor and anchor not in heads:
                out.append(f"{where}: {path or name} has no heading #{anchor}")
                continue
            label = label.replace('`', '').strip()
            said, _, section = label.partition(' § ')
            paths = {path, Path(os.path.relpath(file.resolve(), REPO)).as_posix()} if path else {name}
            if image:
                continue
            if section or (anchor and '/' in label):
                if said not in paths:
                    out.append(f"{where}: the label names {said}, the link goes to {path}")
                elif not anchor:
                    out.append(f"{where}: the label names section '{section}', the link goes to no section")
                elif not heads[anchor].startswith(section):
                    out.append(f"{where}: the label names section '{section}', the link goes to "
                               f"'{heads[anchor]}'")
                elif not section:
                    out.append(f"{where}: the link goes to a section: name it, '{path} § {heads[anchor]}'")
            elif '/' in label or re.fullmatch(r'[\w.-]+\.\w+', label):
                if label not in paths:
                    out.append(f"{where}: the label names {label}, the link goes to {path}")
            elif re.fullmatch(r'[\w-]+', label) and label != Path(path or name).stem:
                out.append(f"{where}: the label names {label}, the link goes to {path} "
                           f"(a one-word label is the file's name: {Path(path or name).stem})")
    return out


def test_readme_links_say_where_they_go_and_go_somewhere():
    found = link_problems((REPO / 'README.md').read_text(encoding='utf-8'), REPO)
    assert not found, '\n'.join(found)


RELABELLED = {  # a careless edit of a link in the committed README: each must be caught
    'a path label changed, its target kept': ('[docs/decoding.md](docs/decoding.md)',
                                              '[docs/harness.md](docs/decoding.md)'),
    'a report label changed, its target kept': ('[kappa](assets/kappa.md)', '[escape](assets/kappa.md)'),
    'a section label changed, its anchor kept': ('[docs/results.md § Paper 2, DeepLoop]',
                                                 '[docs/results.md § Paper 2, escape fractions]'),
    'a section link that names no section': ('[docs/results.md § Paper 2, DeepLoop]', '[docs/results.md]'),
    'a target that does not exist': ('(docs/decoding.md)', '(docs/decode.md)'),
    'an anchor that names no heading': ('(docs/results.md#paper-2-deeploop)', '(docs/results.md#paper-2)'),
}


def test_a_relabelled_readme_link_is_caught():
    readme = (REPO / 'README.md').read_text(encoding='utf-8')
    for error, (old, new) in RELABELLED.items():
        assert readme.count(old) == 1, f"README.md no longer holds {old!r} once: update '{error}'"
        assert link_problems(readme.replace(old, new), REPO), f"{error}: not caught"


def test_ci_fails_when_a_test_it_expects_to_run_skips(tmp_path):
    # a test of real corpora skips without the offline copies: a pass here, a failure in CI (CI=true)
    node = 'tests/test_prepare.py::test_input_text_with_the_word_tokenizer'
    env = {k: v for k, v in os.environ.items() if k not in ('CI', 'NANOLOOP_OFFLINE_DATA')}
    command = [sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', node]
    run = lambda **extra: subprocess.run(command, cwd=REPO, env={**env, **extra}, capture_output=True, text=True)
    here, ci = run(), run(CI='true')
    assert here.returncode == 0 and '1 skipped' in here.stdout, here.stdout[-500:]
    assert ci.returncode == 1 and 'skipped in CI' in ci.stdout, ci.stdout[-500:]
