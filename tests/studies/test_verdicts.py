"""The claims layer: one synthetic record set per verdict path, no noise estimate, Holm order, TOST
as statsmodels computes it, and the pairing chosen by the seeds the arms share."""

import math

import numpy as np
import pytest
from statsmodels.stats.weightstats import ttost_paired

from moe_lit.config import ConfigError
from moe_lit.stats import holm
from moe_lit.studies.records import by_seed
from moe_lit.studies.verdicts import (
    CONTRADICTED,
    CONVERTED_MOE,
    EQUIVALENT,
    HIGHER,
    INDEPENDENT,
    LOWER,
    NO_MARGIN,
    NOT_DETECTED,
    REPRODUCED,
    TRAINED_MOE,
    UNTESTABLE,
    Claim,
    Evidence,
    Subject,
    about,
    finding,
    holm_levels,
    judge,
    report_json,
    used_tests,
)


def _records(arm_values: dict[str, list[float]], seeds=None) -> list[dict]:
    """Study records of each arm over seeds 0.. (or ``seeds[arm]``), plus a failed one that never counts."""
    records = [{"status": "failed", "arm": arm, "seed": 9, "loss": 0.0} for arm in arm_values]
    for arm, values in arm_values.items():
        for seed, value in zip((seeds or {}).get(arm, range(len(values))), values, strict=True):
            records.append({"status": "ok", "arm": arm, "seed": seed, "loss": value})
    return records


def _judged(claim: Claim, records):
    a, b = claim.arms
    (verdict,) = judge([claim.on(by_seed(records, "loss", arm=a), by_seed(records, "loss", arm=b))])
    return verdict


# seed effects of 0.1 between seeds; the arms differ by a small, steady amount
SEEDS = [4.00, 4.10, 3.90, 4.05]


def test_an_effect_in_the_claimed_direction_is_reproduced():
    records = _records({"moe": [s - 0.02 + 0.001 * i for i, s in enumerate(SEEDS)], "dense": SEEDS})
    verdict = _judged(Claim("MoE beats dense", "val loss", ("moe", "dense"), LOWER), records)
    assert verdict.word == REPRODUCED and verdict.evidence.difference.test == "paired t-test"
    assert verdict.fields["verdict"] == "**reproduced**" and verdict.fields["test"] == "paired t-test, n=4"
    assert verdict.fields["estimate [95% CI]"].startswith("-0.0185 [")


def test_an_effect_the_other_way_is_contradicted():
    records = _records({"moe": [s + 0.02 + 0.001 * i for i, s in enumerate(SEEDS)], "dense": SEEDS})
    assert _judged(Claim("MoE beats dense", "val loss", ("moe", "dense"), LOWER), records).word == CONTRADICTED
    assert _judged(Claim("dense beats MoE", "val loss", ("dense", "moe"), LOWER), records).word == REPRODUCED
    assert _judged(Claim("MoE is higher", "val loss", ("moe", "dense"), HIGHER), records).word == REPRODUCED


def test_within_noise_is_not_detected_with_the_mde_and_the_papers_effect_beside_it():
    records = _records({"moe": [4.01, 4.08, 3.93, 4.04], "dense": SEEDS})
    verdict = _judged(Claim("MoE beats dense", "val loss", ("moe", "dense"), LOWER, paper=-0.05), records)
    assert verdict.word == NOT_DETECTED
    d = verdict.evidence.difference
    assert d.mde > abs(d.estimate) and verdict.fields["MDE (power 0.8)"] == f"{d.mde:.4f}"
    assert verdict.fields["paper"] == "-0.0500"


def test_a_claim_of_no_effect_needs_its_margin_and_is_reproduced_by_tost():
    records = _records({"moe": [s + 0.002 * (-1) ** i for i, s in enumerate(SEEDS)], "dense": SEEDS})
    claim = Claim("shared experts matter little", "val loss", ("moe", "dense"), EQUIVALENT, margin=0.01)
    verdict = _judged(claim, records)
    assert verdict.word == REPRODUCED and verdict.evidence.decides == "equivalence"
    diffs = np.array([0.002, -0.002, 0.002, -0.002])
    assert verdict.evidence.p == pytest.approx(ttost_paired(diffs, np.zeros(4), -0.01, 0.01)[0])
    assert verdict.fields["p"].endswith("(TOST)") and "TOST (-0.01, +0.01)" in verdict.fields["test"]
    unstated = _judged(Claim("matters little", "val loss", ("moe", "dense"), EQUIVALENT), records)
    assert unstated.word == UNTESTABLE and unstated.evidence.reason == NO_MARGIN
    assert unstated.fields["verdict"] == f"**untestable here**: {NO_MARGIN}"


def test_a_claim_of_no_effect_is_contradicted_beyond_its_margin():
    records = _records({"moe": [s + 0.05 + 0.002 * (-1) ** i for i, s in enumerate(SEEDS)], "dense": SEEDS})
    claim = Claim("no loss", "val loss", ("moe", "dense"), EQUIVALENT, margin=0.01)
    verdict = _judged(claim, records)
    assert verdict.word == CONTRADICTED and verdict.evidence.decides == "beyond margin"
    # between: a significant 0.9% increase that TOST cannot place within 1% is not detected either way
    near = _records({"moe": [s + 0.009 + 0.002 * (-1) ** i for i, s in enumerate(SEEDS)], "dense": SEEDS})
    assert _judged(claim, near).word == NOT_DETECTED


def test_equivalence_shown_where_the_paper_claims_an_effect_contradicts_it():
    records = _records({"moe": [s + 0.0005 * (-1) ** i for i, s in enumerate(SEEDS)], "dense": SEEDS})
    claim = Claim("MoE beats dense", "val loss", ("moe", "dense"), LOWER, margin=0.01)
    verdict = _judged(claim, records)
    assert verdict.word == CONTRADICTED and verdict.evidence.decides == "equivalence"


def test_no_noise_estimate_is_untestable_never_significant():
    # every seed's difference is exactly 0.02: se = 0, the difference is exact but untested
    records = _records({"moe": [s - 0.02 for s in (4.0, 4.5, 5.0)], "dense": [4.0, 4.5, 5.0]})
    verdict = _judged(Claim("MoE beats dense", "val loss", ("moe", "dense"), LOWER), records)
    assert verdict.word == UNTESTABLE and math.isnan(verdict.p_holm)
    assert verdict.evidence.reason == "no noise estimate: the 3 differences are all equal (zero spread)"
    assert verdict.fields["estimate [95% CI]"] == "-0.0200 (no CI)" and verdict.fields["Holm p"] == "n/a"
    single = _judged(Claim("x", "val loss", ("moe", "dense"), LOWER), _records({"moe": [3.9], "dense": [4.0]}))
    assert single.word == UNTESTABLE and single.evidence.reason == "no noise estimate: 1 seed"


def test_a_claim_this_machine_cannot_test_says_why():
    claim = Claim("2.5x layer speedup", "speedup", ("sparse", "dense"), HIGHER, untestable="GPU kernels, not CPU")
    (verdict,) = judge([claim.on({0: 1.2}, {0: 1.0}), Claim("y", "m", ("a", "b"), LOWER).missing("b did not finish")])[
        :1
    ]
    assert verdict.word == UNTESTABLE and verdict.fields["verdict"] == "**untestable here**: GPU kernels, not CPU"
    assert used_tests([verdict]) == "1 claims, none testable here (reasons in the claims table)."


def test_holm_adjusts_the_studys_claims_together_in_order():
    def evidence(p: float) -> Evidence:
        claim = Claim(f"p={p}", "m", ("a", "b"), LOWER)
        return Evidence(claim, claim.on({0: 1.0, 1: 2.0}, {0: 1.5, 1: 2.9}).difference, decides="difference", p=p)

    alone = judge([evidence(0.03)])
    assert alone[0].p_holm == pytest.approx(0.03) and alone[0].word == REPRODUCED
    family = judge([evidence(0.04), evidence(0.01), evidence(0.03)])
    # sorted 0.01, 0.03, 0.04 -> 3 x 0.01, max(0.03, 2 x 0.03), max(0.06, 1 x 0.04)
    assert [v.p_holm for v in family] == pytest.approx([0.06, 0.03, 0.06])
    assert [v.word for v in family] == [NOT_DETECTED, REPRODUCED, NOT_DETECTED]
    assert "Holm over the study's 3 tested claims" in used_tests(family)
    row = report_json(family)[1]
    assert (row["verdict"], row["decides"], row["p_holm"]) == (REPRODUCED, "difference", pytest.approx(0.03))


def test_pairing_follows_the_shared_seeds():
    claim = Claim("a beats b", "val loss", ("a", "b"), LOWER)
    shared = claim.on({0: 1.0, 1: 1.2, 2: 1.1, 5: 9.0}, {0: 1.1, 1: 1.25, 2: 1.2})  # seed 5 has no partner
    assert shared.difference.test == "paired t-test" and shared.difference.n_a == 3
    disjoint = claim.on({0: 1.0, 1: 1.2, 2: 1.1}, {3: 1.1, 4: 1.25})
    assert disjoint.difference.test == "Welch's t-test" and (disjoint.difference.n_a, disjoint.difference.n_b) == (3, 2)
    independent = Claim("a beats b", "val loss", ("a", "b"), LOWER, pairing=INDEPENDENT)
    assert independent.on({0: 1.0, 1: 1.2}, {0: 1.1, 1: 1.25}).difference.test == "Welch's t-test"
    constant = claim.on({0: 0.9, 1: 0.95, 2: 0.92}, 1.0)
    assert constant.difference.test == "one-sample t-test"
    assert "Welch's t-test (scipy.stats.ttest_ind" in used_tests(judge([disjoint]))
    assert "paired t-test (scipy.stats.ttest_rel)" in used_tests(judge([shared]))


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"direction": "better"}, "claim.direction: got 'better', allowed values: lower, higher, equivalent"),
        ({"pairing": "token"}, "claim.pairing: got 'token', allowed values: seed, independent"),
        ({"margin": 0.0}, "claim.margin: must be > 0 or (low, upp) with low < upp"),
        ({"margin": (0.1, -0.1)}, "claim.margin: must be > 0 or (low, upp) with low < upp"),
    ],
)
def test_bad_declarations_name_the_field(fields, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Claim(**{"text": "x", "metric": "m", "arms": ("a", "b"), "direction": LOWER, **fields})


def test_claims_with_identical_outcome_vectors_enter_holm_once_and_say_why():
    a, b = {0: 1.0, 1: 2.0, 2: 1.6}, {0: 1.5, 1: 2.9, 2: 2.0}
    frequency = Claim("maestro beats frequency", "acc", ("maestro", "frequency"), LOWER).on(a, b)
    twin = Claim("maestro beats router_weighted", "acc", ("maestro", "rw"), LOWER, same_outcomes="unit weights")
    other = Claim("maestro beats reap", "acc", ("maestro", "reap"), LOWER).on(a, {0: 1.1, 1: 2.5, 2: 1.7})
    verdicts = judge([frequency, twin.on(a, b), other])
    assert [v.evidence.claim.text for v in verdicts] == ["maestro beats frequency", "maestro beats reap"]
    assert verdicts[0].p_holm == pytest.approx(holm([frequency.p, other.p])[0])  # a family of 2, not 3
    assert "counted once with 'maestro beats router_weighted'" in verdicts[0].fields["claim"]
    assert "(unit weights)" in verdicts[0].fields["claim"]
    values = [v.evidence.values for v in verdicts if not math.isnan(v.p_holm)]
    assert len(values) == len(set(values))  # no two claims of the family share their outcome vectors


@pytest.mark.parametrize("seed", range(5))
def test_the_simultaneous_interval_excludes_zero_exactly_where_holm_rejects(seed):
    rng = np.random.default_rng(seed)
    claims = []
    for i, shift in enumerate(rng.uniform(-0.05, 0.05, size=6)):
        b = {s: float(v) for s, v in enumerate(rng.normal(4.0, 0.1, size=5))}
        a = {s: v + shift + float(rng.normal(0, 0.02)) for s, v in b.items()}
        claims.append(Claim(f"claim {i}", "loss", ("a", "b"), LOWER).on(a, b))
    for verdict in judge(claims):
        interval = verdict.interval
        assert (interval.ci_low > 0 or interval.ci_high < 0) == (verdict.p_holm < 0.05)
        assert interval.ci_low <= verdict.evidence.difference.ci_low  # never narrower than the unadjusted CI
        assert verdict.fields["Holm simultaneous CI"].endswith("used")


def test_holm_levels_follow_the_step_down_and_stop_at_the_first_acceptance():
    levels = holm_levels([0.001, 0.04, 0.011, math.nan])
    # ascending: 0.001 (step 1: 0.05/3 rejects), 0.011 (step 2: 0.05/2 rejects), 0.04 (step 3: 0.05/1 rejects)
    assert levels[:3] == pytest.approx([0.05 / 3, 0.05, 0.05 / 2]) and math.isnan(levels[3])
    assert holm_levels([0.03, 0.03, 0.001]) == pytest.approx([0.05 / 2, 0.05 / 2, 0.05 / 3])  # stops at step 2


def test_a_claim_about_another_object_is_untestable_and_its_contrast_a_finding():
    evidence = Claim("MoE->dense beats dense->dense", "acc", ("moe", "dense"), HIGHER).on(
        {0: 0.8, 1: 0.82, 2: 0.79}, {0: 0.9, 1: 0.93, 2: 0.91}
    )
    paper, here = Subject(TRAINED_MOE, "Qwen3-30B-A3B"), Subject(CONVERTED_MOE, "SmolLM2-135M cut into experts")
    (moved,) = about([evidence], paper, here)
    (verdict,) = judge([moved])
    assert verdict.word == UNTESTABLE and "the paper tested a trained MoE" in verdict.evidence.reason
    assert verdict.fields["object: paper / here"] == f"{paper} / {here}"
    assert finding(moved).startswith("- Finding about this model, not a verdict on the paper: MoE->dense")
    assert report_json([verdict])[0]["objects_match"] is False
    (same,) = judge(about([evidence], here, here))
    assert same.word == CONTRADICTED and finding(same.evidence) == ""
    with pytest.raises(ConfigError, match="subject.kind"):
        Subject("a large model")


def test_a_claim_decided_against_its_margin_shows_the_tost_interval_of_its_holm_step():
    a = {s: 4.0 + 0.1 * s for s in range(6)}
    close = Claim("matches", "loss", ("a", "b"), EQUIVALENT, margin=0.05).on(
        a, {s: v - 0.004 + 0.003 * (s % 2) for s, v in a.items()}
    )
    far = Claim("also matches", "loss", ("a", "c"), EQUIVALENT, margin=0.05).on(
        a, {s: v - 0.2 + 0.01 * (s % 3) for s, v in a.items()}
    )
    for verdict in judge([close, far]):
        interval, (low, upp) = verdict.interval, verdict.evidence.claim.bounds
        inside, beyond = (
            low < interval.ci_low and interval.ci_high < upp,
            interval.ci_low > upp or interval.ci_high < low,
        )
        assert inside == (verdict.word == REPRODUCED) and beyond == (verdict.word == CONTRADICTED)
        assert verdict.fields["Holm simultaneous CI"].endswith("used against the margin (-0.05, +0.05)")
    assert [v.word for v in judge([close, far])] == [REPRODUCED, CONTRADICTED]
