"""The machinery shared by the upcycling callbacks: swap the network mid-run, rebuild the optimizer.

A subclass decides *what* the new network is (``transform``: one of the pure functions of
``moe_lit.convert``); this base decides *when* and carries the training state across:

* at the first training batch of each chosen optimizer step (``trainer.global_step == step``, at
  the start of an accumulation window) the module's network is replaced through
  ``MoELitModule.replace_model``, which also records the new shape in ``hparams['model']``; a
  checkpoint taken afterwards therefore rebuilds in the new shape (``MoELitModule.on_load_checkpoint``);
* the optimizer and LR scheduler are rebuilt by the module's own ``configure_optimizers``; the
  scheduler state and the param groups' hyper-parameters (lr, initial_lr, ...) are restored, so
  the LR schedule goes on where it was;
* ``optimizer_state='copy'`` carries the AdamW state over by parameter name: unchanged tensors keep
  theirs, grown ones take the rows of their sources (expert rows, router rows); tensors with no
  source (a new router after dense->MoE) start fresh. ``'reset'`` starts every tensor fresh;
* the next-token loss of the current batch is measured before and after the swap and logged
  (``upcycling/loss_before``, ``upcycling/loss_after``) with the new expert count;
* the callback state — the events done, with the source of every grown row by parameter name — is
  saved in checkpoints, so a resumed run does not transform twice.

Single-process training only: a DDP/FSDP wrapper would have to be rebuilt around the new network.

Shape legend: R rows of a grown parameter (dim 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from moe_lit.config import ConfigError
from moe_lit.convert.common import next_token_loss
from moe_lit.errors import MoeLitError
from moe_lit.model import Transformer

OPTIMIZER_STATES = ("copy", "reset")


def _positive_steps(at_steps: Sequence[int], owner: str) -> list[int]:
    steps = list(at_steps)
    if not steps or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in steps):
        raise ConfigError(f"{owner}.at_steps: need one or more integers >= 1, got {steps}")
    if sorted(set(steps)) != steps:
        raise ConfigError(f"{owner}.at_steps: must be strictly increasing, got {steps}")
    return steps


class ModelSwapCallback(pl.Callback):
    """Base class: replace ``pl_module.model`` by ``self.transform(model, step)`` at ``at_steps``."""

    def __init__(self, at_steps: Sequence[int], optimizer_state: str = "copy") -> None:
        super().__init__()
        name = type(self).__name__
        self.at_steps = _positive_steps(at_steps, name)
        if optimizer_state not in OPTIMIZER_STATES:
            raise ConfigError(
                f"{name}.optimizer_state: got {optimizer_state!r}, allowed values: {', '.join(OPTIMIZER_STATES)}"
            )
        self.optimizer_state = optimizer_state
        self.events: list[dict[str, Any]] = []
        """One entry per transform done: step, shapes, losses and grown rows by parameter name."""

    # ------------------------------------------------------------------ subclass API
    def transform(
        self, model: Transformer, step: int, batch_BL1: torch.Tensor
    ) -> tuple[Transformer, dict[str, torch.Tensor], dict[str, Any]]:
        """The new network; per grown parameter name, the source row of each of its rows; and
        JSON-ready details of the decision, recorded with the event."""
        raise NotImplementedError

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        name = type(self).__name__
        if not callable(getattr(pl_module, "replace_model", None)) or not isinstance(
            getattr(pl_module, "model", None), Transformer
        ):
            raise MoeLitError(f"{name}: needs a MoELitModule (a module with .model and .replace_model)")
        if trainer.world_size > 1:
            raise MoeLitError(f"{name}: swapping the network mid-run is single-process only (world_size=1)")

    def pending_step(self) -> int | None:
        """The next step still to transform at, if any."""
        done = {event["step"] for event in self.events}
        return next((s for s in self.at_steps if s not in done), None)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step != self.pending_step() or batch_idx % trainer.accumulate_grad_batches:
            return
        self.swap(trainer, pl_module, batch, step)

    def study_record(self) -> dict[str, Any]:
        """The expansion events (without the per-row sources) for a study record."""
        return {"events": [{k: v for k, v in e.items() if k != "row_sources"} for e in self.events]}

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"events": self.events}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.events = list(state_dict["events"])

    # ------------------------------------------------------------------ the swap
    def swap(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_BL1: torch.Tensor, step: int) -> None:
        old = pl_module.model
        new, row_sources, details = self.transform(old, step, batch_BL1)
        loss_before, loss_after = _eval_loss(old, batch_BL1), _eval_loss(new, batch_BL1)
        saved = _optimizer_state_by_name(trainer, old)
        schedulers = [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs]
        groups = [[_group_settings(g) for g in opt.param_groups] for opt in trainer.optimizers]
        pl_module.replace_model(new)
        trainer.strategy.setup_optimizers(trainer)
        _restore_schedule(trainer, schedulers, groups)
        if self.optimizer_state == "copy":
            _load_state_by_name(trainer, new, saved, row_sources)
        moe = new.config.moe
        event = {
            "step": step,
            "num_experts": moe.num_experts if moe else 0,
            "loss_before": loss_before,
            "loss_after": loss_after,
            "optimizer_state": self.optimizer_state,
            **details,
            "row_sources": {name: index.tolist() for name, index in row_sources.items()},
        }
        self.events.append(event)
        self._log(trainer, event)

    def _log(self, trainer: pl.Trainer, event: dict[str, Any]) -> None:
        rank_zero_info(
            f"{type(self).__name__}: step {event['step']}: now {event['num_experts']} experts; "
            f"batch loss {event['loss_before']:.4f} -> {event['loss_after']:.4f}"
        )
        metrics = {f"upcycling/{k}": float(event[k]) for k in ("num_experts", "loss_before", "loss_after")}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=event["step"])


@torch.no_grad()
def _eval_loss(model: Transformer, batch_BL1: torch.Tensor) -> float:
    was_training = model.training
    model.eval()  # NOTE: eval forwards leave the routers' training counts (bias balancing) alone
    try:
        return next_token_loss(model, batch_BL1).item()
    finally:
        model.train(was_training)


def _group_settings(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _optimizer_state_by_name(trainer: pl.Trainer, model: Transformer) -> dict[str, dict[str, Any]]:
    names = {id(p): n for n, p in model.named_parameters()}
    saved = {}
    for optimizer in trainer.optimizers:
        for param, state in optimizer.state.items():
            if id(param) in names and state:
                saved[names[id(param)]] = state
    return saved


def _restore_schedule(trainer: pl.Trainer, schedulers: list[dict], groups: list[list[dict]]) -> None:
    for config, state in zip(trainer.lr_scheduler_configs, schedulers, strict=False):
        config.scheduler.load_state_dict(state)
    for optimizer, settings in zip(trainer.optimizers, groups, strict=False):
        if len(optimizer.param_groups) != len(settings):
            raise MoeLitError(
                f"upcycling: configure_optimizers built {len(optimizer.param_groups)} param groups for the new "
                f"network but {len(settings)} for the old one; the LR schedule cannot be carried over"
            )
        for group, setting in zip(optimizer.param_groups, settings, strict=False):
            group.update(setting)


def _load_state_by_name(
    trainer: pl.Trainer, model: Transformer, saved: dict[str, dict[str, Any]], row_sources: dict[str, torch.Tensor]
) -> None:
    """Give every new parameter the saved state of its namesake: whole, or row-indexed when it grew."""
    for optimizer in trainer.optimizers:
        tracked = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for name, param in model.named_parameters():
            if id(param) not in tracked or name not in saved:
                continue
            state = saved[name]
            if name in row_sources:
                index_R = row_sources[name].to(param.device)
                optimizer.state[param] = {k: _rows(v, index_R, param) for k, v in state.items()}
            elif all(v.shape == param.shape for v in state.values() if torch.is_tensor(v) and v.dim() > 0):
                optimizer.state[param] = state


def _rows(value: Any, index_R: torch.Tensor, param: torch.Tensor) -> Any:
    """A per-row state tensor indexed to the grown shape; scalars (AdamW's step) copied."""
    if torch.is_tensor(value) and value.dim() > 0:
        return value[index_R].reshape(param.shape)
    return value.clone() if torch.is_tensor(value) else value


__all__ = ["OPTIMIZER_STATES", "ModelSwapCallback"]
