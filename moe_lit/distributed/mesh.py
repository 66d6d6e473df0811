"""Expert parallelism: the 2-D device mesh and the split of every MoE layer's experts over it."""

from __future__ import annotations

from typing import Any

from torch import nn

from moe_lit.errors import MoeLitError
from moe_lit.model.moe import MoELayer


def expert_parallel_mesh(device_type: str, world_size: int, expert_parallel_size: int) -> Any:
    """A 2-D DeviceMesh ("expert_data_parallel", "expert_parallel"): ep groups of consecutive ranks.

    Rank r holds the experts of ep rank ``r % ep``; the ranks holding the same experts form an
    "expert_data_parallel" group, over which (and only over which) those experts' gradients are reduced.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if world_size % expert_parallel_size:
        raise MoeLitError(
            f"strategy.expert_parallel_size: {expert_parallel_size} does not divide the world size {world_size}"
        )
    shape = (world_size // expert_parallel_size, expert_parallel_size)
    return init_device_mesh(device_type, shape, mesh_dim_names=("expert_data_parallel", "expert_parallel"))


def apply_expert_parallel(model: nn.Module, mesh: Any) -> None:
    """Split every MoE layer's experts over a 1-D expert-parallel mesh (in place, idempotent); a
    backend that cannot split them raises a one-line ``strategy.expert_parallel_size`` error."""
    for module in model.modules():
        if isinstance(module, MoELayer):
            module.experts.shard_experts(mesh)


__all__ = ["apply_expert_parallel", "expert_parallel_mesh"]
