import pytest
import torch

from moe_lit.config import ConfigError
from moe_lit.convert.dot_moe import (
    DotMoEConfig,
    DotMoELayer,
    dot_moe_student,
    export_dot_moe,
    hard_assignment,
    sinkhorn,
)
from moe_lit.errors import MoeLitError
from moe_lit.lit.distill import fit_dot_moe
from moe_lit.model import Transformer
from tests.helpers.models import tiny


@pytest.fixture(scope="module")
def dense():
    torch.manual_seed(0)
    return Transformer(tiny(dense=True, vocab_size=64)).eval()


@pytest.fixture(scope="module")
def idx():
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))


def _batches(n):
    return list(torch.randint(0, 64, (n, 4, 17), generator=torch.Generator().manual_seed(2)))


def test_sinkhorn_marginals():
    logits_FE = torch.randn(64, 8, generator=torch.Generator().manual_seed(0)) * 3
    plan_FE = sinkhorn(logits_FE, iterations=100)
    assert torch.allclose(plan_FE.sum(1), torch.ones(64), atol=1e-5)
    assert torch.allclose(plan_FE.sum(0), torch.full((8,), 8.0), atol=1e-3)
    assert (sinkhorn(logits_FE, 1).sum(0) - 8).abs().max() > (plan_FE.sum(0) - 8).abs().max()


def test_rounding_is_exactly_balanced_and_one_hot():
    plan_FE = sinkhorn(torch.randn(48, 6, generator=torch.Generator().manual_seed(0)), 5)
    m_FE = hard_assignment(plan_FE)
    assert m_FE.sum(0).tolist() == [8.0] * 6 and m_FE.sum(1).tolist() == [1.0] * 48
    assert set(m_FE.unique().tolist()) == {0.0, 1.0}


def test_all_experts_active_equals_dense(dense, idx):
    for init in ("kmeans", "random"):
        student = dot_moe_student(dense, 4, 4, DotMoEConfig(affinity_init=init)).eval()
        assert (student(idx).logits_BLV - dense(idx).logits_BLV).abs().max().item() < 1e-5
        assert (export_dot_moe(student)(idx).logits_BLV - dense(idx).logits_BLV).abs().max().item() < 1e-5


def test_gradients_reach_the_affinities_and_the_router_only_by_default(dense, idx):
    student = dot_moe_student(dense, 4, 2, DotMoEConfig(affinity_init="random", affinity_scale=0.5)).train()
    out = student(idx[:, :-1], idx[:, 1:])
    (out.ce + out.aux_loss).backward()
    layer = student.blocks[0].ffn
    assert isinstance(layer, DotMoELayer)
    assert layer.affinity.grad.abs().sum() > 0 and layer.router.layer.weight.grad.abs().sum() > 0
    assert layer.dense.w1.weight.grad is None and student.tok_embeddings.weight.grad is None
    trainable = dot_moe_student(dense, 4, 2, DotMoEConfig(train_dense=True))
    assert all(p.requires_grad for p in trainable.parameters())


def test_training_then_export_gives_the_same_forward(dense, idx):
    cfg = DotMoEConfig(affinity_init="random", affinity_scale=0.3, sinkhorn_iterations=5)
    student = dot_moe_student(dense, 4, 2, cfg, z_loss_coef=1e-3)
    affinity_before = student.blocks[0].ffn.affinity.detach().clone()
    fit_dot_moe(dense, student, _batches(4), cfg)
    layer = student.blocks[0].ffn
    assert not torch.equal(layer.affinity, affinity_before)
    assert layer.temperature.item() == pytest.approx(0.1)  # annealed by step 4 * 0.2
    assert torch.equal(layer.dense.w1.weight, dense.blocks[0].ffn.w1.weight)  # frozen dense
    assert layer.affinity.requires_grad
    moe = export_dot_moe(student).eval()
    assert moe.config.moe.num_experts == 4 and moe.config.moe.expert_size == 16 and moe.config.moe.z_loss_coef == 1e-3
    assert (moe(idx).logits_BLV - student(idx).logits_BLV).abs().max().item() < 1e-5
    assert torch.bincount(layer.assignment(), minlength=4).tolist() == [16] * 4


def test_trained_dense_weights_change_when_asked(dense):
    student = dot_moe_student(dense, 4, 2, DotMoEConfig(train_dense=True))
    fit_dot_moe(dense, student, _batches(2))
    assert not torch.equal(student.blocks[0].ffn.dense.w1.weight, dense.blocks[0].ffn.w1.weight)
    assert not torch.equal(student.tok_embeddings.weight, dense.tok_embeddings.weight)


def test_temperature_schedule_and_bad_config():
    cfg = DotMoEConfig(temperature_start=1.0, temperature_end=0.1, anneal_fraction=0.2)
    assert cfg.temperature(0, 100) == 1.0
    assert cfg.temperature(10, 100) == pytest.approx(0.1**0.5)
    assert cfg.temperature(20, 100) == pytest.approx(0.1) and cfg.temperature(90, 100) == pytest.approx(0.1)
    with pytest.raises(ConfigError, match="dot_moe.temperature_end"):
        DotMoEConfig(temperature_end=0)
    with pytest.raises(ConfigError, match="dot_moe.affinity_init"):
        DotMoEConfig(affinity_init="spectral")
    with pytest.raises(MoeLitError, match="no DOT-MoE layers"):
        export_dot_moe(Transformer(tiny()))
