"""AdamW parameter groups and learning-rate schedules (warmup + cosine | WSD | constant).

``rewarm_at`` splits a run in two phases with a schedule each (pretraining, then continued
pretraining): the first decays over steps ``[0, rewarm_at)``, the second warms up again and decays
over the rest, as when a trained checkpoint is taken up for continued pretraining.

Every schedule is a multiplier of ``OptimConfig.lr`` as a function of the optimizer step, so it
plugs into ``torch.optim.lr_scheduler.LambdaLR`` and its position is restored from a checkpoint
with the scheduler's state (the step counter), nothing else.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from moe_lit.configbase import ConfigBase, ConfigError

Schedule = Literal["cosine", "wsd", "constant"]
SCHEDULES = ("cosine", "wsd", "constant")
Implementation = Literal["fused", "foreach", "for_loop"]
ADAMW_KERNELS: dict[str, dict[str, bool]] = {
    "fused": {"fused": True},
    "foreach": {"foreach": True},
    "for_loop": {"foreach": False},
}
"""``torch.optim.AdamW`` keyword arguments of each ``optim.implementation``."""
IMPLEMENTATIONS = tuple(ADAMW_KERNELS)


@dataclass
class OptimConfig(ConfigBase):
    """AdamW and its learning-rate schedule (gradient clipping is the Trainer's gradient_clip_val)."""

    section: ClassVar[str] = "optim"

    lr: float = 1e-3
    """Peak learning rate, reached at the end of the warmup."""
    weight_decay: float = 0.1
    """Decoupled weight decay of the matrices; norms, biases and the input embedding get none."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 100
    """Optimizer steps of linear warmup from 0 to lr."""
    schedule: Schedule = "cosine"
    """After the warmup: cosine (decay to min_lr_ratio*lr at the last step) | wsd (warmup-stable-decay:
    constant, then a linear decay over the last decay_fraction of the steps) | constant."""
    decay_fraction: float = 0.2
    """WSD only: fraction of all steps spent in the final linear decay."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of lr (cosine and wsd)."""
    rewarm_at: int | None = None
    """Optimizer step at which the schedule starts again: a new warmup to lr, then the same schedule
    over the remaining steps, the first phase having decayed by then (continued pretraining); null: one schedule."""
    implementation: Implementation = "fused"
    """AdamW kernel: fused (one kernel over all parameters, CPU and CUDA; the fastest, see
    docs/performance.md) | foreach | for_loop (torch's CPU default)."""

    def __post_init__(self) -> None:
        if self.implementation not in IMPLEMENTATIONS:
            raise ConfigError(
                f"optim.implementation: got {self.implementation!r}, allowed values: {', '.join(IMPLEMENTATIONS)}"
            )
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"optim.schedule: got {self.schedule!r}, allowed values: {', '.join(SCHEDULES)}")
        if not self.lr > 0:
            raise ConfigError(f"optim.lr: must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ConfigError(f"optim.weight_decay: must be >= 0, got {self.weight_decay}")
        self.betas = tuple(self.betas)
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"optim.betas: must be two numbers in [0, 1), got {list(self.betas)}")
        if not self.eps > 0:
            raise ConfigError(f"optim.eps: must be > 0, got {self.eps}")
        if not (isinstance(self.warmup_steps, int) and self.warmup_steps >= 0):
            raise ConfigError(f"optim.warmup_steps: must be an integer >= 0, got {self.warmup_steps!r}")
        if not 0 < self.decay_fraction <= 1:
            raise ConfigError(f"optim.decay_fraction: must be in (0, 1], got {self.decay_fraction}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"optim.min_lr_ratio: must be in [0, 1], got {self.min_lr_ratio}")
        rewarm = self.rewarm_at
        if rewarm is not None and not (isinstance(rewarm, int) and rewarm > self.warmup_steps):
            why = f"must be null or an integer > warmup_steps={self.warmup_steps}, got {rewarm!r}"
            raise ConfigError(f"optim.rewarm_at: {why}")


def lr_multiplier(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """The factor applied to ``cfg.lr`` before optimizer step ``step`` (0-based) of ``total_steps``."""
    if cfg.rewarm_at is not None:
        phase = dataclasses.replace(cfg, rewarm_at=None)
        if step < cfg.rewarm_at:
            return lr_multiplier(step, phase, cfg.rewarm_at)
        return lr_multiplier(step - cfg.rewarm_at, phase, total_steps - cfg.rewarm_at)
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    floor = cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        span = max(1, total_steps - 1 - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_steps = max(1, round(cfg.decay_fraction * total_steps))
    decay_start = max(cfg.warmup_steps, total_steps - decay_steps)
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start + 1) / max(1, total_steps - decay_start))
    return 1.0 - (1 - floor) * progress


EXTEND_SCHEDULE = ("keep", "replan")
"""What a resume with another step budget than the run's does with the schedule (TrainConfig.extend_schedule)."""


def resumed_schedule_steps(planned: int, budget: int, extend: str) -> tuple[int, str]:
    """The steps the lr schedule of a resumed run spans, and the line that says so: the run's
    ``planned`` steps (``extend`` keep) or its new ``budget`` (replan)."""
    if extend == "replan":
        return budget, (
            f"schedule: re-planned over {budget} steps (the run's was {planned}; train.extend_schedule replan)"
        )
    past = (
        f"past step {planned} the lr stays at its end value" if budget > planned else f"the run stops at step {budget}"
    )
    return planned, (
        f"schedule: the run's, over {planned} steps ({past}); --train.extend_schedule replan re-plans it over {budget}"
    )


NORMS = (nn.RMSNorm, nn.LayerNorm)
"""Modules whose parameters are never decayed."""


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: decayed matrices, and undecayed norm weights, biases and input embedding.

    NOTE: the input embedding is a lookup table (each row only sees the tokens that use it), so decay
    would shrink rare tokens towards zero; it is left undecayed as in GPT-NeoX/OLMo. An untied output
    head is an ordinary matmul and is decayed; a tied one is the embedding and is not. Norms and
    biases are found by module type and attribute name, not by ``ndim``: FSDP1 (use_orig_params)
    hands the optimizer 1-D shards of every parameter, matrices included.
    """
    no_decay_ids = {
        id(param)
        for module in model.modules()
        for name, param in module.named_parameters(recurse=False)
        if name == "bias" or isinstance(module, NORMS)
    }
    embedding = getattr(model, "tok_embeddings", None)
    if embedding is not None:
        no_decay_ids.add(id(embedding.weight))
    decay, no_decay = [], []
    for param in model.parameters():  # parameters() yields a tied weight once
        if param.requires_grad:
            (no_decay if id(param) in no_decay_ids else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over :func:`param_groups` and a per-step ``LambdaLR`` following :func:`lr_multiplier`."""
    if cfg.schedule != "constant" and total_steps < cfg.warmup_steps:
        rank_zero_warn(
            f"optim.warmup_steps={cfg.warmup_steps} > the run's {total_steps} steps: it never leaves the warmup"
        )
    if cfg.rewarm_at is not None and cfg.rewarm_at >= total_steps:
        raise ConfigError(f"optim.rewarm_at: must be below the run's {total_steps} steps, got {cfg.rewarm_at}")
    optimizer = torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        **ADAMW_KERNELS[cfg.implementation],
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg, total_steps))
    return optimizer, scheduler


__all__ = [
    "ADAMW_KERNELS",
    "EXTEND_SCHEDULE",
    "IMPLEMENTATIONS",
    "OptimConfig",
    "SCHEDULES",
    "build_optimizer",
    "lr_multiplier",
    "param_groups",
    "resumed_schedule_steps",
]
