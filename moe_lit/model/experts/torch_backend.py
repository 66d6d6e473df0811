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

from moe_lit.model.experts.grouped_swiglu import Slots, build_slots, grouped_swiglu
from moe_lit.model.experts.layout import ExpertLayout

Strategy = Literal["auto", "batched", "looped"]
STRATEGIES = ("auto", "batched", "looped")


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


def use_batched(strategy: Strategy, layout: ExpertLayout, device: torch.device) -> bool:
    """Whether to run the chunked ``bmm`` path rather than the packed loop.

    NOTE: ``auto`` takes the loop where nothing runs in parallel (one CPU thread): there it does the
    same FLOPs minus the padding, measured 10-30% faster. Elsewhere each per-expert ``mm`` is its
    own parallel region (or kernel launch), and on two busy shared cores the loop was measured 2-4x
    slower than the ``bmm``s (README, Performance). The loop also serves unequal expert sizes.
    """
    if strategy != "auto":
        return strategy == "batched"
    single_thread = device.type == "cpu" and torch.get_num_threads() == 1
    return layout.uniform and not single_thread


def plan_dispatch(
    indices_TK: torch.Tensor, layout: ExpertLayout, capacity: Optional[int], strategy: Strategy = "auto"
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
    batched = use_batched(strategy, layout, indices_TK.device)
    slots = build_slots(indices_TK.shape, order_N, sorted_experts_N, rank_N, kept_counts, batched, capacity)
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

    ``strategy`` picks the grouped matmuls: ``auto`` (see :func:`use_batched`), ``batched``
    (chunked bmm; equal sizes only) or ``looped``. All give the same results up to float rounding.
    """

    def __init__(self, d_model: int, layout: ExpertLayout, strategy: Strategy = "auto") -> None:
        super().__init__()
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy: got {strategy!r}, allowed values: {', '.join(STRATEGIES)}")
        if strategy == "batched" and not layout.uniform:
            raise ValueError("strategy: 'batched' needs equal expert sizes; use 'auto' or 'looped'")
        self.mlp = ExpertWeights(d_model, layout)
        self.bias = nn.Parameter(torch.zeros(d_model))
        self.strategy: Strategy = strategy

    @property
    def layout(self) -> ExpertLayout:
        return self.mlp.layout

    def forward(
        self, x_TD: torch.Tensor, weights_TK: torch.Tensor, indices_TK: torch.Tensor, capacity: Optional[int]
    ) -> tuple[torch.Tensor, Dispatch]:
        plan = plan_dispatch(indices_TK, self.layout, capacity, self.strategy)
        tensors = (x_TD, weights_TK, self.mlp.w1, self.mlp.v1, self.mlp.w2, self.bias)
        device_type = x_TD.device.type
        # NOTE: the Function's buffers are written with out=, which autocast cannot see: cast the
        # inputs to the autocast dtype here (as torch.amp.custom_fwd would) and run it without autocast.
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x_TD.dtype
        with torch.autocast(device_type, enabled=False):
            y_TD = grouped_swiglu(*(t.to(dtype) for t in tensors), plan.slots, self.layout)
        return y_TD, plan
