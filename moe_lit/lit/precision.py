"""The training precision of a CPU run: bf16 autocast where it is native and measured faster.

``train.precision: auto`` means bf16-mixed on a CPU whose flags include a native bf16 instruction
set (``avx512_bf16`` or ``amx_bf16``, as ``lscpu`` lists them;
:func:`moe_lit.inference.precision.native_bf16_flags`, which inference shares), MoE models as dense
ones (:data:`MOE_BF16_RESULT`), *and* where a short probe (the
model's own forward and backward on one batch, interleaved with fp32) runs at least
:data:`MIN_SPEEDUP` times faster; 32-true otherwise. The model matters: autocast casts every
weight at each matmul, which costs more than bf16 saves on small GEMMs, while a large vocabulary
head or wide projections gain; without native bf16 the CPU emulates it. On accelerators other
than the CPU, ``auto`` leaves ``trainer.precision`` as configured. bf16-mixed keeps fp32 master weights, fp32
optimizer state and the loss in fp32 (the chunked cross-entropy reduces in fp32).

A run decides once: the probe's speedup is cached per machine (:func:`probe_cache_file`, keyed by
the CPU's model name and flags, the torch version, the model's config and the batch shape), so the
same command on the same machine always chooses the same precision; a resumed run keeps the
precision its checkpoint records (``MoELitModule`` stores it), whatever a probe would say now.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from moe_lit.errors import MoeLitError
from moe_lit.inference import precision as capability
from moe_lit.inference.precision import MIN_SPEEDUP, PROBE_ROUNDS, PrecisionChoice, native_bf16_flags
from moe_lit.io import atomic_write_json
from moe_lit.lit.throughput import training_step
from moe_lit.model.transformer import Transformer
from moe_lit.timing import interleaved_times, paired_ratio

PRECISIONS = ("auto", "32-true", "bf16-mixed")
"""Values of ``train.precision``: auto (below), or a Lightning precision forced as given."""
MOE_BF16_RESULT = "benchmarks/results/bf16_accuracy-20261206-073201.json"
"""The bf16 accuracy verdict that lets ``auto`` treat MoE models as dense ones (``python -m
benchmarks.bf16_accuracy``): the demo MoE's mean final validation loss in bf16-mixed equals fp32's
within one fp32 seed sd over 8 seeds of each (Welch's TOST: reproduced; docs/performance.md), and
bf16-mixed gives the same bits at 1 and 2 threads on an avx512_bf16 CPU
(``tests/model/test_thread_invariance.py``)."""
PROBE_MAX_TOKENS = 2048
"""Tokens of the probe batch at most (the probe takes a few training steps' time)."""
FP32 = ("32-true", "32", "None")
"""``trainer.precision`` values that mean fp32 (Lightning's default), which ``auto`` may replace."""


def probe_speedup(model: Transformer, batch_size: int, seq_len: int) -> float:
    """Median over :data:`PROBE_ROUNDS` interleaved rounds (after one warm-up) of the fp32 over the
    bf16-autocast time of ``model``'s training step (``moe_lit.lit.throughput.training_step``) on a
    random batch of ``batch_size`` x ``seq_len`` tokens (:data:`PROBE_MAX_TOKENS` at most). Each
    precision trains its own copy: ``model`` and its routers' statistics stay untouched."""
    batch_size = max(1, min(batch_size, PROBE_MAX_TOKENS // seq_len))
    gen = torch.Generator().manual_seed(0)
    batch_BL1 = torch.randint(0, model.config.vocab_size, (batch_size, seq_len + 1), generator=gen)
    cases = {f"bf16={bf16}": training_step(copy.deepcopy(model), batch_BL1, bf16=bf16) for bf16 in (False, True)}
    times = interleaved_times(cases, rounds=PROBE_ROUNDS, warmup=1)
    return paired_ratio(times, "bf16=False", "bf16=True")


def probe_cache_file() -> Path:
    """``$XDG_CACHE_HOME/moe_lit/precision_probes.json`` (default ``~/.cache``): the probes' speedups
    measured on this machine."""
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "moe_lit" / "precision_probes.json"


def probe_key(model: Transformer, batch_size: int, seq_len: int) -> str:
    """What a probe's speedup depends on: the CPU (model name and flags, as ``/proc/cpuinfo`` lists
    them for its first processor), the torch version, the model's config and the batch shape."""
    try:
        cpu = capability.CPUINFO.read_text(errors="replace").split("\n\n")[0]
    except OSError:
        cpu = ""
    lines = sorted(line for line in cpu.splitlines() if line.split(":")[0].strip() in ("model name", "flags"))
    key = {"cpu": lines, "torch": torch.__version__, "model": model.config.to_dict(), "batch": [batch_size, seq_len]}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def cached_speedup(model: Transformer, batch_size: int, seq_len: int, cache: Path) -> tuple[float, bool]:
    """The probe's speedup of ``model`` on this machine from ``cache``, else measured and stored
    there; and whether it came from the cache."""
    key = probe_key(model, batch_size, seq_len)
    try:
        stored = json.loads(cache.read_text())
    except (OSError, ValueError):
        stored = {}
    if isinstance(stored, dict) and isinstance(stored.get(key), int | float):
        return float(stored[key]), True
    speedup = probe_speedup(model, batch_size, seq_len)
    try:
        atomic_write_json(cache, {**(stored if isinstance(stored, dict) else {}), key: speedup})
    except MoeLitError:
        pass  # NOTE: an unwritable cache only costs the next start a probe
    return speedup, False


def runs_on_cpu(accelerator: str | None) -> bool:
    """Whether a Trainer with this ``accelerator`` setting trains on the CPU."""
    return accelerator == "cpu" or (accelerator in (None, "auto") and not torch.cuda.is_available())


def choose_precision(
    requested: str | None,
    trainer: dict[str, Any],
    model: Transformer,
    batch_size: int,
    seq_len: int,
    resumed: str | None = None,
) -> PrecisionChoice | None:
    """The precision that ``train.precision: requested`` means for training ``model`` (a
    Transformer) on batches of ``batch_size`` x ``seq_len`` under the Trainer arguments ``trainer``;
    None: keep ``trainer.precision`` (no request, or ``auto`` off the CPU or where the trainer asks
    for a mixed precision itself). ``resumed``: the precision the checkpoint of a resumed run
    records, which ``auto`` keeps.

    NOTE: several processes of one run must agree, so there ``auto`` decides by the CPU flags
    alone: each process would time its own probe on a share of the cores."""
    if requested is None:
        return None
    if requested != "auto":
        return PrecisionChoice(requested, "train.precision")
    if str(trainer.get("precision", "32-true")) not in FP32 or not runs_on_cpu(trainer.get("accelerator")):
        return None
    if resumed is not None:
        return PrecisionChoice(resumed, "auto: the run's, decided at its start")
    flags = native_bf16_flags()
    if not flags:
        return PrecisionChoice("32-true", "auto: no native bf16 on this CPU")
    if trainer.get("devices", 1) not in (1, "1") or trainer.get("num_nodes", 1) != 1:
        return PrecisionChoice("bf16-mixed", f"auto: {'+'.join(flags)}, several processes (no probe)")
    cache = probe_cache_file()
    speedup, cached = cached_speedup(model, batch_size, seq_len, cache)
    probe = f"{'+'.join(flags)}, bf16 step probe {speedup:.2f}x fp32" + (f" (cached in {cache})" if cached else "")
    if speedup >= MIN_SPEEDUP:
        return PrecisionChoice("bf16-mixed", f"auto: {probe}; --train.precision 32-true for fp32")
    return PrecisionChoice("32-true", f"auto: {probe}, below {MIN_SPEEDUP}x")


__all__ = [
    "PRECISIONS",
    "cached_speedup",
    "choose_precision",
    "probe_cache_file",
    "probe_key",
    "probe_speedup",
    "runs_on_cpu",
]
