"""Seed statistics, backed by scipy and statsmodels: summaries, differences, equivalence, Holm, power.

A group of runs that differ only by seed reduces to a :class:`Summary` (mean, sample std,
n, standard error). Two groups compare as a :class:`Difference` ``a - b`` with its 95%
confidence interval, its two-sided p and its minimum detectable effect (the smallest ``|a -
b|`` that ``n`` such runs detect with power 0.8 at the same alpha, from the observed noise):

* :func:`paired_difference`: runs paired by seed (same data order, same parent), the t-test of
  the per-seed differences (``scipy.stats.ttest_rel``; power: ``statsmodels TTestPower``);
* :func:`welch_difference`: two independent groups, Welch's unequal-variance t-test
  (``scipy.stats.ttest_ind(equal_var=False)``; power: ``statsmodels TTestIndPower``);
* :func:`equivalence`: TOST, two one-sided tests that ``a - b`` lies inside ``(low, upp)``
  (``statsmodels ttost_paired`` / ``ttost_ind``), and the one-sided p that it lies beyond the margin;
* :func:`holm`: Holm's step-down adjustment of a family of p-values (``statsmodels multipletests``).

Without a noise estimate (fewer than two values, or every difference equal so the standard
error is 0) nothing is tested: ``p`` is NaN and ``note`` says why; a difference is never called
significant because its runs happen not to vary.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

ALPHA = 0.05
"""Significance level of every test (two-sided)."""
POWER = 0.8
"""Power at which the minimum detectable effect is stated."""
NO_NOISE = "no noise estimate"


@dataclass(frozen=True)
class Summary:
    """One group of runs (e.g. one arm over its seeds)."""

    mean: float
    """Mean of the finite values; nan when there are none."""
    std: float
    """Sample standard deviation (ddof=1); 0.0 for a single value, nan for none."""
    n: int
    """Number of finite values used."""
    sem: float
    """Standard error of the mean, std / sqrt(n); nan for n == 0."""
    n_nan: int = 0
    """Values dropped because they were NaN (e.g. a diverged run)."""


@dataclass(frozen=True)
class Difference:
    """``a - b`` as one test sees it; every field is stated so that a report can print it."""

    test: str
    """paired t-test | Welch's t-test | one-sample t-test (``b`` a constant)."""
    estimate: float
    """mean(a) - mean(b) (paired: the mean per-seed difference)."""
    ci_low: float
    """Lower end of the 95% confidence interval of the estimate (nan without a noise estimate)."""
    ci_high: float
    """Upper end of the 95% confidence interval."""
    p: float
    """Two-sided p of ``a - b = 0``; nan without a noise estimate."""
    n_a: int
    """Values of ``a`` used (pairs, when paired)."""
    n_b: int
    """Values of ``b`` used (= n_a when paired)."""
    sd: float
    """The noise: sd of the per-seed differences (paired), pooled sd of the groups (Welch)."""
    mde: float
    """Smallest ``|a - b|`` detected with power :data:`POWER` at this n and noise; nan without noise."""
    note: str = ""
    """Why nothing was tested (``no noise estimate: ...``); empty when tested."""

    @property
    def testable(self) -> bool:
        return not math.isnan(self.p)

    @property
    def paired(self) -> bool:
        return self.test != WELCH


PAIRED, WELCH, ONE_SAMPLE = "paired t-test", "Welch's t-test", "one-sample t-test"


def summarize(values: Sequence[float]) -> Summary:
    """Mean, sample std, n and sem of ``values``; NaNs are dropped and counted in ``n_nan``."""
    finite = _finite(values)
    n, n_nan = len(finite), len(values) - len(finite)
    if n == 0:
        return Summary(mean=math.nan, std=math.nan, n=0, sem=math.nan, n_nan=n_nan)
    mean = math.fsum(finite) / n
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in finite) / (n - 1)) if n > 1 else 0.0
    return Summary(mean=mean, std=std, n=n, sem=std / math.sqrt(n), n_nan=n_nan)


def _finite(values: Sequence[float]) -> list[float]:
    return [float(v) for v in values if v is not None and not math.isnan(float(v))]


def _untested(test: str, estimate: float, n_a: int, n_b: int, why: str) -> Difference:
    nan = math.nan
    return Difference(test, estimate, nan, nan, nan, n_a, n_b, nan, nan, f"{NO_NOISE}: {why}")


def paired_difference(
    a: Sequence[float], b: Sequence[float] | float, alpha: float = ALPHA, power: float = POWER
) -> Difference:
    """The t-test of the per-seed differences ``a[i] - b[i]`` (``b`` a number: of ``a`` against it).

    Pairs with a NaN on either side are dropped. The seed's own variation cancels in each
    difference, so an effect smaller than the spread between seeds can still stand out.
    """
    from scipy import stats as scipy_stats

    constant = not isinstance(b, Sequence)
    others = [float(b)] * len(a) if constant else list(b)  # type: ignore[arg-type]
    if len(others) != len(a):
        raise ValueError(f"paired_difference: needs equal-length groups, got {len(a)} and {len(others)}")
    pairs = [(float(x), float(y)) for x, y in zip(a, others, strict=True) if not (_nan(x) or _nan(y))]
    test = ONE_SAMPLE if constant else PAIRED
    diffs = [x - y for x, y in pairs]
    n, mean = len(diffs), (math.fsum(diffs) / len(diffs) if diffs else math.nan)
    if n < 2:
        return _untested(test, mean, n, n, f"{n} {'seed' if n == 1 else 'seeds'}")
    sd = summarize(diffs).std
    if _no_spread(sd, [v for pair in pairs for v in pair]):
        return _untested(test, mean, n, n, f"the {n} differences are all equal (zero spread)")
    result = scipy_stats.ttest_rel([x for x, _ in pairs], [y for _, y in pairs])
    ci = result.confidence_interval(1 - alpha)
    return Difference(
        test, mean, float(ci.low), float(ci.high), float(result.pvalue), n, n, sd, _mde_paired(sd, n, alpha, power)
    )


def welch_difference(a: Sequence[float], b: Sequence[float], alpha: float = ALPHA, power: float = POWER) -> Difference:
    """Welch's two-sided t-test of mean(a) - mean(b), two independent groups (NaNs dropped)."""
    from scipy import stats as scipy_stats

    xs, ys = _finite(a), _finite(b)
    estimate = summarize(xs).mean - summarize(ys).mean
    if len(xs) < 2 or len(ys) < 2:
        return _untested(WELCH, estimate, len(xs), len(ys), f"n={len(xs)} vs n={len(ys)}")
    sa, sb = summarize(xs).std, summarize(ys).std
    if _no_spread(sa, xs) and _no_spread(sb, ys):
        return _untested(WELCH, estimate, len(xs), len(ys), "both groups have zero spread")
    result = scipy_stats.ttest_ind(xs, ys, equal_var=False)
    ci = result.confidence_interval(1 - alpha)
    pooled = math.sqrt(((len(xs) - 1) * sa**2 + (len(ys) - 1) * sb**2) / (len(xs) + len(ys) - 2))
    mde = _mde_welch(pooled, len(xs), len(ys), alpha, power)
    return Difference(
        WELCH, estimate, float(ci.low), float(ci.high), float(result.pvalue), len(xs), len(ys), pooled, mde
    )


def _no_spread(sd: float, values: Sequence[float]) -> bool:
    """Zero spread up to the rounding of the values (equal differences computed in floating point)."""
    # NOTE: 4.0 - 0.02 - 4.0 and 5.0 - 0.02 - 5.0 differ in the last bits: that is no noise estimate.
    return sd <= 1e-12 * max(abs(v) for v in values)


def _nan(value: float | None) -> bool:
    return value is None or math.isnan(float(value))


def _mde_paired(sd: float, n: int, alpha: float, power: float) -> float:
    from statsmodels.stats.power import TTestPower

    return sd * float(TTestPower().solve_power(nobs=n, alpha=alpha, power=power, alternative="two-sided"))


def seeds_needed(sd: float, effect: float, alpha: float = ALPHA, power: float = POWER) -> int:
    """Pairs a paired t-test needs to detect ``effect`` at noise ``sd`` (sd of the differences) with ``power``."""
    from statsmodels.stats.power import TTestPower

    nobs = TTestPower().solve_power(effect_size=abs(effect) / sd, alpha=alpha, power=power, alternative="two-sided")
    return math.ceil(float(nobs))


def _mde_welch(pooled_sd: float, n_a: int, n_b: int, alpha: float, power: float) -> float:
    from statsmodels.stats.power import TTestIndPower

    effect = TTestIndPower().solve_power(nobs1=n_a, ratio=n_b / n_a, alpha=alpha, power=power)
    return pooled_sd * float(effect)


@dataclass(frozen=True)
class Equivalence:
    """TOST of ``low < a - b < upp`` and the one-sided test that ``a - b`` lies beyond the margin."""

    p: float
    """TOST p (the larger of the two one-sided p's): small = equivalence shown."""
    p_beyond: float
    """One-sided p of ``a - b`` beyond the margin on the estimate's side: small = outside shown."""
    low: float
    """Lower equivalence bound."""
    upp: float
    """Upper equivalence bound."""


def equivalence(a: Sequence[float], b: Sequence[float] | float, low: float, upp: float, paired: bool) -> Equivalence:
    """TOST of ``low < a - b < upp`` by statsmodels (``ttost_paired``, or ``ttost_ind`` with
    unequal variances); ``b`` a number: the paired form against it. Needs a noise estimate (the
    :class:`Difference` of the same values is testable)."""
    import numpy as np
    from statsmodels.stats.weightstats import ttost_ind, ttost_paired

    if not low < upp:
        raise ValueError(f"equivalence: needs low < upp, got {low} and {upp}")
    if paired:
        others = [float(b)] * len(a) if not isinstance(b, Sequence) else list(b)
        pairs = [(float(x), float(y)) for x, y in zip(a, others, strict=True) if not (_nan(x) or _nan(y))]
        x1, x2 = np.array([x for x, _ in pairs]), np.array([y for _, y in pairs])
        p, (_, p_above_low, _), (_, p_below_upp, _) = ttost_paired(x1, x2, low, upp)
    else:
        assert isinstance(b, Sequence)
        x1, x2 = np.array(_finite(a)), np.array(_finite(b))
        p, (_, p_above_low, _), (_, p_below_upp, _) = ttost_ind(x1, x2, low, upp, usevar="unequal")
    # NOTE: each of TOST's tests has a complement: "a - b > upp" has p 1 - p(a - b < upp) for the
    # continuous t; the estimate's side is the one with the smaller complement.
    beyond = min(1.0 - float(p_above_low), 1.0 - float(p_below_upp))
    return Equivalence(float(p), beyond, float(low), float(upp))


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm-adjusted p-values (``statsmodels multipletests(method="holm")``), NaNs kept in place."""
    from statsmodels.stats.multitest import multipletests

    tested = [i for i, p in enumerate(p_values) if not _nan(p)]
    adjusted = [math.nan] * len(p_values)
    if tested:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            values = multipletests([p_values[i] for i in tested], method="holm")[1]
        for i, value in zip(tested, values, strict=True):
            adjusted[i] = float(value)
    return adjusted


def format_summary(s: Summary, digits: int = 4) -> str:
    """``5.6810 ± 0.0123 (n=3)``; ``5.6810 (n=1)``; NaNs dropped are named: ``(n=2, 1 NaN)``."""
    count = f"n={s.n}" + (f", {s.n_nan} NaN" if s.n_nan else "")
    if s.n < 2:
        return f"{s.mean:.{digits}f} ({count})"
    return f"{s.mean:.{digits}f} ± {s.std:.{digits}f} ({count})"


def format_values(values: Sequence[float], digits: int = 4) -> str:
    """:func:`format_summary` of the values; empty for none (a table cell of an arm not measured)."""
    return format_summary(summarize(values), digits) if len(values) else ""


def format_estimate(d: Difference, digits: int = 4) -> str:
    """``-0.0170 [-0.0401, +0.0061]``: the estimate and its 95% CI; ``-0.0361 (no CI)`` untested."""
    if not d.testable:
        return f"{d.estimate:+.{digits}f} (no CI)"
    return f"{d.estimate:+.{digits}f} [{d.ci_low:+.{digits}f}, {d.ci_high:+.{digits}f}]"


def format_p(p: float) -> str:
    """Three significant digits (``0.0869``, ``0.0495``, ``< 1e-6``); ``n/a`` for NaN."""
    if _nan(p):
        return "n/a"
    return "< 1e-6" if p < 1e-6 else f"{p:.3g}"


def format_difference(d: Difference, digits: int = 4) -> str:
    """One table cell: ``+0.0019 [-0.0110, +0.0148] (paired t-test, p=0.6)`` or why it is untested."""
    if not d.testable:
        return f"{format_estimate(d, digits)} ({d.note})"
    return f"{format_estimate(d, digits)} ({d.test}, p={format_p(d.p)})"


__all__ = [
    "ALPHA",
    "Difference",
    "Equivalence",
    "NO_NOISE",
    "ONE_SAMPLE",
    "PAIRED",
    "POWER",
    "Summary",
    "WELCH",
    "equivalence",
    "format_difference",
    "format_estimate",
    "format_p",
    "format_summary",
    "format_values",
    "holm",
    "paired_difference",
    "seeds_needed",
    "summarize",
    "welch_difference",
]
