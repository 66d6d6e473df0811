"""ThreadShare: a CPU run's intra-op threads follow the cores that other processes leave free.

torch starts one intra-op thread per core, and its OpenMP threads spin while they wait for each
other at the end of every parallel op. Beside another busy process each op then waits for the one
of its threads that the scheduler has just given to the other process, and a small model (many
short ops) slows far more than by its share of the machine. The rule:

* **threads** = the cores this process may use minus the cores other processes kept busy (CPU
  time from ``/proc/stat`` minus this process's own, over the last window), rounded, at least 1
  and at most the thread count the run started with (so ``torch.set_num_threads`` and a study
  worker's ``cpu_count // parallel`` stay upper bounds). Measured for a quarter of a second when
  training starts, then every ``every_s`` seconds of training; the start count is restored when it
  ends;
* ``OMP_NUM_THREADS`` set in the environment pins the count: the rule stays out (the tests set it,
  so that runs they compare bit for bit use the same kernels);
* data loading stays in the main process (``DataConfig.num_workers``: 0, the training stream
  always): a loader worker is one more process competing for the same cores.

Only CPU runs are touched (on an accelerator the intra-op threads do little); a system without
``/proc/stat`` keeps torch's default. docs/performance.md has the measurement.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.accelerators import CPUAccelerator
from typing_extensions import override

from moe_lit.config import ConfigError

PROC_STAT = Path("/proc/stat")
FIRST_SAMPLE_S = 0.25


@dataclass(frozen=True)
class CpuSample:
    """Cumulative CPU seconds: busy on the whole machine, and used by this process; wall seconds."""

    machine_busy_s: float
    own_s: float
    wall_s: float


def cpu_sample() -> CpuSample | None:
    """The machine's busy CPU seconds (``/proc/stat``: all but idle and iowait) and this process's
    CPU seconds, now; None without ``/proc/stat``."""
    try:
        fields = PROC_STAT.read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    ticks = [int(value) for value in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    busy = (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # NOTE: guest time is already in user
    own = os.times()
    return CpuSample(busy, own.user + own.system, time.monotonic())


def others_busy_cores(start: CpuSample, end: CpuSample) -> float:
    """Cores other processes kept busy between two samples, on average."""
    wall = end.wall_s - start.wall_s
    if wall <= 0:
        return 0.0
    return max(0.0, (end.machine_busy_s - start.machine_busy_s) - (end.own_s - start.own_s)) / wall


def fair_threads(cores: int, others_busy: float, cap: int) -> int:
    """The cores left free by the others (rounded), between 1 and ``cap``."""
    return max(1, min(cap, cores - round(others_busy)))


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class ThreadShare(pl.Callback):
    """Sets ``torch.set_num_threads`` of a CPU run to the cores other processes leave free."""

    def __init__(self, every_s: float = 5.0) -> None:
        """
        Args:
            every_s: Seconds of training between two measurements.
        """
        super().__init__()
        if not (isinstance(every_s, int | float) and not isinstance(every_s, bool) and every_s > 0):
            raise ConfigError(f"ThreadShare.every_s: must be a positive number of seconds, got {every_s!r}")
        self.every_s = float(every_s)
        self._cap = 0
        self._last: CpuSample | None = None
        self.history: list[int] = []
        """The thread counts chosen, in order (one entry per change)."""

    def _applies(self, trainer: pl.Trainer) -> bool:
        return isinstance(trainer.accelerator, CPUAccelerator) and "OMP_NUM_THREADS" not in os.environ

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._cap, self._last, self.history = torch.get_num_threads(), None, []
        if not self._applies(trainer) or (start := cpu_sample()) is None:
            return
        time.sleep(FIRST_SAMPLE_S)
        self._update(start)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: object, batch: object, batch_idx: int
    ) -> None:
        if self._last is not None and time.monotonic() - self._last.wall_s >= self.every_s:
            self._update(self._last)

    def _update(self, start: CpuSample) -> None:
        end = cpu_sample()
        if end is None:
            return
        threads = fair_threads(usable_cores(), others_busy_cores(start, end), self._cap)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
            self.history.append(threads)
        self._last = end

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._last is not None and torch.get_num_threads() != self._cap:
            torch.set_num_threads(self._cap)
        self._last = None


__all__ = ["CpuSample", "ThreadShare", "cpu_sample", "fair_threads", "others_busy_cores", "usable_cores"]
