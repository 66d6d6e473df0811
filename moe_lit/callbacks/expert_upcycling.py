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
from moe_lit.config import BALANCING, ConfigError
from moe_lit.convert.expand import (
    MAX_COPIES,
    SELECTIONS,
    UTILITY_METRICS,
    UtilityAccumulator,
    apply_expansion,
    expert_gradients,
    expert_utility,
    plan_expansion,
)
from moe_lit.errors import MoeLitError
from moe_lit.model import Transformer


class ExpertUpcycling(ModelSwapCallback):
    """Multiply the experts of every MoE layer by ``factor`` at each step of ``at_steps``."""

    def __init__(
        self,
        at_steps: Sequence[int],
        factor: int = 2,
        selection: str = "uniform",
        optimizer_state: str = "copy",
        utility_batches: int = 10,
        utility_metric: str = "grad_sq",
        max_copies: int = MAX_COPIES,
        noise: float = 1e-3,
        balancing: str | None = "bias",
        seed: int = 0,
        router_noise: float = 0.0,
        drop_fraction: float = 0.0,
    ) -> None:
        """
        Args:
            at_steps: Optimizer steps after which to expand (strictly increasing, >= 1).
            factor: m: each expansion turns E experts into m*E (integer >= 2).
            selection: uniform (m-1 copies of every expert) | utility (greedy by expert utility).
            optimizer_state: copy (copies inherit their source's AdamW moments) | reset.
            utility_batches: Optimizer steps before the expansion whose gradients make the utility.
            utility_metric: grad_sq | weight_grad | frequency.
            max_copies: At most this many copies of one expert (utility selection).
            noise: U(-noise, noise) on the copies' selection bias (needs balancing=bias).
            balancing: Balancing of the expanded model: bias (default, see moe_lit.convert.expand) |
                aux_loss | none | null to keep the source's.
            seed: Seed of the bias noise.
            router_noise: Relative N(0, sigma^2) noise on the copies' router rows (symmetry breaking).
            drop_fraction: Fraction of each copy's neurons re-initialised (drop-upcycling the copies).
        """
        super().__init__(at_steps, optimizer_state)
        if not (isinstance(factor, int) and factor >= 2):
            raise ConfigError(f"ExpertUpcycling.factor: must be an integer >= 2, got {factor!r}")
        for field, value, allowed in (
            ("selection", selection, SELECTIONS),
            ("utility_metric", utility_metric, UTILITY_METRICS),
            ("balancing", balancing, (*BALANCING, None)),
        ):
            if value not in allowed:
                raise ConfigError(f"ExpertUpcycling.{field}: got {value!r}, allowed values: {allowed}")
        if not (isinstance(utility_batches, int) and utility_batches >= 1):
            raise ConfigError(f"ExpertUpcycling.utility_batches: must be an integer >= 1, got {utility_batches!r}")
        if noise < 0 or (noise > 0 and balancing != "bias"):
            raise ConfigError(f"ExpertUpcycling.noise: must be >= 0 and needs balancing='bias' when > 0, got {noise}")
        self.factor, self.selection, self.utility_batches = factor, selection, utility_batches
        self.utility_metric, self.max_copies = utility_metric, max_copies
        self.noise, self.balancing, self.seed = noise, balancing, seed
        self.router_noise, self.drop_fraction = router_noise, drop_fraction
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
            self.selection == "utility"
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
        if self.selection == "utility":
            # NOTE: a run resumed right at the expansion step has no gradients accumulated yet;
            # the current batch then stands in for the window.
            utility = self._utility.result() if self._utility.num_batches else expert_utility(model, [batch_BL1], 1)
        self._utility = UtilityAccumulator()
        plan = plan_expansion(model, self.factor, None, self.selection, utility, self.utility_metric, self.max_copies)
        new = apply_expansion(
            model, plan, self.noise, self.balancing, self.seed + step, self.router_noise, self.drop_fraction
        )
        details = {
            "selection": self.selection,
            "copies": {str(block): plan.copies(block) for block in plan.sources},
            "sources": {str(block): list(src) for block, src in plan.sources.items()},
            "utility": utility.to_dict() if utility is not None else None,
        }
        return new, plan.row_sources(model), details


__all__ = ["ExpertUpcycling"]
