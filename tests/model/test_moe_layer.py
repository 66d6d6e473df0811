import math

import pytest
import torch

from moe_lit.config import MoEConfig
from moe_lit.model.experts.layout import ExpertLayout
from moe_lit.model.experts.torch_backend import TorchExperts, plan_dispatch
from moe_lit.model.mlp import SwiGLU
from moe_lit.model.moe import MoELayer
from moe_lit.model.router import Router, finish_routing_step, load_balancing_loss, z_loss
from tests.helpers.models import random_init, reference_moe

D = 16


def test_one_expert_top1_equals_dense_swiglu():
    torch.manual_seed(0)
    moe = random_init(MoELayer(D, MoEConfig(num_experts=1, expert_size=24, top_k=1, renormalize=True), 1))
    dense = SwiGLU(D, 24)
    with torch.no_grad():
        moe.experts.bias.zero_()
        dense.w1.weight.copy_(moe.experts.mlp.w1)
        dense.v1.weight.copy_(moe.experts.mlp.v1)
        dense.w2.weight.copy_(moe.experts.mlp.w2.t())
    x = torch.randn(2, 5, D)
    y_moe, _ = moe(x)
    assert (y_moe - dense(x)).abs().max().item() < 1e-6


@pytest.mark.parametrize(
    "cfg",
    [
        MoEConfig(num_experts=4, expert_size=8, top_k=2),
        MoEConfig(num_experts=5, expert_size=[4, 8, 12, 3, 9], top_k=3, shared_expert_size=6),
        MoEConfig(num_experts=6, expert_size=5, top_k=1, score_func="sigmoid", renormalize=False),
        MoEConfig(num_experts=3, expert_size=[7, 2, 5], top_k=2, balancing="bias", shared_expert_size=4),
    ],
    ids=["uniform", "hetero-shared", "sigmoid-top1", "bias-hetero"],
)
def test_dropless_matches_reference_loop_outputs_and_gradients(cfg):
    layer = random_init(MoELayer(D, cfg, 1), seed=1)
    x = torch.randn(3, 7, D, generator=torch.Generator().manual_seed(2))
    x_fast = x.clone().requires_grad_(True)
    x_ref = x.clone().requires_grad_(True)
    y_fast, _ = layer(x_fast)
    grads_fast = torch.autograd.grad(y_fast.square().sum(), [x_fast, *layer.parameters()])
    y_ref = reference_moe(layer, x_ref.view(-1, D)).view_as(x)
    grads_ref = torch.autograd.grad(y_ref.square().sum(), [x_ref, *layer.parameters()])
    assert (y_fast - y_ref).abs().max().item() < 1e-5
    for g_fast, g_ref in zip(grads_fast, grads_ref, strict=False):
        assert (g_fast - g_ref).abs().max().item() < 1e-5


def test_capacity_factor_drops_exactly_the_overflow_in_token_order():
    experts = random_init(TorchExperts(D, ExpertLayout.of([4, 4])))
    x = torch.randn(6, D)
    indices = torch.tensor([[0], [0], [0], [0], [1], [0]])
    weights = torch.ones(6, 1)
    capacity = MoEConfig(num_experts=2, top_k=1, capacity_factor=1.0).capacity(6)
    assert capacity == 3
    y, counts = experts(x, weights, indices, capacity)
    assert int(counts.dropped) == 2  # expert 0 got tokens 0,1,2,3,5: keeps 0,1,2
    assert counts.routed_counts_E.tolist() == [5, 1]
    assert plan_dispatch(indices, experts.layout, capacity, "looped").kept_counts == [3, 1]
    y_dropless, _ = experts(x, weights, indices, None)
    kept = [0, 1, 2, 4]
    assert torch.allclose(y[kept], y_dropless[kept])
    assert torch.allclose(y[[3, 5]], experts.bias.expand(2, D))


def test_load_balancing_loss_formula_by_hand():
    scores = torch.tensor([[0.7, 0.3], [0.6, 0.4]])
    counts = torch.tensor([2, 0])
    # w * E / (layers * T * k) * sum_e count_e * mean_t score_te = 0.1 * 2 / (1*2*1) * (2*0.65) = 0.13
    assert load_balancing_loss(scores, counts, top_k=1, num_moe_layers=1, coef=0.1).item() == pytest.approx(0.13)
    # two layers halve each layer's share
    assert load_balancing_loss(scores, counts, 1, 2, 0.1).item() == pytest.approx(0.065)


def test_z_loss_formula_by_hand():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    expected = 0.5 * (math.log(2.0) ** 2 + math.log(4.0) ** 2) * 0.01
    assert z_loss(logits, num_moe_layers=1, coef=0.01).item() == pytest.approx(expected, rel=1e-6)


def test_layer_reports_weighted_losses_and_training_counts():
    cfg = MoEConfig(num_experts=4, expert_size=8, top_k=2, aux_loss_coef=0.5, z_loss_coef=0.1)
    layer = random_init(MoELayer(D, cfg, 1))
    layer.eval()
    _, losses = layer(torch.randn(2, 3, D))
    assert set(losses) == {"load_balancing", "z_loss"}
    assert layer.router.pending_tokens_per_expert().sum().item() == 0  # eval forwards are not recorded
    layer.train()
    layer(torch.randn(2, 3, D))
    assert layer.router.pending_tokens_per_expert().sum().item() == 2 * 3 * 2


@pytest.mark.slow
def test_bias_balancing_lowers_load_imbalance_on_a_skewed_router():
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=4, expert_size=4, top_k=1, balancing="bias", bias_update_rate=0.02)
    layer = random_init(MoELayer(D, cfg, 1)).train()
    with torch.no_grad():
        layer.router.layer.weight[0] += 1.0  # expert 0 dominates
    x = torch.randn(256, D).abs()  # positive inputs make the skew strong

    def imbalance() -> float:
        load = layer.router.tokens_per_expert
        return (load.max() / load.mean()).item()

    layer(x)
    finish_routing_step([layer.router])
    start = imbalance()
    for _ in range(200):
        layer(x)
        finish_routing_step([layer.router])
    assert start > 2.0
    assert imbalance() < 0.6 * start


def test_shared_expert_gate_scales_the_shared_output_by_its_sigmoid():
    cfg = MoEConfig(num_experts=4, expert_size=8, top_k=2, shared_expert_size=6, shared_expert_gate=True)
    layer = random_init(MoELayer(D, cfg, 1))
    x_TD = torch.randn(5, D, generator=torch.Generator().manual_seed(3))
    ungated = reference_moe(layer, x_TD) - layer.shared_expert(x_TD)
    gate_T1 = torch.sigmoid(x_TD @ layer.shared_expert_gate.weight.t())
    y_TD, _ = layer(x_TD)
    assert torch.allclose(y_TD, ungated + gate_T1 * layer.shared_expert(x_TD), atol=1e-6)


def test_without_expert_output_bias_the_bias_is_a_fixed_zero_outside_the_checkpoint():
    layer = random_init(MoELayer(D, MoEConfig(num_experts=4, expert_size=8, top_k=2, expert_output_bias=False), 1))
    assert "experts.bias" not in layer.state_dict()
    assert all(not name.endswith("bias") for name, _ in layer.named_parameters())
    y_TD, _ = layer(torch.randn(5, D))
    y_TD.sum().backward()
    assert torch.equal(layer.experts.bias, torch.zeros(D)) and layer.experts.mlp.w1.grad is not None


def test_the_router_decides_in_float32_under_bf16_autocast():
    """Selective precision: a bf16 autocast region routes exactly as float32 does."""
    router = Router(64, MoEConfig(num_experts=16, expert_size=8, top_k=2)).eval()
    x_TD = torch.randn(512, 64, generator=torch.Generator().manual_seed(0))
    fp32 = router(x_TD)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = router(x_TD)
    assert bf16.logits_TE.dtype == torch.float32
    assert torch.equal(bf16.indices_TK, fp32.indices_TK) and torch.equal(bf16.weights_TK, fp32.weights_TK)
