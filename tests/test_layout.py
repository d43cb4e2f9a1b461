"""
The house: the reading path at the root, everything else in folders named for what they hold, imports that
flow one way (module to module and folder to folder), and no name that hides a package a user imports.
"""
import ast
import importlib.metadata
import subprocess
import sys

from conftest import REPO

READING_PATH = {'model.py', 'train.py', 'sample.py', 'prepare.py', 'configurator.py'}
FOLDERS = ('compute', 'run', 'decoding', 'lab')  # the rooms beside the root; tests/ is not code


def modules():
    """{module name: path} of every project module: root files by stem, folder files as folder.stem (lab's
    scripts by stem too: they put lab/ on sys.path and import each other as `import bench`)."""
    found = {p.stem: p for p in REPO.glob('*.py')}
    for folder in FOLDERS:
        for p in (REPO / folder).glob('*.py'):
            found[p.stem if folder == 'lab' else f"{folder}.{p.stem}"] = p
    return found


def imports_of(path, known):
    """The project modules a file imports, resolved as its interpreter would."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding='utf-8'))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            subs = {f"{node.module}.{a.name}" for a in node.names} & set(known)  # from run import checkpoint
            out |= subs or ({node.module} & set(known))
            if not subs and node.module not in known and f"{node.module}.__init__" in known:
                out.add(f"{node.module}.__init__")
    return out


def room(module):
    # a root module is a room of its own; a folder's modules share their folder's room
    path = modules()[module]
    return path.stem if path.parent == REPO else path.parent.name


def circles(arrows):
    """Every cycle's smallest member path, found by depth-first search over {node: {nodes}}."""
    found = set()

    def walk(start, node, path):
        for nxt in sorted(arrows.get(node, ())):
            if nxt == start:
                found.add(' -> '.join(path + [nxt]))
            elif nxt not in path and nxt > start:  # each cycle once, from its least node
                walk(start, nxt, path + [nxt])
    for node in sorted(arrows):
        walk(node, node, [node])
    return sorted(found)


def module_arrows():
    known = modules()
    return {m: imports_of(p, known) - {m} for m, p in known.items()}


def test_the_root_holds_the_reading_path_and_the_configurator_only():
    root = {p.name for p in REPO.glob('*.py')}
    assert root == READING_PATH, root  # at most 6; a new module goes into the folder named for it


def test_modules_import_each_other_one_way():
    assert not circles(module_arrows())


def test_folders_import_each_other_one_way():
    arrows = {}
    for m, targets in module_arrows().items():
        arrows.setdefault(room(m), set()).update(room(t) for t in targets if room(t) != room(m))
    assert not circles(arrows), arrows


def test_a_planted_circle_is_found():
    arrows = module_arrows()
    arrows['decoding.engine'] = arrows['decoding.engine'] | {'sample'}  # sample imports decoding already
    assert any('decoding.engine' in c and 'sample' in c for c in circles(arrows))


def test_decoding_asks_the_model_without_importing_it():
    # the decoders get the model as an argument and ask it for its pieces: no import of model.py
    arrows = module_arrows()
    assert not [m for m in arrows if m.startswith('decoding.') and 'model' in arrows[m]]


def test_no_project_name_hides_an_installed_or_standard_package():
    taken = set(importlib.metadata.packages_distributions()) | set(sys.stdlib_module_names)
    ours = {p.stem for p in REPO.glob('*.py')} | set(FOLDERS)
    assert not ours & taken, ours & taken


def test_hugging_face_and_lm_eval_import_from_the_repository_root():
    # transformers imports a package named `kernels`: a root kernels.py used to answer in its place
    code = "import transformers, lm_eval, datasets; from transformers import GPT2LMHeadModel"
    r = subprocess.run([sys.executable, '-c', code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def commands():
    # what a user types: the root's scripts, the lab's scripts and its shell check
    scripts = [p for p in [*REPO.glob('*.py'), *(REPO / 'lab').glob('*.py')]
               if "__name__ == '__main__'" in p.read_text(encoding='utf-8')]
    shell = [['bash', str(REPO / 'lab' / 'gpu_check.sh')]]
    return [[sys.executable, str(p)] for p in sorted(scripts)] + shell


def test_every_command_answers_help_from_another_folder_and_writes_nothing(tmp_path):
    for cmd in commands():
        r = subprocess.run(cmd + ['--help'], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip(), (cmd, r.stderr[-1000:])
        assert not list(tmp_path.iterdir()), (cmd, list(tmp_path.iterdir()))
