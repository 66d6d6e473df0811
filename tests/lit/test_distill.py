"""DistillModule: the loss by hand, a frozen teacher, a short fit, checkpoints without the teacher."""

import lightning.pytorch as pl
import pytest
import torch

from moe_lit.config import ConfigError
from moe_lit.lit.distill import DistillConfig, DistillModule, distill_losses
from moe_lit.lit.optim import OptimConfig
from moe_lit.model import Transformer
from tests.helpers.models import tiny
from tests.lit.fakes import RandomTokenDataModule


def _trainer(**kwargs) -> pl.Trainer:
    defaults = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        max_steps=2,
    )
    return pl.Trainer(**{**defaults, **kwargs})


def _pair():
    torch.manual_seed(0)
    teacher = Transformer(tiny(vocab_size=64, dense=True))
    student = Transformer(tiny(vocab_size=64, z_loss_coef=1e-3))
    return student, teacher


def test_loss_terms_equal_the_hand_computed_kl_and_ce():
    student_TV = torch.tensor([[1.0, 0.0, -1.0], [0.5, 0.5, 2.0]])
    teacher_TV = torch.tensor([[0.0, 2.0, 0.0], [1.0, -1.0, 0.0]])
    targets_T = torch.tensor([0, 2])
    tau = 2.0
    p = torch.softmax(teacher_TV / tau, -1)
    q = torch.softmax(student_TV / tau, -1)
    kl_by_hand = (p * (p.log() - q.log())).sum(-1).mean() * tau**2
    ce_by_hand = -torch.log_softmax(student_TV, -1)[torch.arange(2), targets_T].mean()
    kl, ce = distill_losses(student_TV, teacher_TV, targets_T, tau)
    assert kl.item() == pytest.approx(kl_by_hand.item(), rel=1e-6)
    assert ce.item() == pytest.approx(ce_by_hand.item(), rel=1e-6)


def test_training_loss_mixes_the_terms_with_the_configured_weights():
    student, teacher = _pair()
    cfg = DistillConfig(temperature=2.0, kl_weight=0.7, ce_weight=0.3, aux_weight=2.0)
    module = DistillModule.from_models(student, teacher, OptimConfig(warmup_steps=1), cfg)
    trainer = _trainer(max_steps=1, log_every_n_steps=1)
    trainer.fit(module, datamodule=RandomTokenDataModule())
    m = trainer.callback_metrics
    aux = m["train/load_balancing"] + m["train/z_loss"]
    assert m["train/loss"].item() == pytest.approx(
        (0.7 * m["train/kl"] + 0.3 * m["train/ce"] + 2.0 * aux).item(), rel=1e-5
    )
    assert m["train/kl"] > 0


def test_teacher_gets_no_gradient_and_stays_frozen_while_the_student_learns():
    student, teacher = _pair()
    teacher_before = {k: v.clone() for k, v in teacher.state_dict().items()}
    student_before = student.lm_head.weight.clone()
    module = DistillModule.from_models(student, teacher, OptimConfig(warmup_steps=1, lr=1e-2))
    trainer = _trainer(max_steps=3)
    trainer.fit(module, datamodule=RandomTokenDataModule())
    assert all(p.grad is None and not p.requires_grad for p in teacher.parameters())
    assert all(torch.equal(teacher.state_dict()[k], v) for k, v in teacher_before.items())
    assert not module.teacher.training
    assert not torch.equal(module.model.lm_head.weight, student_before)
    assert module.model is student
    optimized = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert not optimized & {id(p) for p in teacher.parameters()}


def test_checkpoint_leaves_the_teacher_out_and_resumes(tmp_path):
    student, teacher = _pair()
    module = DistillModule.from_models(student, teacher, OptimConfig(warmup_steps=1))
    trainer = _trainer(max_steps=1, default_root_dir=tmp_path)
    trainer.fit(module, datamodule=RandomTokenDataModule())
    trainer.save_checkpoint(tmp_path / "d.ckpt")
    ckpt = torch.load(tmp_path / "d.ckpt", weights_only=True)
    assert not any(k.startswith("teacher.") for k in ckpt["state_dict"])
    assert ckpt["hyper_parameters"]["distill"]["kl_weight"] == 1.0
    resumed = DistillModule.from_models(Transformer(student.config), teacher, OptimConfig(warmup_steps=1))
    _trainer(max_steps=2).fit(resumed, datamodule=RandomTokenDataModule(), ckpt_path=tmp_path / "d.ckpt")


def test_teacher_from_a_checkpoint_path(tmp_path):
    from moe_lit.checkpoint import export_model

    student, teacher = _pair()
    export_model(teacher, tmp_path / "teacher")
    module = DistillModule(student.config, teacher=str(tmp_path / "teacher"))
    idx = torch.randint(0, 64, (1, 8))
    assert torch.equal(module.teacher(idx).logits_BLV, teacher.eval()(idx).logits_BLV)


def test_bad_config_and_mismatched_teacher_are_refused():
    with pytest.raises(ConfigError, match="distill.temperature"):
        DistillConfig(temperature=0)
    with pytest.raises(ConfigError, match="distill.kl_weight"):
        DistillConfig(kl_weight=0, ce_weight=0)
    student, _ = _pair()
    with pytest.raises(Exception, match="teacher: vocabulary 97 differs"):
        DistillModule.from_models(student, Transformer(tiny(dense=True)))
