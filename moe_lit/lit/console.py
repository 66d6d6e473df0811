"""What a run prints: a progress bar with the run's step and health, a model summary with our FLOPs,
one table per evaluation, and none of Lightning's harmless notices.

* :class:`MoEProgressBar` (a RichProgressBar): ``step/max_steps`` of the whole run (a resumed run
  continues where it stopped; epochs only count when there is no max_steps) and, refreshed every
  ``trainer.log_every_n_steps`` steps, what torchtitan shows: loss, ce, every auxiliary loss, lr,
  tokens/s (ThroughputMonitor), the mean load imbalance over MoE layers (the routers' last step) and
  the last validation loss.
* :class:`MoEModelSummary` (a RichModelSummary): the FLOPs column and "Total FLOPs" are the package's
  analytic training FLOPs per token (``moe_lit.accounting``; Lightning would measure a forward of an
  example input, which we do not give), followed by one line with forward FLOPs and active parameters.
* :func:`evaluation_table`: the per-language losses of ``validate``/``test`` as one table, a row per
  language, instead of Lightning's one column per dataloader.
* :func:`quiet_lightning`: drops Lightning's notices that say nothing about this run.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichModelSummary, RichProgressBar
from lightning.pytorch.utilities.model_summary import ModelSummary as Summary
from typing_extensions import override

from moe_lit.accounting import count_config_params, forward_flops_per_token

LIGHTNING_WARNINGS = (
    # NOTE: Lightning's CombinedLoader flattens the dataloaders with torch's deprecated LeafSpec
    # (lightning/pytorch/utilities/_pytree.py); nothing we pass changes it.
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    # NOTE: the training MixtureLoader runs in the main process (num_workers=0) and its len() is
    # exact, which is what this warning about multi-process loading asks for.
    r"Your `IterableDataset` has `__len__` defined",
)
"""Messages of the Lightning warnings :func:`quiet_lightning` ignores (regular expressions)."""
LIGHTNING_NOTICES = (
    "💡 Tip: For seamless cloud logging",  # an advertisement for litlogger
    "Trainer already configured with model summary callbacks",  # MoEModelSummary is ours on purpose
    # NOTE: save_checkpoint's default is the full checkpoint (optimizer and loops too), which is
    # what every save of ours wants; Lightning announces the default on each save.
    "`weights_only` was not set, defaulting to `False`",
)
"""Starts of the Lightning info lines :func:`quiet_lightning` drops."""
LIGHTNING_LOGGERS = (
    "lightning.pytorch.utilities.rank_zero",
    "lightning.fabric.utilities.rank_zero",
    "lightning.pytorch.trainer.connectors.checkpoint_connector",
)
"""The loggers those info lines come from."""


class _DropNotices(logging.Filter):
    @override
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(LIGHTNING_NOTICES)


@contextmanager
def quiet_lightning() -> Iterator[None]:
    """Inside the block, Lightning's :data:`LIGHTNING_WARNINGS` and :data:`LIGHTNING_NOTICES` are not shown."""
    notices = _DropNotices()
    loggers = [logging.getLogger(name) for name in LIGHTNING_LOGGERS]
    with warnings.catch_warnings():
        for message in LIGHTNING_WARNINGS:
            warnings.filterwarnings("ignore", message=message)
        for logger in loggers:
            logger.addFilter(notices)
        try:
            yield
        finally:
            for logger in loggers:
                logger.removeFilter(notices)


# ----------------------------------------------------------------------------- progress bar
def _si(value: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{suffix}"
    return f"{value:.1f}"


def step_metrics(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, str]:
    """The progress bar's fields: loss, ce, auxiliary losses, lr, tokens/s, load imbalance (formatted)."""
    from moe_lit.callbacks.routing_monitor import layer_metrics

    logged = trainer.callback_metrics
    shown: dict[str, str] = {}
    for key, name in (("train/loss", "loss"), ("train/ce", "ce")):
        if key in logged:
            shown[name] = f"{float(logged[key]):.3f}"
    for key, value in logged.items():
        if key.startswith("train/") and key not in ("train/loss", "train/ce", "train/lr"):
            shown[key.removeprefix("train/")] = f"{float(value):.4f}"
    if "val/loss" in logged:
        shown["val/loss"] = f"{float(logged['val/loss']):.3f}"
    if "train/lr" in logged:
        shown["lr"] = f"{float(logged['train/lr']):.2e}"
    tokens_per_s = _tokens_per_s(trainer)
    if tokens_per_s is not None and math.isfinite(tokens_per_s):
        shown["tok/s"] = _si(tokens_per_s)
    model = getattr(pl_module, "model", None)
    imbalance = layer_metrics(model.routing_stats()).get("routing/mean/load_imbalance") if model is not None else None
    if imbalance is not None:
        shown["imbalance"] = f"{imbalance:.2f}"
    return shown


def _tokens_per_s(trainer: pl.Trainer) -> float | None:
    """ThroughputMonitor's tokens/s of all devices (it logs only the per-device rate on one device)."""
    logged = trainer.logged_metrics
    if "train/items_per_sec" in logged:
        return float(logged["train/items_per_sec"])
    per_device = logged.get("train/device/items_per_sec")
    return None if per_device is None else float(per_device) * trainer.world_size


class MoEProgressBar(RichProgressBar):
    """RichProgressBar over the run's optimizer steps, with the run's health every log step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._shown: dict[str, str] = {}
        self._shown_step = -1

    def _counts_steps(self) -> bool:
        return self.trainer.max_steps is not None and self.trainer.max_steps > 0

    @property
    @override
    def total_train_batches(self) -> int | float:
        return self.trainer.max_steps if self._counts_steps() else super().total_train_batches

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        if not self._counts_steps():
            return super()._get_train_description(current_epoch)
        return f"{'Step':{len(self.validation_description)}}"

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        if self._counts_steps():
            self._update(self.train_progress_bar_id, trainer.global_step)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()
        self._update(self.train_progress_bar_id, trainer.global_step if self._counts_steps() else batch_idx + 1)
        self._update_metrics(trainer, pl_module)
        self.refresh()

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        # NOTE: recomputed at log steps only (the throughput and losses are logged then), and
        # without the logger's version number (v_num).
        step = trainer.global_step
        if step != self._shown_step and (step % trainer.log_every_n_steps == 0 or not self._shown):
            self._shown, self._shown_step = step_metrics(trainer, pl_module), step
        return dict(self._shown)


# ----------------------------------------------------------------------------- model summary
class AccountedSummary(Summary):
    """Lightning's model summary with the analytic training FLOPs per token of ``pl_module.model``."""

    @property
    @override
    def total_flops(self) -> int:
        return int(getattr(self._model, "flops_per_token", 0))

    @property
    @override
    def flop_counts(self) -> dict[str, dict[Any, int]]:
        return {name: ({"training": self.total_flops} if name == "model" else {}) for name in self.layer_names}


class MoEModelSummary(RichModelSummary):
    """RichModelSummary whose FLOPs are the package's training FLOPs per token, plus one accounting line."""

    @override
    def _summary(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Summary:
        return AccountedSummary(pl_module, max_depth=self._max_depth)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        config = getattr(pl_module, "config", None)
        if self._max_depth and trainer.is_global_zero and config is not None:
            from rich import get_console

            get_console().print(accounting_line(config), soft_wrap=True)


def accounting_line(config) -> str:
    """One line: what the summary's FLOPs are, and the active parameters per token."""
    counts = count_config_params(config)
    forward = forward_flops_per_token(config)
    return (
        f"FLOPs are per token (moe_lit.accounting, seq_len {config.seq_len}): training {3 * forward:,} "
        f"= 3 x forward {forward:,}; parameters: {counts.total:,} total, {counts.active:,} active per token"
    )


# ----------------------------------------------------------------------------- evaluation table
def evaluation_table(metrics: dict[str, Any], stage: str, languages: list[str]) -> list[dict[str, Any]]:
    """Rows ``{language, loss, ppl}`` (``<stage>/loss_<lang>``, ``<stage>/ppl_<lang>``), then ``overall``."""
    rows = []
    for name, suffix in [*((lang, f"_{lang}") for lang in languages), ("overall", "")]:
        loss = metrics.get(f"{stage}/loss{suffix}")
        if loss is not None:
            loss = float(loss)
            rows.append({"language": name, f"{stage}/loss": loss, f"{stage}/ppl": math.exp(loss)})
    return rows


__all__ = [
    "AccountedSummary",
    "MoEModelSummary",
    "MoEProgressBar",
    "accounting_line",
    "evaluation_table",
    "quiet_lightning",
    "step_metrics",
]
