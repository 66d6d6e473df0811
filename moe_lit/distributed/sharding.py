"""FSDP plans: the bf16 mixed-precision policies (FSDP1 and FSDP2) and the FSDP2 per-Block plan."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from moe_lit._compat import composable_checkpoint
from moe_lit.errors import MoeLitError
from moe_lit.model.experts import ExpertsBackend
from moe_lit.model.transformer import Block

MixedPrecisionName = Literal["bf16"] | None


def check_mixed_precision(value: MixedPrecisionName) -> None:
    """Refuse a ``strategy.mixed_precision`` other than bf16 or null, naming the field."""
    if value not in (None, "bf16"):
        raise MoeLitError(f"strategy.mixed_precision: got {value!r}, allowed values: bf16, null")


def fsdp1_mixed_precision() -> Any:
    """FSDP1's bf16 policy: bf16 parameters and activations, fp32 gradient reduction and buffers."""
    from torch.distributed.fsdp import MixedPrecision

    return MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32)


def apply_fsdp2(
    model: nn.Module,
    mesh: Any,
    mixed_precision: MixedPrecisionName = None,
    activation_checkpointing: bool = False,
    reshard_after_forward: bool = True,
    experts_mesh: Any = None,
) -> None:
    """``fully_shard`` each Block (with optional activation checkpointing), then the whole model.

    With ``experts_mesh`` (expert parallelism), each expert-parallel ``experts.mlp`` (MegaBlocks)
    first becomes its own unit over that mesh.
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    check_mixed_precision(mixed_precision)
    if isinstance(model, FSDPModule):
        return
    kwargs: dict[str, Any] = {"mesh": mesh}
    if mixed_precision == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if experts_mesh is not None:
        for module in model.modules():
            if isinstance(module, ExpertsBackend) and module.expert_parallel_group is not None:
                # NOTE: the expert weights (DTensors over the expert-parallel mesh) are sharded and
                # their gradients averaged over the ranks holding the SAME experts only; MegaBlocks
                # already scaled them by 1/ep, so together: the mean over every rank's tokens. The
                # experts' output bias is not expert-parallel and stays in the Block's unit.
                fully_shard(module.mlp, reshard_after_forward=reshard_after_forward, **{**kwargs, "mesh": experts_mesh})
    for module in model.modules():
        if isinstance(module, Block):
            if activation_checkpointing:
                # NOTE: the composable checkpoint hooks the module in place: unlike
                # checkpoint_wrapper it adds no submodule, so parameter names stay unchanged.
                composable_checkpoint(module)
            fully_shard(module, reshard_after_forward=reshard_after_forward, **kwargs)
    # NOTE: the root unit holds what the blocks do not (embeddings, final norm, head); the root
    # keeps its parameters after the forward, the backward needs the head first anyway.
    fully_shard(model, reshard_after_forward=False, **kwargs)


__all__ = ["MixedPrecisionName", "apply_fsdp2", "check_mixed_precision", "fsdp1_mixed_precision"]
