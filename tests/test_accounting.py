import pytest

from moe_lit.accounting import (
    accounting_rows,
    count_config_params,
    count_model_params,
    forward_flops_per_token,
    matched_moe_config,
)
from moe_lit.config import ConfigError
from moe_lit.model import Transformer
from tests.helpers.models import tiny

# The options the transformers MoE families need (moe_lit.convert.hf), alone and together.
HF_FEATURES = [
    tiny(qk_norm="head", n_kv_heads=2),
    tiny(qk_norm="full", n_kv_heads=2, tie_embeddings=True),
    tiny(qkv_bias=True, shared_expert_size=8, shared_expert_gate=True, expert_output_bias=False),
    tiny(dense=True, attn_head_dim=16, qk_norm="head", qkv_bias=True),
]
HF_IDS = ["qk-norm-head", "qk-norm-full", "qkv-bias-gated-shared-no-bias", "dense-head-dim"]


@pytest.mark.parametrize(
    "cfg",
    [
        tiny(dense=True),
        tiny(dense=True, tie_embeddings=True, n_kv_heads=2),
        tiny(num_experts=8, expert_size=16, top_k=2),
        tiny(num_experts=4, expert_size=[8, 16, 24, 32], top_k=2),
        tiny(num_experts=4, expert_size=12, top_k=1, shared_expert_size=20),
        tiny(num_experts=3, expert_size=[5, 7, 9], top_k=2, n_layers=5, first_dense_layers=1, layer_interval=2),
        tiny(balancing="bias", tie_embeddings=True),
        tiny(num_experts=4, expert_size=16, top_k=1, n_layers=3, layer_expert_sizes=[[16] * 4, [8, 24], [16]]),
        *HF_FEATURES,
    ],
    ids=[
        "dense",
        "dense-tied-gqa",
        "uniform",
        "hetero",
        "shared",
        "interleaved-hetero",
        "bias-tied",
        "per-layer",
        *HF_IDS,
    ],
)
def test_analytic_counts_equal_built_model(cfg):
    assert count_config_params(cfg) == count_model_params(Transformer(cfg))


@pytest.mark.parametrize(
    "cfg", [tiny(dense=True), tiny(shared_expert_size=8), *HF_FEATURES], ids=["dense", "shared", *HF_IDS]
)
def test_flops_equal_twice_the_built_models_active_matmul_parameters(cfg):
    model = Transformer(cfg)
    matrices = [p for name, p in model.named_parameters() if p.dim() == 2 and "tok_embeddings" not in name]
    matmul = sum(p.numel() for p in matrices)
    if cfg.tie_embeddings:
        matmul += model.lm_head.weight.numel()
    for layer in model.moe_layers():
        experts = sum(p.numel() for p in layer.experts.mlp.parameters())
        matmul -= experts - experts * cfg.moe.top_k // cfg.moe.num_experts
    attention = 4 * cfg.n_layers * cfg.seq_len * cfg.n_heads * cfg.head_dim
    assert forward_flops_per_token(cfg) == 2 * matmul + attention


def test_active_counts_by_hand_for_uniform_moe():
    cfg = tiny(num_experts=8, expert_size=16, top_k=2, n_layers=1)
    counts = count_config_params(cfg)
    d, v = 32, 97
    attention, norms = 4 * d * d, 2 * d
    router, bias, experts = 8 * d, d, 3 * d * 16 * 8
    assert counts.total == 2 * v * d + d + attention + norms + router + bias + experts
    assert counts.active == counts.total - experts + experts // 4


@pytest.mark.parametrize("num_experts, top_k, shared", [(4, 1, 0.0), (8, 2, 0.0), (16, 4, 0.25), (32, 8, 0.0)])
def test_active_matched_config_hits_budget_within_one_percent(num_experts, top_k, shared):
    dense = tiny(dense=True, d_ff=256, d_model=64)
    moe = matched_moe_config(dense, num_experts, top_k, match="active", shared_fraction=shared)
    dense_active = count_config_params(dense).active_non_embedding
    moe_counts = count_config_params(moe)
    assert abs(moe_counts.active_non_embedding - dense_active) / dense_active < 0.01
    assert moe_counts.total > count_config_params(dense).total


@pytest.mark.parametrize("num_experts, top_k", [(4, 1), (8, 2)])
def test_total_matched_config_hits_budget_within_one_percent(num_experts, top_k):
    dense = tiny(dense=True, d_ff=256, d_model=64)
    moe = matched_moe_config(dense, num_experts, top_k, match="total")
    dense_total = count_config_params(dense).total
    assert abs(count_config_params(moe).total - dense_total) / dense_total < 0.01
    assert count_config_params(moe).active < dense_total


def test_heterogeneous_profile_keeps_the_mean_size():
    dense = tiny(dense=True, d_ff=256, d_model=64)
    uniform = matched_moe_config(dense, 4, 2)
    hetero = matched_moe_config(dense, 4, 2, size_profile=[1, 1, 2, 4])
    assert hetero.moe.expert_sizes[3] == pytest.approx(4 * hetero.moe.expert_sizes[0], rel=0.02)
    assert abs(hetero.moe.total_expert_size - uniform.moe.total_expert_size) <= 4


def test_impossible_match_is_a_named_error():
    with pytest.raises(ConfigError, match="moe.expert_size"):
        matched_moe_config(tiny(dense=True, d_ff=8), num_experts=64, top_k=1, match="total")
    with pytest.raises(ConfigError, match="match: got 'both'"):
        matched_moe_config(tiny(dense=True), 4, 1, match="both")


def test_flops_count_active_not_total_parameters():
    dense = tiny(dense=True, d_ff=256, d_model=64)
    moe = matched_moe_config(dense, 16, 2)
    assert forward_flops_per_token(moe) == pytest.approx(forward_flops_per_token(dense), rel=0.02)
    rows = accounting_rows({"dense": dense, "moe": moe})
    assert rows[1]["total/active"] > 3
