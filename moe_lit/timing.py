"""Interleaved timing: the one step-timing helper of the benchmarks and the studies.

The machines here are shared and noisy, so cases are timed INTERLEAVED (one repetition of each
case per round, in rotating order) and compared by the median of per-round ratios: a load spike
hits all cases of a round alike and cancels in the ratio.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
"""``wall``: elapsed time (what the goals are stated in); ``cpu``: this process's CPU time, which
other processes' load barely changes (meaningful with one thread: no spinning workers)."""


def interleaved_times(
    cases: dict[str, Callable[[], object]], rounds: int, warmup: int, clock: str = "wall"
) -> dict[str, list[float]]:
    """Seconds per call of each case, ``rounds`` samples each, the case order rotating per round."""
    timer = CLOCKS[clock]
    names = list(cases)
    for _ in range(warmup):
        for name in names:
            cases[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = timer()
            cases[name]()
            times[name].append(timer() - start)
    return times


def median(values: list[float]) -> float:
    return statistics.median(values)


def paired_ratio(times: dict[str, list[float]], num: str, den: str) -> float:
    """Median over rounds of ``time[num] / time[den]`` (same round, same machine load)."""
    return statistics.median(a / b for a, b in zip(times[num], times[den], strict=False))


__all__ = ["CLOCKS", "interleaved_times", "median", "paired_ratio"]
