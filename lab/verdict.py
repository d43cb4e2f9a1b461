"""
The one verdict rule of every report (docs/results.md, "How a verdict is reached"): from an effect, its
95 % CI over the right unit (paired over seeds, or a bootstrap over the groups whose residuals correlate)
and, where the paper gives one, the paper's value:

    reproduces          the CI excludes 0 on the paper's side and, where the paper gives a size, holds it
    direction only      the CI excludes 0 on the paper's side but excludes the paper's size
    does not reproduce  the CI holds 0 but excludes the paper's size, or lies beyond 0 on the other side
    inconclusive        neither: the CI holds 0 and the paper's value; the why names the n that would decide

An equivalence claim ("neutral", "costs little") is judged against a margin stated beside it: reproduces if
the CI lies inside [-margin, +margin], does not reproduce if it lies outside, inconclusive otherwise.
A count of same-sign seeds is not a CI: three seeds of one sign happen one time in eight by chance.

    from verdict import verdict, mean_ci
    word, why = verdict(*mean_ci(diffs), sign=-1, n=len(diffs))   # 'lower' claimed: sign -1
"""
import math

import numpy as np

WORDS = ('reproduces', 'direction only', 'does not reproduce', 'inconclusive')
# Student t's 0.975 quantile by degrees of freedom (any statistics table; tests check it against scipy):
# the paired CI over n seeds uses n - 1, and beyond 30 the normal's 1.96 is within 2 %
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042)
Z975 = 1.960


def t975(df):
    assert df >= 1, "a CI over seeds needs two of them at least"
    return T975[df - 1] if df <= len(T975) else Z975


def mean_ci(xs):
    """(mean, lo, hi): the 95 % Student-t CI of the mean of xs, one number per independent unit (a seed's
    paired difference); lo and hi None for fewer than two units."""
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return None, None, None
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, None, None
    half = t975(len(xs) - 1) * float(np.std(xs, ddof=1)) / math.sqrt(len(xs))
    return m, m - half, m + half


def bootstrap_ci(groups, stat, resamples=2000, seed=0):
    """(stat(groups), lo, hi): a percentile 95 % CI of stat over resamples of the groups with replacement.
    groups: a list of the units that are independent (e.g. the runs of one (budget, width) group each);
    stat: a list of groups -> a number (None where it cannot be computed, left out)."""
    rng = np.random.default_rng(seed)
    boot = [stat([groups[i] for i in rng.integers(len(groups), size=len(groups))]) for _ in range(resamples)]
    boot = [b for b in boot if b is not None and math.isfinite(b)]
    lo, hi = np.percentile(boot, [2.5, 97.5]) if boot else (None, None)
    return stat(groups), float(lo), float(hi)


def n_to_decide(n, half_width, needed):
    """The units a CI needs to reach half-width `needed` from `half_width` at n units: the half-width
    falls as 1/sqrt(n), so n scales as (half_width / needed)^2. None where no n decides (needed 0)."""
    if needed <= 0:
        return None
    return max(n + 1, math.ceil(n * (half_width / needed) ** 2))


def undecided(effect, lo, hi, needed, n, unit, spec):
    # the CI's half-width must shrink below the distance from the effect to the point that decides
    half, size = (hi - lo) / 2, spec.lstrip('+')
    if needed <= 0:
        return 'inconclusive', f"no n of {unit} decides it: the effect sits on the point that decides"
    scale = f"half-width {half:{size}}, {needed:{size}} needed: n scales as (half-width / needed)^2"
    if not n:
        return 'inconclusive', scale
    return 'inconclusive', f"about {n_to_decide(n, half, needed)} {unit} would decide it (n {n} now; {scale})"


def verdict(effect, lo, hi, paper=None, sign=+1, margin=None, n=None, unit='seeds', spec='+.3f'):
    """(word, why) of a claim whose effect is `effect` with 95 % CI [lo, hi] over n units (seeds, groups).
    sign: the paper's direction (+1: the effect is claimed positive, -1: negative); paper: the size claimed,
    the paper's value of the effect where it gives one (or the size a claim names: 'the whole gain');
    margin: an equivalence claim |effect| <= margin (sign and paper unused). The why states the CI and
    what decided it; an inconclusive one, the n that would decide."""
    assert sign in (+1, -1), f"sign {sign}: +1 or -1, the direction the paper claims"
    if lo is None or hi is None:
        return 'inconclusive', f"{effect:{spec}} has no CI: two {unit} at least are needed"
    assert paper is None or sign * paper > 0, f"the paper's {paper} is not on the side sign {sign} claims"
    ci = f"{effect:{spec}}, 95 % CI [{lo:{spec}}, {hi:{spec}}]" + (f" over {n} {unit}" if n else "")
    if margin is not None:
        assert margin > 0, "an equivalence claim needs a margin > 0"
        eq = f"±{margin:{spec.lstrip('+')}}"
        if -margin <= lo and hi <= margin:
            return 'reproduces', f"{ci}: inside the equivalence margin {eq}"
        if lo > margin or hi < -margin:
            return 'does not reproduce', f"{ci}: outside the equivalence margin {eq}"
        word, why = undecided(effect, lo, hi, abs(margin - abs(effect)), n, unit, spec)
        return word, f"{ci}: crosses the equivalence margin {eq}; {why}"
    s_lo, s_hi = sorted((sign * lo, sign * hi))  # the CI in the claimed direction: positive is the paper's
    side = s_lo > 0
    if s_hi < 0:
        return 'does not reproduce', f"{ci}: the other sign beyond noise"
    if paper is None:
        if side:
            return 'reproduces', f"{ci}: excludes 0 on the claimed side"
        word, why = undecided(effect, lo, hi, abs(effect), n, unit, spec)
        return word, f"{ci}: holds 0; {why}"
    holds_paper = lo <= paper <= hi
    at = f"the claimed size {paper:{spec}}"
    if side and holds_paper:
        return 'reproduces', f"{ci}: excludes 0 on the paper's side and holds {at}"
    if side:
        return 'direction only', f"{ci}: excludes 0 on the paper's side but excludes {at}"
    if not holds_paper:
        return 'does not reproduce', f"{ci}: holds 0 and excludes {at}"
    word, why = undecided(effect, lo, hi, max(abs(effect), abs(effect - paper)), n, unit, spec)
    return word, f"{ci}: holds 0 and {at}; {why}"


def shares_ci(k1, n1, k2, n2):
    """(k1/n1 - k2/n2, lo, hi): the 95 % CI of a difference of two shares (runs stuck, say) by Newcombe's
    hybrid score method (Wilson's interval for each share), which stays inside [-1, 1] at 0 of n."""
    def wilson(k, n):
        p, z2 = k / n, Z975 ** 2
        mid, half = (p + z2 / (2 * n)) / (1 + z2 / n), Z975 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
        return p, mid - half / (1 + z2 / n), mid + half / (1 + z2 / n)
    (p1, l1, u1), (p2, l2, u2) = wilson(k1, n1), wilson(k2, n2)
    d = p1 - p2
    return d, d - math.hypot(p1 - l1, u2 - p2), d + math.hypot(u1 - p1, p2 - l2)


def weakest(words):
    """The verdict on a claim that must hold in every one of several cells: its weakest cell's."""
    for word in ('does not reproduce', 'inconclusive', 'direction only', 'reproduces'):
        if word in words:
            return word
    return 'not tested'


if __name__ == '__main__':  # a module the lab's commands import
    print("lab/verdict.py: the reports' verdict rule, not a command; see python lab/ablate.py --help")
