"""DenseToMoEUpcycling: turn the dense FFNs of a run into MoE layers at one chosen step.

The transform is :func:`moe_lit.convert.dense_to_moe.dense_to_moe` (copy | granular | drop; copy
and granular keep the function exactly, so the logged loss before and after are equal). The
optimizer, LR schedule, logging and checkpoint state are handled by
:class:`~moe_lit.callbacks.upcycling.ModelSwapCallback`. With ``optimizer_state='copy'`` the
attention, norm and embedding tensors keep their AdamW moments; the experts and the new router
start fresh: their tensors have other names and shapes than the dense FFN's, and a moment of the
dense ``w2`` says nothing exact about a shard of it scaled by the granularity.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from moe_lit.callbacks.upcycling import ModelSwapCallback
from moe_lit.config import ConfigError
from moe_lit.convert.dense_to_moe import RECIPES, dense_to_moe, upcycled_config
from moe_lit.model import Transformer

UPCYCLED_MOE_DEFAULTS = {"expert_output_bias": False}
"""MoEConfig fields of the upcycled layers unless ``moe`` gives them: those of the shipped MoE
configs, so that the model exports (``moe-lit export``)."""


class DenseToMoEUpcycling(ModelSwapCallback):
    """Upcycle every (selected) dense FFN into an MoE layer after ``at_step`` optimizer steps."""

    def __init__(
        self,
        at_step: int,
        recipe: str = "copy",
        num_experts: int = 8,
        top_k: int = 2,
        granularity: int = 1,
        drop_fraction: float = 0.5,
        optimizer_state: str = "copy",
        seed: int = 0,
        moe: dict[str, Any] | None = None,
    ) -> None:
        """
        Args:
            at_step: Optimizer step after which the FFNs become MoE layers (>= 1).
            recipe: copy | granular | drop (see moe_lit.convert.dense_to_moe).
            num_experts: Experts per MoE layer.
            top_k: Experts per token (a multiple of granularity).
            granularity: Shards of d_ff (granular and drop recipes).
            drop_fraction: Neurons re-initialised per expert (drop recipe).
            optimizer_state: copy (unchanged tensors keep their AdamW moments) | reset.
            seed: Seed of the router initialisation and of the dropped neurons.
            moe: Further MoEConfig fields of the new layers (balancing, aux_loss_coef, ...);
                ``expert_output_bias`` is false unless given, as in the shipped configs (no export
                format holds an expert output bias).
        """
        super().__init__([at_step], optimizer_state)
        if recipe not in RECIPES:
            raise ConfigError(f"DenseToMoEUpcycling.recipe: got {recipe!r}, allowed values: {', '.join(RECIPES)}")
        self.recipe, self.num_experts, self.top_k = recipe, num_experts, top_k
        self.granularity, self.drop_fraction, self.seed = granularity, drop_fraction, seed
        self.moe_fields = {**UPCYCLED_MOE_DEFAULTS, **(moe or {})}

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        cfg = pl_module.model.config
        # NOTE: validate the arguments against the model now, not after at_step steps of training.
        # A resumed run whose network is already MoE has done its upcycling (see on_load_checkpoint).
        if cfg.moe is None:
            upcycled_config(cfg, *self._arguments()[:5], **self.moe_fields)

    def _arguments(self) -> tuple:
        return self.recipe, self.num_experts, self.top_k, self.granularity, self.drop_fraction, self.seed

    @override
    def transform(
        self, model: Transformer, step: int, batch_BL1: torch.Tensor
    ) -> tuple[Transformer, dict[str, torch.Tensor], dict[str, Any]]:
        return dense_to_moe(model, *self._arguments(), **self.moe_fields), {}, {"recipe": self.recipe}


__all__ = ["UPCYCLED_MOE_DEFAULTS", "DenseToMoEUpcycling"]
