"""Every private torch / Lightning / lm-eval API that moe_lit uses, behind one version check.

Private APIs change without deprecation, so each one is reached only through a function of this
module, which first checks the installed release against the range this code was tested with
(:data:`TESTED`: the versions pinned in ``requirements/lock.txt``, later patch releases included).
Outside that range the call fails with one line naming the package, its version and the range;
``MOE_LIT_ALLOW_UNTESTED=1`` in the environment lets it run anyway. Where a public API exists
(``F.grouped_mm``) it is used, unchecked.

Private API -> the function that reaches it:

* ``torch._grouped_mm`` (only where torch < 2.10 has no ``F.grouped_mm``) -> :func:`grouped_mm_op`
* ``torch.distributed.fsdp._common_utils.clean_tensor_name`` -> :func:`clean_tensor_name`
* ``torch.distributed._composable.checkpoint`` -> :func:`composable_checkpoint`
* ``lightning.fabric.strategies.model_parallel._load_raw_module_state`` -> :func:`load_raw_module_state`
* ``ModelParallelStrategy._data_parallel_size`` -> :func:`resolve_data_parallel_size`
* ``ModelParallelStrategy._save_distributed_checkpoint`` -> :func:`saves_distributed_checkpoint`
* ``FSDPStrategy._state_dict_type`` -> :func:`fsdp_state_dict_type`
* ``LightningModule._trainer`` (the public ``trainer`` raises when detached) -> :func:`attached_trainer`
* ``LightningCLI._parse_ckpt_path`` (a hook ``lit/lightning_cli.py`` overrides) -> :func:`require_tested` there
* ``lm_eval.tasks._yaml_loader.load_yaml`` -> :func:`load_task_yaml`
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from moe_lit.errors import MoeLitError

ALLOW_UNTESTED_ENV = "MOE_LIT_ALLOW_UNTESTED"
"""Set to 1 to call the private APIs on releases outside :data:`TESTED`."""

TESTED: dict[str, str] = {"torch": "~=2.13.0", "lightning": "~=2.6.6", "lm_eval": "~=0.4.13"}
"""Release range per package whose private APIs we call: ``~=X.Y.Z`` is the locked X.Y.Z and its patch releases."""


def installed_version(package: str) -> str:
    """The ``__version__`` of an importable package (cheap: no metadata scan)."""
    module = __import__(package)
    return str(module.__version__)


def require_tested(package: str) -> bool:
    """Whether ``package``'s installed release is inside :data:`TESTED`: True, or False when an
    untested one is allowed by the environment; raise otherwise."""
    version = installed_version(package)
    # NOTE: a local build tag (2.13.0+cpu) is the same release for the API.
    if Version(version).public in SpecifierSet(TESTED[package]):
        return True
    if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        return False
    raise MoeLitError(
        f"{package} {version}: moe_lit uses private {package} APIs tested only with {package}{TESTED[package]} "
        f"(requirements/lock.txt); install that, or set {ALLOW_UNTESTED_ENV}=1 to try this release"
    )


def grouped_mm_op() -> Callable[..., torch.Tensor] | None:
    """``F.grouped_mm`` (public since torch 2.10), else ``torch._grouped_mm`` (2.8+), else None."""
    public = getattr(torch.nn.functional, "grouped_mm", None)
    if public is not None:
        return public
    private = getattr(torch, "_grouped_mm", None)
    if private is not None:
        require_tested("torch")
    return private


def clean_tensor_name(name: str) -> str:
    """A parameter name without FSDP1 / activation-checkpoint wrapper prefixes (torch's own helper)."""
    require_tested("torch")
    from torch.distributed.fsdp._common_utils import clean_tensor_name as clean

    return clean(name)


def composable_checkpoint(module: torch.nn.Module) -> None:
    """Activation checkpointing hooked into ``module`` in place (no wrapper submodule, names unchanged)."""
    require_tested("torch")
    from torch.distributed._composable import checkpoint

    checkpoint(module)


def load_raw_module_state(state_dict: dict[str, Any], module: torch.nn.Module, world_size: int, strict: bool) -> None:
    """Lightning's load of a full (unsharded) state dict into a module sharded by FSDP2."""
    require_tested("lightning")
    from lightning.fabric.strategies.model_parallel import _load_raw_module_state

    _load_raw_module_state(state_dict, module, world_size=world_size, strict=strict)


def resolve_data_parallel_size(strategy: Any) -> None:
    """Fill ``ModelParallelStrategy``'s ``"auto"`` data-parallel size with every process (pure data parallelism)."""
    require_tested("lightning")
    if strategy._data_parallel_size == "auto":
        strategy._data_parallel_size = strategy.num_nodes * strategy.num_processes


def saves_distributed_checkpoint(strategy: Any) -> bool:
    """Whether a ``ModelParallelStrategy`` writes one checkpoint file per rank."""
    require_tested("lightning")
    return bool(strategy._save_distributed_checkpoint)


def fsdp_state_dict_type(strategy: Any) -> str:
    """``"full"`` or ``"sharded"``: the ``state_dict_type`` an ``FSDPStrategy`` was built with."""
    require_tested("lightning")
    return str(strategy._state_dict_type)


def attached_trainer(module: Any) -> Any:
    """The Trainer a LightningModule is attached to, or None (the public ``trainer`` raises then)."""
    require_tested("lightning")
    return getattr(module, "_trainer", None)


def load_task_yaml(path: Path) -> dict[str, Any]:
    """An lm-eval task YAML as lm-eval reads it (its ``!function`` tags left unresolved: no code runs)."""
    require_tested("lm_eval")
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(path, resolve_func=False)
