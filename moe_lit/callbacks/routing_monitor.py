"""RoutingMonitor: per-MoE-layer routing health, logged every N optimizer steps.

Shape legend: T tokens, E experts.

For every MoE layer ``i`` (its block index) it logs the layer's
:class:`~moe_lit.model.router.RoutingStats` of the last optimizer step: all its micro-batches,
summed over the data-parallel ranks (the same object the bias update reads):

* ``routing/layer<i>/load_imbalance``: max / mean assignments per expert (1 = perfectly
  balanced, E = every assignment went to one expert);
* ``routing/layer<i>/entropy``: mean over tokens of the entropy (nats) of the router's score
  distribution (sigmoid scores are normalised per token). It is computed from the *scores*, not
  the counts: a router that is unsure about every token has high entropy even when its top-k
  counts happen to be balanced;
* ``routing/layer<i>/dropped_fraction``: dropped / routed assignments (0 when dropless);

plus their means over layers under ``routing/mean/...``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from moe_lit.config import ConfigError
from moe_lit.model.router import RoutingStats

METRICS = ("load_imbalance", "entropy", "dropped_fraction")


def layer_metrics(stats: dict[int, RoutingStats]) -> dict[str, float]:
    """Logged metrics of per-layer statistics, by name (empty when no step has finished yet)."""
    metrics: dict[str, float] = {}
    layers = [i for i, layer in stats.items() if layer.num_tokens > 0]
    for i in layers:
        values = {
            "load_imbalance": stats[i].load_imbalance,
            "entropy": stats[i].mean_entropy,
            "dropped_fraction": stats[i].dropped_fraction,
        }
        metrics.update({f"routing/layer{i}/{name}": value for name, value in values.items()})
    for name in METRICS if layers else ():
        metrics[f"routing/mean/{name}"] = sum(metrics[f"routing/layer{i}/{name}"] for i in layers) / len(layers)
    return metrics


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
        self._last_logged_step = -1

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        # NOTE: with gradient accumulation this hook runs once per micro-batch at the same step; the
        # first run after the optimizer step sees that step's finished statistics. Upcycling callbacks
        # swap pl_module.model mid-run, so the live model is read every time.
        if step % self.every_n_steps != 0 or step == self._last_logged_step or not trainer.is_global_zero:
            return
        metrics = layer_metrics(pl_module.model.routing_stats())
        if metrics:
            self._last_logged_step = step
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)


__all__ = ["RoutingMonitor", "layer_metrics"]
