"""The shared pieces the kinds read records and name points through (records, spec.FineTune and
spec.errors_under, plots.category_figure, the header)."""

import math
from pathlib import Path

import pytest

from moe_lit.config import ConfigError
from moe_lit.studies.identity import Point, Start
from moe_lit.studies.records import best, cells, collect, language_means
from moe_lit.studies.spec import FineTune, errors_under
from moe_lit.studies.study import parse_study
from tests.helpers.studies import small_spec


def test_collect_gathers_arm_measure_seed_in_first_seen_order():
    items = [("b", 1, {"loss": 2.0}), ("a", 0, {"loss": 1.0, "gap": 0.1}), ("b", 0, {"loss": 3.0})]
    values = collect(items)
    assert list(values) == ["b", "a"]
    assert values == {"b": {"loss": {1: 2.0, 0: 3.0}}, "a": {"loss": {0: 1.0}, "gap": {0: 0.1}}}


def test_cells_format_each_column_over_the_seeds_and_leave_unmeasured_ones_empty():
    values = {"loss": {0: 1.0, 1: 2.0}, "gap": {0: math.nan, 1: 0.5}}
    row = cells(values, {"val loss": "loss", "gap": "gap", "acc": "acc"}, digits=2)
    assert row == {"val loss": "1.50 ± 0.71 (n=2)", "gap": "0.50 (n=1, 1 NaN)", "acc": ""}


def test_language_means_average_each_language_over_the_seeds_that_have_it():
    per_seed = {0: {"en": 1.0, "de": 2.0}, 1: {"en": 2.0}, 2: {"de": 4.0, "fr": 5.0, "it": math.nan}}
    assert language_means(per_seed, 2) == {"en": "1.50", "de": "3.00", "fr": "5.00", "it": ""}
    assert language_means(per_seed, 1, ["fr", "es", "en"]) == {"fr": "5.0", "es": "", "en": "1.5"}


def test_best_picks_the_lowest_or_highest_mean_and_ignores_arms_without_a_value():
    arms = {"a": {0: 1.0, 1: 3.0}, "b": {0: 1.5, 1: 1.5}, "c": {0: math.nan}}
    assert best(arms) == "b" and best(arms, lowest=False) == "a"
    assert best({}) is None and best({"c": {0: math.nan}}) is None


def test_fine_tune_is_a_budget_and_a_fresh_schedule_validated_by_field():
    run = parse_study(small_spec()).header.run
    tuned = FineTune(steps=30, lr=0.01, warmup=3).run(run)
    assert (tuned.train.max_steps, tuned.train.val_every, tuned.optim.lr, tuned.optim.warmup_steps) == (30, 30, 0.01, 3)
    assert tuned.data == run.data and run.optim.lr != 0.01  # the base is left as it was
    with pytest.raises(ConfigError, match=r"warmup: must be an integer in \[0, steps\), got 30"):
        FineTune(steps=30, warmup=30)


def test_errors_under_names_a_nested_error_by_its_section_and_lets_others_through():
    with pytest.raises(ConfigError, match=r"^settings\[1\]\.temperature: must be > 0$"):
        with errors_under("settings[1].", strip="distill."):
            raise ConfigError("distill.temperature: must be > 0")
    with pytest.raises(KeyError), errors_under("settings[1]."):
        raise KeyError("not a config error")


def test_category_figure_summarizes_seed_maps_one_panel_per_entry(monkeypatch):
    from moe_lit.plotting import pyplot
    from moe_lit.studies import plots

    monkeypatch.setattr(plots, "save", lambda fig, plots_dir, name: fig)  # the figure, not its file
    series = {"x": [{0: 1.0, 1: 3.0}, {0: 2.0, 1: 6.0}]}
    panels = [{"names": ["a", "b"], "title": f"panel {i}", "series": series} for i in (0, 1)]
    fig = plots.category_figure(Path("unused"), "fig", panels, sharey=True, ylabel="loss", suptitle="both")
    assert len(fig.axes) == 2 and fig.axes[0].get_ylabel() == "loss" and fig.axes[1].get_ylabel() == ""
    dots = fig.axes[0].containers[0].lines[0]
    assert list(dots.get_ydata()) == [2.0, 4.0]  # the mean of each name's seeds
    assert fig.axes[1].get_title().startswith("panel 1") and fig._suptitle.get_text().startswith("both (")
    pyplot().close(fig)


def test_the_header_names_a_point_and_its_parent_start_by_seed():
    header = parse_study(small_spec(seeds=[0, 1], ablations=None)).header
    point = header.point("M/x", 1, None, header.run, {"arm": "x"}, header.start("M/parent", 1, step=5))
    assert point == Point(
        "M/x/s1", "M/x", 1, None, header.run, {"arm": "x"}, Start(parent="M/parent/s1", step=5, mode="init")
    )
    assert header.start("M/parent", 0) == Start(parent="M/parent/s0", mode="init")
