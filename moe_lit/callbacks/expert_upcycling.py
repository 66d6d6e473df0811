"""ExpertUpcycling: grow an E-expert MoE into an mE-expert MoE at chosen steps of a run.

Each expansion is :func:`moe_lit.convert.expand.apply_expansion` (copies of experts and router
rows, top-k fixed, aux-loss-free bias balancing by default; see that module for the guarantees).
With ``selection='utility'`` the copies go to the experts with the largest utility, measured on
the real training gradients of the ``utility_batches`` optimizer steps just before the expansion
(``||dL/dW_e||^2`` read in ``on_before_optimizer_step``, i.e. after backward, before clipping and
the update). The optimizer, LR schedule, logging and checkpoint state are handled by
:class:`~moe_lit.callbacks.upcycling.ModelSwapCallback`: with ``optimizer_state='copy'`` every copy
starts with its source's AdamW moments.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from moe_lit.callbacks.dense_upcycling import DenseToMoEUpcycling
from moe_lit.callbacks.upcycling import ModelSwapCallback
from moe_lit.config import ConfigError
from moe_lit.convert.expand import (
    ExpansionConfig,
    UtilityAccumulator,
    apply_expansion,
    expert_gradients,
    expert_utility,
    plan_expansion,
)
from moe_lit.errors import MoeLitError
from moe_lit.model import Transformer

DEFAULT_EXPANSION = ExpansionConfig(factor=2)
"""Each expansion doubles the experts, uniform copies (the rest: :class:`ExpansionConfig`'s defaults)."""


class ExpertUpcycling(ModelSwapCallback):
    """Grow the experts of every MoE layer by ``expansion`` at each step of ``at_steps``."""

    def __init__(
        self,
        at_steps: Sequence[int],
        expansion: ExpansionConfig = DEFAULT_EXPANSION,
        optimizer_state: str = "copy",
        utility_batches: int = 10,
    ) -> None:
        """
        Args:
            at_steps: Optimizer steps after which to expand (strictly increasing, >= 1).
            expansion: The expansion (moe_lit.convert.expand.ExpansionConfig: factor, selection,
                noise, balancing, ...), or its fields as a mapping (a YAML's or a study point's);
                its seed plus the step seeds each expansion.
            optimizer_state: copy (copies inherit their source's AdamW moments) | reset.
            utility_batches: Optimizer steps before the expansion whose gradients make the utility.
        """
        super().__init__(at_steps, optimizer_state)
        expansion = ExpansionConfig.from_dict(expansion, "ExpertUpcycling.expansion")
        if expansion.factor is None:
            raise ConfigError("ExpertUpcycling.expansion.counts: the expert count grows at every step; give a factor")
        if not (isinstance(utility_batches, int) and utility_batches >= 1):
            raise ConfigError(f"ExpertUpcycling.utility_batches: must be an integer >= 1, got {utility_batches!r}")
        self.expansion, self.utility_batches = expansion, utility_batches
        self._utility = UtilityAccumulator()

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        upcycled_before = any(
            isinstance(cb, DenseToMoEUpcycling) and cb.at_steps[0] < self.at_steps[0] for cb in trainer.callbacks
        )
        if pl_module.model.config.moe is None and not upcycled_before:
            raise MoeLitError(
                "ExpertUpcycling: the model is dense; add a DenseToMoEUpcycling callback with an earlier step"
            )

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        step = self.pending_step()
        if (
            self.expansion.selection == "utility"
            and step is not None
            and step - self.utility_batches <= trainer.global_step < step
        ):
            # NOTE: callbacks run before the module's hook, so this finishes the step's routing
            # statistics (all ranks, bias step included); the module's own call is then a no-op.
            pl_module.model.update_router_biases()
            self._utility.add(pl_module.model, expert_gradients(pl_module.model))

    @override
    def transform(
        self, model: Transformer, step: int, batch_BL1: torch.Tensor
    ) -> tuple[Transformer, dict[str, torch.Tensor], dict[str, Any]]:
        utility = None
        if self.expansion.selection == "utility":
            # NOTE: a run resumed right at the expansion step has no gradients accumulated yet;
            # the current batch then stands in for the window.
            utility = self._utility.result() if self._utility.num_batches else expert_utility(model, [batch_BL1], 1)
        self._utility = UtilityAccumulator()
        plan = plan_expansion(model, self.expansion, utility)
        new = apply_expansion(model, plan, self.expansion.replace(seed=self.expansion.seed + step))
        details = {
            "selection": self.expansion.selection,
            "copies": {str(block): plan.copies(block) for block in plan.sources},
            "sources": {str(block): list(src) for block, src in plan.sources.items()},
            "utility": utility.to_dict() if utility is not None else None,
        }
        return new, plan.row_sources(model), details


__all__ = ["DEFAULT_EXPANSION", "ExpertUpcycling"]
