"""Full optimizer states of a sharded model (FSDP1 or FSDP2), in the plain numbering of one device.

A plain optimizer state dict numbers the parameters in param-group order; these helpers save and
load full states in that numbering on every strategy, so a checkpoint's Adam moments move between
FSDP1, FSDP2, DDP and one device unchanged.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import nn
from torch.optim import Optimizer

from moe_lit._compat import clean_tensor_name
from moe_lit.errors import MoeLitError


# NOTE: Lightning's FSDP2 save/load converts between numbers and names assuming module order, which
# scrambles the Adam moments of any optimizer with several groups (ours: decay / no decay) when a
# checkpoint moves between FSDP2 and DDP or one device. These two keep the plain numbering on both sides.
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
    # one aliased buffer (torch 2.13): offload only from an accelerator. Without offload every
    # rank gets the full state; Lightning writes rank 0's.
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


__all__ = ["full_optimizer_state", "load_full_optimizer_states", "optimizer_state_by_id", "optimizer_state_by_name"]
