"""CompileBlocks: ``torch.compile`` each transformer block of the trained network (``train.compile: true``).

The blocks are compiled in place (:func:`moe_lit.model.compile.compile_blocks`: state-dict keys
unchanged, the routed experts eager) at ``on_fit_start``, which Lightning calls after
``configure_model`` (FSDP2's ``fully_shard``), after the strategy wrapped the module (DDP) and after
a resumed checkpoint was loaded. Every training batch it compiles the blocks a model swap brought
in (the upcycling callbacks replace ``pl_module.model`` at a batch start: list CompileBlocks after
them, as ``train_run`` and ``moe-lit fit`` do, and the new blocks run compiled from that batch on).

Compile time is reported at the end of training as one log line and the logger metrics
``compile/first_step_s``, ``compile/median_step_s``, ``compile_s`` and ``compile/fraction``:
``compile_s`` is what the batches that took over twice the median (the first ones, which trace and
generate code, and any recompile after a swap) took beyond the median, ``compile/fraction`` its
share of all batches' time.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from moe_lit.config import ConfigError
from moe_lit.errors import MoeLitError
from moe_lit.model import Transformer
from moe_lit.model.compile import compile_blocks, use_inductor_cache_dir

BACKENDS = ("inductor", "aot_eager")


class CompileBlocks(pl.Callback):
    """Compiles ``pl_module.model``'s blocks at fit start and after every model swap; logs compile time."""

    def __init__(self, backend: str = "inductor") -> None:
        """
        Args:
            backend: ``torch.compile`` backend: ``inductor`` (generated C++/Triton kernels) or
                ``aot_eager`` (the same graphs run by eager kernels: to tell a compiler bug from a
                tracing problem).
        """
        super().__init__()
        if backend not in BACKENDS:
            raise ConfigError(f"CompileBlocks.backend: got {backend!r}, allowed values: {', '.join(BACKENDS)}")
        self.backend = backend
        self.batch_seconds: list[float] = []
        """Wall seconds of each training batch of this fit (forward, backward, optimizer step)."""
        self._batch_start: float | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not isinstance(getattr(pl_module, "model", None), Transformer):
            raise MoeLitError("train.compile: needs a MoELitModule (a module whose .model is a Transformer)")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        count = compile_blocks(pl_module.model, backend=self.backend)
        self.batch_seconds = []
        rank_zero_info(
            f"train.compile: compiling {count} transformer blocks (inductor cache {use_inductor_cache_dir()})"
        )

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        count = compile_blocks(pl_module.model, backend=self.backend)
        if count:
            rank_zero_info(f"train.compile: compiling {count} new transformer blocks after a model swap")
        self._batch_start = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._batch_start is not None:
            self.batch_seconds.append(time.perf_counter() - self._batch_start)
            self._batch_start = None

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.batch_seconds:
            return
        metrics = compile_cost(self.batch_seconds)
        rank_zero_info(
            f"train.compile: first step {metrics['compile/first_step_s']:.2f} s, median step "
            f"{metrics['compile/median_step_s']:.3f} s, compile ~{metrics['compile_s']:.2f} s = "
            f"{metrics['compile/fraction']:.1%} of {len(self.batch_seconds)} steps"
        )
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)


def compile_cost(batch_seconds: list[float]) -> dict[str, float]:
    """The compile's share of a run from its batch times (see the module docstring)."""
    median = statistics.median(batch_seconds[1:] or batch_seconds)
    compile_s = sum(t - median for t in batch_seconds if t > 2 * median)
    return {
        "compile/first_step_s": batch_seconds[0],
        "compile/median_step_s": median,
        "compile_s": compile_s,
        "compile/fraction": compile_s / sum(batch_seconds),
    }


__all__ = ["CompileBlocks", "compile_cost"]
