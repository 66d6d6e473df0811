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

Three rules keep a verdict inside what the study can test:

* **The object.** A claim states what the paper tested it on and what the study tests it on
  (:class:`Subject`: a trained MoE, a dense model converted to an MoE, ...; :func:`about`). Where the two
  differ the claim is untestable here with that reason; its measured contrast stays in the row and
  becomes a *finding* about this model (:func:`finding`), never a verdict on the paper.
* **Counted once.** Claims whose outcome vectors are identical (the same values of ``a`` and of ``b``)
  are one measurement: :func:`judge` merges them into one row before Holm and says why.
* **The interval of the verdict.** Beside the unadjusted 95% CI each row prints the Holm-consistent
  simultaneous interval (:func:`holm_levels`): the claim at Holm step ``j`` gets the confidence level
  ``1 - alpha / (m - j + 1)`` (steps after the first one not rejected keep that step's level), so the
  interval excludes 0 exactly where Holm rejects; a claim decided against its margin shows the
  ``1 - 2 alpha_j`` interval, inside (or beyond) the margin exactly where TOST (or its complement) rejects.
"""

from __future__ import annotations

import dataclasses
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
TRAINED_MOE, CONVERTED_MOE, DENSE, SCRATCH = (
    "a trained MoE",
    "a dense model converted to an MoE",
    "a trained dense model",
    "models trained from scratch",
)
SUBJECTS = (TRAINED_MOE, CONVERTED_MOE, DENSE, SCRATCH)
"""What a claim is about: an MoE trained as one (pretrained or from scratch), a dense model cut into
experts (its MoE a copy of its dense parent), a dense model, or a training recipe run from scratch."""


@dataclass(frozen=True)
class Subject:
    """The object a claim is tested on: its kind and, where the claim depends on them, scale and budget."""

    kind: str
    """One of :data:`SUBJECTS`; a claim is testable only where the paper's and the study's kinds agree."""
    detail: str = ""
    """Which model, its scale and training budget (``Qwen3-30B-A3B``, ``SmolLM2-135M, 98k distillation tokens``)."""

    def __post_init__(self) -> None:
        if self.kind not in SUBJECTS:
            raise ConfigError(f"subject.kind: got {self.kind!r}, allowed values: {', '.join(SUBJECTS)}")

    def __str__(self) -> str:
        return f"{self.kind} ({self.detail})" if self.detail else self.kind


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
    paper_object: Subject | None = None
    """What the paper tested the claim on (set by :func:`about`)."""
    study_object: Subject | None = None
    """What this study tests it on (set by :func:`about`)."""
    same_outcomes: str = ""
    """Why this claim's outcomes may equal another claim's (printed where :func:`judge` counts them once)."""

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
        difference = _difference(self, a, b)
        xs, ys = _paired_values(self, a, b, difference.paired)
        values = (tuple(xs), ys if isinstance(ys, float) else tuple(ys))
        if self.direction == EQUIVALENT and self.margin is None:
            return Evidence(self, difference, reason=NO_MARGIN, values=values)
        if not difference.testable:
            return Evidence(self, difference, reason=difference.note, values=values)
        if self.margin is None:
            return Evidence(self, difference, decides="difference", p=difference.p, values=values)
        test = equivalence(xs, ys, *self.bounds, paired=difference.paired)
        if self.direction == EQUIVALENT:
            decides, p = ("equivalence", test.p) if test.p <= test.p_beyond else ("beyond margin", test.p_beyond)
        else:
            decides, p = ("equivalence", test.p) if test.p < difference.p else ("difference", difference.p)
        return Evidence(self, difference, test, decides, p, values=values)

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
    values: tuple[tuple[float, ...], tuple[float, ...] | float] | None = None
    """The outcome vectors tested, (a, b) as paired or grouped (b: a constant); None without values."""
    merged: str = ""
    """The claims counted once with this one, and why (empty when none)."""
    also: Evidence | None = None
    """The same contrast by a second analysis that is not the verdict's (another unit, a rule added later),
    printed beside it as a labelled finding."""

    def untestable(self, reason: str) -> Evidence:
        """This evidence untestable here for ``reason`` (added to any reason it has); its measured
        difference is kept as a finding."""
        reason = f"{self.reason}; {reason}" if self.reason else reason
        return dataclasses.replace(self, equivalence=None, decides="", p=math.nan, reason=reason)


def about(evidence: Sequence[Evidence], paper: Subject, study: Subject) -> list[Evidence]:
    """Each claim with the object the paper tested it on and the one this study has; where their
    kinds differ, untestable here with that reason (the measured contrast stays, as a finding)."""
    out = []
    for item in evidence:
        item = dataclasses.replace(item, claim=dataclasses.replace(item.claim, paper_object=paper, study_object=study))
        if paper.kind != study.kind:
            item = item.untestable(f"the paper tested {paper.kind}; this study has {study.kind}")
        out.append(item)
    return out


ABOUT_THIS_MODEL = "Finding about this model, not a verdict on the paper"


def claim_findings(evidence: Evidence) -> list[str]:
    """The labelled findings of one claim: its measured contrast where it is untestable here, and its
    second analysis (:func:`second_analysis`), never a verdict."""
    return [line for line in (finding(evidence), second_analysis(evidence)) if line]


def second_analysis(evidence: Evidence) -> str:
    """The claim's second analysis (:attr:`Evidence.also`) as a labelled bullet; empty when it has none."""
    if (other := evidence.also) is None:
        return ""
    label = f"Second analysis, not the verdict ({other.claim.metric})"
    return finding(other.untestable(other.reason or "second analysis"), label) or f"- {label}: {other.reason}"


def finding(evidence: Evidence, label: str = ABOUT_THIS_MODEL) -> str:
    """The measured contrast of an untestable claim as a markdown bullet under ``label``; empty when there is none."""
    d, claim = evidence.difference, evidence.claim
    if evidence.decides or d is None or not d.testable:
        return ""
    a, b = claim.arms
    p = format_p(d.p)
    return (
        f"- {label}: {claim.text}: {claim.metric} {a} - {b} = {format_estimate(d, claim.digits)} "
        f"(95% CI, unadjusted; {d.test}, n={d.n_a}, p {p if p.startswith('<') else f'= {p}'})."
    )


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
    interval: Difference | None = None
    """The difference at its Holm-consistent simultaneous level (:func:`holm_levels`); None when untested."""


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


def counted_once(evidence: Sequence[Evidence]) -> list[Evidence]:
    """The claims with claims of identical outcome vectors (same metric, same values of a and b)
    merged into the first of them, which names the others and why (``Claim.same_outcomes``)."""
    first: dict[Any, int] = {}
    out: list[Evidence] = []
    twins: dict[int, list[Evidence]] = {}
    for item in evidence:
        key = None if item.values is None else (item.claim.metric, item.values)
        if key is not None and key in first:
            twins.setdefault(first[key], []).append(item)
            continue
        if key is not None:
            first[key] = len(out)
        out.append(item)
    for index, others in twins.items():
        item = out[index]
        why = next((c.claim.same_outcomes for c in (item, *others) if c.claim.same_outcomes), "")
        names = "; ".join(f"'{o.claim.text}'" for o in others)
        n = len(item.values[0]) if item.values else 0
        note = f"counted once with {names}: identical outcomes on all {n} units" + (f" ({why})" if why else "")
        out[index] = dataclasses.replace(item, merged=note)
    return out


def holm_levels(p_values: Sequence[float], alpha: float = ALPHA) -> list[float]:
    """Per p, the alpha of its Holm-consistent simultaneous interval (nan for a nan p): Holm step j of
    m (p ascending) tests at alpha / (m - j + 1); from the first step not rejected on, that step's."""
    order = sorted((i for i, p in enumerate(p_values) if not math.isnan(p)), key=lambda i: p_values[i])
    m, levels, stop = len(order), [math.nan] * len(p_values), None
    for step, i in enumerate(order, start=1):
        if stop is None and p_values[i] >= alpha / (m - step + 1):
            stop = step
        levels[i] = alpha / (m - (stop or step) + 1)
    return levels


def _interval(evidence: Evidence, level: float) -> Difference | None:
    """The claim's difference recomputed at confidence 1 - ``level`` from its outcome vectors."""
    if evidence.values is None or math.isnan(level) or evidence.difference is None:
        return None
    xs, ys = evidence.values
    if evidence.difference.paired:
        return paired_difference(list(xs), ys if isinstance(ys, float) else list(ys), alpha=level)
    return welch_difference(list(xs), list(ys), alpha=level)  # type: ignore[arg-type]


def judge(evidence: Sequence[Evidence], alpha: float = ALPHA) -> list[Verdict]:
    """Every claim of one study, counted once (:func:`counted_once`), Holm-adjusted together, each
    with its verdict, its simultaneous interval and its report row."""
    evidence = counted_once(evidence)
    p_values = [e.p for e in evidence]
    adjusted, levels = holm(p_values), holm_levels(p_values, alpha)
    verdicts = []
    for item, p_holm, level in zip(evidence, adjusted, levels, strict=True):
        # NOTE: a margin decides by TOST (or its complement): the 1 - 2 x level interval inside (or beyond)
        # the margin is that test at level, so the row shows that interval.
        level = level if item.decides in ("", "difference") else 2 * level
        word, interval = _word(item, p_holm, alpha), _interval(item, level)
        verdicts.append(Verdict(item, p_holm, word, _report_row(item, p_holm, word, interval, level), interval))
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


def _interval_cell(evidence: Evidence, interval: Difference | None, level: float) -> str:
    """The simultaneous interval the verdict used: against 0 (the difference decides) or the margin (TOST)."""
    if interval is None or not interval.testable:
        return "n/a"
    digits = evidence.claim.digits
    cell = f"[{interval.ci_low:+.{digits}f}, {interval.ci_high:+.{digits}f}] ({100 * (1 - level):.4g}%)"
    if evidence.decides in ("", "difference"):
        return f"{cell} used"
    low, upp = evidence.claim.bounds
    return f"{cell} used against the margin ({low:+g}, {upp:+g})"


def _report_row(
    evidence: Evidence, p_holm: float, word: str, interval: Difference | None = None, level: float = math.nan
) -> dict[str, Any]:
    claim, d = evidence.claim, evidence.difference
    digits = claim.digits
    a, b = claim.arms
    verdict = f"**{word}**" + (f": {evidence.reason}" if word == UNTESTABLE and evidence.reason else "")
    objects = (claim.paper_object, claim.study_object)
    return {
        "claim": claim.text + (f" ({evidence.merged})" if evidence.merged else ""),
        "object: paper / here": " / ".join(map(str, objects)) if None not in objects else "not declared",
        "a - b": f"{claim.metric}: {a} - {b}",
        "estimate [95% CI]": format_estimate(d, digits) if d is not None else "n/a",
        "Holm simultaneous CI": _interval_cell(evidence, interval, level),
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
        f"tested claims (statsmodels multipletests), alpha {ALPHA:g}, and the Holm-consistent simultaneous interval "
        f"(level 1 - alpha / (m - j + 1) at Holm step j; 'used': the verdict is that interval's, which excludes 0 "
        f"exactly where Holm rejects; against a margin 1 - 2 alpha_j, inside or beyond it exactly where TOST or its "
        f"complement rejects); MDE: the smallest |a - b| detected with "
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
                "paper_object": str(claim.paper_object) if claim.paper_object else None,
                "study_object": str(claim.study_object) if claim.study_object else None,
                "objects_match": _objects_match(claim),
                "merged": v.evidence.merged or None,
                "second_analysis": second_analysis(v.evidence)[2:] or None,
                "metric": claim.metric,
                "arms": list(claim.arms),
                "direction": claim.direction,
                "margin": list(claim.bounds) if claim.margin is not None else None,
                "paper": claim.paper,
                "test": d.test if d else None,
                "n": [d.n_a, d.n_b] if d else None,
                "estimate": _number(d.estimate) if d else None,
                "ci": [_number(d.ci_low), _number(d.ci_high)] if d else None,
                "ci_holm": [_number(v.interval.ci_low), _number(v.interval.ci_high)] if v.interval else None,
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


def _objects_match(claim: Claim) -> bool | None:
    """Whether the paper's and the study's objects are of one kind; None where either is not declared."""
    if claim.paper_object is None or claim.study_object is None:
        return None
    return claim.paper_object.kind == claim.study_object.kind


def _number(value: float) -> float | None:
    return None if math.isnan(value) else float(value)


__all__ = [
    "BY_SEED",
    "CONVERTED_MOE",
    "DENSE",
    "SCRATCH",
    "SUBJECTS",
    "Subject",
    "TRAINED_MOE",
    "about",
    "counted_once",
    "finding",
    "claim_findings",
    "holm_levels",
    "second_analysis",
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
