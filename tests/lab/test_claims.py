"""
Every results number and verdict the README and docs state comes from a committed report in assets/, which
one documented command (`python lab/ablate.py PRESET`, `python lab/decode_eval.py ...`) regenerates.

Markers. An HTML comment names the sources, on one line or several:
    <!-- from assets/NAME.md[, assets/OTHER.md][, docs/papers.md][; DOC LABEL -> REPORT LABEL]...
         [; derived: 28.2, 0.40] -->
docs/papers.md is the source of published numbers. `DOC LABEL -> REPORT LABEL` maps a table row's label
to the first cell of a report row (`R = 1, plain -> 1 (table 1)`: in the report's first table); ARMS below
maps the display names every doc uses for an arm (`per-loop + RMSNorm` -> `loop_rmsnorm`). `derived:`
lists numbers the text computes from the report's (a ratio, a difference) or takes from the run's settings:
allowed, and visible as such. A table's marker is the comment ending on the line above it (or one blank line
above); a table of what no report measures carries `<!-- not from an asset: REASON -->`. Every table in
README.md's "## What you will see" section and in docs/*.md carries one of the two.

Tables. A row binds to ONE report row: its label (first cell) resolves to a report row's first cell (the
marker's map, then ARMS, then the label itself, then a report label the label spells out, e.g. in
`code`), and its other cells, in order, each hold the tokens of one report cell or of a run of adjacent
ones (a doc may leave columns out, never reorder them). Tokens are the numbers and the verdicts. A row
whose label names no report row but states a verdict (a summary of claims) is checked as prose, against the
report its row links to where it links one.

Prose. A marker also covers the paragraphs and bullets after it, up to the next heading or marker, in
README's "What you will see" and docs/results.md. In that prose:
- every decimal number (2.59, +0.090, 5.6e-09, x1.10) occurs in one of the sources, as written up to its
  sign ("0.049 nats behind" for +0.049), or in `derived:`. Exempt, because they are settings and counts,
  not results: integers (steps, seeds, R, dates, 1,024 tokens), a power with an integer mantissa (lr 3e-4),
  numbers inside a word (bf16, GPT-2, loop_rmsnorm-2000, 0496aca) and inside `code`.
- a number that a *name* binds must be a number of the report cells the name names, not just any number of
  the sources: "0.049" planted as "0.009" is caught though 0.009 is elsewhere in the report. A marker's
  `PHRASE -> LABEL` (optionally `(table N)`) makes PHRASE a name (any case), and a report row's first cell or
  a report column's header written in `code` (`looped_moe`) is one; LABEL names the rows whose first cell it
  is and the columns it heads. A name binds the numbers after it up to the next name or the end of its
  sentence (. ; : ! ?). A number no name binds, or one in `derived:`, is checked by the rule above.
- every verdict (*reproduces*, *direction only*, *does not reproduce*, *inconclusive*, *not tested*) binds to
  a line of a source's "### Verdicts" block, `- KEY: VERDICT (N seeds)...`, whose KEY occurs in the verdict's
  sentence and whose N is the verdict's seed count: the first "N seed(s)" after it in its paragraph, else the
  last before it there, else the last the section stated above it. The paragraph that defines the five words
  (it names all five) is exempt. The words themselves come from one rule, lab/verdict.py's verdict(), which
  the tests at the end of this file pin on synthetic cases of each outcome.

A number is what a reader reads as one: 2.59, -0.20, +0.090, 5.6e-09, 1,922, 39, x1.10's 1.10. The sign is
part of it; the minus sign U+2212 reads as '-', and a thousands comma is dropped (10,000 = 10000). Nothing
else is rounded or reformatted: 2.592 and 2.59 are different numbers.
"""
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from verdict import T975, bootstrap_ci, mean_ci, n_to_decide, verdict

from conftest import REPO
SOURCE = r'(?:assets/[\w./-]+\.md|docs/papers\.md)'  # a report in assets/ or a folder of it
FROM = re.compile(rf'^<!-- from ({SOURCE}(?:, {SOURCE})*)((?:; [^;]+)*) -->$')
NOT_FROM = re.compile(r'^<!-- not from an asset: \S.* -->$')
NUMBER = re.compile(r'(?<![\d.])([+\-\u2212]?)(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?([eE][+\-\u2212]?\d+)?(?!\d)')
VERDICT = re.compile(r'\b(does not reproduce|direction only|not tested|inconclusive|reproduces)\b', re.I)
SEEDS = re.compile(r'\b(\d+|one|two|three|four|five|six|seven|eight|nine|ten) seeds?\b', re.I)
WORDS = dict(one=1, two=2, three=3, four=4, five=5, six=6, seven=7, eight=8, nine=9, ten=10)
REPORT_VERDICT = re.compile(r'^- (.+?): (reproduces|direction only|does not reproduce|not tested|'
                            r'inconclusive) \((\d+) seeds?\)')
README_RESULTS = '## What you will see'  # README.md: the headline findings, each with its report
CLAIMS = '## Every claim at a glance'  # docs/results.md: one row per claim, its verdict, its report
# the display names the docs give the reports' arms (a marker's own `LABEL -> ROW` comes first)
ARMS = {
    'terminal + RMSNorm': 'terminal_rmsnorm', 'terminal + raw': 'terminal_raw',
    'terminal + penalty': 'terminal_penalty', 'per-loop + RMSNorm': 'loop_rmsnorm',
    'per-loop + LayerNorm': 'loop_layernorm', 'per-loop + raw': 'loop_raw',
    'per-loop + final-only norm': 'loop_final_only', 'per-loop + penalty': 'loop_penalty',
    'per-loop + inter-loop norm': 'loop_interloop_norm', 'per-loop + RMSNorm, init gpt2': 'loop_rmsnorm_gpt2',
    'per-loop + raw, init gpt2': 'loop_raw_gpt2', 'per-loop RMSNorm': 'loop_rmsnorm',
    '+ injection add': 'inject_add', '+ sampled depth, backprop 2': 'random_depth', 'Ouro-like': 'ouro',
    'RMSNorm': 'loop_rmsnorm', 'raw': 'loop_raw', 'pre-norm baseline': 'preln', 'pre-norm': 'preln',
    'sandwich, p = 0': 'sandwich_p0', 'sandwich, p = 1/4': 'sandwich_p0.25',
    'sandwich, p = 1/2': 'sandwich_p0.5', 'sandwich, p = 1/2 (DeepLoop)': 'sandwich_p0.5',
}


def numbers(text):
    """The numbers in text, as written (see the module docstring for what counts as one)."""
    return [n for n, _, _ in number_spans(text)]


def number_spans(text):
    found = []
    for m in NUMBER.finditer(text):
        sign, whole, frac, exp = m.group(1), m.group(2), m.group(3) or '', m.group(4) or ''
        before = text[:m.start()]
        if sign and before and (before[-1].isalnum() or before[-1] in '_)'):
            sign = ''  # a hyphen inside a name (loop_rmsnorm-2000), not a sign
        n = (sign + whole.replace(',', '') + frac + exp).replace('\u2212', '-')
        found.append((n, m.start() + (len(m.group(1)) - len(sign)), m.end()))
    return found


def tokens(text):
    """The numbers and verdicts of text, in order; `code` is a name, not a result."""
    text = re.sub(r'`[^`]*`', '', text)
    found = [(s, n) for n, s, _ in number_spans(text)]
    found += [(m.start(), 'verdict: ' + m.group(1).lower()) for m in VERDICT.finditer(text)]
    return [t for _, t in sorted(found)]


def checked(text):
    """The numbers of prose text that must come from a source: decimals, not settings (module docstring)."""
    return [n for n, _, _ in checked_spans(text)]


def blank(pattern, text, keep=0):
    """text with each match of pattern turned into spaces but its first `keep` characters: offsets kept."""
    return re.sub(pattern, lambda m: m.group(0)[:keep] + ' ' * (len(m.group(0)) - keep), text)


def checked_spans(text):
    """(number, start, end) of each number checked(text) returns, at its offsets in text."""
    text = blank(r'`[^`]*`', blank(r'\]\([^)]*\)', text, keep=1))  # a link's target, `code`
    out = []
    for n, start, end in number_spans(text):
        left, right = text[start - 1:start], text[end:end + 1]
        glued = left.isalnum() or left == '_' or right.isalpha() or right == '_'
        ratio = left == 'x' and not text[start - 2:start - 1].isalnum()  # x0.72
        if '.' in n and (ratio or not glued):
            out.append((n, start, end))
    return out


def unsigned(n):
    return n.lstrip('+-')


def shown(path):
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name


def doc_files():
    return [REPO / 'README.md'] + sorted((REPO / 'docs').glob('*.md'))

# -----------------------------------------------------------------------------
# markers and tables


def comment_above(lines, i):
    """The comment block (joined into one line) that ends on line i - 1, or on i - 2 after a blank line."""
    k = i - 1
    if k >= 0 and not lines[k].strip():
        k -= 1
    if k < 0 or not lines[k].rstrip().endswith('-->'):
        return None
    j = k
    while j > 0 and '<!--' not in lines[j]:
        j -= 1
    return ' '.join(line.strip() for line in lines[j:k + 1]) if lines[j].lstrip().startswith('<!--') else None


def parse_marker(marker):
    """(sources, {doc label: (report label, table number or None)}, derived numbers) of a from-marker."""
    m = FROM.match(marker or '')
    if not m:
        return None
    labels, derived = {}, set()
    for part in filter(None, m.group(2).split('; ')):
        if part.startswith(('derived:', 'settings:')):
            derived |= {unsigned(n) for n in numbers(part.split(':', 1)[1])}
        else:
            doc, row = part.split(' -> ', 1)
            t = re.match(r'^(.*) \(table (\d+)\)$', row)
            labels[label_of(doc)] = (t.group(1), int(t.group(2))) if t else (row.strip(), None)
    return m.group(1).split(', '), labels, derived


def tables(path):
    """(first line number, marker or None, rows as lists of cells, data rows' line numbers) of every
    markdown table in path. A table is a run of lines starting with '|' whose second line is |---|..."""
    lines = path.read_text(encoding='utf-8').splitlines()
    found, i = [], 0
    while i < len(lines):
        if lines[i].startswith('|') and i + 1 < len(lines) and re.match(r'^\|[\s:|-]+\|$', lines[i + 1]):
            j = i + 2
            while j < len(lines) and lines[j].startswith('|'):
                j += 1
            rows = [cells(lines[k]) for k in range(i + 2, j)]
            found.append((i + 1, comment_above(lines, i), rows, list(range(i + 3, j + 1))))
            i = j
        else:
            i += 1
    return found


def cells(line):
    return [c.strip() for c in line.strip().strip('|').split('|')]


def label_of(cell):
    return re.sub(r'[*`]', '', cell).strip()


def report_rows(sources):
    """[(report, table number, label, cells after the label)] of every table row of the sources."""
    out = []
    for name in sources:
        if name.startswith('assets/'):
            for n, (_, _, rows, _) in enumerate(tables(REPO / name), 1):
                out += [(name, n, label_of(row[0]), row[1:]) for row in rows]
    return out


def source_text(sources):
    return '\n'.join((REPO / name).read_text(encoding='utf-8') for name in sources)


def candidates(label, labels, rows):
    """The report rows a doc row's label names."""
    if label in labels:
        want, table = labels[label]
        return [r for r in rows if r[2] == want and table in (None, r[1])]
    for want in (ARMS.get(label), label):
        if want and any(r[2] == want for r in rows):
            return [r for r in rows if r[2] == want]
    spelled = [r for r in rows if re.search(rf'(?<![\w.-]){re.escape(r[2])}(?![\w.-])', label)]
    longest = max((len(r[2]) for r in spelled), default=0)
    return [r for r in spelled if len(r[2]) == longest]


def cells_follow(doc, rep):
    """Whether the doc cells (token lists) are, in order, each one report cell's tokens or a run of adjacent
    report cells' tokens."""
    doc = [d for d in doc if d]

    def go(i, j):
        if i == len(doc):
            return True
        for a in range(j, len(rep)):
            run = []
            for b in range(a, len(rep)):
                run = run + rep[b]
                if run == doc[i] and go(i + 1, b + 1):
                    return True
                if len(run) > len(doc[i]):
                    break
        return False
    return go(0, 0)


def row_problems(path, table, lines):
    """One message per data row of a marked table that binds to no report row."""
    start, marker, rows, row_lines = table
    parsed = parse_marker(marker)
    if not parsed:
        return []
    sources, labels, derived = parsed
    known = report_rows(sources)
    out = []
    for row, lineno in zip(rows, row_lines):
        label, doc = label_of(row[0]), [tokens(c) for c in row[1:]]
        if not any(doc):
            continue
        rep = candidates(label, labels, known)
        if not rep and VERDICT.search(lines[lineno - 1]):
            # a summary row's verdict binds to the report its row links to, not to any of the marker's
            linked = [f'assets/{n}' for n in re.findall(r'\(\.{0,2}/?assets/([\w.-]+\.md)\)',
                                                        lines[lineno - 1])]
            own = linked if linked and set(linked) <= set(sources) else None
            out += prose_problems(path, lineno, lines[lineno - 1], parsed, None, verdicts_from=own)
        elif not rep:
            out.append(f"{shown(path)}:{lineno}: no row of {', '.join(sources)} is labelled '{label}' "
                       f"(map it in the marker: '{label} -> REPORT LABEL')")
        elif not any(cells_follow(doc, [tokens(c) for c in r[3]]) for r in rep):
            best = rep[0]
            out.append(f"{shown(path)}:{lineno} ('{label}'): its cells are not, in order, the cells of "
                       f"{best[0]}'s row '{best[2]}': {' | '.join(best[3])[:150]}")
    return out

# -----------------------------------------------------------------------------
# prose


def report_verdicts(sources):
    """[(key, verdict, seeds)] of the sources' Verdicts blocks."""
    out = []
    for line in source_text(sources).splitlines():
        m = REPORT_VERDICT.match(line)
        if m:
            out.append((flat(m.group(1)), m.group(2), int(m.group(3))))
    return out


def flat(text):
    return ' '.join(re.sub(r'[*"“”`_]', '', text).lower().split())


def seed_count(m):
    return int(m.group(1)) if m.group(1).isdigit() else WORDS[m.group(1).lower()]


SENTENCE_END = re.compile(r'[.;:!?](?=\s|$)')


def report_tables(sources):
    """(table number, header labels, data rows) of every table of the sources' reports."""
    out = []
    for name in sources:
        if name.startswith('assets/'):
            lines = (REPO / name).read_text(encoding='utf-8').splitlines()
            out += [(n, [label_of(c) for c in cells(lines[start - 1])], rows)
                    for n, (start, _, rows, _) in enumerate(tables(REPO / name), 1)]
    return out


def named_cells(sources, label, table=None):
    """The numbers (unsigned) of the report cells label names: the rows whose first cell is label and the
    columns it heads (in table number `table` only, where given); None when it names no row or column."""
    found, named = set(), False
    for n, header, rows in report_tables(sources):
        if table not in (None, n):
            continue
        cols = [i for i, h in enumerate(header) if h == label]
        for row in rows:
            picked = [row[i] for i in cols if i < len(row)]
            picked += row[1:] if label_of(row[0]) == label else []
            named = named or bool(cols) or label_of(row[0]) == label
            found |= {unsigned(x) for c in picked for x in numbers(c)}
    return found if named else None


def names(text, sources, labels):
    """[(start, end, name, report label, table)] of the names in text (module docstring): the marker's
    phrases, in any case and outside `code`, and the report labels written in `code`."""
    text = blank(r'\]\([^)]*\)', text, keep=1)
    code = [(m.start(), m.end(), m.group(1)) for m in re.finditer(r'`([^`]*)`', text)]
    found = [(s, e, c, c, None) for s, e, c in code if named_cells(sources, c) is not None]
    if labels:
        lower = {doc.lower(): target for doc, target in labels.items()}
        phrase = '|'.join(re.escape(doc) for doc in sorted(labels, key=len, reverse=True))
        for m in re.finditer(rf'(?<![\w-])(?:{phrase})(?![\w-])', text, re.I):
            if not any(s <= m.start() < e for s, e, _ in code):
                found.append((m.start(), m.end(), m.group(0), *lower[m.group(0).lower()]))
    return sorted(found)


def bindings(text, sources, labels):
    """{offset of a checked number: (name, report label, the numbers of the cells it names or None)} for
    every number of text that a name binds: the last name before it in its sentence."""
    found = names(text, sources, labels)
    out = {}
    for n, start, _ in checked_spans(text):
        before = [x for x in found if x[1] <= start]
        if before and not SENTENCE_END.search(text, before[-1][1], start):
            _, _, name, label, table = before[-1]
            out[start] = (name, label, named_cells(sources, label, table))
    return out


def prose_problems(path, lineno, text, parsed, section_seeds, verdicts_from=None):
    """One message per number or verdict of a paragraph that its sources do not carry (its verdicts: those
    of verdicts_from, where given, a summary row's own report)."""
    where = f"{shown(path)}:{lineno}"
    verdicts = [m for m in VERDICT.finditer(text)]
    if len({m.group(1).lower() for m in verdicts}) == 5:
        verdicts = []  # the paragraph that defines the vocabulary
    wanted = checked(text)
    if not parsed:
        what = ', '.join(wanted[:4]) or verdicts[0].group(1) if wanted or verdicts else ''
        return [f"{where}: states {what} with no <!-- from assets/NAME.md --> marker above it"] \
            if what else []
    if parsed == 'not from an asset':
        return []
    sources, labels, derived = parsed
    have = {unsigned(n) for n in numbers(source_text(sources))} | derived
    bound, out = bindings(text, sources, labels), []
    for n, start, _ in checked_spans(text):
        if start not in bound or unsigned(n) in derived:
            out += [f"{where}: {n} is in none of {', '.join(sources)}"] if unsigned(n) not in have else []
            continue
        name, label, cells_of = bound[start]
        if cells_of is None:
            out.append(f"{where}: '{name}' -> '{label}': no row or column of {', '.join(sources)} is "
                       f"labelled '{label}'")
        elif unsigned(n) not in cells_of:
            out.append(f"{where}: {n} follows '{name}' but is in none of the cells '{label}' names in "
                       f"{', '.join(sources)}")
    said = report_verdicts(verdicts_from or sources)
    for m in verdicts:
        after = SEEDS.search(text, m.end())
        before = list(SEEDS.finditer(text, 0, m.start()))
        n = seed_count(after) if after else seed_count(before[-1]) if before else section_seeds
        sentence = flat(next(s for s in re.split(r'(?<=\.)\s+', text + ' ') if m.group(0) in s))
        word = m.group(1).lower()
        if not any(key in sentence and v == word and s == n for key, v, s in said):
            keys = [f"{key}: {v} ({s})" for key, v, s in said if key in sentence]
            out.append(f"{where}: '{word}' ({n} seeds) is no verdict of "
                       f"{', '.join(verdicts_from or sources)} on this claim"
                       + (f"; the report says {'; '.join(keys)}" if keys else
                          "; no report verdict's key occurs in its sentence"))
    return out


def paragraphs(lines, scope):
    """(first line number, text, marker text in force, a heading line?) of each prose paragraph or bullet in
    scope (line numbers, 1-based), skipping tables, code, images and comments."""
    out, marker, i, fence = [], None, 0, False
    idx = [k - 1 for k in scope]
    while i < len(idx):
        line = lines[idx[i]]
        if line.startswith('```'):
            fence = not fence
            i += 1
            continue
        if fence or not line.strip() or line.startswith(('|', '![')) or line.startswith('    '):
            i += 1
            continue
        if line.startswith('#'):
            marker = None
            out.append((idx[i] + 1, line, None, True))
            i += 1
            continue
        if line.lstrip().startswith('<!--'):
            j = i
            while not lines[idx[j]].rstrip().endswith('-->'):
                j += 1
            marker = ' '.join(lines[idx[k]].strip() for k in range(i, j + 1))
            i = j + 1
            continue
        j = i + 1
        while j < len(idx) and lines[idx[j]].strip() and not lines[idx[j]].startswith(
                ('- ', '* ', '|', '#', '<!--', '![', '```')):
            j += 1
        out.append((idx[i] + 1, ' '.join(lines[idx[k]].strip() for k in range(i, j)), marker, False))
        i = j
    return out


def prose_check(path, scope):
    lines = path.read_text(encoding='utf-8').splitlines()
    out, seeds = [], None
    for lineno, text, marker, heading in paragraphs(lines, scope):
        if heading:
            seeds = None
            continue
        parsed = 'not from an asset' if NOT_FROM.match(marker or '') else parse_marker(marker)
        out += prose_problems(path, lineno, text, parsed, seeds)
        stated = list(SEEDS.finditer(text))
        seeds = seed_count(stated[-1]) if stated else seeds
    return out


def section(path, heading):
    """The line numbers (1-based) of the section of path that starts at heading, up to the next heading
    of the same level; all of the file when heading is None."""
    lines = path.read_text(encoding='utf-8').splitlines()
    if heading is None:
        return range(1, len(lines) + 1)
    level = heading.split(' ')[0]
    start = lines.index(heading)
    end = next((k for k in range(start + 1, len(lines)) if lines[k].startswith(level + ' ')), len(lines))
    return range(start + 1, end + 1)


def problems(path, heading=None, prose=True):
    """Every claim problem of path (within the section under heading): unmarked tables, table rows that
    bind to no report row, and, with prose, prose numbers and verdicts no source carries."""
    scope, lines = section(path, heading), path.read_text(encoding='utf-8').splitlines()
    out = []
    for t in tables(path):
        if t[0] not in scope:
            continue
        if not (t[1] and (FROM.match(t[1]) or NOT_FROM.match(t[1]))):
            out.append(f"{shown(path)}:{t[0]}: a table with no <!-- from assets/NAME.md --> "
                       f"(or <!-- not from an asset: REASON -->) marker above it")
        out += row_problems(path, t, lines)
    return out + (prose_check(path, scope) if prose else [])


def docs_problems(root=REPO):
    """The checks on docs/*.md: docs/results.md in full, the other files' tables."""
    return [p for path in sorted((root / 'docs').glob('*.md'))
            for p in problems(path, prose=path.name == 'results.md')]

# -----------------------------------------------------------------------------
# the tests


def test_numbers_are_read_as_written():
    cell = '2.59 / -0.20 / +0.090 (5.6e-09) 1,922 39 \u22120.054 x1.10 loop_rmsnorm-2000 10,000 2/2'
    assert numbers(cell) == ['2.59', '-0.20', '+0.090', '5.6e-09', '1922', '39', '-0.054', '1.10', '2000',
                             '10000', '2', '2']
    assert numbers('2.592') != numbers('2.59')  # no rounding: a table states the report's digits


def test_prose_checks_decimals_but_not_settings_counts_or_names():
    text = 'x0.72 at 600 steps, lr 3e-4, 3 seeds, bf16, `--lr=0.5`, 5.5e-09 and ‖h_4‖ 496.6 (0496aca)'
    assert checked(text) == ['0.72', '5.5e-09', '496.6']


def test_markers_name_reports_that_exist():
    for path in doc_files():
        for start, marker, _, _ in tables(path):
            if marker and marker.startswith('<!-- from'):
                assert FROM.match(marker), f"{shown(path)}:{start}: malformed marker {marker}"
                for name in parse_marker(marker)[0]:
                    assert (REPO / name).is_file(), f"{shown(path)}:{start} cites {name}"
            elif marker and marker.startswith('<!-- not from'):
                assert NOT_FROM.match(marker), f"{shown(path)}:{start}: give a reason: {marker}"


def test_docs_tables_rows_numbers_and_verdicts_come_from_their_reports():
    found = docs_problems()
    assert not found, '\n'.join(found)


def test_readme_headline_findings_come_from_their_reports():
    found = problems(REPO / 'README.md', README_RESULTS)
    assert not found, '\n'.join(found)


def test_the_table_of_every_claim_comes_from_its_reports():
    found = problems(REPO / 'docs' / 'results.md', CLAIMS)
    assert not found, '\n'.join(found)


def test_every_claim_row_states_a_verdict_bound_to_its_report():
    # tables only (prose: the test above): a summary table of verdicts binds through the Verdicts blocks,
    # and a row with no number and no verdict would be skipped, so every row must state its verdict
    path = REPO / 'docs' / 'results.md'
    found = problems(path, CLAIMS, prose=False)
    assert not found, '\n'.join(found)
    rows = [row for start, _, rows, _ in tables(path) if start in section(path, CLAIMS) for row in rows]
    assert len(rows) >= 38 and all(VERDICT.search(row[2]) for row in rows), len(rows)
    readme = (REPO / 'README.md').read_text(encoding='utf-8').split(README_RESULTS, 1)[1]
    assert f'all {len(rows)},' in readme.split('\n## ', 1)[0]  # the README counts the claims the table has


def planted(tmp_path, name, old, new):
    """The problems docs/NAME finds once `old` (which must occur once in it) reads `new`."""
    text = (REPO / 'docs' / name).read_text(encoding='utf-8')
    assert text.count(old) == 1, f"{name} no longer holds {old!r}: update the planted error"
    (tmp_path / 'docs').mkdir(exist_ok=True)
    copy = tmp_path / 'docs' / name
    copy.write_text(text.replace(old, new), encoding='utf-8')
    return problems(copy, prose=name == 'results.md')


BLINDSPOT_RAW = ('| per-loop + raw | 2.8112 | 15.8 / 17.3 / 18.1 / 19.1 | 31.2 (50/75/75) '
                 '| 24.9 / 19.1 | x0.77 |\n| per-loop + final-only norm | 2.7258 |')
ERRORS = {  # what a careless edit does, in a copy of the committed text: each must be caught
    'prose number changed': ('results.md', '+0.024, +0.033 and +0.069 per seed',
                             '+0.024, +0.037 and +0.069 per seed'),
    'verdict word changed': ('results.md', '**DeepLoop is neutral at R = 1: inconclusive (3 seeds).**',
                             '**DeepLoop is neutral at R = 1: reproduces (3 seeds).**'),
    'seed count changed': ('results.md', 'one best LR for every R: direction only (2 seeds)',
                           'one best LR for every R: direction only (3 seeds)'),
    'two row labels swapped': ('results.md', BLINDSPOT_RAW, BLINDSPOT_RAW.replace('per-loop + raw', 'X')
                               .replace('per-loop + final-only norm', 'per-loop + raw')
                               .replace('X', 'per-loop + final-only norm')),
    'two cells swapped': ('results.md', BLINDSPOT_RAW, BLINDSPOT_RAW.replace(
        '31.2 (50/75/75) | 24.9 / 19.1', '24.9 / 19.1 | 31.2 (50/75/75)')),
    'a number borrowed from another cell of the report line': (
        'results.md', BLINDSPOT_RAW, BLINDSPOT_RAW.replace('31.2 (50/75/75)', '24.9 (50/75/75)')),
    'an unmarked table in docs/decoding.md': ('decoding.md', '<!-- not from an asset: a description of '
                                              'the policies -->\n', ''),
    # numbers a name binds, changed to numbers the report holds elsewhere: the occurrence rule passes them
    'a bound number changed to one of another column': ('results.md', '-0.014 to -0.044, disjoint',
                                                        '-0.014 to -0.009, disjoint'),
    "a bound number changed to another arm's": ('results.md', 'looped experts end at 1.9866',
                                                 'looped experts end at 1.9802'),
}
MOE_SECTION = '## Looped-MoE (Lee et al.), three seeds, 1,000 steps'  # docs/results.md: every number bound


def moe_prose(text):
    """The problems of text as a paragraph of docs/results.md's Looped-MoE bullets, under their marker."""
    lines = (REPO / 'docs' / 'results.md').read_text(encoding='utf-8').splitlines()
    scope = section(REPO / 'docs' / 'results.md', MOE_SECTION)
    marker = [m for _, t, m, _ in paragraphs(lines, scope) if t.startswith('- **Routing diverges')][0]
    return prose_problems(REPO / 'docs' / 'results.md', 1, text, parse_marker(marker), 3)


def test_a_bound_prose_number_planted_as_one_elsewhere_in_its_report_is_caught(tmp_path):
    # the case, "0.049" planted as "0.009": here kappa -0.044 (layer 0, loops 1-4) planted as
    # -0.009, which assets/moe.md holds in its JS column, so that only the binding to 'kappa' catches it
    assert '0.009' in {unsigned(n) for n in numbers(source_text(['assets/moe.md']))}
    found = planted(tmp_path, 'results.md', *ERRORS['a bound number changed to one of another column'][1:])
    found = [p for p in found if '0.009' in p]  # the rest of the file's problems, if any, are not this test's
    assert len(found) == 1 and found[0].endswith(": -0.009 follows 'kappa' but is in none of the cells "
                                                 "'kappa' names in assets/moe.md"), found


def test_a_name_binds_the_numbers_after_it_in_its_sentence_to_the_row_or_column_it_names():
    assert moe_prose("The dense loop ends at 2.0349, kappa reaches +0.901.") == []
    assert "follows 'dense loop'" in moe_prose("The dense loop ends at 1.9866.")[0]  # looped_moe's CE
    # the name's reach ends with its sentence; a number no name binds only has to be in the report
    assert moe_prose("The dense loop ends at 2.0349. Free-running, 1.9866.") == []
    # a report label in `code` is a name too, a row's or a column's
    assert moe_prose("`looped_moe_tied` ends at 1.9802 and `tied keeps` 1.48.") == []
    assert "follows 'looped_moe_tied'" in moe_prose("`looped_moe_tied` ends at 1.9866.")[0]
    # a marker's phrase that names no row or column is an error, not a free pass
    parsed = parse_marker('<!-- from assets/moe.md; the loop -> no_such_arm -->')
    assert "no row or column of assets/moe.md is labelled 'no_such_arm'" in \
        prose_problems(REPO / 'docs' / 'results.md', 1, 'the loop ends at 1.9866', parsed, 3)[0]


def test_every_decimal_of_the_looped_moe_bullets_is_bound_to_a_named_row_or_column():
    path = REPO / 'docs' / 'results.md'
    lines = path.read_text(encoding='utf-8').splitlines()
    unbound = []
    for lineno, text, marker, _ in paragraphs(lines, section(path, MOE_SECTION)):
        if text.startswith('- **'):
            sources, labels, _ = parse_marker(marker)
            bound = bindings(text, sources, labels)
            unbound += [f"{lineno}: {n}" for n, start, _ in checked_spans(text) if start not in bound]
    assert not unbound, unbound


def test_committed_docs_copied_unchanged_pass(tmp_path):
    for name in ('results.md', 'decoding.md'):
        copy = tmp_path / name
        copy.write_text((REPO / 'docs' / name).read_text(encoding='utf-8'), encoding='utf-8')
        assert problems(copy, prose=name == 'results.md') == []


@pytest.mark.parametrize('error', list(ERRORS))
def test_a_planted_error_is_caught(tmp_path, error):
    name, old, new = ERRORS[error]
    assert planted(tmp_path, name, old, new), f"{error}: not caught"


# -----------------------------------------------------------------------------
# the one verdict rule (lab/verdict.py) on synthetic cases of each outcome


def test_t_quantiles_of_the_paired_ci_are_students():
    stats = pytest.importorskip('scipy.stats')
    assert np.allclose(T975, [stats.t.ppf(0.975, df) for df in range(1, len(T975) + 1)], atol=6e-4)


def test_a_ci_on_the_papers_side_that_holds_its_size_reproduces():
    assert verdict(-0.15, -0.20, -0.10, sign=-1)[0] == 'reproduces'  # a sign claimed, no size
    assert verdict(0.40, 0.30, 0.50, paper=0.45)[0] == 'reproduces'


def test_a_ci_on_the_papers_side_that_excludes_its_size_is_direction_only():
    word, why = verdict(0.05, 0.02, 0.08, paper=0.193)
    assert word == 'direction only' and "excludes the claimed size +0.193" in why
    assert verdict(0.40, 0.30, 0.50, paper=0.45, sign=+1)[0] != 'direction only'
    assert verdict(0.05, 0.02, 0.08, sign=+1)[0] == 'reproduces'  # without a size, no 'direction only'


def test_a_ci_that_excludes_the_papers_value_or_lies_beyond_0_on_the_other_side_does_not_reproduce():
    assert verdict(0.050, -0.11, 0.17, paper=0.193)[0] == 'does not reproduce'  # holds 0, not the paper's
    word, why = verdict(0.15, 0.10, 0.20, sign=-1)
    assert word == 'does not reproduce' and 'other sign' in why


def test_a_ci_that_holds_0_and_the_papers_value_is_inconclusive_and_names_the_n_that_decides():
    word, why = verdict(-0.006, -0.11, 0.08, paper=-0.079, sign=-1, n=13, unit='groups')
    assert word == 'inconclusive'
    # half-width 0.095 must fall to 0.073, the distance to the farther of 0 and -0.079: 13 (0.095/0.073)^2
    assert 'about 23 groups would decide it (n 13 now' in why
    assert n_to_decide(4, 0.10, 0.05) == 16 and n_to_decide(4, 0.10, 0.20) == 5
    assert n_to_decide(4, 1, 0) is None  # the effect on the deciding point: no n decides
    assert verdict(0.02, -0.01, 0.05, n=3)[0] == 'inconclusive'  # a sign claimed, the CI holds 0


def test_the_predicted_n_decides_on_simulated_seeds():
    # an effect of 0.5 sd: at n 4 the CI holds 0; at the n the rule names (and Student's t at its df) it
    # excludes 0 on most draws, at n 4 on few
    rng, decided = np.random.default_rng(0), {}
    m, lo, hi = mean_ci(0.5 + rng.standard_normal(4))
    word, why = verdict(m, lo, hi, n=4)
    k = int(re.search(r'about (\d+) seeds', why).group(1)) if word == 'inconclusive' else 4
    for n in (4, max(k, 40)):
        cis = [mean_ci(0.5 + rng.standard_normal(n)) for _ in range(200)]
        decided[n] = np.mean([verdict(*c, n=n)[0] == 'reproduces' for c in cis])
    assert decided[4] < 0.5 < decided[max(k, 40)], decided


def test_three_same_sign_seeds_are_no_ci_that_excludes_0():
    # disjoint minus free routing, per seed: all three below 0, yet the paired CI holds 0
    word, why = verdict(*mean_ci([-0.0059, -0.0080, -0.0024]), sign=-1, n=3, spec='+.4f')
    assert word == 'inconclusive' and 'CI [-0.0125, +0.0016]' in why
    assert verdict(*mean_ci([-0.01]), sign=-1)[0] == 'inconclusive'  # one seed: no CI at all


def test_an_equivalence_claim_is_judged_against_its_stated_margin():
    assert verdict(0.001, -0.004, 0.006, margin=0.01)[0] == 'reproduces'
    assert verdict(0.042, 0.025, 0.060, margin=0.01)[0] == 'does not reproduce'
    word, why = verdict(0.042, -0.017, 0.100, margin=0.02, n=3)
    assert word == 'inconclusive' and 'crosses the equivalence margin ±0.020' in why
    with pytest.raises(AssertionError):
        verdict(0.0, -0.1, 0.1, margin=0)


def test_a_bootstrap_over_correlated_groups_is_wider_than_one_over_their_runs():
    # 8 groups of 10 runs sharing a group effect: the unit of independence is the group
    rng = np.random.default_rng(1)
    groups = [list(g + 0.1 * rng.standard_normal(10)) for g in rng.standard_normal(8)]
    pooled = lambda gs: float(np.mean([x for g in gs for x in g]))  # noqa: E731
    by_group, by_run = bootstrap_ci(groups, pooled), bootstrap_ci([[x] for g in groups for x in g], pooled)
    assert by_group[0] == pytest.approx(by_run[0])
    assert by_group[2] - by_group[1] > 2 * (by_run[2] - by_run[1])


def report_block(name):
    """The lines of assets/NAME.md's "### Verdicts" block, as the report states them."""
    lines = (REPO / 'assets' / f'{name}.md').read_text(encoding='utf-8').splitlines()
    i = lines.index('### Verdicts') + 2
    j = next((k for k in range(i, len(lines)) if not lines[k].startswith('- ')), len(lines))
    return lines[i:j]


@pytest.mark.parametrize('name', ['moe', 'moe_4x2', 'moe_causal', 'moe_pool'])
def test_looped_moe_verdicts_are_the_rules_on_the_reports_per_seed_records(name):
    # each report's .json holds every run's moe_eval.json: the verdicts recomputed from them by the rule
    import moe
    from reports import verdict_block
    runs = json.loads((REPO / 'assets' / f'{name}.json').read_text(encoding='utf-8'))
    ev = {arm: {r['seed']: r['moe_eval'] for r in rs if r.get('moe_eval')} for arm, rs in runs.items()}
    assert [line for line in verdict_block(moe.verdicts(ev)) if line.startswith('- ')] == report_block(name)


def test_the_probes_verdicts_are_the_rules_on_the_reports_per_seed_records():
    # assets/probes.json holds every run's eval_depth results: the clamp and depth claims recomputed
    from report_blindspot import probes_verdicts
    from reports import verdict_block
    runs = json.loads((REPO / 'assets' / 'probes.json').read_text(encoding='utf-8'))
    said = [line for line in verdict_block(probes_verdicts(runs)) if line.startswith('- ')]
    assert said == report_block('probes')


def test_deeploop_verdicts_are_the_rules_on_the_committed_runs(tmp_path):
    # assets/runs/deeploop holds every run's metrics: rebuilding the report gives its Verdicts block
    import subprocess
    import sys
    from conftest import real_data
    cwd = real_data(tmp_path / 'cwd')  # the unigram floor reads data/shakespeare_char
    if cwd is None:
        pytest.skip("the unigram floor needs data/shakespeare_char: set NANOLOOP_OFFLINE_DATA or run python "
                    "prepare.py shakespeare_char")
    runs = str(REPO / 'assets' / 'runs' / 'deeploop')
    subprocess.run([sys.executable, str(REPO / 'lab' / 'ablate.py'), 'deeploop', '--report_only',
                    '--seeds=1,2,3', '--out', runs, '--report_dir', str(tmp_path)], cwd=cwd, check=True,
                   capture_output=True)
    rebuilt = (tmp_path / 'deeploop.md').read_text(encoding='utf-8').splitlines()
    i = rebuilt.index('### Verdicts') + 2
    assert rebuilt[i:i + len(report_block('deeploop'))] == report_block('deeploop')


def test_a_difference_of_stuck_shares_has_a_ci_that_stays_in_bounds_and_decides_only_with_enough_runs():
    from verdict import shares_ci, weakest
    d, lo, hi = shares_ci(3, 36, 0, 36)   # the DeepLoop trainability count: 3 of 36 against none
    assert d == pytest.approx(3 / 36) and lo < 0 < hi and -1 <= lo and hi <= 1
    assert shares_ci(24, 36, 0, 36)[1] > 0
    assert weakest(['reproduces', 'inconclusive', 'direction only']) == 'inconclusive'
    assert weakest(['reproduces', 'does not reproduce']) == 'does not reproduce'
    assert weakest([]) == 'not tested'


@pytest.mark.parametrize('k1,n1,k2,n2,lo,hi', [(56, 70, 48, 80, 0.0524, 0.3339),
                                              (9, 10, 3, 10, 0.1705, 0.8090),
                                              (5, 56, 0, 29, -0.0381, 0.1926)])
def test_a_difference_of_two_shares_has_newcombes_published_hybrid_score_interval(k1, n1, k2, n2, lo, hi):
    # Newcombe (1998, Stat. Med. 17:873), Table II, method 10 (Wilson's score interval for each share)
    from verdict import shares_ci
    d, got_lo, got_hi = shares_ci(k1, n1, k2, n2)
    assert d == pytest.approx(k1 / n1 - k2 / n2) and (got_lo, got_hi) == pytest.approx((lo, hi), abs=6e-5)


def test_a_bootstrap_ci_of_a_mean_is_the_normal_95_percent_interval_for_many_independent_units():
    # 400 draws of N(0, 1): the percentile interval of the mean is mean -+ 1.96 sd / sqrt(n) to within the
    # bootstrap's own noise (a 90 % interval would be 1.645 sd / sqrt(n): 16 % narrower)
    x = np.random.default_rng(0).standard_normal(400)
    m, lo, hi = bootstrap_ci([[v] for v in x], lambda g: float(np.mean([v for (v,) in g])))
    half = 1.96 * float(np.std(x, ddof=1)) / math.sqrt(len(x))
    assert m == pytest.approx(float(np.mean(x))) and (hi - lo) / 2 == pytest.approx(half, rel=0.06)


@pytest.mark.parametrize('name', ['isodepth_grouped', 'runs/isodepth_seeds/isodepth_grouped'])
def test_iso_depth_verdicts_are_the_rules_on_the_grouped_reports_fits(name):
    # each grouped report's .json holds its fits (the seeds sweep's: 3 seeds a cell, matched runs): the
    # report's block is the rule's on them
    import isodepth
    res = json.loads((REPO / 'assets' / f'{name}.json').read_text(encoding='utf-8'))
    assert isodepth.grouped_verdict_lines(res) == report_block(name)
