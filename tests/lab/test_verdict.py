"""lab/verdict.py's rule where it combines cells: a claim that must hold in every cell (every R, every p,
both ends of a fit) is as strong as its weakest cell. A failing cell fails the claim; an undecided one
leaves it undecided unless another fails; a claim holds only if every cell holds."""
import itertools

import pytest

from verdict import WORDS, verdict, weakest

DNR, INC, DIR, REP = 'does not reproduce', 'inconclusive', 'direction only', 'reproduces'

# every pair of cells, written out by hand: (cell, cell) -> the claim's verdict
PAIRS = {
    (REP, REP): REP, (REP, DIR): DIR, (REP, INC): INC, (REP, DNR): DNR,
    (DIR, DIR): DIR, (DIR, INC): INC, (DIR, DNR): DNR,
    (INC, INC): INC, (INC, DNR): DNR,
    (DNR, DNR): DNR,
}


@pytest.mark.parametrize('a,b', list(PAIRS))
def test_a_claim_over_two_cells_is_its_weakest_cells_verdict_in_either_order(a, b):
    assert weakest([a, b]) == weakest([b, a]) == PAIRS[a, b]


def test_a_failing_cell_fails_the_claim_even_beside_undecided_ones():
    # an undecided cell ranks above a failing one: more seeds could still make it hold, a failure cannot
    assert weakest([INC, DNR, INC]) == DNR
    assert weakest([REP, INC, DIR]) == INC  # nothing fails, one cell is open: the claim is open
    assert weakest([REP, DIR, REP]) == DIR  # every cell on the paper's side, one off its size


def test_every_combination_of_three_cells_is_one_of_its_own_cells_and_none_stronger():
    strength = [DNR, INC, DIR, REP]  # weakest first, as stated in the module's docstring
    for cells in itertools.product(WORDS, repeat=3):
        word = weakest(list(cells))
        assert word in cells and all(strength.index(word) <= strength.index(c) for c in cells), cells


def test_a_claim_with_no_cell_is_not_tested():
    assert weakest([]) == 'not tested'


# the single-cell rule, tabulated over where the CI lies: below 0, across 0, above 0, around the paper's
# size 0.4 (claimed positive) and short of it
CELLS = [
    ((-0.3, -0.2), None, DNR), ((-0.1, 0.1), None, INC), ((0.1, 0.2), None, REP),
    ((0.3, 0.5), 0.4, REP), ((0.1, 0.2), 0.4, DIR), ((-0.1, 0.1), 0.4, DNR), ((-0.1, 0.5), 0.4, INC),
    ((-0.3, -0.2), 0.4, DNR),
]


@pytest.mark.parametrize('ci,paper,word', CELLS)
def test_one_cells_verdict_follows_where_its_ci_lies(ci, paper, word):
    lo, hi = ci
    assert verdict((lo + hi) / 2, lo, hi, paper=paper, n=4)[0] == word
    # the same cell with the claim's sign flipped and the CI mirrored: the same verdict
    assert verdict(-(lo + hi) / 2, -hi, -lo, paper=None if paper is None else -paper, sign=-1, n=4)[0] == word
