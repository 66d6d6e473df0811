"""Pure-PyTorch dropless experts (CPU and GPU), in MegaBlocks' parameter layout.

Shape legend: T tokens, D d_model, E experts, K top-k, F one expert's hidden size,
S sum of hidden sizes, N = T*K routed assignments (see ``layout.py``).

The forward groups the N (token, expert) assignments by expert with one stable sort, runs each
expert's SwiGLU on its contiguous slice of tokens, and scatters the weighted results back with an
``index_add``. Dropless mode never drops an assignment. Capacity mode keeps, for each expert, the
first ``capacity`` assignments in token order (a stable sort keeps that order deterministic) and
drops the rest: a dropped assignment contributes nothing, the residual stream carries the token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from moe_lit.model.experts.layout import ExpertLayout


@dataclass
class Dispatch:
    """Where each kept assignment goes: sorted by expert, then by token order."""

    order_N: torch.Tensor
    """Indices into the flattened ``(T*K)`` assignments, grouped by expert."""
    token_N: torch.Tensor
    """Token index of each kept assignment."""
    kept_counts: list[int]
    """Kept assignments per expert (python ints: they size the per-expert slices)."""
    routed_counts_E: torch.Tensor
    """Assignments per expert before dropping."""
    dropped: torch.Tensor
    """Number of dropped assignments (0-dim)."""


def plan_dispatch(indices_TK: torch.Tensor, num_experts: int, capacity: Optional[int]) -> Dispatch:
    """Group assignments by expert; with a capacity, drop each expert's overflow in token order."""
    top_k = indices_TK.shape[-1]
    experts_N = indices_TK.reshape(-1)
    order_N = torch.argsort(experts_N, stable=True)
    routed_counts_E = torch.bincount(experts_N, minlength=num_experts)
    dropped = torch.zeros((), dtype=torch.long, device=indices_TK.device)
    if capacity is not None:
        starts_E = torch.cumsum(routed_counts_E, 0) - routed_counts_E
        sorted_experts_N = experts_N[order_N]
        rank_N = torch.arange(order_N.numel(), device=order_N.device) - starts_E[sorted_experts_N]
        keep_N = rank_N < capacity
        dropped = (~keep_N).sum()
        order_N = order_N[keep_N]
        kept_counts_E = routed_counts_E.clamp(max=capacity)
    else:
        kept_counts_E = routed_counts_E
    return Dispatch(order_N, order_N // top_k, kept_counts_E.tolist(), routed_counts_E, dropped)


def swiglu(x_TD: torch.Tensor, w1_FD: torch.Tensor, v1_FD: torch.Tensor, w2_FD: torch.Tensor) -> torch.Tensor:
    """One expert in MegaBlocks GLU form: ``(silu(x w1^T) * (x v1^T)) w2``."""
    return (F.silu(x_TD @ w1_FD.t()) * (x_TD @ v1_FD.t())) @ w2_FD


class ExpertWeights(nn.Module):
    """The stacked expert matrices ``w1``, ``v1``, ``w2`` of shape (S, D): MegaBlocks' ``mlp``."""

    def __init__(self, d_model: int, layout: ExpertLayout) -> None:
        super().__init__()
        self.layout = layout
        self.w1 = nn.Parameter(torch.empty(layout.total_rows, d_model))
        self.v1 = nn.Parameter(torch.empty(layout.total_rows, d_model))
        self.w2 = nn.Parameter(torch.empty(layout.total_rows, d_model))


class TorchExperts(nn.Module):
    """Dropless (or capacity-limited) routed experts; ``mlp`` + ``bias`` as in MegaBlocks dMoE."""

    def __init__(self, d_model: int, layout: ExpertLayout) -> None:
        super().__init__()
        self.mlp = ExpertWeights(d_model, layout)
        self.bias = nn.Parameter(torch.zeros(d_model))

    @property
    def layout(self) -> ExpertLayout:
        return self.mlp.layout

    def forward(
        self, x_TD: torch.Tensor, weights_TK: torch.Tensor, indices_TK: torch.Tensor, capacity: Optional[int]
    ) -> tuple[torch.Tensor, Dispatch]:
        layout = self.layout
        plan = plan_dispatch(indices_TK, layout.num_experts, capacity)
        x_ND = x_TD.index_select(0, plan.token_N)
        outputs = []
        chunks = torch.split(x_ND, plan.kept_counts, dim=0)
        weights = zip(layout.split(self.mlp.w1), layout.split(self.mlp.v1), layout.split(self.mlp.w2))
        for chunk_ND, (w1_FD, v1_FD, w2_FD) in zip(chunks, weights):
            if chunk_ND.shape[0]:
                outputs.append(swiglu(chunk_ND, w1_FD, v1_FD, w2_FD))
        y_TD = torch.zeros_like(x_TD)
        if outputs:
            gate_N = weights_TK.reshape(-1).index_select(0, plan.order_N).unsqueeze(-1)
            y_TD = y_TD.index_add(0, plan.token_N, torch.cat(outputs) * gate_N)
        return y_TD + self.bias, plan
