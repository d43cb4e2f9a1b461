"""tests/tools/plant_bugs.py, the planted-bug run: its mutants still apply to the code as it is (each one's
original text occurs exactly once in its file), so the run anyone repeats plants what its table says. The
mutants themselves are not run here (minutes): python tests/tools/plant_bugs.py does that."""
import subprocess
import sys

from conftest import REPO


def test_every_planted_bug_still_applies_exactly_once_to_the_current_code():
    out = subprocess.run([sys.executable, str(REPO / 'tests' / 'tools' / 'plant_bugs.py'), '--list'],
                         capture_output=True, text=True, cwd=REPO / 'tests', timeout=120)
    rows = [line.split('\t') for line in out.stdout.splitlines()]
    assert len(rows) >= 30 and all(len(r) == 4 for r in rows), out.stdout + out.stderr
    stale = [f"{name} ({file}: {n} times)" for name, file, n, _ in rows if n != '1']
    assert not stale and out.returncode == 0, f"mutants that no longer apply once: {stale}"
    assert len({r[0] for r in rows}) == len(rows)  # one name each: --only picks one
    files = {r[1].split('/')[0] for r in rows}
    assert {'decoding', 'run', 'lab', 'model.py'} <= files  # decoding, retrofit, schedule, checkpoints, lab


def test_the_committed_table_lists_every_mutant_and_leaves_no_survivor_unexplained():
    table = (REPO / 'tests' / 'tools' / 'plant_bugs.md').read_text(encoding='utf-8')
    out = subprocess.run([sys.executable, str(REPO / 'tests' / 'tools' / 'plant_bugs.py'), '--list'],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    names = [line.split('\t')[0] for line in out.stdout.splitlines()]
    results = {cells[1].strip(): cells[3].strip() for cells in
               (line.split('|') for line in table.splitlines()) if len(cells) > 4}
    assert set(names) <= set(results), set(names) - set(results)
    assert all(results[n] in ('caught', 'survived (harmless)') for n in names), \
        {n: results[n] for n in names if results[n] not in ('caught', 'survived (harmless)')}
