"""The experts-backend protocol and the registry of backends by stable name.

Shape legend: T tokens, D d_model, K top-k, S sum of the experts' hidden sizes (see ``layout.py``).

A backend is an ``nn.Module`` class holding the ONE weight layout (``mlp.w1|v1|w2`` of shape (S, D),
``bias`` (D,)), so a checkpoint never depends on which backend wrote or reads it. Code outside
``model/`` asks this protocol (``isinstance(module, ExpertsBackend)``, ``shard_experts``,
``expert_parallel_group``, ``supports``), never a backend's class. A new backend is a module with
its class, one entry in ``moe_lit.model.experts.BACKENDS`` (a :class:`moe_lit.registry.Registry`)
and its name in ``config.BACKENDS``
(``moe.backend``'s allowed values, below this layer; tests/model/test_experts_backend.py keeps the
two equal).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from moe_lit.config import MoEConfig
from moe_lit.model.experts.layout import ExpertLayout, RoutingCounts
from moe_lit.registry import Registry

AUTO = "auto"
"""``moe.backend``'s choice by device; never a backend's name."""


class ExpertMatrices(Protocol):
    """A backend's ``mlp``: the stacked expert matrices of shape (S, D)."""

    @property
    def w1(self) -> torch.Tensor:
        """Gate projection rows (activated)."""
        ...

    @property
    def v1(self) -> torch.Tensor:
        """Up projection rows."""
        ...

    @property
    def w2(self) -> torch.Tensor:
        """Down projection rows."""
        ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """``nn.Module.parameters``: the mlp is one module (sharded as one unit)."""
        ...


@runtime_checkable
class ExpertsBackend(Protocol):
    """Routed experts of one MoE layer, in the shared weight layout."""

    name: ClassVar[str]
    """The stable name ``moe.backend`` selects it by."""
    bias: torch.Tensor
    """The (D,) expert output bias (a zero buffer when ``moe.expert_output_bias`` is false)."""

    @property
    def mlp(self) -> ExpertMatrices:
        """The module holding the stacked expert matrices."""
        ...

    @property
    def layout(self) -> ExpertLayout:
        """Row offsets of the experts inside ``mlp.w1|v1|w2``."""
        ...

    @property
    def expert_parallel_group(self) -> dist.ProcessGroup | None:
        """The process group the experts are split over (None: this rank holds all of them)."""
        ...

    @classmethod
    def from_config(cls, d_model: int, cfg: MoEConfig) -> ExpertsBackend:
        """The experts of one MoE layer of ``cfg``."""
        ...

    @classmethod
    def supports(cls, cfg: MoEConfig, device: torch.device) -> str | None:
        """Why this backend cannot run a layer of ``cfg`` on ``device`` here (None when it can)."""
        ...

    def shard_experts(self, mesh: Any) -> None:
        """Keep only this rank's experts of a 1-D expert-parallel DeviceMesh (in place, once), or
        raise a one-line error naming ``strategy.expert_parallel_size`` when the backend cannot."""
        ...

    def forward(
        self, x_TD: torch.Tensor, weights_TK: torch.Tensor, indices_TK: torch.Tensor, capacity: int | None
    ) -> tuple[torch.Tensor, RoutingCounts]:
        """``y_TD`` (bias included) and the routing counts; ``capacity`` None is dropless."""
        ...

    def __call__(
        self, x_TD: torch.Tensor, weights_TK: torch.Tensor, indices_TK: torch.Tensor, capacity: int | None
    ) -> tuple[torch.Tensor, RoutingCounts]:
        """``nn.Module.__call__``: :meth:`forward` with the module's hooks."""
        ...


def backend_registry(*backends: type[ExpertsBackend]) -> Registry[type[ExpertsBackend]]:
    """The backends by their ``name``, in the order given (``auto``'s preference); a name given
    twice, or ``auto``, is refused (:class:`moe_lit.registry.Registry`)."""
    registry: Registry[type[ExpertsBackend]] = Registry("experts backend", reserved=(AUTO,))
    for backend in backends:
        registry.register(backend.name, backend)
    return registry


__all__ = ["AUTO", "ExpertMatrices", "ExpertsBackend", "backend_registry"]
