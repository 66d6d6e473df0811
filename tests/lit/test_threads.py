"""ThreadShare: a CPU run's threads are the cores other processes leave free, pinned by OMP_NUM_THREADS."""

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.accelerators import CPUAccelerator

from moe_lit.callbacks import threads
from moe_lit.callbacks.threads import CpuSample, ThreadShare, fair_threads, others_busy_cores


def test_the_threads_are_the_free_cores_between_one_and_the_start_count():
    assert fair_threads(cores=2, others_busy=2.0, cap=2) == 1  # a 2-thread process beside: one thread
    assert fair_threads(cores=2, others_busy=0.1, cap=2) == 2  # alone
    assert fair_threads(cores=2, others_busy=3.5, cap=2) == 1  # never none
    assert fair_threads(cores=16, others_busy=3.4, cap=8) == 8  # a study worker's cpu_count // parallel stays the bound
    assert fair_threads(cores=16, others_busy=12.6, cap=16) == 3


def test_the_others_are_the_machine_busy_time_minus_this_process():
    start, end = CpuSample(100.0, 10.0, 50.0), CpuSample(103.0, 11.0, 51.0)
    assert others_busy_cores(start, end) == pytest.approx(2.0)  # 3 busy CPU seconds in 1 s, 1 of them ours
    assert others_busy_cores(end, end) == 0.0


def _trainer():
    return SimpleNamespace(accelerator=CPUAccelerator())


def test_thread_share_follows_the_others_and_restores_the_start_count(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(threads.time, "sleep", lambda s: None)
    samples = iter([CpuSample(0.0, 0.0, 0.0), CpuSample(2.0, 0.0, 1.0), CpuSample(2.5, 0.5, 7.0)])
    monkeypatch.setattr(threads, "cpu_sample", lambda: next(samples))
    monkeypatch.setattr(threads.time, "monotonic", lambda: 7.0)
    start = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        share = ThreadShare(every_s=5)
        share.on_train_start(_trainer(), None)  # others kept 2 cores busy: one thread
        assert torch.get_num_threads() == 1
        share.on_train_batch_end(_trainer(), None, None, None, 0)  # 6 s later the others are gone: two
        assert torch.get_num_threads() == 2 and share.history == [1, 2]
        torch.set_num_threads(1)
        share.on_train_end(_trainer(), None)
        assert torch.get_num_threads() == 2  # the count the run started with
    finally:
        torch.set_num_threads(start)


def test_omp_num_threads_pins_the_count(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setattr(threads, "cpu_sample", lambda: pytest.fail("measured although pinned"))
    share = ThreadShare()
    share.on_train_start(_trainer(), None)
    assert share.history == []
    with pytest.raises(Exception, match="every_s: must be a positive number"):
        ThreadShare(every_s=0)
