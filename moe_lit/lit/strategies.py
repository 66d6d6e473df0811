"""Distributed training strategies for :class:`~moe_lit.lit.module.MoELitModule`, selectable in YAML.

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
  consecutive ranks (:func:`apply_expert_parallel`).

Every strategy saves a checkpoint with the same ``model.``-prefixed state-dict keys as a
single-device run (FSDP1 with ``state_dict_type: full`` and FSDP2 by default write one consolidated
file), expert-parallel runs included, so ``moe_lit.checkpoint.load_model`` and any other strategy
load it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import FSDPStrategy as _LightningFSDPStrategy
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from moe_lit._compat import (
    attached_trainer,
    clean_tensor_name,
    composable_checkpoint,
    fsdp_state_dict_type,
    load_raw_module_state,
    resolve_data_parallel_size,
    saves_distributed_checkpoint,
)
from moe_lit.errors import MoeLitError
from moe_lit.model.experts.megablocks_backend import MegaBlocksExperts
from moe_lit.model.moe import MoELayer
from moe_lit.model.transformer import Block

MixedPrecisionName = Literal["bf16"] | None


def _check_mixed_precision(value: MixedPrecisionName) -> None:
    if value not in (None, "bf16"):
        raise MoeLitError(f"strategy.mixed_precision: got {value!r}, allowed values: bf16, null")


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
        _check_mixed_precision(mixed_precision)
        super().__init__(
            auto_wrap_policy={Block},
            activation_checkpointing_policy={Block} if activation_checkpointing else None,
            mixed_precision=_fsdp1_mixed_precision() if mixed_precision == "bf16" else None,
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


def _fsdp1_mixed_precision():
    from torch.distributed.fsdp import MixedPrecision

    return MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32)


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
        _check_mixed_precision(mixed_precision)
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


# NOTE: a plain optimizer state dict numbers the parameters in param-group order; Lightning's
# FSDP2 save/load converts between numbers and names assuming module order, which scrambles the
# Adam moments of any optimizer with several groups (ours: decay / no decay) when a checkpoint
# moves between FSDP2 and DDP or one device. These two keep the plain numbering on both sides.
def optimizer_state_by_id(named_state: dict[str, Any]) -> dict[str, Any]:
    """Parameter-name keys -> the ids ``torch.optim.Optimizer.state_dict`` would use (group order)."""
    if not named_state:
        return named_state  # ranks other than 0 get nothing from a full state dict
    ids: dict[str, int] = {}
    groups = []
    for group in named_state["param_groups"]:
        groups.append({**group, "params": [ids.setdefault(name, len(ids)) for name in group["params"]]})
    return {"state": {ids[name]: value for name, value in named_state["state"].items()}, "param_groups": groups}


def optimizer_state_by_name(state: dict[str, Any], optimizer: Optimizer, model: nn.Module) -> dict[str, Any]:
    """A plain (id-keyed) optimizer state -> parameter-name keys, via ``optimizer``'s own groups.

    Names are the unwrapped module's (FSDP1 and activation-checkpoint wrapper prefixes removed).
    """
    if not state["state"] or isinstance(next(iter(state["state"])), str):
        return state
    # NOTE: torch's own helper, the one FSDP1's optimizer state dicts name parameters with.
    name_of = {id(p): clean_tensor_name(name) for name, p in model.named_parameters()}
    if len(state["param_groups"]) != len(optimizer.param_groups):
        raise MoeLitError(
            f"checkpoint: optimizer has {len(state['param_groups'])} parameter groups, this run has "
            f"{len(optimizer.param_groups)}; was it saved with another optimizer config?"
        )
    names: dict[int, str] = {}
    groups = []
    for saved, ours in zip(state["param_groups"], optimizer.param_groups, strict=False):
        if len(saved["params"]) != len(ours["params"]):
            raise MoeLitError("checkpoint: optimizer parameter groups differ in size from this run's")
        group_names = [name_of[id(p)] for p in ours["params"]]
        names.update(zip(saved["params"], group_names, strict=False))
        groups.append({**saved, "params": group_names})
    return {"state": {names[i]: value for i, value in state["state"].items()}, "param_groups": groups}


def full_optimizer_state(model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """The full optimizer state of a sharded model (FSDP1 or FSDP2) on rank 0, keyed by plain ids."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    if isinstance(optimizer, LightningOptimizer):
        optimizer = optimizer.optimizer
    # NOTE: offloading a CPU model's state "to CPU" makes FSDP1 return exp_avg and exp_avg_sq as
    # one aliased buffer (torch 2.13, measured): offload only from an accelerator. Without
    # offload every rank gets the full state; Lightning writes rank 0's.
    on_accelerator = next(model.parameters()).device.type != "cpu"
    options = StateDictOptions(full_state_dict=True, cpu_offload=on_accelerator)
    return optimizer_state_by_id(get_optimizer_state_dict(model, optimizer, options=options))


def load_full_optimizer_states(
    model: nn.Module,
    optimizers: list[Optimizer],
    states: list[dict[str, Any]],
    broadcast_from_rank0: bool,
    strict: bool,
) -> None:
    """Load plain (id-keyed) full optimizer states, e.g. from any strategy's checkpoint, into a sharded model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast_from_rank0, strict=strict)
    for state, optimizer in zip(states, optimizers, strict=False):
        named = optimizer_state_by_name(state, optimizer, model)
        set_optimizer_state_dict(model, optimizer, optim_state_dict=named, options=options)


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


def apply_fsdp2(
    model: nn.Module,
    mesh: Any,
    mixed_precision: MixedPrecisionName = None,
    activation_checkpointing: bool = False,
    reshard_after_forward: bool = True,
    experts_mesh: Any = None,
) -> None:
    """``fully_shard`` each Block (with optional activation checkpointing), then the whole model.

    With ``experts_mesh`` (expert parallelism), each expert-parallel MegaBlocks ``experts.mlp``
    first becomes its own unit over that mesh.
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    _check_mixed_precision(mixed_precision)
    if isinstance(model, FSDPModule):
        return
    kwargs: dict[str, Any] = {"mesh": mesh}
    if mixed_precision == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if experts_mesh is not None:
        for module in model.modules():
            if isinstance(module, MegaBlocksExperts) and module.expert_parallel_group is not None:
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


def shard_for_strategy(module: Any) -> None:
    """``configure_model`` hook body: shard ``module.model`` when the trainer runs FSDP2."""
    trainer = attached_trainer(module)
    if trainer is not None and isinstance(trainer.strategy, FSDP2Strategy):
        trainer.strategy.shard(module.model)


__all__ = [
    "FSDP2Strategy",
    "FSDPStrategy",
    "apply_expert_parallel",
    "apply_fsdp2",
    "expert_parallel_mesh",
    "full_optimizer_state",
    "load_full_checkpoint",
    "load_full_optimizer_states",
    "optimizer_state_by_id",
    "optimizer_state_by_name",
    "shard_for_strategy",
]
