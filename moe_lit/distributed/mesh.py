"""Expert parallelism: the 2-D device mesh and the split of every MoE layer's experts over it."""

from __future__ import annotations

from typing import Any

from torch import nn

from moe_lit.errors import MoeLitError
from moe_lit.model.experts.megablocks_backend import MegaBlocksExperts
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
    """Split every MoE layer's experts over a 1-D expert-parallel mesh (in place, idempotent)."""
    for name, module in model.named_modules():
        if not isinstance(module, MoELayer):
            continue
        if not isinstance(module.experts, MegaBlocksExperts):
            raise MoeLitError(
                f"strategy.expert_parallel_size: {mesh.size()} needs the MegaBlocks backend "
                f"(moe.backend: megablocks), but {name}.experts is {type(module.experts).__name__}"
            )
        module.experts.shard_experts(mesh)


__all__ = ["apply_expert_parallel", "expert_parallel_mesh"]
