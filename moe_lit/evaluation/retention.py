"""Performance retention of a compressed model: ``pruned / original`` per task or language.

``retention(original, pruned)`` takes two ``{key: metric}`` mappings with the same keys (tasks,
languages, ``task/language``...) and returns each key's ratio, their mean and their variance.
For a metric where higher is better (accuracy) the ratio is ``pruned / original``; for one where
lower is better (loss, perplexity) it is ``original / pruned``, so that in both cases 1 means
nothing lost and below 1 means worse. The variance is the population variance over the keys
(MAESTRO's "cross-task variance": the spread of retention across the evaluated keys themselves).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass

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


__all__ = ["Retention", "retention"]
