"""Gradient clipping by the global L2 norm, whatever the gradients' sharding.

One function for every strategy: plain tensors (one device, DDP: every rank holds the full,
reduced gradient), FSDP1 (the root module clips its flat shards itself) and FSDP2 DTensors, one
norm per device mesh (expert-parallel weights live on their own mesh), reduced once per mesh.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


def _mesh_key(grad: torch.Tensor) -> Any:
    """The device mesh a DTensor gradient is sharded over, or None for a plain tensor."""
    from torch.distributed.tensor import DTensor

    return grad.device_mesh if isinstance(grad, DTensor) else None


def total_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all ``grads`` together, as a plain fp32 tensor equal on every rank."""
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for grad in grads:
        by_mesh.setdefault(_mesh_key(grad), []).append(grad)
    norms = []
    for mesh, group in by_mesh.items():
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0)
        # NOTE: the norm of DTensor shards is a Partial DTensor: full_tensor() is its one all-reduce.
        norms.append((norm.full_tensor() if mesh is not None else norm).float())
    if not norms:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float, root: nn.Module | None = None) -> torch.Tensor:
    """Scale the gradients of ``parameters`` so that their global L2 norm is at most ``max_norm``;
    returns the norm before clipping (as ``torch.nn.utils.clip_grad_norm_``).

    ``root``: the strategy's wrapped model; an FSDP1 root clips through its own ``clip_grad_norm_``
    (its flat shards are not the optimizer's view of the parameters).
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(root, FullyShardedDataParallel):
        return root.clip_grad_norm_(max_norm)
    params = [p for p in parameters if p.grad is not None]
    total = total_grad_norm([p.grad for p in params])
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


__all__ = ["clip_grad_norm", "total_grad_norm"]
