"""RoutingMonitor: per-MoE-layer routing health, logged every N optimizer steps.

Shape legend: T tokens, E experts.

For every MoE layer ``i`` (its block index) it logs, from the last training forward:

* ``routing/layer<i>/load_imbalance``: max / mean of ``router.tokens_per_expert`` (1 = perfectly
  balanced, E = every assignment went to one expert);
* ``routing/layer<i>/entropy``: mean over tokens of the entropy (nats) of the router's score
  distribution, read from a forward hook on the router (sigmoid scores are normalised per token).
  It is computed from the *scores*, not the counts: a router that is unsure about every token has
  high entropy even when its top-k counts happen to be balanced;
* ``routing/layer<i>/dropped_fraction``: ``router.dropped_tokens`` / routed assignments (0 when
  dropless);

plus their means over layers under ``routing/mean/...``.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from moe_lit.config import ConfigError
from moe_lit.model.router import Router, RouterOutput, balancing_scores

METRICS = ("load_imbalance", "entropy", "dropped_fraction")


def load_imbalance(tokens_per_expert_E: torch.Tensor) -> float:
    """max / mean tokens per expert (nan when nothing was routed)."""
    counts_E = tokens_per_expert_E.float()
    mean = counts_E.mean()
    return (counts_E.max() / mean).item() if mean > 0 else float("nan")


def score_entropy(scores_TE: torch.Tensor, score_func: str) -> torch.Tensor:
    """Mean per-token entropy (nats) of the routing distribution."""
    probs_TE = balancing_scores(scores_TE.float(), score_func)
    return -(probs_TE * probs_TE.clamp_min(1e-20).log()).sum(dim=-1).mean()


class RoutingMonitor(pl.Callback):
    """Logs load imbalance, router entropy and dropped-token fraction per MoE layer every N steps."""

    def __init__(self, every_n_steps: int = 50) -> None:
        """
        Args:
            every_n_steps: Log after every N-th optimizer step (N >= 1).
        """
        super().__init__()
        if not (isinstance(every_n_steps, int) and not isinstance(every_n_steps, bool) and every_n_steps > 0):
            raise ConfigError(f"RoutingMonitor.every_n_steps: must be a positive integer, got {every_n_steps!r}")
        self.every_n_steps = every_n_steps
        self._handles: list[RemovableHandle] = []
        self._entropy: dict[int, torch.Tensor] = {}
        self._routers: dict[int, Router] = {}
        self._model: Optional[torch.nn.Module] = None
        self._last_logged_step = -1

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._attach(pl_module.model)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # NOTE: upcycling callbacks swap pl_module.model mid-run; follow the live routers.
        if pl_module.model is not self._model:
            self._attach(pl_module.model)

    def _attach(self, model: torch.nn.Module) -> None:
        self._detach()
        self._model = model
        self._routers = {i: block.ffn.router for i, block in enumerate(model.blocks) if block.is_moe}
        if not self._routers:
            rank_zero_info("RoutingMonitor: the model has no MoE layer; nothing to log")
        for layer_id, router in self._routers.items():
            self._handles.append(router.register_forward_hook(self._entropy_hook(layer_id, router.score_func)))

    def _detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._entropy, self._routers, self._model = [], {}, {}, None

    def _entropy_hook(self, layer_id: int, score_func: str):
        def hook(module: Router, args: Any, output: RouterOutput) -> None:
            # NOTE: only training forwards, the same ones whose counts the router buffers hold.
            if module.training:
                with torch.no_grad():
                    self._entropy[layer_id] = score_entropy(output.scores_TE, score_func)

        return hook

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._detach()

    def layer_metrics(self) -> dict[str, float]:
        """The metrics of the last training forward, by name (empty before the first one)."""
        metrics: dict[str, float] = {}
        for layer_id, router in self._routers.items():
            if layer_id not in self._entropy:
                continue
            routed = router.tokens_per_expert.sum()
            values = {
                "load_imbalance": load_imbalance(router.tokens_per_expert),
                "entropy": self._entropy[layer_id].item(),
                "dropped_fraction": (router.dropped_tokens / routed).item() if routed > 0 else 0.0,
            }
            metrics.update({f"routing/layer{layer_id}/{name}": value for name, value in values.items()})
        layers = [lid for lid in self._routers if lid in self._entropy]
        for name in METRICS if layers else ():
            metrics[f"routing/mean/{name}"] = sum(metrics[f"routing/layer{i}/{name}"] for i in layers) / len(layers)
        return metrics

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        # NOTE: with gradient accumulation this hook runs once per micro-batch at the same step.
        if step % self.every_n_steps != 0 or step == self._last_logged_step or not trainer.is_global_zero:
            return
        self._last_logged_step = step
        metrics = self.layer_metrics()
        if metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)


__all__ = ["RoutingMonitor", "load_imbalance", "score_entropy"]
