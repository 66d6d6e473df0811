"""Seed statistics against numbers worked out by hand."""

import math

import pytest
from scipy import stats as scipy_stats

from moe_lit.errors import MoeLitError
from moe_lit.studies.stats import (
    NOT_TESTABLE,
    SIGNIFICANT,
    WITHIN_NOISE,
    Summary,
    compare,
    format_comparison,
    format_summary,
    group_values,
    summarize,
)


def test_summary_by_hand():
    # [2, 4, 6]: mean 4, squared deviations 4 + 0 + 4 = 8, sample variance 8 / 2 = 4, std 2.
    s = summarize([2.0, 4.0, 6.0])
    assert (s.mean, s.std, s.n, s.n_nan) == (4.0, 2.0, 3, 0)
    assert s.sem == pytest.approx(2.0 / math.sqrt(3))


def test_welch_by_hand():
    # a = [1, 2, 3]: mean 2, var 1;  b = [2, 4, 6]: mean 4, var 4;  n = 3 each.
    # se² = 1/3 + 4/3 = 5/3;  t = -2 / sqrt(5/3);  dof = (5/3)² / ((1/3)²/2 + (4/3)²/2) = 50/17.
    c = compare([1.0, 2.0, 3.0], [2.0, 4.0, 6.0])
    assert c.diff == -2.0
    assert c.se == pytest.approx(math.sqrt(5 / 3))
    assert c.t == pytest.approx(-2 / math.sqrt(5 / 3))
    assert c.dof == pytest.approx(50 / 17)
    p = 2 * scipy_stats.t.sf(2 / math.sqrt(5 / 3), 50 / 17)
    assert c.p_value == pytest.approx(p)
    assert c.p_value == pytest.approx(scipy_stats.ttest_ind([1, 2, 3], [2, 4, 6], equal_var=False).pvalue)
    assert 0.2 < c.p_value < 0.25 and not c.significant and c.verdict == WITHIN_NOISE


def test_clear_difference_is_significant():
    c = compare([10.0, 10.1, 9.9], [1.0, 1.1, 0.9])
    assert c.diff == pytest.approx(9.0) and c.p_value < 1e-4
    assert c.significant and c.verdict == SIGNIFICANT
    strict = compare([10.0, 10.1, 9.9], [1.0, 1.1, 0.9], alpha=1e-12)
    assert not strict.significant and strict.verdict == WITHIN_NOISE


def test_nan_dropped_and_counted_empty_and_single():
    s = summarize([1.0, math.nan, 3.0])
    assert (s.mean, s.n, s.n_nan) == (2.0, 2, 1)
    empty = summarize([])
    assert math.isnan(empty.mean) and empty.n == 0 and math.isnan(empty.std)
    one = summarize([5.5])
    assert (one.mean, one.std, one.n, one.sem) == (5.5, 0.0, 1, 0.0)


def test_not_testable_below_two_values():
    c = compare([1.0], [2.0, 3.0])
    assert c.verdict == NOT_TESTABLE and not c.significant and math.isnan(c.p_value)
    assert compare([1.0, math.nan], [2.0, 3.0]).verdict == NOT_TESTABLE
    assert format_comparison(c) == "diff -1.5000 (n=1 vs n=2): not testable (n < 2)"


def test_zero_spread():
    c = compare([1.0, 1.0], [2.0, 2.0])
    assert c.se == 0.0 and c.p_value == 0.0 and c.t == -math.inf and c.significant
    assert format_comparison(c) == "diff -1.0000 ± 0 (no seed spread, p=0): significant"
    same = compare([1.0, 1.0], [1.0, 1.0])
    assert same.p_value == 1.0 and same.verdict == WITHIN_NOISE


def test_formats():
    assert format_summary(Summary(mean=5.681, std=0.0123, n=3, sem=0.0071)) == "5.6810 ± 0.0123 (n=3)"
    assert format_summary(summarize([5.681])) == "5.6810 (n=1)"
    assert format_summary(summarize([1.0, 2.0, math.nan]), digits=2) == "1.50 ± 0.71 (n=2, 1 NaN)"
    text = format_comparison(compare([1.0, 2.0, 3.0], [2.0, 4.0, 6.0]))
    assert text == "diff -2.0000 ± 1.2910 (Welch t=-1.55, p=0.22): within noise"


def test_bad_alpha_refused():
    with pytest.raises(MoeLitError, match="alpha"):
        compare([1.0, 2.0], [1.0, 2.0], alpha=1.5)


def test_group_values_keeps_order_and_only_ok_records():
    records = [
        {"arm": "moe", "seed": 0, "status": "ok", "val_loss": 5.0},
        {"arm": "dense", "seed": 0, "status": "ok", "val_loss": 6.0},
        {"arm": "moe", "seed": 1, "status": "failed", "val_loss": None},
        {"arm": "moe", "seed": 2, "status": "ok", "val_loss": 5.2},
        {"arm": "dense", "seed": 1, "status": "ok", "val_loss": None},
        {"arm": "dense", "seed": 2, "status": "pending"},
    ]
    groups = group_values(records, key=lambda r: r["arm"], value="val_loss")
    assert list(groups) == ["moe", "dense"]
    assert groups["moe"] == [5.0, 5.2]
    assert groups["dense"][0] == 6.0 and math.isnan(groups["dense"][1])
    assert summarize(groups["dense"]).n_nan == 1
    with pytest.raises(MoeLitError, match="'val_los'"):
        group_values(records, key=lambda r: r["arm"], value="val_los")


def test_paired_by_hand_sees_an_effect_below_the_seed_spread():
    from moe_lit.studies.stats import compare_paired

    a, b = [4.10, 4.20, 4.00], [4.09, 4.18, 3.985]  # seeds differ by 0.1, the effect is 0.01-0.02
    diffs = [0.01, 0.02, 0.015]
    mean = sum(diffs) / 3
    sem = (sum((d - mean) ** 2 for d in diffs) / 2) ** 0.5 / 3**0.5
    c = compare_paired(a, b)
    assert c.test == "paired" and c.dof == 2
    assert c.diff == pytest.approx(mean) and c.se == pytest.approx(sem) and c.t == pytest.approx(mean / sem)
    assert c.p_value == pytest.approx(2 * scipy_stats.t.sf(mean / sem, 2))
    assert c.significant and not compare(a, b).significant  # Welch drowns it in the seed spread
    assert "(paired t=" in format_comparison(c)
    with pytest.raises(MoeLitError, match="equal-length"):
        compare_paired([1.0, 2.0], [1.0])
