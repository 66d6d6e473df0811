"""PyTorch's grouped GEMM (``torch._grouped_mm``, as torchtitan uses it) for uniform experts.

Shape legend: T tokens, D d_model, E experts, K top-k, F one expert's hidden size, N = T*K routed
assignments, P kept assignments (slots) in expert order (see ``layout.py``).

:class:`GroupedMMExperts` is the torch backend with the per-expert matmul loop replaced by three
grouped GEMMs over the expert-sorted tokens: same parameters (it *is* a ``TorchExperts``), same
dispatch plan, same dropless / capacity semantics. It takes the grouped path on the device types it
is given (CUDA by default: there the kernels want bf16, so it runs under bf16 autocast or on bf16
inputs) when the rows are 16-byte aligned, and falls back to the inherited forward otherwise.
torch 2.13 also runs the grouped GEMM on CPU, which the tests use to check it against the loop.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from moe_lit.model.experts.layout import ExpertLayout
from moe_lit.model.experts.torch_backend import Dispatch, TorchExperts, plan_dispatch

ALIGN_BYTES = 16
"""Grouped GEMM kernels need every row stride to be a multiple of 16 bytes."""


def grouped_mm_op() -> Optional[Callable[..., torch.Tensor]]:
    """``F.grouped_mm`` (public since torch 2.10), else ``torch._grouped_mm`` (2.8+), else None."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_swiglu(
    x_PD: torch.Tensor, w1_EFD: torch.Tensor, v1_EFD: torch.Tensor, w2_EFD: torch.Tensor, counts_E: torch.Tensor
) -> torch.Tensor:
    """Expert e's SwiGLU on its contiguous block of ``counts_E[e]`` rows of ``x_PD``, in 3 grouped GEMMs."""
    mm = grouped_mm_op()
    offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
    h1_PF = mm(x_PD, w1_EFD.transpose(-2, -1), offs=offs_E)
    h2_PF = mm(x_PD, v1_EFD.transpose(-2, -1), offs=offs_E)
    return mm(F.silu(h1_PF) * h2_PF, w2_EFD, offs=offs_E)


def _compute_dtype(x_TD: torch.Tensor) -> torch.dtype:
    device_type = x_TD.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x_TD.dtype


class GroupedMMExperts(TorchExperts):
    """Uniform experts whose matmuls run as grouped GEMMs on ``devices``; the torch backend elsewhere."""

    def __init__(self, d_model: int, layout: ExpertLayout, devices: tuple[str, ...] = ("cuda",)) -> None:
        if not layout.uniform:
            raise ValueError("GroupedMMExperts needs equal expert sizes; use TorchExperts for this layout")
        super().__init__(d_model, layout)
        self.devices = devices

    def runs_grouped(self, x_TD: torch.Tensor) -> bool:
        """True when this input takes the grouped-GEMM path."""
        if grouped_mm_op() is None or x_TD.device.type not in self.devices:
            return False
        dtype = _compute_dtype(x_TD)
        if x_TD.is_cuda and dtype != torch.bfloat16:
            return False
        itemsize = torch.empty((), dtype=dtype).element_size()
        return all(n * itemsize % ALIGN_BYTES == 0 for n in (x_TD.shape[-1], self.layout.sizes[0]))

    def forward(
        self, x_TD: torch.Tensor, weights_TK: torch.Tensor, indices_TK: torch.Tensor, capacity: Optional[int]
    ) -> tuple[torch.Tensor, Dispatch]:
        if not self.runs_grouped(x_TD):
            return super().forward(x_TD, weights_TK, indices_TK, capacity)
        layout, dtype = self.layout, _compute_dtype(x_TD)
        # NOTE: the packed ("looped") slot geometry has no padding: slot p holds assignment
        # assign_P[p] of token token_P[p], experts in order, dropped assignments nowhere.
        plan = plan_dispatch(indices_TK, layout, capacity, strategy="looped")
        kept_counts_E = plan.routed_counts_E if capacity is None else plan.routed_counts_E.clamp(max=capacity)
        x_PD = x_TD.index_select(0, plan.slots.token_P).to(dtype)
        w1_EFD, v1_EFD, w2_EFD = (layout.as_EFD(w.to(dtype)) for w in (self.mlp.w1, self.mlp.v1, self.mlp.w2))
        h_PD = grouped_mm_swiglu(x_PD, w1_EFD, v1_EFD, w2_EFD, kept_counts_E)
        gate_P = weights_TK.reshape(-1).index_select(0, plan.slots.assign_P).unsqueeze(-1).to(dtype)
        y_TD = torch.zeros_like(x_TD).index_add(0, plan.slots.token_P, (h_PD * gate_P).to(x_TD.dtype))
        return y_TD + self.bias, plan


__all__ = ["GroupedMMExperts", "grouped_mm_op", "grouped_mm_swiglu"]
