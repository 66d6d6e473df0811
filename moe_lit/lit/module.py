"""MoELitModule: next-token training of a dense or MoE :class:`~moe_lit.model.Transformer`.

Shape legend: B batch, L sequence (the batch holds L+1 tokens: inputs [:, :-1], targets [:, 1:]),
V vocabulary.

Training logs ``train/ce``, every auxiliary loss by name (``train/load_balancing``,
``train/z_loss``), their sum ``train/loss``, ``train/lr`` and, when the Trainer clips by norm
(``gradient_clip_val``), the gradient norm before clipping ``train/grad_norm``. Validation and test keep a
token-weighted mean cross-entropy per language (dataloader ``i`` is language ``i`` of the
datamodule's ``languages``) and overall, and log ``<stage>/loss``, ``<stage>/ppl``,
``<stage>/loss_<lang>`` and ``<stage>/ppl_<lang>``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torchmetrics import MeanMetric
from typing_extensions import override

from moe_lit.accounting import training_flops_per_token
from moe_lit.config import ConfigError, ModelConfig
from moe_lit.distributed.grad_norm import clip_grad_norm
from moe_lit.lit.optim import OptimConfig, build_optimizer, resumed_schedule_steps
from moe_lit.model import Transformer

OVERALL = "overall"
RUN_STATE = "moe_lit_run"
"""Checkpoint key of what a resume keeps and checks: ``model``, the config the run started with
(before any upcycling grew it), and ``precision``, the Trainer's (``train.precision: auto``
decides once per run)."""


class MoELitModule(pl.LightningModule):
    """Lightning wrapper: losses, metrics, optimizer; the network is ``self.model`` (prefix ``model.``)."""

    def __init__(self, model: ModelConfig, optim: OptimConfig = OptimConfig()) -> None:  # noqa: B008 - never mutated
        """
        Args:
            model: The network to train (dense or MoE).
            optim: AdamW and its learning-rate schedule.
        """
        super().__init__()
        # NOTE: checkpoints store both configs as plain dicts (on_save_checkpoint), which
        # load_from_checkpoint passes back here.
        model = ModelConfig.from_dict(model)
        optim = OptimConfig.from_dict(optim)
        # NOTE: moe_lit.checkpoint rebuilds the network from hyper_parameters['model'].
        self.save_hyperparameters()
        self.config = model
        self.started_config = model
        """The model the run started as (``config`` is the current one, grown by upcycling)."""
        self.optim_config = optim
        self.extend_schedule = "keep"
        """What a resume with another step budget does with the schedule (TrainConfig.extend_schedule)."""
        self.schedule_steps: int | None = None
        """Steps the lr schedule spans: the run's first budget, restored from its checkpoint on resume."""
        # NOTE: the network is built here (not in configure_model) so that a module is usable
        # right after construction; a sharded strategy can move this into configure_model.
        self.model = Transformer(model)
        self.flops_per_token = training_flops_per_token(model)
        self.flops_per_batch: int | None = None
        """Training FLOPs of the last training batch: ThroughputMonitor reads it for flops/s and MFU."""
        # NOTE: one MeanMetric per (stage, language), created when the number of evaluation
        # dataloaders is known; metric states are not part of the state dict.
        self.eval_metrics = nn.ModuleDict()

    @override
    def configure_model(self) -> None:
        # NOTE: FSDP2 (moe_lit.lit.strategies.FSDP2Strategy) shards the built network here; every
        # other strategy wraps the module itself and this is a no-op.
        from moe_lit.lit.strategies import shard_for_strategy

        shard_for_strategy(self)

    # ------------------------------------------------------------------ training
    def forward(self, idx_BL: torch.Tensor):
        return self.model(idx_BL)

    # ------------------------------------------------------------------ growing the model (upcycling)
    def replace_model(self, model: Transformer) -> None:
        """Swap the network for one of another shape; the hyper-parameters record the new shape."""
        self.model = model
        self.config = model.config
        self.hparams["model"] = model.config
        self.flops_per_token = training_flops_per_token(model.config)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # NOTE: a model grown mid-run (moe_lit.callbacks upcycling) saved its new shape in
        # hyper_parameters['model']; rebuild in that shape before Lightning loads the weights.
        saved = checkpoint.get("hyper_parameters", {}).get("model")
        if saved is not None:
            saved = ModelConfig.from_dict(saved)
        if saved is not None and saved != self.config:
            self.replace_model(Transformer(saved).to(self.device))
        state = checkpoint.get(RUN_STATE) or {}
        if state.get("model") is not None:
            self.started_config = ModelConfig.from_dict(state["model"])
        self.schedule_steps = state.get("schedule_steps", self.schedule_steps)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # NOTE: config dataclasses become plain dicts: the checkpoint then loads with
        # torch.load(weights_only=True) (the default of `fit(ckpt_path=...)`), and LightningCLI's
        # `--ckpt_path` can parse its hyper-parameters back into a config.
        hparams = checkpoint.get("hyper_parameters", {})
        for key, value in hparams.items():
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                hparams[key] = dataclasses.asdict(value)
        checkpoint[RUN_STATE] = {
            "model": self.started_config.to_dict(),
            "precision": str(self.trainer.precision),
            "schedule_steps": self.schedule_steps,
        }

    def _losses(self, batch_BL1: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Cross-entropy (mean over tokens, fp32) and the model's weighted auxiliary losses."""
        inputs_BL, targets_BL = batch_BL1[:, :-1], batch_BL1[:, 1:]
        out = self.model(inputs_BL, targets_BL)
        return out.ce, out.aux_losses

    @override
    def training_step(self, batch_BL1: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.flops_per_batch = self.flops_per_token * batch_BL1[:, :-1].numel()
        ce, aux_losses = self._losses(batch_BL1)
        loss = ce + sum(aux_losses.values(), torch.zeros_like(ce))
        batch_size = batch_BL1.shape[0]
        self.log("train/ce", ce, batch_size=batch_size)
        for name, value in aux_losses.items():
            self.log(f"train/{name}", value, batch_size=batch_size)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch_size)
        self.log("train/lr", self.lr_schedulers().get_last_lr()[0], batch_size=batch_size)
        return loss

    @override
    def on_before_optimizer_step(self, optimizer) -> None:
        # NOTE: once per optimizer step, after the last micro-batch's backward and on every rank:
        # the routers' sums over the step's micro-batches are all-reduced over the data-parallel
        # ranks, stored as the step's statistics, the selection biases nudged (balancing=bias) and
        # the sums reset (as torchtitan's optimizer pre-hook). Doing it here, not in
        # on_train_batch_end, puts the update before any checkpoint of this step, since Lightning
        # runs callbacks' (ModelCheckpoint's) on_train_batch_end before the module's.
        self.model.update_router_biases()

    @override
    def configure_optimizers(self):
        total_steps = self.trainer.estimated_stepping_batches
        if not math.isfinite(total_steps):
            if self.optim_config.schedule != "constant":
                raise ConfigError(
                    f"optim.schedule={self.optim_config.schedule} needs a known number of steps; set trainer.max_steps"
                )
            total_steps = 0
        total_steps = int(total_steps)
        if self.schedule_steps is not None and self.schedule_steps != total_steps:
            # NOTE: a resume with another budget; Lightning restores the scheduler's step, not its span.
            total_steps, line = resumed_schedule_steps(self.schedule_steps, total_steps, self.extend_schedule)
            if self.trainer.is_global_zero:
                print(line, flush=True)
        self.schedule_steps = total_steps
        optim = self.optim_config
        scaled = getattr(self.trainer.precision_plugin, "scaler", None) is not None
        if optim.implementation == "fused" and scaled and self.trainer.gradient_clip_val:
            # NOTE: a loss scaler (16-mixed) unscales inside the fused kernel's step, after clipping
            # would have to see unscaled gradients; foreach is the fastest kernel that allows both.
            rank_zero_info("optim.implementation: foreach, not fused (16-mixed loss scaling with gradient clipping)")
            optim = dataclasses.replace(optim, implementation="foreach")
        optimizer, scheduler = build_optimizer(self.model, optim, total_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    @override
    def on_train_start(self) -> None:
        # NOTE: a resume restores the optimizer's lr of the next step as the checkpoint's schedule
        # computed it; a schedule re-planned over a new budget (extend_schedule replan) sets it anew
        # (for an unchanged schedule this is the same value).
        scheduler = self.lr_schedulers()
        if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
            lrs = [
                base * rule(scheduler.last_epoch)
                for base, rule in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
            ]
            for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
                group["lr"] = lr
            scheduler._last_lr = lrs  # NOTE: what get_last_lr() returns (train/lr is logged from it)

    @override
    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        # NOTE: Lightning's mixed-precision plugin refuses to clip for any optimizer that can
        # unscale in its step (fused AdamW), scaler or not, and its FSDP1 plugin refuses norm
        # clipping; without a scaler (32-true, bf16-mixed) the gradients are never scaled, so the
        # norm is clipped here, for every strategy. With a scaler, Lightning has unscaled them
        # before this hook (configure_optimizers then picks a non-fused kernel).
        if not gradient_clip_val:
            return
        if gradient_clip_algorithm == "value":
            params = (p for group in optimizer.param_groups for p in group["params"])
            torch.nn.utils.clip_grad_value_(params, gradient_clip_val)
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        norm = clip_grad_norm(params, gradient_clip_val, root=self.trainer.strategy.model)
        self.log("train/grad_norm", norm, batch_size=1)

    # ------------------------------------------------------------------ evaluation
    def language_names(self, num_dataloaders: int) -> list[str]:
        """Names of the evaluation dataloaders: the datamodule's languages, else ``dl<i>``."""
        datamodule = getattr(self.trainer, "datamodule", None)
        languages = list(getattr(datamodule, "languages", None) or [])
        if len(languages) == num_dataloaders:
            return languages
        return [f"dl{i}" for i in range(num_dataloaders)]

    def _num_dataloaders(self, stage: str) -> int:
        loaders = self.trainer.val_dataloaders if stage == "val" else self.trainer.test_dataloaders
        return len(loaders) if isinstance(loaders, (list, tuple)) else 1

    def _start_eval(self, stage: str) -> None:
        for name in [*self.language_names(self._num_dataloaders(stage)), OVERALL]:
            key = f"{stage}_{name}"
            if key not in self.eval_metrics:
                self.eval_metrics[key] = MeanMetric().to(self.device)
            self.eval_metrics[key].reset()

    def _eval_step(self, stage: str, batch_BL1: torch.Tensor, dataloader_idx: int) -> torch.Tensor:
        ce, _ = self._losses(batch_BL1)
        language = self.language_names(self._num_dataloaders(stage))[dataloader_idx]
        num_tokens = batch_BL1[:, 1:].numel()
        for name in (language, OVERALL):
            self.eval_metrics[f"{stage}_{name}"].update(ce.detach(), weight=num_tokens)
        return ce

    def _end_eval(self, stage: str) -> None:
        for name in [*self.language_names(self._num_dataloaders(stage)), OVERALL]:
            metric = self.eval_metrics[f"{stage}_{name}"]
            if metric.update_count == 0:
                continue
            loss = metric.compute()
            suffix = "" if name == OVERALL else f"_{name}"
            self.log(f"{stage}/loss{suffix}", loss, prog_bar=name == OVERALL)
            self.log(f"{stage}/ppl{suffix}", loss.exp())

    @override
    def on_validation_epoch_start(self) -> None:
        self._start_eval("val")

    @override
    def validation_step(self, batch_BL1: torch.Tensor, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        return self._eval_step("val", batch_BL1, dataloader_idx)

    @override
    def on_validation_epoch_end(self) -> None:
        self._end_eval("val")

    @override
    def on_test_epoch_start(self) -> None:
        self._start_eval("test")

    @override
    def test_step(self, batch_BL1: torch.Tensor, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        return self._eval_step("test", batch_BL1, dataloader_idx)

    @override
    def on_test_epoch_end(self) -> None:
        self._end_eval("test")


__all__ = ["RUN_STATE", "MoELitModule", "OptimConfig"]
