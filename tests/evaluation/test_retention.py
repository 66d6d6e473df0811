import pytest

from moe_lit.errors import MoeLitError
from moe_lit.evaluation.retention import retention


def test_accuracy_retention_is_pruned_over_original_with_mean_and_population_variance():
    result = retention({"a": 0.8, "b": 0.5}, {"a": 0.4, "b": 0.5})
    assert result.per_key == {"a": 0.5, "b": 1.0}
    assert result.mean == pytest.approx(0.75) and result.variance == pytest.approx(0.0625)


def test_loss_retention_is_original_over_pruned():
    result = retention({"de": 2.0, "en": 3.0}, {"de": 4.0, "en": 3.0}, higher_is_better=False)
    assert result.per_key == {"de": 0.5, "en": 1.0}


def test_single_key_has_zero_variance():
    assert retention({"x": 2.0}, {"x": 1.0}).variance == 0.0


@pytest.mark.parametrize(
    "original, pruned, message",
    [
        ({"a": 1.0}, {"b": 1.0}, "same non-empty keys"),
        ({}, {}, "same non-empty keys"),
        ({"a": 0.0}, {"a": 1.0}, "positive denominator"),
        ({"a": 1.0}, {"a": float("nan")}, "finite"),
    ],
)
def test_bad_inputs_are_refused(original, pruned, message):
    with pytest.raises(MoeLitError, match=message):
        retention(original, pruned)
