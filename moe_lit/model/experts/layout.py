"""The ONE expert weight layout, shared by every backend and every checkpoint.

Shape legend (used in tensor names across moe_lit):
    T  tokens in the flattened batch          D  d_model
    E  routed experts                         K  top-k experts per token
    F  one expert's hidden size               S  sum of all experts' hidden sizes (rows of w1)
    N  T*K routed (token, expert) assignments B/L  batch / sequence

The layout is MegaBlocks dMoE's (``mlp_type='glu'``): three stacked matrices ``w1_SD`` (gate,
the activated one: Llama's ``gate_proj``), ``v1_SD`` (up: ``up_proj``) and ``w2_SD`` (down),
expert e owning rows ``offsets[e]:offsets[e+1]``.
Expert e computes ``(silu(x @ w1_e.T) * (x @ v1_e.T)) @ w2_e``. Heterogeneous experts are just
unequal row counts, so the same tensors describe a uniform layer (which MegaBlocks can run) and a
heterogeneous one (torch backend only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn


@dataclass(frozen=True)
class ExpertLayout:
    """Row offsets of each expert inside the stacked ``(S, D)`` expert matrices."""

    sizes: tuple[int, ...]

    @classmethod
    def of(cls, sizes: Sequence[int]) -> ExpertLayout:
        return cls(tuple(int(s) for s in sizes))

    @property
    def num_experts(self) -> int:
        return len(self.sizes)

    @property
    def total_rows(self) -> int:
        return sum(self.sizes)

    @property
    def uniform(self) -> bool:
        return len(set(self.sizes)) == 1

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """``E + 1`` cumulative row offsets, starting at 0."""
        out = [0]
        for size in self.sizes:
            out.append(out[-1] + size)
        return tuple(out)

    def rows(self, expert: int) -> slice:
        return slice(self.offsets[expert], self.offsets[expert + 1])

    def split(self, w_SD: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per-expert views ``w_FD`` of a stacked matrix (no copy)."""
        return torch.split(w_SD, list(self.sizes), dim=0)

    def as_EFD(self, w_SD: torch.Tensor) -> torch.Tensor:
        """View a uniform stacked matrix as ``(E, F, D)`` (no copy)."""
        if not self.uniform:
            raise ValueError("as_EFD needs equal expert sizes; this layout is heterogeneous")
        return w_SD.view(self.num_experts, self.sizes[0], w_SD.shape[-1])

    def expert_of_row(self) -> torch.Tensor:
        """``(S,)`` expert id of every stacked row."""
        return torch.repeat_interleave(torch.arange(self.num_experts), torch.tensor(self.sizes))


@dataclass
class RoutingCounts:
    """What the MoE layer reads from an experts backend's forward: the routing counts it records."""

    routed_counts_E: torch.Tensor
    """Assignments per expert, before any dropping."""
    dropped: torch.Tensor
    """Assignments dropped by the capacity limit (0-dim; 0 when dropless)."""

    @classmethod
    def of(cls, routed_counts_E: torch.Tensor, capacity: int | None) -> RoutingCounts:
        """The counts of a routing whose experts keep at most ``capacity`` assignments each (None: all)."""
        if capacity is None:
            return cls(routed_counts_E, routed_counts_E.new_zeros(()))
        return cls(routed_counts_E, (routed_counts_E - routed_counts_E.clamp(max=capacity)).sum())


def register_output_bias(module: nn.Module, d_model: int, learned: bool, device=None) -> None:
    """``module.bias``: MegaBlocks' learned ``(D,)`` expert output bias, or (``learned=False``,
    ``moe.expert_output_bias: false``) a fixed zero kept out of the parameters and the checkpoint."""
    zeros_D = torch.zeros(d_model, device=device)
    if learned:
        module.bias = nn.Parameter(zeros_D)
    else:
        module.register_buffer("bias", zeros_D, persistent=False)
