"""Pure-PyTorch dropless experts (CPU and GPU), in MegaBlocks' parameter layout.

Shape legend: T tokens, D d_model, E experts, K top-k, F one expert's hidden size,
S sum of hidden sizes, N = T*K routed assignments (see ``layout.py``).

The forward groups the N (token, expert) assignments by expert with one stable sort and hands the
grouped computation (gather, per-expert SwiGLU, weighted combine and the bias) to one autograd
Function with a hand-written backward (``grouped_swiglu.py``), or, when no gradient is needed, to
its forward-only twin ``grouped_swiglu_forward`` (same plan, nothing saved). Dropless mode never drops an
assignment. Capacity mode keeps, for each expert, the first ``capacity`` assignments in token order
(the stable sort keeps that order deterministic) and drops the rest: a dropped assignment
contributes nothing, the residual stream carries the token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from moe_lit._compat import grouped_mm_op
from moe_lit.model.experts.grouped_swiglu import (
    ALIGN_BYTES,
    Geometry,
    Slots,
    build_slots,
    grouped_swiglu,
    grouped_swiglu_forward,
)
from moe_lit.model.experts.layout import ExpertLayout, register_output_bias

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
    return all(n * dtype.itemsize % ALIGN_BYTES == 0 for n in (d_model, layout.sizes[0]))


def choose_geometry(
    strategy: Strategy, layout: ExpertLayout, d_model: int, dtype: torch.dtype, device: torch.device
) -> Geometry:
    """The slot geometry for ``strategy``; ``auto``: the loop on CPU and for unequal sizes, else grouped
    GEMMs where they fit, else padded ``bmm`` chunks.

    NOTE: on CPU the loop of per-expert GEMMs is the fastest geometry (``python -m
    benchmarks.moe_layer``; its numbers are in docs/performance.md and benchmarks/results/): it does
    no padding, and torch's CPU grouped GEMM is itself a loop over the experts. On GPUs one grouped
    GEMM replaces a kernel launch per expert.
    """
    grouped_fits = grouped_gemm_fits(layout, d_model, dtype, device)
    if strategy != "auto":
        if strategy == "grouped" and not grouped_fits:
            raise ValueError(
                "strategy: 'grouped' needs equal expert sizes, torch._grouped_mm, 16-byte aligned rows "
                "and bf16 on CUDA; use 'auto'"
            )
        return strategy
    if not layout.uniform or device.type == "cpu":
        return "looped"
    return "grouped" if grouped_fits else "batched"


def plan_dispatch(indices_TK: torch.Tensor, layout: ExpertLayout, capacity: int | None, geometry: Geometry) -> Dispatch:
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

    bias: torch.Tensor
    """The (D,) expert output bias (:func:`~moe_lit.model.experts.layout.register_output_bias`)."""

    def __init__(
        self, d_model: int, layout: ExpertLayout, strategy: Strategy = "auto", output_bias: bool = True
    ) -> None:
        super().__init__()
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy: got {strategy!r}, allowed values: {', '.join(STRATEGIES)}")
        if strategy in ("grouped", "batched") and not layout.uniform:
            raise ValueError(f"strategy: {strategy!r} needs equal expert sizes; use 'auto' or 'looped'")
        self.mlp = ExpertWeights(d_model, layout)
        register_output_bias(self, d_model, output_bias)
        self.strategy: Strategy = strategy

    @property
    def layout(self) -> ExpertLayout:
        return self.mlp.layout

    # NOTE: under torch.compile (moe_lit.model.compile) the dispatch stays eager, a graph break:
    # it sizes its slot buffers from python ints of the routing counts (``kept_counts``), which
    # dynamo would either break on anyway or trace as unbacked symbols that change every batch,
    # and its hand-written backward is already one fused pass. The router before it and the
    # combine after it are compiled.
    @torch.compiler.disable
    def forward(
        self, x_TD: torch.Tensor, weights_TK: torch.Tensor, indices_TK: torch.Tensor, capacity: int | None
    ) -> tuple[torch.Tensor, Dispatch]:
        device_type = x_TD.device.type
        # NOTE: the Function's buffers are written with out=, which autocast cannot see: cast the
        # inputs to the autocast dtype here (as torch.amp.custom_fwd would) and run it without autocast.
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x_TD.dtype
        geometry = choose_geometry(self.strategy, self.layout, x_TD.shape[-1], dtype, x_TD.device)
        plan = plan_dispatch(indices_TK, self.layout, capacity, geometry)
        tensors = (x_TD, weights_TK, self.mlp.w1, self.mlp.v1, self.mlp.w2, self.bias)
        # NOTE: the autograd Function saves five buffers for its backward; without a gradient to
        # compute (decoding, evaluation) the forward-only function runs the same plan and matmuls.
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        swiglu = grouped_swiglu if needs_grad else grouped_swiglu_forward
        x, weights, w1, v1, w2, bias = (t.to(dtype) for t in tensors)
        with torch.autocast(device_type, enabled=False):
            y_TD = swiglu(x, weights, w1, v1, w2, bias, plan.slots, self.layout)
        return y_TD, plan
