"""Callbacks that record what a run measured: the validation curve (every train_run), fork
checkpoints, validation probes and expert-copy separation (the study engine and its kinds).

Each callback with a ``study_record() -> dict`` method adds that dict to its point's record
(:func:`moe_lit.studies.run.run_point`).

Shape legend: E experts, S stacked expert rows, D d_model (see ``model/experts/layout.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from moe_lit.config import ConfigError
from moe_lit.convert.common import next_token_loss


def _steps(steps: Any, owner: str) -> list[int]:
    values = sorted(int(s) for s in steps)
    if not values or any(s < 0 for s in values):
        raise ConfigError(f"{owner}: steps must be integers >= 0, got {steps!r}")
    return values


class ValidationCurve(pl.Callback):
    """``{step, val_loss}`` of every validation of a run, keyed by the optimizer step.

    NOTE: the step column of Lightning's logs for validation rows is the count of batches that
    stepped *before* the validation, one less than ``trainer.global_step``; this records the
    step of the weights that were validated.
    """

    def __init__(self) -> None:
        super().__init__()
        self.curve: list[dict[str, float]] = []

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or "val/loss" not in trainer.callback_metrics:
            return
        point = {"step": trainer.global_step, "val_loss": float(trainer.callback_metrics["val/loss"])}
        self.curve = [p for p in self.curve if p["step"] != point["step"]] + [point]

    @override
    def state_dict(self) -> dict[str, Any]:
        # NOTE: in the checkpoint, so that a resumed run's curve starts at its first validation.
        return {"curve": [dict(p) for p in self.curve]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.curve = [dict(p) for p in state_dict.get("curve", [])]


class SaveAtSteps(pl.Callback):
    """Save a full checkpoint (weights, optimizer, schedule, data position) right after given
    optimizer steps: the checkpoints child points fork from."""

    def __init__(self, paths: Mapping[int, Path]) -> None:
        super().__init__()
        _steps(paths, "SaveAtSteps")
        self.paths = {int(step): Path(path) for step, path in paths.items()}

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        path = self.paths.get(trainer.global_step)
        if path is not None and not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            trainer.save_checkpoint(path)


class ValidationProbe(pl.Callback):
    """Validation loss (all languages) of the current network at the start of optimizer step
    ``step``, measured before the callbacks listed after it act: put one before and one after a
    model-swap callback to see the loss jump of the swap itself (same weights, no step between)."""

    def __init__(self, step: int, key: str) -> None:
        super().__init__()
        self.step = _steps([step], "ValidationProbe")[0]
        self.key = key
        self.value: float | None = None

    @override
    @torch.no_grad()
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx) -> None:
        if trainer.global_step != self.step or self.value is not None:
            return
        model = pl_module.model
        model.eval()
        total = tokens = 0.0
        for loader in trainer.datamodule.val_dataloader():
            for batch_BL1 in loader:
                n = batch_BL1[:, 1:].numel()
                total += next_token_loss(model, batch_BL1.to(pl_module.device)).item() * n
                tokens += n
        model.train()
        self.value = total / tokens

    def study_record(self) -> dict[str, Any]:
        return {f"probe_{self.key}": self.value}


class CopySeparation(pl.Callback):
    """How far expert copies move from their sources after an expansion.

    Every ``every`` optimizer steps after the first model swap of the run (an
    :class:`~moe_lit.callbacks.expert_upcycling.ExpertUpcycling` event), per MoE layer and copy: the
    cosine similarity of the copy's stacked expert rows (w1, v1, w2 concatenated) to its source's,
    and the tokens each expert received in the last step. With top-k >= 2 a copy and its source
    are often selected together with equal weights and then get equal gradients: this measures
    whether they separate at all.
    """

    def __init__(self, every: int = 10) -> None:
        super().__init__()
        if not isinstance(every, int) or every < 1:
            raise ConfigError(f"CopySeparation.every: must be an integer >= 1, got {every!r}")
        self.every = every
        self.series: list[dict[str, Any]] = []

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        event = _first_swap(trainer)
        if event is None or (trainer.global_step - event["step"]) % self.every:
            return
        self.series.append({"step": trainer.global_step, "layers": _separation(pl_module.model, event["sources"])})

    def study_record(self) -> dict[str, Any]:
        return {"copy_separation": self.series}

    @staticmethod
    def last(series: list[dict[str, Any]]) -> tuple[float, float, float]:
        """At the last measurement of ``series`` (a record's ``copy_separation``): the mean cosine of
        the copies to their sources, the fraction still > 0.99, and the share of routed tokens that
        went to copies (0.5 = as many as the sources); NaNs for an empty series."""
        if not series:
            return math.nan, math.nan, math.nan
        layers = list(series[-1]["layers"].values())
        cosines = [c for layer in layers for c in layer["cosine"]]
        copies = [(lay["tokens"][len(lay["tokens"]) - len(lay["cosine"]) :], lay["tokens"]) for lay in layers]
        shares = [sum(copied) / max(1.0, sum(tokens)) for copied, tokens in copies]
        return sum(cosines) / len(cosines), sum(c > 0.99 for c in cosines) / len(cosines), sum(shares) / len(shares)

    @staticmethod
    def cosines(series: list[dict[str, Any]]) -> dict[int, float]:
        """step -> mean cosine of the copies to their sources (over layers and copies) in ``series``."""
        by_step = {e["step"]: [c for layer in e["layers"].values() for c in layer["cosine"]] for e in series}
        return {step: sum(values) / len(values) for step, values in by_step.items()}


def _first_swap(trainer: pl.Trainer) -> dict[str, Any] | None:
    from moe_lit.callbacks.expert_upcycling import ExpertUpcycling

    for callback in trainer.callbacks:
        if isinstance(callback, ExpertUpcycling) and callback.events:
            return callback.events[0]
    return None


@torch.no_grad()
def _separation(model, sources: Mapping[str, list[int]]) -> dict[str, Any]:
    """block -> {cosine: [per copy], tokens: [per expert]}; ``sources[block][m]`` is the source of
    new expert m, the first E entries being the sources themselves."""
    out = {}
    for block, src in sources.items():
        ffn = model.blocks[int(block)].ffn
        layout = ffn.experts.layout
        rows = [
            torch.cat(
                [w[layout.rows(e)].flatten() for w in (ffn.experts.mlp.w1, ffn.experts.mlp.v1, ffn.experts.mlp.w2)]
            )
            for e in range(layout.num_experts)
        ]
        num_sources = len(set(src))
        cosine = [
            float(torch.nn.functional.cosine_similarity(rows[m], rows[src[m]], dim=0))
            for m in range(num_sources, len(src))
        ]
        out[block] = {"cosine": cosine, "tokens": ffn.router.tokens_per_expert.tolist()}
    return out


__all__ = ["CopySeparation", "SaveAtSteps", "ValidationCurve", "ValidationProbe"]
