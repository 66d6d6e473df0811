"""``train_run``: one training run built in code (no CLI), as ``make demo`` and the studies use it.

It trains ``model_cfg`` on a prepared data directory for a token budget, validates every
``eval_every`` steps and at the end, and returns a :class:`RunResult`. Everything it writes lies
under ``out_dir``: ``metrics.csv`` (CSVLogger, one row per logged step) and
``checkpoints/last.ckpt`` (overwritten every ``checkpoint_every`` steps and at the end; resume
with ``ckpt_path``).
"""

from __future__ import annotations

import csv
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, RichProgressBar, ThroughputMonitor
from lightning.pytorch.loggers import CSVLogger

from moe_lit.accounting import count_config_params, forward_flops_per_token
from moe_lit.callbacks import DivergenceGuard, RoutingMonitor
from moe_lit.config import ModelConfig
from moe_lit.errors import MoeLitError
from moe_lit.lit.module import MoELitModule
from moe_lit.lit.optim import OptimConfig

METRICS_FILE = "metrics.csv"
CHECKPOINT_DIR = "checkpoints"
LAST_CHECKPOINT = "last.ckpt"
MEAN_IMBALANCE = "routing/mean/load_imbalance"
EVALUATIONS_PER_RUN = 8
"""Default number of validations during a run (the curve the demo plots)."""


@dataclass
class RunResult:
    """What one training run measured."""

    total_params: int
    """Parameters of the model (analytic, equal to the built model's)."""
    active_params: int
    """Parameters touched by one token."""
    flops_per_token: int
    """Forward FLOPs per token (``moe_lit.accounting.forward_flops_per_token``; training is ~3x)."""
    tokens: int
    """Training tokens seen (steps x batch_size x seq_len)."""
    steps: int
    """Optimizer steps."""
    val_loss: float
    """Final validation cross-entropy (nats/token), over all validation tokens of all languages."""
    val_loss_per_language: dict[str, float]
    """Final validation cross-entropy per language."""
    tokens_per_s: float
    """Training throughput (tokens / training time, validation excluded; ThroughputMonitor)."""
    load_imbalance: float
    """max/mean tokens per expert, mean over MoE layers and over the logged steps of the second half
    of training (1.0 for a dense model: its FFN is one always-used expert)."""
    wall_s: float
    """Seconds of the whole run (training + validation)."""
    checkpoint: str
    """Path of the checkpoint of the final weights."""
    metrics_csv: str
    """Path of the CSV log."""


def tokens_in_batch(batch_BL1) -> int:
    """Predicted tokens of a (B, L+1) batch: the ThroughputMonitor's ``length_fn``."""
    return batch_BL1[:, 1:].numel()


def samples_in_batch(batch_BL1) -> int:
    return batch_BL1.shape[0]


def throughput_monitor() -> ThroughputMonitor:
    """Logs ``train/items_per_sec`` (tokens/s), ``train/flops_per_sec`` and, on a device whose peak
    Lightning knows (CUDA; none on CPU), ``train/device/mfu``."""
    return ThroughputMonitor(batch_size_fn=samples_in_batch, length_fn=tokens_in_batch, window_size=10)


def read_metrics(path: Union[str, Path]) -> list[dict[str, float]]:
    """Rows of a CSVLogger file with the empty cells dropped and the values as floats."""
    with open(path, newline="") as handle:
        return [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(handle)]


def last_value(rows: Sequence[dict[str, float]], key: str) -> float:
    values = [row[key] for row in rows if key in row]
    return values[-1] if values else math.nan


def train_run(
    model_cfg: ModelConfig,
    data_dir: Union[str, Path],
    out_dir: Union[str, Path],
    max_tokens: int,
    seq_len: int,
    batch_size: int,
    optim: OptimConfig,
    seed: int,
    val_batches: int,
    extra_callbacks: Iterable[Callback] = (),
    trainer_overrides: Optional[dict[str, Any]] = None,
    eval_every: Optional[int] = None,
    checkpoint_every: Optional[int] = None,
    ckpt_path: Optional[Union[str, Path]] = None,
) -> RunResult:
    """Train ``model_cfg`` (vocab size from the data, ``seq_len`` from here) for ``max_tokens``.

    ``eval_every`` / ``checkpoint_every`` are in optimizer steps (default: 8 validations per run,
    a checkpoint at each); ``trainer_overrides`` are Trainer arguments (precision, accelerator,
    gradient_clip_val, ...) that replace the defaults; ``ckpt_path`` resumes a run.
    """
    from moe_lit.lit.datamodule import MoEDataModule

    tokens_per_step = seq_len * batch_size
    steps = max_tokens // tokens_per_step
    if steps < 1:
        raise MoeLitError(f"max_tokens: {max_tokens} is less than one batch (seq_len*batch_size={tokens_per_step})")
    overrides = dict(trainer_overrides or {})
    if "callbacks" in overrides:
        raise MoeLitError("trainer_overrides: pass callbacks as extra_callbacks, not as trainer_overrides['callbacks']")
    eval_every = eval_every or max(1, steps // EVALUATIONS_PER_RUN)
    out_dir = Path(out_dir)
    start = time.perf_counter()
    pl.seed_everything(seed, verbose=False)
    datamodule = MoEDataModule(
        str(data_dir), seq_len=seq_len, batch_size=batch_size, val_batches=val_batches, seed=seed
    )
    cfg = model_cfg.replace(vocab_size=datamodule.vocab_size, seq_len=seq_len)
    module = MoELitModule(cfg, optim)
    trainer = pl.Trainer(**_trainer_kwargs(out_dir, steps, eval_every, checkpoint_every, extra_callbacks, overrides))
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    # NOTE: ModelCheckpoint writes last.ckpt every checkpoint_every steps only; the run's result
    # is the final weights, so they are saved there too.
    trainer.save_checkpoint(out_dir / CHECKPOINT_DIR / LAST_CHECKPOINT, weights_only=False)
    if "val_check_interval" in overrides or trainer.global_step % eval_every != 0:
        trainer.validate(module, datamodule=datamodule, verbose=False)
    wall_s = time.perf_counter() - start
    return _result(module, trainer, datamodule.languages, tokens_per_step, out_dir, wall_s)


def _trainer_kwargs(
    out_dir: Path, steps: int, eval_every: int, checkpoint_every: Optional[int],
    extra_callbacks: Iterable[Callback], overrides: dict[str, Any],
) -> dict[str, Any]:
    checkpoint = ModelCheckpoint(
        dirpath=out_dir / CHECKPOINT_DIR,
        save_last=True,
        save_top_k=0,
        every_n_train_steps=checkpoint_every or eval_every,
    )
    log_every = max(1, min(50, eval_every // 4))
    callbacks = [checkpoint, throughput_monitor(), RoutingMonitor(every_n_steps=log_every), *extra_callbacks]
    callbacks.append(DivergenceGuard())
    if overrides.get("enable_progress_bar", True):
        callbacks.append(RichProgressBar())
    kwargs = {
        "max_steps": steps,
        "val_check_interval": eval_every,
        "check_val_every_n_epoch": None,
        "num_sanity_val_steps": 0,
        "log_every_n_steps": log_every,
        "logger": CSVLogger(out_dir, name="", version=""),
        "enable_model_summary": False,
        "default_root_dir": out_dir,
    }
    kwargs.update(overrides)
    kwargs["callbacks"] = callbacks
    return kwargs


def _load_imbalance(module: MoELitModule, rows: Sequence[dict[str, float]], steps: int) -> float:
    """Mean logged ``routing/mean/load_imbalance`` of the second half of training; the last step's
    routing statistics when nothing was logged there; 1.0 for a dense model."""
    layers = module.model.moe_layers()
    if not layers:
        return 1.0
    late = [row[MEAN_IMBALANCE] for row in rows if MEAN_IMBALANCE in row and row.get("step", 0) >= steps / 2]
    late = late or [sum(stats.load_imbalance for stats in module.model.routing_stats().values()) / len(layers)]
    return sum(late) / len(late)


def _result(
    module: MoELitModule, trainer: pl.Trainer, languages: list[str], tokens_per_step: int, out_dir: Path,
    wall_s: float,
) -> RunResult:
    cfg = module.config
    counts = count_config_params(cfg)
    metrics_csv = out_dir / METRICS_FILE
    rows = read_metrics(metrics_csv)
    final = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/loss")}
    steps = trainer.global_step
    return RunResult(
        total_params=counts.total,
        active_params=counts.active,
        flops_per_token=forward_flops_per_token(cfg),
        tokens=steps * tokens_per_step,
        steps=steps,
        val_loss=final.get("val/loss", math.nan),
        val_loss_per_language={lang: final.get(f"val/loss_{lang}", math.nan) for lang in languages},
        tokens_per_s=last_value(rows, "train/lengths") / last_value(rows, "train/time"),
        load_imbalance=_load_imbalance(module, rows, steps),
        wall_s=round(wall_s, 3),
        checkpoint=str(out_dir / CHECKPOINT_DIR / LAST_CHECKPOINT),
        metrics_csv=str(metrics_csv),
    )


__all__ = ["RunResult", "read_metrics", "throughput_monitor", "train_run"]
