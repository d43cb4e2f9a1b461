"""
Every results number the README and docs state comes from a committed report in assets/, which one
documented command (`python lab/ablate.py PRESET`, `python lab/decode_eval.py ...`) regenerates.

The rule, as these tests check it:
- A results table (a markdown table in README.md or docs/*.md) names its source on the line above it, or
  above it with one blank line between: `<!-- from assets/NAME.md -->`, several comma-separated
  (`<!-- from assets/a.md, assets/b.md -->`).
- Each data row of such a table matches one line of one of those assets: every number in the row, outside
  its first cell, occurs as the same string among the numbers of that one line (in practice: the report's
  table row for the same arm). The first cell is the row's label (an arm, "R = 4", "600 steps, lr 1e-3")
  and is not checked; numbers inside `code` are names, not results, and are not checked either.
- A number is what a reader reads as one: 2.59, -0.20, +0.090, 5.6e-09, 1,922, 39, x1.10's 1.10. The sign
  is part of it; the minus sign U+2212 reads as '-', and a thousands comma is dropped (10,000 = 10000).
  Nothing else is rounded or reformatted: 2.592 and 2.59 are different numbers.
- Every table in README.md's "## Results at laptop scale" section and in docs/results.md carries such a
  marker, or `<!-- not from an asset: REASON -->` for a table of what no report here measures (published
  paper numbers, GPU-hour estimates).
"""
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FROM = re.compile(r'^<!-- from (assets/[\w.-]+\.md(?:, assets/[\w.-]+\.md)*) -->$')
NOT_FROM = re.compile(r'^<!-- not from an asset: \S.* -->$')
NUMBER = re.compile(r'(?<![\d.])([+\-\u2212]?)(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?([eE][+\-\u2212]?\d+)?(?!\d)')


def numbers(text):
    """The numbers in text, as written (see the module docstring for what counts as one)."""
    found = []
    for m in NUMBER.finditer(text):
        sign, whole, frac, exp = m.group(1), m.group(2), m.group(3) or '', m.group(4) or ''
        before = text[:m.start()]
        if sign and before and (before[-1].isalnum() or before[-1] in '_)'):
            sign = ''  # a hyphen inside a name (loop_rmsnorm-2000), not a sign
        found.append((sign + whole.replace(',', '') + frac + exp).replace('\u2212', '-'))
    return found


def shown(path):
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name


def doc_files():
    return [REPO / 'README.md'] + sorted((REPO / 'docs').glob('*.md'))


def tables(path):
    """(first line number, marker line or None, rows as lists of cells, data rows' line numbers) of every
    markdown table in path. A table is a run of lines starting with '|' whose second line is |---|...;
    the marker is the line above it, or the one above that when the line above is blank."""
    lines = path.read_text(encoding='utf-8').splitlines()
    found, i = [], 0
    while i < len(lines):
        if lines[i].startswith('|') and i + 1 < len(lines) and re.match(r'^\|[\s:|-]+\|$', lines[i + 1]):
            j = i + 2
            while j < len(lines) and lines[j].startswith('|'):
                j += 1
            above = [lines[k].strip() for k in (i - 1, i - 2) if k >= 0]
            marker = above[0] if above and above[0] else (above[1] if len(above) > 1 else None)
            marker = marker if marker and marker.startswith('<!--') else None
            rows = [[c.strip() for c in lines[k].strip().strip('|').split('|')] for k in range(i + 2, j)]
            found.append((i + 1, marker, rows, list(range(i + 3, j + 1))))
            i = j
        else:
            i += 1
    return found


def section(path, heading):
    """The line numbers (1-based) of the section of path that starts at heading, up to the next heading
    of the same level."""
    lines = path.read_text(encoding='utf-8').splitlines()
    level = heading.split(' ')[0]
    start = lines.index(heading)
    end = next((k for k in range(start + 1, len(lines))
                if lines[k].startswith(level + ' ')), len(lines))
    return range(start + 1, end + 1)


def results_tables():
    """(path, table) for every table that must carry a marker."""
    readme = REPO / 'README.md'
    lines = section(readme, '## Results at laptop scale')
    out = [(readme, t) for t in tables(readme) if t[0] in lines]
    return out + [(REPO / 'docs' / 'results.md', t) for t in tables(REPO / 'docs' / 'results.md')]


def asset_lines(marker):
    names = FROM.match(marker).group(1).split(', ')
    return [(name, line, set(numbers(line))) for name in names
            for line in (REPO / name).read_text(encoding='utf-8').splitlines()]


def mismatches(path, table):
    """One message per data row of a marked table that no single line of its assets carries."""
    start, marker, rows, row_lines = table
    where = f"{shown(path)}:{start}"
    if not marker or not FROM.match(marker):
        return []
    sources = asset_lines(marker)
    out = []
    for row, lineno in zip(rows, row_lines):
        wanted = [n for cell in row[1:] for n in numbers(re.sub(r'`[^`]*`', '', cell))]
        if not wanted:
            continue
        best = max(sources, key=lambda s: sum(n in s[2] for n in wanted))
        missing = [n for n in wanted if n not in best[2]]
        if missing:
            source = FROM.match(marker).group(1)
            out.append(f"{where} (row at line {lineno}, '{row[0]}'): no line of {source} "
                       f"carries all of its numbers; missing {', '.join(missing)} on the closest line, "
                       f"{best[0]}: {best[1].strip()[:120]}")
    return out


def test_numbers_are_read_as_written():
    cell = '2.59 / -0.20 / +0.090 (5.6e-09) 1,922 39 \u22120.054 x1.10 loop_rmsnorm-2000 10,000 2/2'
    assert numbers(cell) == ['2.59', '-0.20', '+0.090', '5.6e-09', '1922', '39', '-0.054', '1.10', '2000',
                             '10000', '2', '2']
    assert numbers('2.592') != numbers('2.59')  # no rounding: a table states the report's digits


def test_markers_name_reports_that_exist():
    for path in doc_files():
        for start, marker, _, _ in tables(path):
            if marker and marker.startswith('<!-- from'):
                assert FROM.match(marker), f"{shown(path)}:{start}: malformed marker {marker}"
                for name in FROM.match(marker).group(1).split(', '):
                    assert (REPO / name).is_file(), f"{shown(path)}:{start} cites {name}"
            elif marker and marker.startswith('<!-- not from'):
                assert NOT_FROM.match(marker), f"{shown(path)}:{start}: give a reason: {marker}"


def test_every_marked_table_row_matches_one_line_of_its_report():
    problems = [m for path in doc_files() for t in tables(path) for m in mismatches(path, t)]
    assert not problems, '\n'.join(problems)


def test_every_results_table_names_its_source():
    unmarked = [f"{shown(path)}:{t[0]}" for path, t in results_tables()
                if not (t[1] and (FROM.match(t[1]) or NOT_FROM.match(t[1])))]
    assert not unmarked, "results tables with no <!-- from assets/NAME.md --> (or <!-- not from an asset: "\
                         "REASON -->) marker above them: " + ', '.join(unmarked)


def test_a_changed_number_is_caught(tmp_path):
    # the checker on a copy of a real report row: as written it passes; with one digit changed it fails and
    # names the file, the table's line and the number
    row = next(line for line in (REPO / 'assets' / 'growing.md').read_text(encoding='utf-8').splitlines()
               if line.startswith('| loop_rmsnorm | 600 |'))
    doc = tmp_path / 'doc.md'
    head = '<!-- from assets/growing.md -->\n\n| arm | step | norms | val CE | train CE |\n'
    head += '|---' * 5 + '|\n'
    doc.write_text(head + row + '\n', encoding='utf-8')
    assert mismatches(doc, tables(doc)[0]) == []
    doc.write_text(head + row.replace('496.6', '496.7') + '\n', encoding='utf-8')
    (problem,) = mismatches(doc, tables(doc)[0])
    assert problem.startswith('doc.md:3 ') and 'missing 496.7 ' in problem, problem
