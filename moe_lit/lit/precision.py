"""The training precision of a CPU run: bf16 autocast where it is native and measured faster.

``train.precision: auto`` means bf16-mixed on a CPU whose flags include a native bf16 instruction
set (``avx512_bf16`` or ``amx_bf16``, as ``lscpu`` lists them) *and* where a short probe at the
model's own GEMM shape (a forward and backward of its widest projection on one batch of tokens,
interleaved with fp32) runs at least :data:`MIN_SPEEDUP` times faster; 32-true otherwise. Without
native bf16 the CPU emulates it, and small models are dominated by overheads that autocast's casts
only add to: both are measured slower (docs/performance.md). On accelerators other than the CPU,
``auto`` leaves ``trainer.precision`` as configured. bf16-mixed keeps fp32 master weights, fp32
optimizer state and the loss in fp32 (the chunked cross-entropy reduces in fp32).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moe_lit.config import ModelConfig

PRECISIONS = ("auto", "32-true", "bf16-mixed")
"""Values of ``train.precision``: auto (below), or a Lightning precision forced as given."""
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""CPU flags (``/proc/cpuinfo``) of hardware bf16 arithmetic."""
MIN_SPEEDUP = 1.15
"""fp32 / bf16 probe time from which ``auto`` picks bf16 (below it, the precision change is not
worth its rounding)."""
PROBE_MAX_TOKENS = 4096
"""Rows of the probe GEMM at most (the probe stays well under a second)."""
CPUINFO = Path("/proc/cpuinfo")
FP32 = ("32-true", "32", "None")
"""``trainer.precision`` values that mean fp32 (Lightning's default), which ``auto`` may replace."""


@dataclass(frozen=True)
class PrecisionChoice:
    """The precision a run uses and why (printed as one line at the start of the run)."""

    precision: str
    """A Lightning precision: 32-true | bf16-mixed."""
    reason: str
    """Why: forced by the config, or the capability and the probe's measured speedup."""

    def line(self) -> str:
        return f"precision: {self.precision} ({self.reason})"


def native_bf16_flags(cpuinfo: Path = CPUINFO) -> list[str]:
    """The native bf16 flags this CPU reports (none where /proc/cpuinfo does not exist)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return []
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
            break
    return [flag for flag in NATIVE_BF16_FLAGS if flag in flags]


def probe_shape(config: ModelConfig, tokens: int) -> tuple[int, int, int]:
    """(rows, in, out) of the model's widest projection on one batch: the dense FFN, or an expert
    times its top-k when wider (the routed tokens' total width per token)."""
    width = config.d_ff
    if config.is_moe:
        width = max(width, config.moe.expert_size * config.moe.top_k)
    return min(tokens, PROBE_MAX_TOKENS), config.d_model, width


def probe_speedup(rows: int, d_in: int, d_out: int, rounds: int = 5) -> float:
    """fp32 time over bf16-autocast time of ``x @ W`` forward and backward, the median of
    ``rounds`` interleaved rounds after one warm-up of each."""
    gen = torch.Generator().manual_seed(0)
    x_ND = torch.randn(rows, d_in, generator=gen, requires_grad=True)
    w_DF = torch.randn(d_in, d_out, generator=gen, requires_grad=True)

    def step(bf16: bool) -> float:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out_NF = x_ND @ w_DF
        out_NF.float().sum().backward()
        return time.perf_counter() - start

    step(False), step(True)
    fp32, bf16 = [], []
    for _ in range(rounds):
        fp32.append(step(False))
        bf16.append(step(True))
    return statistics.median(fp32) / statistics.median(bf16)


def runs_on_cpu(accelerator: str | None) -> bool:
    """Whether a Trainer with this ``accelerator`` setting trains on the CPU."""
    return accelerator == "cpu" or (accelerator in (None, "auto") and not torch.cuda.is_available())


def choose_precision(
    requested: str | None, trainer: dict[str, Any], config: ModelConfig, tokens: int
) -> PrecisionChoice | None:
    """The precision that ``train.precision: requested`` means for a run of ``config`` on batches
    of ``tokens`` tokens under the Trainer arguments ``trainer``; None: keep ``trainer.precision``
    (no request, or ``auto`` off the CPU or where the trainer asks for a mixed precision itself).

    NOTE: several processes of one run must agree, so there ``auto`` decides by the CPU flags
    alone: each process would time its own probe on a share of the cores."""
    if requested is None:
        return None
    if requested != "auto":
        return PrecisionChoice(requested, "train.precision")
    if str(trainer.get("precision", "32-true")) not in FP32 or not runs_on_cpu(trainer.get("accelerator")):
        return None
    flags = native_bf16_flags()
    if not flags:
        return PrecisionChoice("32-true", "auto: no native bf16 on this CPU")
    if trainer.get("devices", 1) not in (1, "1") or trainer.get("num_nodes", 1) != 1:
        return PrecisionChoice("bf16-mixed", f"auto: {'+'.join(flags)}, several processes (no probe)")
    rows, d_in, d_out = probe_shape(config, tokens)
    speedup = probe_speedup(rows, d_in, d_out)
    probe = f"{'+'.join(flags)}, bf16 probe {speedup:.2f}x fp32 at {rows}x{d_in}x{d_out}"
    if speedup >= MIN_SPEEDUP:
        return PrecisionChoice("bf16-mixed", f"auto: {probe}; --train.precision 32-true for fp32")
    return PrecisionChoice("32-true", f"auto: {probe}, below {MIN_SPEEDUP}x")


__all__ = [
    "MIN_SPEEDUP",
    "NATIVE_BF16_FLAGS",
    "PRECISIONS",
    "PrecisionChoice",
    "choose_precision",
    "native_bf16_flags",
    "probe_shape",
    "probe_speedup",
    "runs_on_cpu",
]
