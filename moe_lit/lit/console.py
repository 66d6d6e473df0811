"""What a run prints: a progress bar (on a terminal) or plain step lines (in a log), a model summary
with our FLOPs, one table per evaluation, and none of Lightning's harmless notices.

* :func:`progress_bar`: :class:`MoEProgressBar` when stdout is a terminal, :class:`StepLines` when it
  is not (CI, SLURM, ``make demo > log``);
* :class:`MoEProgressBar` (a RichProgressBar): one line of at most the terminal's width,
  ``step/max_steps`` of the whole run (a resumed run continues where it stopped; epochs only count
  when there is no max_steps), the ETA and, refreshed every ``trainer.log_every_n_steps`` steps,
  as many of the run's health fields as fit, most telling first: loss, lr, tokens/s
  (ThroughputMonitor), the mean load imbalance over MoE layers (the routers' last step), the last
  validation loss, ce, every auxiliary loss;
* :class:`StepLines`: a plain line every ``log_every_n_steps`` optimizer steps and at least every
  ``max_interval_s`` seconds (step, loss, ..., lr, tok/s, ETA), and one per validation inside fit;
  no escape codes;
* :class:`MoEModelSummary` (a RichModelSummary): the FLOPs column and "Total FLOPs" are the package's
  analytic training FLOPs per token (``moe_lit.accounting``; Lightning would measure a forward of an
  example input, which we do not give), followed by one line with forward FLOPs and active parameters.
* :func:`evaluation_table`: the per-language losses of ``validate``/``test`` as one table, a row per
  language, instead of Lightning's one column per dataloader.
* :func:`quiet_lightning`: drops Lightning's notices that say nothing about this run, and prints
  every warning as one line (:func:`warning_line`: no dangling source line such as ``rank_zero_warn(``).
"""

from __future__ import annotations

import logging
import math
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar, RichModelSummary, RichProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import BatchesProcessedColumn, CustomBarColumn
from lightning.pytorch.utilities.model_summary import ModelSummary as Summary
from rich.progress import ProgressColumn, Task, TextColumn
from rich.style import Style
from rich.text import Text
from typing_extensions import override

from moe_lit.accounting import count_config_params, forward_flops_per_token
from moe_lit.config import ConfigError

LIGHTNING_WARNINGS = (
    # NOTE: Lightning's CombinedLoader flattens the dataloaders with torch's deprecated LeafSpec
    # (lightning/pytorch/utilities/_pytree.py); nothing we pass changes it.
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    # NOTE: the training MixtureLoader runs in the main process (num_workers=0) and its len() is
    # exact, which is what this warning about multi-process loading asks for.
    r"Your `IterableDataset` has `__len__` defined",
    # NOTE: train_run resumes into its own directory and keeps the earlier rows of metrics.csv.
    r"Experiment logs directory .* exists and is not empty",
)
"""Messages of the Lightning warnings :func:`quiet_lightning` ignores (regular expressions)."""
LIGHTNING_NOTICES = (
    "💡 Tip: For seamless cloud logging",  # an advertisement for litlogger
    "Trainer already configured with model summary callbacks",  # MoEModelSummary is ours on purpose
    # NOTE: save_checkpoint's default is the full checkpoint (optimizer and loops too), which is
    # what every save of ours wants; Lightning announces the default on each save.
    "`weights_only` was not set, defaulting to `False`",
    # NOTE: the accelerator a run uses is its config's; Lightning's inventory of absent ones is noise
    # (a GPU present but unused still warns).
    "GPU available:",
    "TPU available:",
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


def warning_line(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None
) -> str:
    """``warnings.formatwarning`` without the source line: ``file:line: Category: message``.

    NOTE: Python adds the source line of the call that warned, which for Lightning's
    ``rank_zero_warn(`` calls spread over several lines is that bare first line."""
    return f"{filename}:{lineno}: {category.__name__}: {message}\n"


@contextmanager
def quiet_lightning() -> Iterator[None]:
    """Inside the block, Lightning's :data:`LIGHTNING_WARNINGS` and :data:`LIGHTNING_NOTICES` are not
    shown and every other warning is printed as :func:`warning_line`."""
    notices = _DropNotices()
    loggers = [logging.getLogger(name) for name in LIGHTNING_LOGGERS]
    formatwarning = warnings.formatwarning
    with warnings.catch_warnings():
        for message in LIGHTNING_WARNINGS:
            warnings.filterwarnings("ignore", message=message)
        for logger in loggers:
            logger.addFilter(notices)
        # NOTE: formatwarning, not showwarning: warnings recorded (pytest, catch_warnings) stay recorded.
        warnings.formatwarning = warning_line
        try:
            yield
        finally:
            warnings.formatwarning = formatwarning
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


SHOWN_FIRST = ("loss", "lr", "tok/s", "imbalance", "val/loss", "ce")
"""The health fields a narrow progress bar keeps first (then the auxiliary losses)."""
BAR_WIDTH = 10
"""Characters of the bar itself."""
ETA_WIDTH = len("eta 00:00:00")


def by_importance(shown: dict[str, str]) -> list[tuple[str, str]]:
    """The fields of :func:`step_metrics`, :data:`SHOWN_FIRST` first, the others in their order."""
    first = [(name, shown[name]) for name in SHOWN_FIRST if name in shown]
    return first + [(name, value) for name, value in shown.items() if name not in SHOWN_FIRST]


def fitting_metrics(shown: dict[str, str], width: int) -> dict[str, str]:
    """The most telling fields whose ``name: value`` texts, space-separated, fit in ``width`` characters."""
    kept: dict[str, str] = {}
    used = 0
    for name, value in by_importance(shown):
        cost = len(f"{name}: {value}") + (1 if kept else 0)
        if used + cost > width:
            break
        kept[name], used = value, used + cost
    return kept


def eta(seconds: float | None) -> str:
    """``h:mm:ss``, hours past 24 included (``-:--:--`` when unknown)."""
    if seconds is None or not math.isfinite(seconds):
        return "-:--:--"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02}:{secs:02}"


class EtaColumn(ProgressColumn):
    """``eta h:mm:ss``: the task's remaining time at its recent speed."""

    max_refresh = 0.5  # NOTE: as Lightning's time column: a steadier number

    def __init__(self, style: str | Style) -> None:
        self.style = style
        super().__init__()

    @override
    def render(self, task: Task) -> Text:
        return Text(f"eta {eta(task.time_remaining)}", style=self.style)


class MoEProgressBar(RichProgressBar):
    """RichProgressBar over the run's optimizer steps on one terminal line: step, ETA and the run's
    health every log step, as much of it as fits the width."""

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
        return "Step"

    @property
    @override
    def validation_description(self) -> str:
        return "Val"  # NOTE: the rows share the column's width: "Validation" would cost every row 6 characters

    @override
    def configure_columns(self, trainer: pl.Trainer) -> list:
        # NOTE: Lightning's columns (a 40-character bar, elapsed and remaining time, it/s) fill an
        # 80-column terminal before any metric, which then wraps over several lines.
        return [
            TextColumn("[progress.description]{task.description}"),
            CustomBarColumn(
                bar_width=BAR_WIDTH,
                complete_style=self.theme.progress_bar,
                finished_style=self.theme.progress_bar_finished,
                pulse_style=self.theme.progress_bar_pulse,
            ),
            BatchesProcessedColumn(style=self.theme.batch_progress),
            EtaColumn(style=self.theme.time),
        ]

    def metrics_width(self, console_width: int) -> int:
        """Characters left for the metrics after the other columns (as wide as their widest row)."""
        total = self.total_train_batches
        count = f"{total}/{total}" if math.isfinite(total) else "--/--"
        description = max(len("Step"), len(self.validation_description))  # the rows shown beside each other
        columns = (description, BAR_WIDTH, len(count), ETA_WIDTH)
        return max(0, console_width - sum(columns) - len(columns) - 1)

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
        width = self._console.width if self._console is not None else 80
        return fitting_metrics(self._shown, self.metrics_width(width))


class StepLines(ProgressBar):
    """The progress of a run as plain lines, for a stdout that is not a terminal (a log file)."""

    def __init__(self, every_n_steps: int | None = None, max_interval_s: float = 20.0) -> None:
        """
        Args:
            every_n_steps: A line after every N-th optimizer step (None: ``trainer.log_every_n_steps``).
            max_interval_s: Also a line after a step that ends this many seconds after the last line.
        """
        super().__init__()
        if every_n_steps is not None and not (isinstance(every_n_steps, int) and every_n_steps > 0):
            raise ConfigError(f"StepLines.every_n_steps: must be a positive integer or null, got {every_n_steps!r}")
        if not (isinstance(max_interval_s, int | float) and max_interval_s > 0):
            raise ConfigError(f"StepLines.max_interval_s: must be a positive number, got {max_interval_s!r}")
        self.every_n_steps, self.max_interval_s = every_n_steps, float(max_interval_s)
        self._enabled = True
        self._start = (0.0, 0)
        self._last_line = 0.0

    @override
    def disable(self) -> None:
        self._enabled = False

    @override
    def enable(self) -> None:
        self._enabled = True

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = (time.monotonic(), trainer.global_step)
        self._last_line = self._start[0]

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step, now = trainer.global_step, time.monotonic()
        every = self.every_n_steps or trainer.log_every_n_steps
        due = step % every == 0 or step == self._start[1] + 1 or now - self._last_line >= self.max_interval_s
        if self._enabled and trainer.is_global_zero and due and step > self._start[1]:
            self._emit(step_line(trainer, step_metrics(trainer, pl_module), self._remaining_s(trainer, now)), now)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        val_loss = trainer.callback_metrics.get("val/loss")
        if not self._enabled or not trainer.is_global_zero or trainer.sanity_checking or val_loss is None:
            return
        if trainer.state.fn == "fit":
            self._emit(f"{_step_of(trainer)}  val/loss {float(val_loss):.3f}", time.monotonic())

    def _remaining_s(self, trainer: pl.Trainer, now: float) -> float | None:
        started, first = self._start
        done = trainer.global_step - first
        if not (trainer.max_steps and trainer.max_steps > 0) or done <= 0:
            return None
        return (now - started) / done * (trainer.max_steps - trainer.global_step)

    def _emit(self, line: str, now: float) -> None:
        print(line, flush=True)
        self._last_line = now


def _step_of(trainer: pl.Trainer) -> str:
    total = f"/{trainer.max_steps}" if trainer.max_steps and trainer.max_steps > 0 else ""
    return f"step {trainer.global_step}{total}"


def step_line(trainer: pl.Trainer, shown: dict[str, str], remaining_s: float | None) -> str:
    """``step 40/2000  loss 6.123  lr 3.00e-04  tok/s 12.3k  ...  eta 0:04:30``."""
    fields = [f"{name} {value}" for name, value in by_importance(shown)]
    return "  ".join([_step_of(trainer), *fields, f"eta {eta(remaining_s)}"])


def progress_bar(stream: TextIO | None = None) -> ProgressBar:
    """:class:`MoEProgressBar` when ``stream`` (stdout) is a terminal, else :class:`StepLines`."""
    stream = sys.stdout if stream is None else stream
    return MoEProgressBar() if stream.isatty() else StepLines()


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
    "StepLines",
    "accounting_line",
    "evaluation_table",
    "fitting_metrics",
    "progress_bar",
    "quiet_lightning",
    "warning_line",
    "step_line",
    "step_metrics",
]
