"""Distributed training strategies for :class:`~moe_lit.lit.module.MoELitModule`, selectable in YAML.

Thin Lightning glue: the sharding plans, the expert-parallel mesh and the optimizer-state
renumbering they apply live in :mod:`moe_lit.distributed`.

* ``ddp``: Lightning's ``DDPStrategy`` (CPU with gloo, or GPUs with NCCL); nothing to configure.
* :class:`FSDPStrategy` (FSDP1, GPUs only): Lightning's FSDPStrategy with one FSDP unit per
  transformer ``Block`` (the MoE layer's router, experts and shared expert shard together),
  optional bf16 mixed precision (fp32 gradient reduction) and optional activation checkpointing
  per block.
* :class:`FSDP2Strategy`: Lightning's ``ModelParallelStrategy`` as pure data parallelism (tensor
  parallel size 1) with ``fully_shard`` applied to every ``Block`` and then to the whole network,
  so every parameter the step uses (embeddings, final norm and head included) is sharded. It runs on
  CPU with gloo too. ``MoELitModule.configure_model`` calls :func:`shard_for_strategy`. With
  ``expert_parallel_size`` > 1 it also splits the experts of MegaBlocks MoE layers over groups of
  consecutive ranks (:func:`~moe_lit.distributed.mesh.apply_expert_parallel`).

Every strategy saves a checkpoint with the same ``model.``-prefixed state-dict keys as a
single-device run (FSDP1 with ``state_dict_type: full`` and FSDP2 by default write one consolidated
file), expert-parallel runs included, so ``moe_lit.checkpoint.load_model`` and any other strategy
load it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch.strategies import FSDPStrategy as _LightningFSDPStrategy
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from moe_lit._compat import (
    attached_trainer,
    fsdp_state_dict_type,
    load_raw_module_state,
    resolve_data_parallel_size,
    saves_distributed_checkpoint,
)
from moe_lit.distributed.mesh import apply_expert_parallel, expert_parallel_mesh
from moe_lit.distributed.optim_state import full_optimizer_state, load_full_optimizer_states
from moe_lit.distributed.sharding import (
    MixedPrecisionName,
    apply_fsdp2,
    check_mixed_precision,
    fsdp1_mixed_precision,
)
from moe_lit.errors import MoeLitError
from moe_lit.model.transformer import Block


class FSDPStrategy(_LightningFSDPStrategy):
    """FSDP1 with one unit per transformer Block (GPU only: FSDP1 refuses CPU)."""

    def __init__(
        self,
        mixed_precision: MixedPrecisionName = None,
        activation_checkpointing: bool = False,
        sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"] = "FULL_SHARD",
        state_dict_type: Literal["full", "sharded"] = "full",
        **kwargs: Any,
    ) -> None:
        """
        Args:
            mixed_precision: bf16 = parameters and activations in bf16, gradients reduced in fp32;
                null = the trainer's precision plugin decides (e.g. precision: bf16-mixed).
            activation_checkpointing: Recompute each Block's activations in the backward pass.
            sharding_strategy: FSDP sharding strategy (FULL_SHARD = ZeRO-3, SHARD_GRAD_OP = ZeRO-2).
            state_dict_type: full = one consolidated checkpoint file; sharded = one file per rank.
        """
        check_mixed_precision(mixed_precision)
        super().__init__(
            auto_wrap_policy={Block},
            activation_checkpointing_policy={Block} if activation_checkpointing else None,
            mixed_precision=fsdp1_mixed_precision() if mixed_precision == "bf16" else None,
            sharding_strategy=sharding_strategy,
            state_dict_type=state_dict_type,
            **kwargs,
        )

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if fsdp_state_dict_type(self) != "full":
            return super().optimizer_state(optimizer)
        return full_optimizer_state(self.model, optimizer)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        if not path.is_file():
            return super().load_checkpoint(path, weights_only=weights_only)
        # NOTE: FSDP1 loads full optimizer states on every rank (no rank-0 broadcast), as Lightning does.
        return load_full_checkpoint(self, path, weights_only, broadcast_from_rank0=False)


class FSDP2Strategy(ModelParallelStrategy):
    """FSDP2 (``fully_shard`` per Block, then the whole network) over all processes (CPU or GPU)."""

    def __init__(
        self,
        mixed_precision: MixedPrecisionName = None,
        activation_checkpointing: bool = False,
        reshard_after_forward: bool = True,
        save_distributed_checkpoint: bool = False,
        expert_parallel_size: int = 1,
        **kwargs: Any,
    ) -> None:
        """
        Args:
            mixed_precision: bf16 = FSDP2 all-gathers bf16 parameters, reduces gradients in fp32;
                null = parameters stay in their dtype (the trainer's precision plugin may autocast).
            activation_checkpointing: Recompute each Block's activations in the backward pass.
            reshard_after_forward: Free each Block's gathered parameters after its forward (ZeRO-3);
                false keeps them until the backward (ZeRO-2-like, more memory, less communication).
            save_distributed_checkpoint: false = one consolidated file (loads anywhere);
                true = a directory of shards (consolidate with Lightning's consolidate_checkpoint).
            expert_parallel_size: ep > 1 splits every MoE layer's experts over ep consecutive ranks
                (MegaBlocks backend only; ep divides the world size and moe.num_experts); the
                checkpoint keeps the full expert layout. 1 = every rank holds every expert.
        """
        check_mixed_precision(mixed_precision)
        if (
            isinstance(expert_parallel_size, bool)
            or not isinstance(expert_parallel_size, int)
            or expert_parallel_size < 1
        ):
            raise MoeLitError(f"strategy.expert_parallel_size: must be an integer >= 1, got {expert_parallel_size!r}")
        # NOTE: pure data parallelism: the data-parallel size is set to the world size once the
        # number of nodes and processes is known (setup_environment).
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            **kwargs,
        )
        self.mixed_precision = mixed_precision
        self.activation_checkpointing = activation_checkpointing
        self.reshard_after_forward = reshard_after_forward
        self.expert_parallel_size = expert_parallel_size
        self.expert_mesh: Any = None
        """("expert_data_parallel", "expert_parallel") DeviceMesh when expert_parallel_size > 1."""

    @override
    def setup_environment(self) -> None:
        resolve_data_parallel_size(self)
        super().setup_environment()
        if self.expert_parallel_size > 1:
            self.expert_mesh = expert_parallel_mesh(self.root_device.type, self.world_size, self.expert_parallel_size)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if saves_distributed_checkpoint(self):
            return super().optimizer_state(optimizer)
        return full_optimizer_state(self.model, optimizer)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        if not path.is_file():
            return super().load_checkpoint(path, weights_only=weights_only)
        return load_full_checkpoint(self, path, weights_only, broadcast_from_rank0=True)

    def shard(self, model: nn.Module) -> None:
        """Apply expert parallelism (when configured), then FSDP2, to a Transformer in place (idempotent)."""
        experts_mesh = None
        if self.expert_mesh is not None:
            if self.root_device.type == "cuda" and self.mixed_precision != "bf16":
                raise MoeLitError(
                    "strategy.mixed_precision: expert_parallel_size > 1 on CUDA needs bf16 "
                    "(grouped_gemm has bf16 kernels only)"
                )
            apply_expert_parallel(model, self.expert_mesh["expert_parallel"])
            experts_mesh = self.expert_mesh["expert_data_parallel"]
        apply_fsdp2(
            model,
            self.device_mesh["data_parallel"],
            mixed_precision=self.mixed_precision,
            activation_checkpointing=self.activation_checkpointing,
            reshard_after_forward=self.reshard_after_forward,
            experts_mesh=experts_mesh,
        )


def load_full_checkpoint(
    strategy: Any, path: Path, weights_only: bool | None, broadcast_from_rank0: bool
) -> dict[str, Any]:
    """``load_checkpoint`` body of our sharded strategies for a one-file checkpoint (any strategy's)."""

    strict = strategy.lightning_module.strict_loading
    checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
    load_raw_module_state(checkpoint.pop("state_dict"), strategy.model, world_size=strategy.world_size, strict=strict)
    states = checkpoint.get("optimizer_states", [])
    load_full_optimizer_states(strategy.model, strategy.optimizers, states, broadcast_from_rank0, strict)
    return checkpoint


def shard_for_strategy(module: Any) -> None:
    """``configure_model`` hook body: shard ``module.model`` when the trainer runs FSDP2."""
    trainer = attached_trainer(module)
    if trainer is not None and isinstance(trainer.strategy, FSDP2Strategy):
        trainer.strategy.shard(module.model)


__all__ = ["FSDP2Strategy", "FSDPStrategy", "load_full_checkpoint", "shard_for_strategy"]
