"""Training-step throughput of our models, eager and compiled side by side (the demo's and the benchmarks' step).

Shape legend: B batch, L sequence.

:func:`training_step` is one optimizer step as training takes it (``model(idx, targets)``: the
chunked head + cross-entropy, plus the auxiliary losses; AdamW); :func:`eager_vs_compiled` times
it INTERLEAVED (``moe_lit.timing``) on an eager copy and a compiled copy (blocks compiled in place,
as ``train.compile``) of each model, so both see the same machine load.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import cast

import torch

from moe_lit.lit.optim import ADAMW_KERNELS
from moe_lit.model.compile import compile_blocks
from moe_lit.model.transformer import Transformer
from moe_lit.timing import interleaved_times, median, paired_ratio


def training_step(
    model: Transformer, batch_BL1: torch.Tensor, adamw: str = "fused", bf16: bool = False
) -> Callable[[], None]:
    """One training step (forward, backward, AdamW with the ``adamw`` kernel) on a fixed batch of
    ``L + 1`` tokens per row (inputs and shifted targets), as a callable; ``bf16``: the forward
    under CPU bf16 autocast, as Lightning's bf16-mixed (fp32 weights, gradients and AdamW)."""
    kernel = ADAMW_KERNELS[adamw]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=kernel.get("foreach"), fused=kernel.get("fused"))
    idx_BL, targets_BL = batch_BL1[:, :-1], batch_BL1[:, 1:]
    model.train()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model(idx_BL, targets_BL)
        (cast(torch.Tensor, out.ce) + out.aux_loss).backward()
        optimizer.step()

    return step


def eager_vs_compiled(
    models: dict[str, Transformer], batch_BL1: torch.Tensor, rounds: int = 8, warmup: int = 2
) -> dict[str, dict[str, float]]:
    """Per model: tokens/s of the eager and the compiled step (medians of ``rounds`` interleaved
    steps), the compiled speedup (median of per-round ratios) and the compile's seconds (the
    compiled copy's ``warmup`` steps beyond ``warmup`` median steps; 0 where a warm compile cache
    made them no slower). The models are not changed."""
    cases: dict[str, Callable[[], object]] = {}
    compile_s: dict[str, float] = {}
    for name, model in models.items():
        cases[f"{name}/eager"] = training_step(copy.deepcopy(model), batch_BL1)
        compiled = copy.deepcopy(model)
        compile_blocks(compiled)
        step = training_step(compiled, batch_BL1)
        start = time.perf_counter()
        for _ in range(warmup):
            step()
        compile_s[name] = time.perf_counter() - start
        cases[f"{name}/compiled"] = step
    times = interleaved_times(cases, rounds=rounds, warmup=1)
    tokens = batch_BL1[:, :-1].numel()
    return {
        name: {
            "eager_tokens_per_s": tokens / median(times[f"{name}/eager"]),
            "compiled_tokens_per_s": tokens / median(times[f"{name}/compiled"]),
            "compiled_speedup": paired_ratio(times, f"{name}/eager", f"{name}/compiled"),
            "compile_s": max(0.0, compile_s[name] - warmup * median(times[f"{name}/compiled"])),
        }
        for name in models
    }


__all__ = ["eager_vs_compiled", "training_step"]
