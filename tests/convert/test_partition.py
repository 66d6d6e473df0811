import pytest
import torch

from moe_lit.config import ConfigError, MoEConfig
from moe_lit.convert.calibration import ffn_inputs
from moe_lit.convert.partition import (
    assign_neurons,
    balanced_assignment,
    build_routers,
    expert_mass,
    partition_ffn,
)
from moe_lit.errors import MoeLitError
from moe_lit.model import Transformer
from tests.helpers.models import tiny


@pytest.fixture(scope="module")
def dense():
    torch.manual_seed(0)
    return Transformer(tiny(dense=True, n_kv_heads=2)).eval()


@pytest.fixture(scope="module")
def idx():
    return torch.randint(0, 97, (3, 16), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def calibration(dense):
    batches = torch.randint(0, 97, (8, 4, 17), generator=torch.Generator().manual_seed(2))
    return ffn_inputs(dense, batches, max_tokens=256)


@pytest.mark.parametrize("method", ["random", "kmeans", "coactivation"])
@pytest.mark.parametrize("router", ["centroid", "trained", "random"])
def test_all_experts_active_equals_dense(dense, idx, calibration, method, router):
    assignment = assign_neurons(dense, method, 4, calibration, seed=3)
    routers = build_routers(dense, assignment, router, 4, calibration, steps=5)
    moe = partition_ffn(dense, assignment, num_experts=4, top_k=4, routers=routers)
    assert moe.config.moe.expert_size == 16 and moe.config.moe.unit_weights
    assert (moe(idx).logits_BLV - dense(idx).logits_BLV).abs().max().item() < 1e-5


def test_experts_hold_the_assigned_neurons_and_top_k_drops_the_others(dense, idx):
    assignment = assign_neurons(dense, "random", 4, seed=0)
    moe = partition_ffn(dense, assignment, num_experts=4, top_k=1)
    layer, ffn = moe.blocks[0].ffn, dense.blocks[0].ffn
    for expert in range(4):
        neurons = torch.nonzero(assignment[0] == expert).squeeze(1)
        assert torch.equal(layer.experts.mlp.w1.view(4, 16, 32)[expert], ffn.w1.weight[neurons])
        assert torch.equal(layer.experts.mlp.w2.view(4, 16, 32)[expert], ffn.w2.weight[:, neurons].t())
    # k < E: the output is the selected expert's neurons only, weight exactly 1
    x_TD = torch.randn(5, 32)
    y_TD, _ = layer(x_TD[None])
    picked = layer.router(x_TD).indices_TK[:, 0]
    for t in range(5):
        neurons = assignment[0] == picked[t]
        h_F = torch.nn.functional.silu(ffn.w1(x_TD[t])) * ffn.v1(x_TD[t])
        assert torch.allclose(y_TD[0, t], ffn.w2.weight[:, neurons] @ h_F[neurons], atol=1e-6)


def test_unit_weights_pass_the_gradient_to_the_router(dense, idx):
    moe = partition_ffn(dense, assign_neurons(dense, "random", 4), num_experts=4, top_k=2).train()
    moe(idx[:, :-1], idx[:, 1:]).ce.backward()
    assert moe.blocks[0].ffn.router.layer.weight.grad.abs().sum() > 0


def test_balanced_assignment_is_exact_and_greedy():
    score_FE = torch.randn(60, 6, generator=torch.Generator().manual_seed(0))
    experts_F = balanced_assignment(score_FE)
    assert torch.bincount(experts_F, minlength=6).tolist() == [10] * 6
    preferred = score_FE.clone()
    preferred[:, 2] += 100  # everyone prefers expert 2: its 10 best takers get it
    experts_F = balanced_assignment(preferred)
    assert set(torch.nonzero(experts_F == 2).squeeze(1).tolist()) == set(
        torch.topk(score_FE[:, 2], 10).indices.tolist()
    )


def test_kmeans_recovers_planted_clusters():
    gen = torch.Generator().manual_seed(0)
    centers_ED = torch.randn(4, 32, generator=gen) * 5
    truth_F = torch.arange(64) % 4
    dense = Transformer(tiny(dense=True))
    with torch.no_grad():
        for block in dense.blocks:
            block.ffn.w1.weight.copy_(centers_ED[truth_F] + 0.1 * torch.randn(64, 32, generator=gen))
    experts_F = assign_neurons(dense, "kmeans", 4, seed=1)[0]
    for cluster in range(4):
        assert experts_F[truth_F == cluster].unique().numel() == 1


def test_trained_router_fits_the_activation_mass_better_than_centroid(dense, calibration):
    assignment = assign_neurons(dense, "kmeans", 4)
    target_TE = expert_mass(dense.blocks[1].ffn, assignment[1], calibration[1], 4)

    def kl(rows):
        log_q_TE = (calibration[1] @ rows[1].t()).log_softmax(-1)
        return (target_TE * (target_TE.clamp_min(1e-20).log() - log_q_TE)).sum(-1).mean().item()

    centroid = build_routers(dense, assignment, "centroid", 4)
    trained = build_routers(dense, assignment, "trained", 4, calibration, steps=50)
    assert kl(trained) < kl(centroid)


def test_source_untouched_and_bad_input_is_refused(dense):
    before = {k: v.clone() for k, v in dense.state_dict().items()}
    assignment = assign_neurons(dense, "random", 4)
    partition_ffn(dense, assignment, num_experts=4, top_k=2)
    assert all(torch.equal(dense.state_dict()[k], v) for k, v in before.items())
    skewed = {0: torch.zeros(64, dtype=torch.long), 1: assignment[1]}
    with pytest.raises(MoeLitError, match="exactly 16 neurons"):
        partition_ffn(dense, skewed, num_experts=4, top_k=2)
    with pytest.raises(ConfigError, match="num_experts: must divide"):
        partition_ffn(dense, assignment, num_experts=5, top_k=2)
    with pytest.raises(MoeLitError, match="needs calibration"):
        assign_neurons(dense, "coactivation", 4)
    with pytest.raises(ConfigError, match="method: got 'spectral'"):
        assign_neurons(dense, "spectral", 4)
    with pytest.raises(MoeLitError, match="already an MoE"):
        partition_ffn(Transformer(tiny()), assignment, num_experts=4, top_k=2)


def test_unit_weights_config_needs_renormalize_off():
    with pytest.raises(ConfigError, match="moe.unit_weights"):
        MoEConfig(unit_weights=True)
