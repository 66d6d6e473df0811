"""Shared benchmark plumbing: thread pinning, interleaved timing, paired ratios, JSON results.

The machines here are shared and noisy, so every script times its cases INTERLEAVED (one
repetition of each case per round, in rotating order) and reports medians plus the median of
per-round ratios: a load spike hits all cases of a round alike and cancels in the ratio.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from moe_lit.io import atomic_write_json

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def set_threads(threads: int) -> None:
    """Pin intra-op and inter-op parallelism (the goals are stated for 2 threads)."""
    torch.set_num_threads(threads)
    # NOTE: interop threads can only be set once per process, before any parallel work.
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:
        pass


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
    return statistics.median(a / b for a, b in zip(times[num], times[den]))


def environment() -> dict[str, object]:
    """What the numbers were measured on."""
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(default)"),
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
    }


def report(name: str, result: dict[str, object], save: bool = True) -> None:
    """Print ``result`` as JSON and save it as ``results/<name>-<date>.json``."""
    result = {"benchmark": name, "environment": environment(), **result}
    print(json.dumps(result, indent=2))
    if save:
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        atomic_write_json(RESULTS_DIR / f"{name}-{stamp}.json", result)
