"""The precision a model runs in: bf16 only on a CPU that computes it natively and measures it faster.

Training (``train.precision``, :mod:`moe_lit.lit.precision`) and inference (``moe-lit generate``,
``moe-lit eval``, the lm-eval model's ``precision=``) decide the same way, from the same CPU flags
(:func:`native_bf16_flags`) and the same threshold (:data:`MIN_SPEEDUP`). For inference the choices
are ``32-true`` (fp32 weights) and ``bf16-true`` (the weights, activations and KV cache in bf16: half
the bytes a decode step reads); ``auto`` picks bf16-true for a dense model on the CPU where the
flags are there *and* a probe of the model's own forward runs at least :data:`MIN_SPEEDUP` times
faster in bf16; fp32 otherwise. Log-probabilities are taken in fp32 either way.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_lit.errors import MoeLitError
from moe_lit.timing import interleaved_times, paired_ratio

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""CPU flags (``/proc/cpuinfo``) of hardware bf16 arithmetic."""
CPUINFO = Path("/proc/cpuinfo")
MIN_SPEEDUP = 1.3
"""fp32 / bf16 probe time from which ``auto`` picks bf16 (below it, the precision change is not
worth its rounding)."""
PROBE_ROUNDS = 3
"""Interleaved rounds of a probe (their median ratio decides)."""
INFERENCE_PRECISIONS = ("auto", "32-true", "bf16-true")
"""Values of an inference command's ``--precision``: auto (above), or a precision forced as given."""
INFERENCE_DTYPES = {"32-true": torch.float32, "bf16-true": torch.bfloat16}
PROBE_TOKENS = 256
"""Tokens of the inference probe's forward at most (one row)."""
MOE_INFERENCE_REASON = "bf16 router logits can flip near-tied expert choices, not checked against fp32 here"
"""Why ``auto`` keeps an MoE model's inference in fp32."""


@dataclass(frozen=True)
class PrecisionChoice:
    """The precision a run uses and why (printed as one line at its start)."""

    precision: str
    """A Lightning precision: 32-true | bf16-mixed (training) | bf16-true (inference)."""
    reason: str
    """Why: forced by the config or a flag, or the capability and the probe's measured speedup."""

    def line(self) -> str:
        return f"precision: {self.precision} ({self.reason})"


def native_bf16_flags(cpuinfo: Path | None = None) -> list[str]:
    """The native bf16 flags this CPU reports in ``cpuinfo`` (default :data:`CPUINFO`; none where
    it does not exist)."""
    try:
        text = (cpuinfo or CPUINFO).read_text(errors="replace")
    except OSError:
        return []
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
            break
    return [flag for flag in NATIVE_BF16_FLAGS if flag in flags]


@torch.no_grad()
def probe_forward_speedup(model: torch.nn.Module) -> float:
    """Median over :data:`PROBE_ROUNDS` interleaved rounds (after one warm-up) of the fp32 over the
    bf16 time of ``model``'s forward (in eval mode) on one random row of up to :data:`PROBE_TOKENS`
    tokens; the bf16 side runs a copy, so ``model``'s weights stay as they are."""
    config = model.config
    gen = torch.Generator().manual_seed(0)
    idx_1L = torch.randint(0, config.vocab_size, (1, min(config.seq_len, PROBE_TOKENS)), generator=gen)
    idx_1L = idx_1L.to(next(model.parameters()).device)
    fp32, bf16 = model.eval(), copy.deepcopy(model).to(torch.bfloat16).eval()
    cases = {"fp32": lambda: fp32(idx_1L), "bf16": lambda: bf16(idx_1L)}
    return paired_ratio(interleaved_times(cases, rounds=PROBE_ROUNDS, warmup=1), "fp32", "bf16")


def choose_inference_precision(requested: str, model: torch.nn.Module, device: str) -> PrecisionChoice:
    """What ``--precision requested`` means for running ``model`` (a Transformer) on ``device``."""
    if requested not in INFERENCE_PRECISIONS:
        raise MoeLitError(f"precision: got {requested!r}, allowed values: {', '.join(INFERENCE_PRECISIONS)}")
    if requested != "auto":
        return PrecisionChoice(requested, "--precision")
    if torch.device(device).type != "cpu":
        return PrecisionChoice("32-true", "auto: bf16 is probed on the CPU only; --precision bf16-true forces it")
    if model.moe_layers():
        why = f"auto: an MoE model, {MOE_INFERENCE_REASON}; --precision bf16-true forces it"
        return PrecisionChoice("32-true", why)
    flags = native_bf16_flags()
    if not flags:
        return PrecisionChoice("32-true", "auto: no native bf16 on this CPU")
    speedup = probe_forward_speedup(model)
    probe = f"{'+'.join(flags)}, bf16 forward probe {speedup:.2f}x fp32"
    if speedup >= MIN_SPEEDUP:
        return PrecisionChoice("bf16-true", f"auto: {probe}; --precision 32-true for fp32")
    return PrecisionChoice("32-true", f"auto: {probe}, below {MIN_SPEEDUP}x")


def run_in_precision(model: torch.nn.Module, choice: PrecisionChoice) -> torch.nn.Module:
    """``model`` with its parameters and buffers in ``choice``'s dtype (in place, as ``.to`` does)."""
    return model.to(INFERENCE_DTYPES[choice.precision])


def to_precision(model: torch.nn.Module, requested: str, device: str) -> tuple[torch.nn.Module, PrecisionChoice]:
    """``model`` in the precision ``requested`` means for it on ``device``
    (:func:`choose_inference_precision`), and that choice, said in one line on stderr."""
    choice = choose_inference_precision(requested, model, device)
    print(choice.line(), file=sys.stderr)
    return run_in_precision(model, choice), choice


__all__ = [
    "INFERENCE_PRECISIONS",
    "MIN_SPEEDUP",
    "NATIVE_BF16_FLAGS",
    "PrecisionChoice",
    "choose_inference_precision",
    "native_bf16_flags",
    "probe_forward_speedup",
    "run_in_precision",
    "to_precision",
]
