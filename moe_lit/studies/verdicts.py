"""What a study can tell: each kind declares its claims, this module tests them and names the verdict.

A :class:`Claim` is the seed's claim in one line, the metric it is judged on (a point measure),
the two arms compared (the estimate is ``a - b``), the direction the seed claims and, for a
claim of no effect, the equivalence margin stated in the study file before it ran::

    claim = Claim("MoE interferes less", "interference", ("moe", "dense"), LOWER)
    evidence = claim.on({0: 0.11, 1: 0.09, 2: 0.12}, {0: 0.15, 1: 0.14, 2: 0.16})   # seed -> value

``on`` (``on_records``: the arms named by a field of the study's records) pairs the arms by seed
where they share seeds (the paired t-test) and uses Welch's test only where they share none; ``b``
may be a number (the one-sample test against it). A claim the study cannot test says why
(``untestable``, or :meth:`Claim.missing`). :func:`judge` adjusts the p-values of a study's
tested claims by Holm and gives each one verdict:

* **reproduced**: the claimed effect, significant after Holm; for a claim of no effect,
  equivalence shown (TOST within the margin);
* **contradicted**: significant the other way; or, for a claim of no effect, the effect shown
  beyond the margin; or, where the seed claims an effect and the study states a margin,
  equivalence shown;
* **not detected**: neither; the minimum detectable effect at the study's n (power 0.8, from the
  observed noise) and the paper's effect on the same scale stand beside it;
* **untestable here**: with the reason (no noise estimate, no margin stated, a saving this machine
  cannot measure).

Each claim enters Holm with one p: that of its deciding test (the difference; or for a claim with
a margin, the smaller of the difference's or the equivalence's p, and for a claim of no effect the
smaller of TOST's and the beyond-margin p).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from moe_lit.config import ConfigError
from moe_lit.stats import (
    ALPHA,
    ONE_SAMPLE,
    PAIRED,
    POWER,
    WELCH,
    Difference,
    Equivalence,
    equivalence,
    format_estimate,
    format_p,
    holm,
    paired_difference,
    welch_difference,
)
from moe_lit.studies.records import Value, by_seed

REPRODUCED, CONTRADICTED, NOT_DETECTED, UNTESTABLE = "reproduced", "contradicted", "not detected", "untestable here"
VERDICTS = (REPRODUCED, CONTRADICTED, NOT_DETECTED, UNTESTABLE)
LOWER, HIGHER, EQUIVALENT = "lower", "higher", "equivalent"
DIRECTIONS = (LOWER, HIGHER, EQUIVALENT)
"""The seed claims ``a - b < 0``, ``a - b > 0``, or ``a - b`` within the margin (no effect)."""
BY_SEED, INDEPENDENT = "seed", "independent"
PAIRINGS = (BY_SEED, INDEPENDENT)
NO_MARGIN = "no equivalence margin was stated in the study file before it ran"
TEST_SOURCES = {
    PAIRED: "paired t-test (scipy.stats.ttest_rel)",
    ONE_SAMPLE: "one-sample t-test (scipy.stats.ttest_rel against a constant)",
    WELCH: "Welch's t-test (scipy.stats.ttest_ind, unequal variances)",
    "TOST": "TOST equivalence (statsmodels ttost_paired / ttost_ind)",
}
SeedValues = Mapping[int, float]


@dataclass(frozen=True)
class Claim:
    """One claim of the seed, declared by a kind before anything is measured."""

    text: str
    """The claim in one line (the paper's, with its setting: ``E8k4: DOT-MoE beats clustering``)."""
    metric: str
    """The point measure it is judged on (``val loss``, ``retention``); the estimate is a - b of it."""
    arms: tuple[str, str]
    """(a, b): the arms compared."""
    direction: str
    """lower | higher (the seed claims a - b < 0 | > 0) | equivalent (no effect: within the margin)."""
    margin: float | tuple[float, float] | None = None
    """Equivalence margin on the metric's scale, stated in the study file: ``m`` (= (-m, m)) or
    (low, upp). Needed by a claim of no effect; for a claim of an effect, equivalence shown within
    it contradicts the claim. None: not stated."""
    pairing: str = BY_SEED
    """seed: paired by seed where the arms share seeds, Welch where they share none | independent: Welch."""
    paper: float | None = None
    """The paper's effect on the same scale (a - b), shown beside a claim not detected; None: none given."""
    untestable: str | None = None
    """Why this study cannot test the claim at all (then no values are needed)."""
    digits: int = 4
    """Decimals of the estimate, its CI and the MDE in the report."""

    def __post_init__(self) -> None:
        if self.direction not in DIRECTIONS:
            raise ConfigError(f"claim.direction: got {self.direction!r}, allowed values: {', '.join(DIRECTIONS)}")
        if self.pairing not in PAIRINGS:
            raise ConfigError(f"claim.pairing: got {self.pairing!r}, allowed values: {', '.join(PAIRINGS)}")
        if self.margin is not None and not self.bounds[0] < self.bounds[1]:
            raise ConfigError(f"claim.margin: must be > 0 or (low, upp) with low < upp, got {self.margin!r}")

    @property
    def bounds(self) -> tuple[float, float]:
        """(low, upp) of the margin."""
        if self.margin is None:
            return (math.nan, math.nan)
        if isinstance(self.margin, (int, float)):
            return (-float(self.margin), float(self.margin))
        low, upp = self.margin
        return (float(low), float(upp))

    def on(self, a: SeedValues, b: SeedValues | float) -> Evidence:
        """The claim tested on ``a`` and ``b`` (seed -> value; ``b`` may be a constant)."""
        if self.untestable:
            return self.missing(self.untestable)
        if self.direction == EQUIVALENT and self.margin is None:
            return Evidence(self, _difference(self, a, b), reason=NO_MARGIN)
        difference = _difference(self, a, b)
        if not difference.testable:
            return Evidence(self, difference, reason=difference.note)
        if self.margin is None:
            return Evidence(self, difference, decides="difference", p=difference.p)
        xs, ys = _paired_values(self, a, b, difference.paired)
        test = equivalence(xs, ys, *self.bounds, paired=difference.paired)
        if self.direction == EQUIVALENT:
            decides, p = ("equivalence", test.p) if test.p <= test.p_beyond else ("beyond margin", test.p_beyond)
        else:
            decides, p = ("equivalence", test.p) if test.p < difference.p else ("difference", difference.p)
        return Evidence(self, difference, test, decides, p)

    def on_records(self, records: Sequence[dict[str, Any]], value: Value, by: str = "config_name") -> Evidence:
        """The claim tested on the ok records whose field ``by`` names its arms: ``value`` per seed."""
        a, b = (by_seed(records, value, **{by: arm}) for arm in self.arms)
        return self.on(a, b)

    def missing(self, reason: str) -> Evidence:
        """The claim without values: untestable here for ``reason`` (e.g. an arm did not finish)."""
        return Evidence(self, None, reason=reason)


def _difference(claim: Claim, a: SeedValues, b: SeedValues | float) -> Difference:
    """The pairing of the claim: by seed on the shared seeds (or against a constant), else Welch."""
    paired = not isinstance(b, Mapping) or (claim.pairing == BY_SEED and bool(set(a) & set(b)))
    xs, ys = _paired_values(claim, a, b, paired)
    return paired_difference(xs, ys) if paired else welch_difference(xs, ys)


def _paired_values(claim: Claim, a: SeedValues, b: SeedValues | float, paired: bool) -> tuple[list[float], Any]:
    if not isinstance(b, Mapping):
        return [a[s] for s in sorted(a)], float(b)
    if paired:
        seeds = sorted(set(a) & set(b))
        return [a[s] for s in seeds], [b[s] for s in seeds]
    return [a[s] for s in sorted(a)], [b[s] for s in sorted(b)]


@dataclass(frozen=True)
class Evidence:
    """A claim with its test(s), before the study's claims are adjusted together."""

    claim: Claim
    """The declaration."""
    difference: Difference | None
    """a - b with its CI, test, p and MDE; None when there were no values."""
    equivalence: Equivalence | None = None
    """TOST within the claim's margin (when it has one and the difference is testable)."""
    decides: str = ""
    """Which test's p enters Holm: difference | equivalence | beyond margin; empty when untestable."""
    p: float = math.nan
    """That test's p (nan when untestable)."""
    reason: str = ""
    """Why it is untestable here (empty when tested)."""


@dataclass(frozen=True)
class Verdict:
    """A claim judged within its study: Holm-adjusted p and one of :data:`VERDICTS`."""

    evidence: Evidence
    """The claim and its tests."""
    p_holm: float
    """The deciding p adjusted by Holm over the study's tested claims (nan when untestable)."""
    word: str
    """reproduced | contradicted | not detected | untestable here."""
    fields: dict[str, Any] = field(default_factory=dict)
    """The row of the report (and report.json)."""


def _word(evidence: Evidence, p_holm: float, alpha: float) -> str:
    if math.isnan(p_holm):
        return UNTESTABLE
    if p_holm >= alpha:
        return NOT_DETECTED
    claim, decides = evidence.claim, evidence.decides
    if decides == "equivalence":
        return REPRODUCED if claim.direction == EQUIVALENT else CONTRADICTED
    if decides == "beyond margin":
        return CONTRADICTED
    estimate = evidence.difference.estimate  # type: ignore[union-attr]
    claimed = estimate < 0 if claim.direction == LOWER else estimate > 0
    return REPRODUCED if claimed else CONTRADICTED


def judge(evidence: Sequence[Evidence], alpha: float = ALPHA) -> list[Verdict]:
    """Every claim of one study, Holm-adjusted together, each with its verdict and report row."""
    adjusted = holm([e.p for e in evidence])
    verdicts = []
    for item, p_holm in zip(evidence, adjusted, strict=True):
        word = _word(item, p_holm, alpha)
        verdicts.append(Verdict(item, p_holm, word, _report_row(item, p_holm, word)))
    return verdicts


def _test_label(evidence: Evidence) -> str:
    d = evidence.difference
    if d is None:
        return ""
    n = f"n={d.n_a}" if d.paired else f"n={d.n_a} vs {d.n_b}"
    label = f"{d.test}, {n}"
    if evidence.claim.margin is not None and evidence.equivalence is not None:
        low, upp = evidence.claim.bounds
        label += f"; TOST ({low:+g}, {upp:+g})"
    return label


def _p_label(evidence: Evidence) -> str:
    if evidence.decides in ("", "difference"):
        return format_p(evidence.p)
    return f"{format_p(evidence.p)} ({'TOST' if evidence.decides == 'equivalence' else 'beyond margin'})"


def _report_row(evidence: Evidence, p_holm: float, word: str) -> dict[str, Any]:
    claim, d = evidence.claim, evidence.difference
    digits = claim.digits
    a, b = claim.arms
    verdict = f"**{word}**" + (f": {evidence.reason}" if word == UNTESTABLE and evidence.reason else "")
    return {
        "claim": claim.text,
        "a - b": f"{claim.metric}: {a} - {b}",
        "estimate [95% CI]": format_estimate(d, digits) if d is not None else "n/a",
        "test": _test_label(evidence),
        "p": _p_label(evidence),
        "Holm p": format_p(p_holm),
        f"MDE (power {POWER:g})": "n/a" if d is None or math.isnan(d.mde) else f"{d.mde:.{digits}f}",
        "paper": "" if claim.paper is None else f"{claim.paper:+.{digits}f}",
        "verdict": verdict,
    }


def used_tests(verdicts: Sequence[Verdict]) -> str:
    """The sentence of the report's header naming the tests its claims used."""
    tested = [v.evidence for v in verdicts if not math.isnan(v.p_holm)]
    names = [e.difference.test for e in tested if e.difference is not None]
    names += ["TOST"] * any(e.equivalence is not None for e in tested)
    if not tested:
        return f"{len(verdicts)} claims, none testable here (reasons in the claims table)." if verdicts else ""
    used = ", ".join(TEST_SOURCES[name] for name in dict.fromkeys(names))
    return (
        f"Tests: {used}. Each claim has its 95% CI and its p adjusted by Holm over the study's {len(tested)} "
        f"tested claims (statsmodels multipletests), alpha {ALPHA:g}; MDE: the smallest |a - b| detected with "
        f"power {POWER:g} at the claim's n and observed noise (statsmodels TTestPower / TTestIndPower)."
    )


def report_json(verdicts: Sequence[Verdict]) -> list[dict[str, Any]]:
    """The claims as data for ``report.json``."""
    out = []
    for v in verdicts:
        d, e, claim = v.evidence.difference, v.evidence.equivalence, v.evidence.claim
        out.append(
            {
                "claim": claim.text,
                "metric": claim.metric,
                "arms": list(claim.arms),
                "direction": claim.direction,
                "margin": list(claim.bounds) if claim.margin is not None else None,
                "paper": claim.paper,
                "test": d.test if d else None,
                "n": [d.n_a, d.n_b] if d else None,
                "estimate": _number(d.estimate) if d else None,
                "ci": [_number(d.ci_low), _number(d.ci_high)] if d else None,
                "p_difference": _number(d.p) if d else None,
                "p_tost": _number(e.p) if e else None,
                "decides": v.evidence.decides or None,
                "p_holm": _number(v.p_holm),
                "mde": _number(d.mde) if d else None,
                "verdict": v.word,
                "reason": v.evidence.reason or None,
            }
        )
    return out


def _number(value: float) -> float | None:
    return None if math.isnan(value) else float(value)


__all__ = [
    "BY_SEED",
    "CONTRADICTED",
    "Claim",
    "DIRECTIONS",
    "EQUIVALENT",
    "Evidence",
    "HIGHER",
    "INDEPENDENT",
    "LOWER",
    "NOT_DETECTED",
    "REPRODUCED",
    "UNTESTABLE",
    "VERDICTS",
    "Verdict",
    "judge",
    "report_json",
    "used_tests",
]
