"""moe_lit.stats against scipy and statsmodels' own results and numbers worked out by hand."""

import math

import pytest
from scipy import stats as scipy_stats
from statsmodels.stats.multitest import multipletests
from statsmodels.stats.power import TTestIndPower, TTestPower
from statsmodels.stats.weightstats import ttost_ind, ttost_paired

from moe_lit.stats import (
    NO_NOISE,
    Summary,
    equivalence,
    format_difference,
    format_summary,
    holm,
    paired_difference,
    summarize,
    welch_difference,
)


def test_summary_by_hand():
    # [2, 4, 6]: mean 4, squared deviations 4 + 0 + 4 = 8, sample variance 8 / 2 = 4, std 2.
    s = summarize([2.0, 4.0, 6.0])
    assert (s.mean, s.std, s.n, s.n_nan) == (4.0, 2.0, 3, 0)
    assert s.sem == pytest.approx(2.0 / math.sqrt(3))
    nan = summarize([1.0, math.nan, 3.0])
    assert (nan.mean, nan.n, nan.n_nan) == (2.0, 2, 1)
    assert math.isnan(summarize([]).mean) and summarize([5.5]).std == 0.0


def test_paired_difference_is_scipys_with_the_power_of_statsmodels():
    a, b = [4.10, 4.20, 4.00, 4.05], [4.09, 4.18, 3.985, 4.03]  # seeds differ by 0.1, the effect ~0.015
    d = paired_difference(a, b)
    ref = scipy_stats.ttest_rel(a, b)
    ci = ref.confidence_interval(0.95)
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    assert d.test == "paired t-test" and (d.n_a, d.n_b) == (4, 4) and d.paired
    assert d.estimate == pytest.approx(sum(diffs) / 4) and d.sd == pytest.approx(summarize(diffs).std)
    assert (d.p, d.ci_low, d.ci_high) == pytest.approx((ref.pvalue, ci.low, ci.high))
    # the MDE is detected with power 0.8 at alpha 0.05 by n = 4 pairs of this noise
    assert TTestPower().power(effect_size=d.mde / d.sd, nobs=4, alpha=0.05) == pytest.approx(0.8, abs=1e-6)
    assert d.p < 0.05 and welch_difference(a, b).p > 0.5  # Welch drowns the effect in the seed spread
    one = paired_difference([1.0, 1.2, 1.1], 1.0)  # against a constant: the one-sample test
    assert one.test == "one-sample t-test" and one.p == pytest.approx(
        scipy_stats.ttest_1samp([1.0, 1.2, 1.1], 1.0).pvalue
    )
    with pytest.raises(ValueError, match="equal-length"):
        paired_difference([1.0, 2.0], [1.0])


def test_welch_difference_is_scipys():
    a, b = [1.0, 2.0, 3.0], [2.0, 4.0, 6.0, 5.0]
    d = welch_difference(a, b)
    ref = scipy_stats.ttest_ind(a, b, equal_var=False)
    ci = ref.confidence_interval(0.95)
    assert d.test == "Welch's t-test" and (d.n_a, d.n_b) == (3, 4) and not d.paired
    assert (d.estimate, d.p, d.ci_low, d.ci_high) == pytest.approx((2.0 - 4.25, ref.pvalue, ci.low, ci.high))
    pooled = math.sqrt((2 * 1.0 + 3 * summarize(b).std ** 2) / 5)
    assert d.sd == pytest.approx(pooled)
    assert TTestIndPower().power(effect_size=d.mde / pooled, nobs1=3, ratio=4 / 3, alpha=0.05) == pytest.approx(0.8)


def test_zero_spread_is_no_noise_estimate_never_significant():
    same = paired_difference([1.0, 2.0, 3.0], [0.5, 1.5, 2.5])  # every difference exactly 0.5: se = 0
    assert same.estimate == 0.5 and math.isnan(same.p) and not same.testable and math.isnan(same.mde)
    assert same.note == f"{NO_NOISE}: the 3 differences are all equal (zero spread)"
    flat = welch_difference([1.0, 1.0], [2.0, 2.0])
    assert flat.estimate == -1.0 and not flat.testable and flat.note == f"{NO_NOISE}: both groups have zero spread"
    single = paired_difference([1.0, math.nan], [2.0, 3.0])  # one pair left
    assert not single.testable and single.note == f"{NO_NOISE}: 1 seed"
    assert format_difference(same) == f"+0.5000 (no CI) ({NO_NOISE}: the 3 differences are all equal (zero spread))"


def test_tost_is_statsmodels_own_result():
    import numpy as np

    a, b = [1.00, 1.10, 1.20, 1.05], [1.00, 1.05, 1.18, 1.04]
    mine = equivalence(a, b, -0.1, 0.1, paired=True)
    p, (_, p_low, _), (_, p_upp, _) = ttost_paired(np.array(a), np.array(b), -0.1, 0.1)
    assert mine.p == pytest.approx(p) and mine.p_beyond == pytest.approx(min(1 - p_low, 1 - p_upp))
    welch = equivalence(a, b, -0.1, 0.1, paired=False)
    assert welch.p == pytest.approx(ttost_ind(np.array(a), np.array(b), -0.1, 0.1, usevar="unequal")[0])
    constant = equivalence([0.009, 0.0095, 0.0105], 0.0, -0.01, 0.01, paired=True)
    assert constant.p == pytest.approx(ttost_paired(np.array([0.009, 0.0095, 0.0105]), np.zeros(3), -0.01, 0.01)[0])
    assert constant.p > 0.05  # a mean of 0.97% is not shown to lie within 1% by three seeds


def test_holm_is_multipletests_and_keeps_nans_in_place():
    values = [0.04, 0.01, math.nan, 0.03, 0.2]
    adjusted = holm(values)
    expected = multipletests([0.04, 0.01, 0.03, 0.2], method="holm")[1]
    assert [adjusted[i] for i in (0, 1, 3, 4)] == pytest.approx(list(expected))
    assert math.isnan(adjusted[2]) and adjusted[1] == pytest.approx(0.04) and adjusted[0] == pytest.approx(0.09)


def test_format_summary():
    assert format_summary(Summary(mean=5.681, std=0.0123, n=3, sem=0.0071)) == "5.6810 ± 0.0123 (n=3)"
    assert format_summary(summarize([5.681])) == "5.6810 (n=1)"
    assert format_summary(summarize([1.0, 2.0, math.nan]), digits=2) == "1.50 ± 0.71 (n=2, 1 NaN)"
    d = paired_difference([1.0, 2.0, 3.0], [1.1, 2.3, 3.2])
    assert format_difference(d).startswith("-0.2000 [") and format_difference(d).endswith(" (paired t-test, p=0.0742)")
