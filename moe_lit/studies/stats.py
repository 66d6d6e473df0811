"""Seed statistics: mean ± std over seeds, and whether a difference stands out of the seed noise.

A finding of a study ("MoE beats dense by 0.04") compares two groups of runs that differ only by
seed. :func:`summarize` reduces one group to mean, sample std (ddof=1), n and standard error;
:func:`compare` runs Welch's unequal-variance t-test on two groups (:func:`compare_paired` the
paired t-test, when the groups' runs pair up by seed: same data order, same initialisation or the
same parent) and names the outcome
``significant`` (p < alpha), ``within noise``, or ``not testable (n < 2)`` when a group has fewer than
two finite values (its spread is unknown). :func:`group_values` pulls the groups out of study records.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from scipy import stats as scipy_stats

from moe_lit.errors import MoeLitError

SIGNIFICANT, WITHIN_NOISE, NOT_TESTABLE = "significant", "within noise", "not testable (n < 2)"
# NOTE: the runner's STATUS_OK; spelled here so that this module imports nothing of the runner.
STATUS_OK = "ok"


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
class Comparison:
    """Welch's t-test of ``a`` against ``b``; every field is stated so a report can print it."""

    a: Summary
    """The first group."""
    b: Summary
    """The second group."""
    diff: float
    """a.mean - b.mean."""
    se: float
    """Standard error of the difference, sqrt(a.std²/a.n + b.std²/b.n)."""
    t: float
    """diff / se; ±inf when se == 0 and diff != 0; nan when not testable."""
    dof: float
    """Welch–Satterthwaite degrees of freedom; nan when se == 0 or not testable."""
    p_value: float
    """Two-sided p-value; 0.0 when both groups have zero spread and different means, 1.0 when equal."""
    alpha: float
    """Significance level the verdict uses."""
    significant: bool
    """p_value < alpha (False when not testable)."""
    verdict: str
    """``significant`` | ``within noise`` | ``not testable (n < 2)``."""
    test: str = "Welch"
    """Welch (two independent groups) | paired (runs paired by seed)."""


def summarize(values: Sequence[float]) -> Summary:
    """Mean, sample std, n and sem of ``values``; NaNs are dropped and counted in ``n_nan``."""
    finite = [float(v) for v in values if not math.isnan(float(v))]
    n, n_nan = len(finite), len(values) - len(finite)
    if n == 0:
        return Summary(mean=math.nan, std=math.nan, n=0, sem=math.nan, n_nan=n_nan)
    mean = math.fsum(finite) / n
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in finite) / (n - 1)) if n > 1 else 0.0
    return Summary(mean=mean, std=std, n=n, sem=std / math.sqrt(n), n_nan=n_nan)


def compare(a_values: Sequence[float], b_values: Sequence[float], alpha: float = 0.05) -> Comparison:
    """Welch's two-sided t-test of mean(a) - mean(b) against the seed noise of both groups."""
    if not 0.0 < alpha < 1.0:
        raise MoeLitError(f"alpha: must be in (0, 1), got {alpha!r}")
    a, b = summarize(a_values), summarize(b_values)
    diff = a.mean - b.mean
    if a.n < 2 or b.n < 2:
        return Comparison(a, b, diff, math.nan, math.nan, math.nan, math.nan, alpha, False, NOT_TESTABLE)
    var_a, var_b = a.std**2 / a.n, b.std**2 / b.n
    se = math.sqrt(var_a + var_b)
    if se == 0.0:
        # NOTE: no seed spread at all (e.g. fully deterministic runs): any difference is exact.
        t, dof, p_value = (math.copysign(math.inf, diff) if diff else 0.0), math.nan, (0.0 if diff else 1.0)
    else:
        t = diff / se
        dof = (var_a + var_b) ** 2 / (var_a**2 / (a.n - 1) + var_b**2 / (b.n - 1))
        p_value = float(2.0 * scipy_stats.t.sf(abs(t), dof))
    significant = p_value < alpha
    return Comparison(a, b, diff, se, t, dof, p_value, alpha, significant, SIGNIFICANT if significant else WITHIN_NOISE)


def compare_paired(a_values: Sequence[float], b_values: Sequence[float], alpha: float = 0.05) -> Comparison:
    """Paired two-sided t-test of mean(a - b), ``a[i]`` and ``b[i]`` being runs of the same seed.

    The seed's own variation (its data order, its initialisation) cancels in each difference, so
    an effect smaller than the spread between seeds can still stand out. ``se`` is the standard
    error of the mean difference and ``dof`` is n - 1; pairs with a NaN on either side are dropped.
    """
    if len(a_values) != len(b_values):
        raise MoeLitError(f"compare_paired: needs equal-length groups, got {len(a_values)} and {len(b_values)}")
    pairs = [
        (float(x), float(y)) for x, y in zip(a_values, b_values, strict=False) if not (math.isnan(x) or math.isnan(y))
    ]
    a, b = summarize([x for x, _ in pairs]), summarize([y for _, y in pairs])
    diffs = summarize([x - y for x, y in pairs])
    if diffs.n < 2:
        return Comparison(
            a, b, diffs.mean, math.nan, math.nan, math.nan, math.nan, alpha, False, NOT_TESTABLE, "paired"
        )
    if diffs.sem == 0.0:
        t, p_value = (math.copysign(math.inf, diffs.mean) if diffs.mean else 0.0), (0.0 if diffs.mean else 1.0)
    else:
        t = diffs.mean / diffs.sem
        p_value = float(2.0 * scipy_stats.t.sf(abs(t), diffs.n - 1))
    significant = p_value < alpha
    verdict = SIGNIFICANT if significant else WITHIN_NOISE
    return Comparison(
        a, b, diffs.mean, diffs.sem, t, float(diffs.n - 1), p_value, alpha, significant, verdict, "paired"
    )


def format_summary(s: Summary, digits: int = 4) -> str:
    """``5.6810 ± 0.0123 (n=3)``; ``5.6810 (n=1)``; NaNs dropped are named: ``(n=2, 1 NaN)``."""
    count = f"n={s.n}" + (f", {s.n_nan} NaN" if s.n_nan else "")
    if s.n < 2:
        return f"{s.mean:.{digits}f} ({count})"
    return f"{s.mean:.{digits}f} ± {s.std:.{digits}f} ({count})"


def format_comparison(c: Comparison, digits: int = 4) -> str:
    """``diff -0.0180 ± 0.0070 (Welch t=-2.57, p=0.061): within noise`` (± is the se of the diff)."""
    diff = f"diff {c.diff:.{digits}f}"
    if c.verdict == NOT_TESTABLE:
        return f"{diff} (n={c.a.n} vs n={c.b.n}): {c.verdict}"
    if c.se == 0.0:
        return f"{diff} ± 0 (no seed spread, p={c.p_value:g}): {c.verdict}"
    return f"{diff} ± {c.se:.{digits}f} ({c.test} t={c.t:.2f}, p={c.p_value:.2g}): {c.verdict}"


def group_values(
    records: Iterable[Mapping], key: Callable[[Mapping], Hashable], value: str
) -> dict[Hashable, list[float]]:
    """``{key(record): [record[value], ...]}`` over records with status ok, in first-seen key order.

    A ``None`` value becomes NaN (so :func:`summarize` counts it); an ok record without the field
    is refused, since it means the field name is wrong.
    """
    groups: dict[Hashable, list[float]] = {}
    for record in records:
        if record.get("status") != STATUS_OK:
            continue
        if value not in record:
            raise MoeLitError(f"{value!r}: not a field of the study records (has: {', '.join(sorted(record))})")
        raw = record[value]
        groups.setdefault(key(record), []).append(math.nan if raw is None else float(raw))
    return groups


__all__ = [
    "Comparison",
    "NOT_TESTABLE",
    "compare_paired",
    "SIGNIFICANT",
    "Summary",
    "WITHIN_NOISE",
    "compare",
    "format_comparison",
    "format_summary",
    "group_values",
    "summarize",
]
