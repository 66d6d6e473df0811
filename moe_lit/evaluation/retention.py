"""Performance retention of a compressed model: ``pruned / original`` per task or language.

``retention(original, pruned)`` takes two ``{key: metric}`` mappings with the same keys (tasks,
languages, ``task/language``...) and returns each key's ratio, their mean and their variance.
For a metric where higher is better (accuracy) the ratio is ``pruned / original``; for one where
lower is better (loss, perplexity) it is ``original / pruned``, so that in both cases 1 means
nothing lost and below 1 means worse. The variance is the population variance over the keys
(MAESTRO's "cross-task variance": the spread of retention across the evaluated keys themselves).

``suite_retention(original, pruned)`` applies it to two local-suite results of
:func:`moe_lit.evaluation.suite.suite_scores`, on accuracy *above chance*: per task
``(pruned - chance) / (original - chance)``, and per language the same ratio of the language's
summed above-chance accuracy. Tasks where the original is not above chance by more than
``min_margin`` are left out (there is nothing to retain, and the ratio of two noise terms is not a
retention); the result names them. A pruned model below chance has a negative retention.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moe_lit.errors import MoeLitError


@dataclass(frozen=True)
class Retention:
    """Per-key retention and its summary."""

    per_key: dict[str, float]
    """Retention of each key (1 = unchanged, < 1 = worse)."""
    mean: float
    """Mean over the keys."""
    variance: float
    """Population variance over the keys (0 for a single key)."""


def retention(original: Mapping[str, float], pruned: Mapping[str, float], higher_is_better: bool = True) -> Retention:
    """Retention of ``pruned`` against ``original`` over their (identical) keys."""
    if set(original) != set(pruned) or not original:
        raise MoeLitError(f"retention: needs the same non-empty keys, got {sorted(original)} and {sorted(pruned)}")
    per_key = {}
    for key in original:
        before, after = float(original[key]), float(pruned[key])
        numerator, denominator = (after, before) if higher_is_better else (before, after)
        if denominator <= 0 or not math.isfinite(numerator) or not math.isfinite(denominator):
            raise MoeLitError(
                f"retention: {key!r} needs finite metrics with a positive denominator, got {before}, {after}"
            )
        per_key[key] = numerator / denominator
    values = list(per_key.values())
    return Retention(per_key, statistics.fmean(values), statistics.pvariance(values))


@dataclass(frozen=True)
class SuiteRetention:
    """Retention of local-suite accuracy above chance, per task and per language."""

    tasks: Retention
    """Per task: ``(pruned - chance) / (original - chance)``."""
    languages: Retention
    """Per language: the same ratio of the summed above-chance accuracy of its (kept) tasks."""
    left_out: list[str]
    """Tasks whose original accuracy is not above chance by more than the margin."""


def suite_retention(original: Mapping[str, Any], pruned: Mapping[str, Any], min_margin: float = 0.0) -> SuiteRetention:
    """Above-chance accuracy retention of ``pruned`` against ``original`` (two ``suite_scores``
    results on the same items: the original's chance is used for both)."""
    from moe_lit.evaluation.tasks import lang_key

    if set(original["tasks"]) != set(pruned["tasks"]):
        raise MoeLitError(
            f"suite retention: needs the same tasks, got {sorted(original['tasks'])} and {sorted(pruned['tasks'])}"
        )
    chance = original["chance"]
    above_original = {task: float(acc) - chance[task] for task, acc in original["tasks"].items()}
    above_pruned = {task: float(pruned["tasks"][task]) - chance[task] for task in above_original}
    kept = sorted(task for task, margin in above_original.items() if margin > min_margin)
    if not kept:
        raise MoeLitError(f"suite retention: no task where the original is above chance by more than {min_margin}")
    language_of = {
        task: next((lang for lang in original["languages"] if task.endswith(f"_{lang_key(lang)}")), "?")
        for task in kept
    }

    def by_language(above: dict[str, float]) -> dict[str, float]:
        summed: dict[str, float] = {}
        for task in kept:
            summed[language_of[task]] = summed.get(language_of[task], 0.0) + above[task]
        return summed

    per_task = retention({t: above_original[t] for t in kept}, {t: above_pruned[t] for t in kept})
    left_out = sorted(set(above_original) - set(kept))
    return SuiteRetention(per_task, retention(by_language(above_original), by_language(above_pruned)), left_out)


__all__ = ["Retention", "SuiteRetention", "retention", "suite_retention"]
