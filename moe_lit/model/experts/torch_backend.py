"""Pure-PyTorch dropless experts (CPU and GPU), in MegaBlocks' parameter layout.

Shape legend: T tokens, D d_model, E experts, K top-k, F one expert's hidden size,
S sum of hidden sizes, N = T*K routed assignments (see ``layout.py``).

The forward groups the N (token, expert) assignments by expert with one stable sort and hands the
grouped computation (gather, per-expert SwiGLU, weighted combine and the bias) to one autograd
Function with a hand-written backward (``grouped_swiglu.py``). Dropless mode never drops an
assignment. Capacity mode keeps, for each expert, the first ``capacity`` assignments in token order
(the stable sort keeps that order deterministic) and drops the rest: a dropped assignment
contributes nothing, the residual stream carries the token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch
from torch import nn

from moe_lit.model.experts.grouped_swiglu import ALIGN_BYTES, Geometry, Slots, build_slots, grouped_mm_op, grouped_swiglu
from moe_lit.model.experts.layout import ExpertLayout

Strategy = Literal["auto", "grouped", "batched", "looped"]
STRATEGIES = ("auto", "grouped", "batched", "looped")


@dataclass
class Dispatch:
    """Where each kept assignment goes, and the routing counts the MoE layer reports."""

    slots: Slots
    """Slot geometry and index maps consumed by the grouped SwiGLU."""
    kept_counts: list[int]
    """Kept assignments per expert (python ints: they size the per-expert slot blocks)."""
    routed_counts_E: torch.Tensor
    """Assignments per expert before dropping."""
    dropped: torch.Tensor
    """Number of dropped assignments (0-dim)."""


def grouped_gemm_fits(layout: ExpertLayout, d_model: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the grouped-GEMM geometry can run: equal experts, the op exists, rows 16-byte aligned,
    and bf16 on CUDA (the only dtype its CUDA kernels take)."""
    if not layout.uniform or grouped_mm_op() is None or (device.type == "cuda" and dtype != torch.bfloat16):
        return False
    itemsize = torch.empty((), dtype=dtype).element_size()
    return all(n * itemsize % ALIGN_BYTES == 0 for n in (d_model, layout.sizes[0]))


# NOTE: on several CPU threads one small GEMM per expert does not keep the threads busy, while one
# bmm over padded chunks splits the experts between them. benchmarks/moe_layer.py on this project's
# 2-core machine (2048 tokens, d_model 256): E16 k2 F256 (about 17M multiply-adds per expert matmul)
# grouped 43.6 ms vs batched 48.1; E64 k8 F64 (4M) grouped 79.2 vs batched 72.6. The threshold sits
# between the two.
MIN_GROUPED_EXPERT_MACS = 8_000_000
"""Mean multiply-adds of one expert matmul below which ``auto`` pads into ``bmm`` chunks on a multi-threaded CPU."""


def choose_geometry(
    strategy: Strategy, layout: ExpertLayout, num_assignments: int, d_model: int, dtype: torch.dtype, device: torch.device
) -> Geometry:
    """The slot geometry for ``strategy`` and this batch (``num_assignments`` = tokens * top-k).

    ``auto``: unequal sizes loop; otherwise grouped GEMMs over packed slots (no padding, no per-expert
    calls from Python) where they fit, except on a multi-threaded CPU when the mean expert matmul is
    small (:data:`MIN_GROUPED_EXPERT_MACS`), and padded ``bmm`` chunks where grouped GEMMs do not fit.
    """
    grouped_fits = grouped_gemm_fits(layout, d_model, dtype, device)
    if strategy != "auto":
        if strategy == "grouped" and not grouped_fits:
            raise ValueError(
                "strategy: 'grouped' needs equal expert sizes, torch._grouped_mm, 16-byte aligned rows "
                "and bf16 on CUDA; use 'auto'"
            )
        return strategy
    if not layout.uniform:
        return "looped"
    if not grouped_fits:
        return "batched"
    mean_expert_macs = num_assignments / layout.num_experts * layout.sizes[0] * d_model
    threaded_cpu = device.type == "cpu" and torch.get_num_threads() > 1
    return "batched" if threaded_cpu and mean_expert_macs < MIN_GROUPED_EXPERT_MACS else "grouped"


def plan_dispatch(
    indices_TK: torch.Tensor, layout: ExpertLayout, capacity: Optional[int], geometry: Geometry
) -> Dispatch:
    """Group assignments by expert; with a capacity, drop each expert's overflow in token order."""
    experts_N = indices_TK.reshape(-1)
    order_N = torch.argsort(experts_N, stable=True)
    routed_counts_E = torch.bincount(experts_N, minlength=layout.num_experts)
    starts_E = torch.cumsum(routed_counts_E, 0) - routed_counts_E
    sorted_experts_N = experts_N.index_select(0, order_N)
    rank_N = torch.arange(order_N.numel(), device=order_N.device) - starts_E.index_select(0, sorted_experts_N)
    if capacity is not None:
        kept_counts_E = routed_counts_E.clamp(max=capacity)
        dropped = routed_counts_E.sum() - kept_counts_E.sum()
    else:
        kept_counts_E = routed_counts_E
        dropped = torch.zeros((), dtype=torch.long, device=indices_TK.device)
    kept_counts = kept_counts_E.tolist()
    slots = build_slots(indices_TK.shape, order_N, sorted_experts_N, rank_N, kept_counts, geometry, capacity)
    return Dispatch(slots, kept_counts, routed_counts_E, dropped)


class ExpertWeights(nn.Module):
    """The stacked expert matrices ``w1``, ``v1``, ``w2`` of shape (S, D): MegaBlocks' ``mlp``."""

    def __init__(self, d_model: int, layout: ExpertLayout) -> None:
        super().__init__()
        self.layout = layout
        self.w1 = nn.Parameter(torch.empty(layout.total_rows, d_model))
        self.v1 = nn.Parameter(torch.empty(layout.total_rows, d_model))
        self.w2 = nn.Parameter(torch.empty(layout.total_rows, d_model))


class TorchExperts(nn.Module):
    """Dropless (or capacity-limited) routed experts; ``mlp`` + ``bias`` as in MegaBlocks dMoE.

    ``strategy`` picks the slot geometry of the matmuls: ``auto`` (see :func:`choose_geometry`),
    ``grouped`` (grouped GEMMs), ``batched`` (chunked bmm) — both for equal sizes only — or
    ``looped``. All give the same results up to float rounding.
    """

    def __init__(self, d_model: int, layout: ExpertLayout, strategy: Strategy = "auto") -> None:
        super().__init__()
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy: got {strategy!r}, allowed values: {', '.join(STRATEGIES)}")
        if strategy in ("grouped", "batched") and not layout.uniform:
            raise ValueError(f"strategy: {strategy!r} needs equal expert sizes; use 'auto' or 'looped'")
        self.mlp = ExpertWeights(d_model, layout)
        self.bias = nn.Parameter(torch.zeros(d_model))
        self.strategy: Strategy = strategy

    @property
    def layout(self) -> ExpertLayout:
        return self.mlp.layout

    def forward(
        self, x_TD: torch.Tensor, weights_TK: torch.Tensor, indices_TK: torch.Tensor, capacity: Optional[int]
    ) -> tuple[torch.Tensor, Dispatch]:
        device_type = x_TD.device.type
        # NOTE: the Function's buffers are written with out=, which autocast cannot see: cast the
        # inputs to the autocast dtype here (as torch.amp.custom_fwd would) and run it without autocast.
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x_TD.dtype
        geometry = choose_geometry(self.strategy, self.layout, indices_TK.numel(), x_TD.shape[-1], dtype, x_TD.device)
        plan = plan_dispatch(indices_TK, self.layout, capacity, geometry)
        tensors = (x_TD, weights_TK, self.mlp.w1, self.mlp.v1, self.mlp.w2, self.bias)
        with torch.autocast(device_type, enabled=False):
            y_TD = grouped_swiglu(*(t.to(dtype) for t in tensors), plan.slots, self.layout)
        return y_TD, plan
