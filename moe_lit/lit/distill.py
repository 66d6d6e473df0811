"""Teacher -> student training: the ONE distillation module (DOT-MoE, MoE -> dense, pruning recovery).

Shape legend: B batch, L sequence (a batch holds L+1 tokens), T = B*L tokens, V vocabulary.

:class:`DistillModule` is a :class:`~moe_lit.lit.module.MoELitModule` whose training loss is

    loss = kl_weight * tau^2 * KL(softmax(z_teacher / tau) || softmax(z_student / tau))
         + ce_weight * CE(z_student, targets) + aux_weight * (student's weighted aux losses)

(forward KL, mean over tokens; the tau^2 keeps the KL gradients on the scale of the CE's, Hinton
et al. 2015). The teacher is frozen: no gradient, no optimizer state, always in eval mode, and its
weights are left out of the module's checkpoints (the constructor or ``set_teacher`` provides it
again on resume). Validation, test, the optimizer and the schedule are the student's, unchanged
from MoELitModule. The student is any network with our ``Transformer`` interface (``config``,
``forward(idx) -> LMOutput``): ``DistillModule.from_models`` takes it as a module, so students of
another class (DOT-MoE's) train here too: :func:`fit_dot_moe` is that training, on a list of batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import override

from moe_lit.config import ConfigError, ModelConfig
from moe_lit.convert.dot_moe import DotMoEConfig, SinkhornAnnealing
from moe_lit.errors import MoeLitError
from moe_lit.lit.module import MoELitModule
from moe_lit.lit.optim import OptimConfig
from moe_lit.model import Transformer

TEACHER_PREFIX = "teacher."


@dataclass
class DistillConfig:
    """Weights of the distillation loss."""

    temperature: float = 1.0
    """Softmax temperature tau of both teacher and student logits in the KL term."""
    kl_weight: float = 1.0
    """Weight of the forward KL to the teacher (multiplied by tau^2)."""
    ce_weight: float = 1.0
    """Weight of the student's next-token cross-entropy on the data (the LM loss)."""
    aux_weight: float = 1.0
    """Multiplier of the student's auxiliary losses (load balancing, z-loss), which the MoE config
    already weighs (moe.aux_loss_coef, moe.z_loss_coef)."""

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ConfigError(f"distill.temperature: must be > 0, got {self.temperature}")
        for name in ("kl_weight", "ce_weight", "aux_weight"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"distill.{name}: must be >= 0, got {getattr(self, name)}")
        if self.kl_weight == 0 and self.ce_weight == 0:
            raise ConfigError("distill.kl_weight: kl_weight and ce_weight are both 0; nothing would be learned")


def distill_losses(
    student_logits_TV: torch.Tensor, teacher_logits_TV: torch.Tensor, targets_T: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tau^2 * KL(teacher || student) at temperature tau, CE)``, both means over tokens, fp32."""
    student_TV, teacher_TV = student_logits_TV.float(), teacher_logits_TV.float()
    log_q_TV = (student_TV / temperature).log_softmax(-1)
    log_p_TV = (teacher_TV / temperature).log_softmax(-1)
    kl = F.kl_div(log_q_TV, log_p_TV, log_target=True, reduction="batchmean") * temperature**2
    return kl, F.cross_entropy(student_TV, targets_T)


class DistillModule(MoELitModule):
    """A student trained on a frozen teacher's logits and the data (see the module docstring)."""

    def __init__(
        self,
        model: ModelConfig,
        optim: OptimConfig = OptimConfig(),  # noqa: B008 - never mutated
        distill: DistillConfig = DistillConfig(),  # noqa: B008 - never mutated
        teacher: str | None = None,
    ) -> None:
        """
        Args:
            model: The student network (dense or MoE), built fresh; ``from_models`` passes a built one.
            optim: AdamW and its learning-rate schedule (student parameters with requires_grad only).
            distill: Weights of the distillation loss.
            teacher: A moe_lit checkpoint (``.ckpt`` or exported dir) of the teacher; or set one
                with ``set_teacher`` before training.
        """
        super().__init__(model, optim)
        self.distill_config = distill if isinstance(distill, DistillConfig) else DistillConfig(**distill)
        self.teacher: nn.Module | None = None
        if teacher is not None:
            from moe_lit.convert.model_input import load_any_model

            self.set_teacher(load_any_model(Path(teacher)))

    @classmethod
    def from_models(
        cls,
        student: nn.Module,
        teacher: nn.Module,
        optim: OptimConfig = OptimConfig(),  # noqa: B008 - never mutated
        distill: DistillConfig = DistillConfig(),  # noqa: B008 - never mutated
    ) -> DistillModule:
        """A module over an already built ``student`` (trained in place) and ``teacher``."""
        # NOTE: MoELitModule builds a network from the config; it is replaced at once (the cost of
        # one initialisation), which keeps every hyper-parameter a plain config.
        module = cls(student.config, optim, distill)
        module.replace_model(student)
        module.set_teacher(teacher)
        return module

    def set_teacher(self, teacher: nn.Module) -> None:
        """Use ``teacher``, frozen in place (requires_grad off, eval mode); the vocabularies must match."""
        vocab = getattr(getattr(teacher, "config", None), "vocab_size", None)
        if vocab != self.config.vocab_size:
            raise MoeLitError(f"teacher: vocabulary {vocab} differs from the student's {self.config.vocab_size}")
        self.teacher = teacher.requires_grad_(False).eval()

    @override
    def train(self, mode: bool = True) -> DistillModule:
        super().train(mode)
        if self.teacher is not None:
            self.teacher.eval()
        return self

    @override
    def training_step(self, batch_BL1: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.teacher is None:
            raise MoeLitError("distill: no teacher set (pass teacher= or call set_teacher)")
        cfg = self.distill_config
        self.flops_per_batch = self.flops_per_token * batch_BL1[:, :-1].numel()
        inputs_BL, targets_BL = batch_BL1[:, :-1], batch_BL1[:, 1:]
        with torch.no_grad():
            teacher_BLV = self.teacher(inputs_BL).logits_BLV
        out = self.model(inputs_BL)
        kl, ce = distill_losses(
            out.logits_BLV.flatten(0, 1), teacher_BLV.flatten(0, 1), targets_BL.flatten(), cfg.temperature
        )
        aux = sum(out.aux_losses.values(), torch.zeros_like(ce))
        loss = cfg.kl_weight * kl + cfg.ce_weight * ce + cfg.aux_weight * aux
        batch_size = batch_BL1.shape[0]
        self.log("train/kl", kl, batch_size=batch_size)
        self.log("train/ce", ce, batch_size=batch_size)
        for name, value in out.aux_losses.items():
            self.log(f"train/{name}", value, batch_size=batch_size)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch_size)
        self.log("train/lr", self.lr_schedulers().get_last_lr()[0], batch_size=batch_size)
        return loss

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        # NOTE: the teacher is an input, not a result: its weights stay out of the checkpoint.
        state = checkpoint.get("state_dict", {})
        for key in [k for k in state if k.startswith(TEACHER_PREFIX)]:
            del state[key]

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        # NOTE: put the current teacher's weights back so that the strict state-dict load matches.
        if self.teacher is not None:
            state = checkpoint.setdefault("state_dict", {})
            state.update({TEACHER_PREFIX + k: v for k, v in self.teacher.state_dict().items()})


def fit_dot_moe(
    dense: Transformer,
    student: Transformer,
    batches: list[torch.Tensor],
    cfg: DotMoEConfig = DotMoEConfig(),  # noqa: B008 - never mutated
    lr: float = 1e-2,
    distill: DistillConfig | None = None,
) -> Transformer:
    """Train ``student`` in place on ``batches`` (one optimizer step each) with ``dense`` as teacher.

    ``student`` is a DOT-MoE student (:func:`~moe_lit.convert.dot_moe.dot_moe_student`), its Sinkhorn
    temperature annealed by :class:`~moe_lit.convert.dot_moe.SinkhornAnnealing`, at the constant
    learning rate ``lr`` (no warmup); ``distill`` defaults to ``DistillConfig()``. Returns the student
    (in eval mode). It is the ``fit`` of :func:`moe_lit.convert.recipes.partition_dense`.
    """
    if not batches:
        raise MoeLitError("fit_dot_moe: no training batches")
    optim = OptimConfig(lr=lr, warmup_steps=0, schedule="constant")
    module = DistillModule.from_models(student, dense, optim, distill or DistillConfig())
    trainer = pl.Trainer(
        accelerator="cpu" if next(dense.parameters()).device.type == "cpu" else "auto",
        max_steps=len(batches),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[SinkhornAnnealing(cfg)],
    )
    # NOTE: Lightning keeps the modules' train/eval mode as it finds them.
    student.train()
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))  # type: ignore[arg-type]  # torch types the dataset as Dataset; any sequence works
    return student.eval()


__all__ = ["DistillConfig", "DistillModule", "distill_losses", "fit_dot_moe"]
