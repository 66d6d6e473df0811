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
from pathlib import Path

import torch

from moe_lit.io import atomic_write_json
from moe_lit.timing import CLOCKS, interleaved_times, median, paired_ratio  # noqa: F401 - the benchmarks' API

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def set_threads(threads: int) -> None:
    """Pin intra-op and inter-op parallelism (the goals are stated for 2 threads)."""
    # NOTE: OMP_NUM_THREADS also keeps moe_lit.callbacks.threads.ThreadShare from changing the count
    # of a benchmark's training runs, here and in the processes it starts.
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    # NOTE: interop threads can only be set once per process, before any parallel work.
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:
        pass


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
