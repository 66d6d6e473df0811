import pytest

from moe_lit.errors import MoeLitError
from moe_lit.evaluation.retention import retention, suite_retention


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


def _suite(tasks, chance, languages=("de", "pt-br")):
    """A suite_scores-shaped result (only the fields suite_retention reads)."""
    return {"tasks": tasks, "chance": chance, "languages": {lang: 0.0 for lang in languages}}


CHANCE = {"moe_lit_next_de": 0.25, "moe_lit_pairs_de": 0.5, "moe_lit_next_pt_br": 0.25, "moe_lit_pairs_pt_br": 0.5}


def test_suite_retention_is_accuracy_above_chance_per_task_and_summed_per_language():
    original = _suite(
        {"moe_lit_next_de": 0.45, "moe_lit_pairs_de": 0.9, "moe_lit_next_pt_br": 0.35, "moe_lit_pairs_pt_br": 0.7},
        CHANCE,
    )
    pruned = _suite(
        {"moe_lit_next_de": 0.35, "moe_lit_pairs_de": 0.9, "moe_lit_next_pt_br": 0.2, "moe_lit_pairs_pt_br": 0.6},
        CHANCE,
    )
    result = suite_retention(original, pruned)
    assert result.tasks.per_key == pytest.approx(
        {"moe_lit_next_de": 0.5, "moe_lit_pairs_de": 1.0, "moe_lit_next_pt_br": -0.5, "moe_lit_pairs_pt_br": 0.5}
    )  # below chance: negative
    # de: (0.1 + 0.4) / (0.2 + 0.4); pt-br: (-0.05 + 0.1) / (0.1 + 0.2)
    assert result.languages.per_key == pytest.approx({"de": 0.5 / 0.6, "pt-br": 0.05 / 0.3})
    assert result.tasks.mean == pytest.approx(0.375) and result.left_out == []


def test_suite_retention_leaves_out_tasks_the_original_does_not_solve_above_the_margin():
    original = _suite(
        {"moe_lit_next_de": 0.26, "moe_lit_pairs_de": 0.9, "moe_lit_next_pt_br": 0.2, "moe_lit_pairs_pt_br": 0.7},
        CHANCE,
    )
    pruned = _suite(
        {"moe_lit_next_de": 0.5, "moe_lit_pairs_de": 0.7, "moe_lit_next_pt_br": 0.9, "moe_lit_pairs_pt_br": 0.6},
        CHANCE,
    )
    result = suite_retention(original, pruned, min_margin=0.02)
    assert result.left_out == ["moe_lit_next_de", "moe_lit_next_pt_br"]
    assert result.tasks.per_key == pytest.approx({"moe_lit_pairs_de": 0.5, "moe_lit_pairs_pt_br": 0.5})
    assert result.languages.per_key == pytest.approx({"de": 0.5, "pt-br": 0.5})
    with pytest.raises(MoeLitError, match="no task where the original is above chance by more than 0.5"):
        suite_retention(original, pruned, min_margin=0.5)
    with pytest.raises(MoeLitError, match="needs the same tasks"):
        suite_retention(original, _suite({"moe_lit_next_de": 0.3}, CHANCE))
