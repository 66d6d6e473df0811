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
from moe_lit.convert.dense_to_moe import UpcyclingConfig, upcycle, upcycled_config
from moe_lit.model import Transformer

UPCYCLED_MOE_DEFAULTS = {"expert_output_bias": False}
"""MoEConfig fields of the upcycled layers unless ``upcycling.moe`` gives them: those of the shipped
MoE configs, so that the model exports (``moe-lit export``)."""
DEFAULT_UPCYCLING = UpcyclingConfig()
"""Copy upcycling into 8 experts, top-2 (:class:`UpcyclingConfig`'s defaults)."""


class DenseToMoEUpcycling(ModelSwapCallback):
    """Upcycle every (selected) dense FFN into an MoE layer after ``at_step`` optimizer steps."""

    def __init__(
        self,
        at_step: int,
        upcycling: UpcyclingConfig = DEFAULT_UPCYCLING,
        optimizer_state: str = "copy",
    ) -> None:
        """
        Args:
            at_step: Optimizer step after which the FFNs become MoE layers (>= 1).
            upcycling: The upcycling (moe_lit.convert.dense_to_moe.UpcyclingConfig: recipe,
                num_experts, top_k, granularity, drop_fraction, seed, moe), or its fields as a
                mapping; ``expert_output_bias``
                is false unless its ``moe`` gives it, as in the shipped configs (no export format
                holds an expert output bias).
            optimizer_state: copy (unchanged tensors keep their AdamW moments) | reset.
        """
        super().__init__([at_step], optimizer_state)
        upcycling = UpcyclingConfig.from_dict(upcycling, "DenseToMoEUpcycling.upcycling")
        self.upcycling = upcycling.replace(moe={**UPCYCLED_MOE_DEFAULTS, **upcycling.moe})

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        cfg = pl_module.model.config
        # NOTE: check the config against the model now, not after at_step steps of training.
        # A resumed run whose network is already MoE has done its upcycling (see on_load_checkpoint).
        if cfg.moe is None:
            upcycled_config(cfg, self.upcycling)

    @override
    def transform(
        self, model: Transformer, step: int, batch_BL1: torch.Tensor
    ) -> tuple[Transformer, dict[str, torch.Tensor], dict[str, Any]]:
        return upcycle(model, self.upcycling), {}, {"recipe": self.upcycling.recipe}


__all__ = ["DEFAULT_UPCYCLING", "UPCYCLED_MOE_DEFAULTS", "DenseToMoEUpcycling"]
