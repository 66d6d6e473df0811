"""DivergenceGuard: a non-finite loss (or gradient) never trains on and never reaches a checkpoint.

Before every optimizer step the guard asks whether any micro-batch of the step had a non-finite
loss (and, with ``check_grads``, whether any gradient is non-finite), agreed over all ranks so that
every rank takes the same decision. Then, by ``policy``:

* ``stop`` (default): raise :class:`DivergenceError` before the optimizer step, naming the step and
  the first non-finite tensor (a parameter, else a gradient, else only the loss). ``moe-lit fit``
  prints it as one line and exits with status 2; the weights were not updated;
* ``skip``: drop the step's gradients (the optimizer leaves every parameter and its moments as they
  were) and go on, at most ``max_skips`` times in a run; the next one stops as above.

Independently of the policy, a checkpoint whose weights hold a non-finite value is refused
(:class:`DivergenceError` from ``on_save_checkpoint``, before anything is written), so the last
good checkpoint is never overwritten by non-finite weights.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from moe_lit.config import ConfigError
from moe_lit.errors import MoeLitError

POLICIES = ("stop", "skip")


class DivergenceError(MoeLitError):
    """Training diverged (non-finite loss, gradient or weight); the message names step and tensor."""


def first_non_finite(named_tensors: Iterable[tuple[str, torch.Tensor | None]]) -> str | None:
    """Name of the first tensor holding a nan or inf (None when all are finite or absent)."""
    for name, tensor in named_tensors:
        if tensor is None or not torch.is_tensor(tensor) or not tensor.is_floating_point():
            continue
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor's shard
        if not torch.isfinite(local).all():
            return name
    return None


class DivergenceGuard(pl.Callback):
    """Stops (or skips the step) on a non-finite loss or gradient; never checkpoints non-finite weights."""

    def __init__(self, policy: str = "stop", max_skips: int = 10, check_grads: bool = False) -> None:
        """
        Args:
            policy: ``stop`` the run, or ``skip`` the optimizer step (at most ``max_skips`` times).
            max_skips: Steps the ``skip`` policy may drop in a run before it stops (>= 1).
            check_grads: Also check every gradient before each optimizer step (one pass over them).
        """
        super().__init__()
        if policy not in POLICIES:
            raise ConfigError(f"DivergenceGuard.policy: got {policy!r}, allowed values: {', '.join(POLICIES)}")
        if not (isinstance(max_skips, int) and not isinstance(max_skips, bool) and max_skips > 0):
            raise ConfigError(f"DivergenceGuard.max_skips: must be a positive integer, got {max_skips!r}")
        if not isinstance(check_grads, bool):
            raise ConfigError(f"DivergenceGuard.check_grads: must be true or false, got {check_grads!r}")
        self.policy, self.max_skips, self.check_grads = policy, max_skips, check_grads
        self.skipped_steps: list[int] = []
        self._bad_loss: float | None = None

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        # NOTE: with gradient accumulation this runs once per micro-batch; one bad one spoils the step.
        if self._bad_loss is None and not torch.isfinite(loss.detach()).all():
            self._bad_loss = loss.detach().float().item()

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        bad_grad = first_non_finite((n, p.grad) for n, p in pl_module.named_parameters()) if self.check_grads else None
        local = self._bad_loss is not None or bad_grad is not None
        bad_loss, self._bad_loss = self._bad_loss, None
        if not trainer.strategy.reduce_boolean_decision(local, all=False):
            return
        step = trainer.global_step + 1  # the step this update would have made
        what = f"loss {bad_loss}" if bad_loss is not None else "gradient" if local else "value on another rank"
        if self.policy == "skip" and len(self.skipped_steps) < self.max_skips:
            self.skipped_steps.append(step)
            optimizer.zero_grad(set_to_none=True)
            rank_zero_warn(
                f"DivergenceGuard: step {step}: non-finite {what}; step skipped "
                f"({len(self.skipped_steps)}/{self.max_skips})"
            )
            return
        raise DivergenceError(self._message(trainer, pl_module, step, what, bad_grad))

    def _message(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, what: str, bad_grad) -> str:
        weight = first_non_finite(pl_module.named_parameters())
        grad = bad_grad or first_non_finite((n, p.grad) for n, p in pl_module.named_parameters())
        tensor = f"weight {weight}" if weight else f"gradient of {grad}" if grad else "none of the weights or gradients"
        checkpoint = getattr(trainer.checkpoint_callback, "last_model_path", "") or "none written yet"
        skipped = f", {len(self.skipped_steps)} step(s) skipped before" if self.skipped_steps else ""
        return (
            f"training diverged at step {step}: non-finite {what}; first non-finite tensor: {tensor}{skipped}; "
            f"stopped before the update, last good checkpoint: {checkpoint}"
        )

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        name = first_non_finite(checkpoint.get("state_dict", {}).items())
        if name is not None:
            last = getattr(trainer.checkpoint_callback, "last_model_path", "") or "none written yet"
            raise DivergenceError(
                f"training diverged at step {trainer.global_step}: weight {name} is not finite; refusing to "
                f"write a checkpoint of it, last good checkpoint: {last}"
            )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"skipped_steps": list(self.skipped_steps)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped_steps = list(state_dict.get("skipped_steps", []))


__all__ = ["POLICIES", "DivergenceError", "DivergenceGuard", "first_non_finite"]
