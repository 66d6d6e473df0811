import dataclasses
import json

import pytest

from moe_lit.config import ConfigError, ModelConfig, MoEConfig


@pytest.mark.parametrize(
    "fields, field_name, fragment",
    [
        (dict(num_experts=4, top_k=5), "moe.top_k", "<= num_experts=4"),
        (dict(num_experts=4, expert_size=[8, 8, 8]), "moe.expert_size", "4 entries"),
        (dict(num_experts=2, expert_size=[8, -1]), "moe.expert_size[1]", "positive integer"),
        (dict(expert_size=-3), "moe.expert_size", "positive integer"),
        (dict(score_func="tanh"), "moe.score_func", "allowed values: softmax, sigmoid"),
        (dict(balancing="magic"), "moe.balancing", "allowed values: aux_loss, bias, none"),
        (dict(backend="cuda"), "moe.backend", "allowed values: auto, torch, megablocks"),
        (dict(capacity_factor=0.0), "moe.capacity_factor", "> 0 or null"),
        (dict(shared_expert_size=-1), "moe.shared_expert_size", ">= 0"),
        (dict(num_experts=0), "moe.num_experts", "positive integer"),
        (dict(layer_interval=0), "moe.layer_interval", "positive integer"),
        (dict(shared_expert_gate=True), "moe.shared_expert_gate", "shared_expert_size > 0"),
        (
            dict(num_experts=3, top_k=2, layer_expert_sizes=[[8, 8, 8], [8]]),
            "moe.layer_expert_sizes[1]",
            "fewer than top_k=2",
        ),
        (dict(num_experts=3, top_k=1, layer_expert_sizes=[[8, 0]]), "moe.layer_expert_sizes[0][1]", "positive integer"),
        (dict(num_experts=4, top_k=1, layer_expert_sizes=[[8, 8, 8]]), "moe.num_experts", "widest layer's count 3"),
        (dict(layer_expert_sizes=[]), "moe.layer_expert_sizes", "non-empty list"),
    ],
)
def test_bad_moe_config_names_the_field(fields, field_name, fragment):
    with pytest.raises(ConfigError) as err:
        MoEConfig(**fields)
    assert str(err.value).startswith(field_name + ":")
    assert fragment in str(err.value)


@pytest.mark.parametrize(
    "fields, field_name, fragment",
    [
        (dict(d_model=30, n_heads=4), "model.n_heads", "divisible"),
        (dict(n_heads=4, n_kv_heads=3), "model.n_kv_heads", "divisible"),
        (dict(d_ff=0), "model.d_ff", "positive integer"),
        (dict(vocab_size=-5), "model.vocab_size", "positive integer"),
        (dict(n_layers=2, moe=MoEConfig(first_dense_layers=2)), "moe.first_dense_layers", "< n_layers=2"),
        (dict(qk_norm="layer"), "model.qk_norm", "allowed values: none, head, full"),
        (dict(attn_head_dim=0), "model.attn_head_dim", "positive integer"),
        (dict(d_model=30, n_heads=4), "model.n_heads", "or set attn_head_dim"),
        (
            dict(n_layers=3, moe=MoEConfig(num_experts=2, top_k=1, layer_expert_sizes=[[4, 4], [4]])),
            "moe.layer_expert_sizes",
            "one list per MoE layer (3), got 2",
        ),
    ],
)
def test_bad_model_config_names_the_field(fields, field_name, fragment):
    with pytest.raises(ConfigError) as err:
        ModelConfig(**fields)
    assert str(err.value).startswith(field_name + ":")
    assert fragment in str(err.value)


def test_yaml_round_trip_preserves_everything():
    cfg = ModelConfig(
        n_layers=5,
        n_kv_heads=2,
        moe=MoEConfig(num_experts=3, expert_size=[8, 16, 24], top_k=2, capacity_factor=1.25, first_dense_layers=1),
    )
    again = ModelConfig.from_yaml(cfg.to_yaml())
    assert again == cfg
    assert again.moe.expert_sizes == (8, 16, 24)
    assert again.moe_layer_ids == (1, 2, 3, 4)


def test_unknown_yaml_key_is_named():
    with pytest.raises(ConfigError, match=r"model: unknown key\(s\) \['dmodel'\]"):
        ModelConfig.from_yaml("dmodel: 3\n")
    with pytest.raises(ConfigError, match=r"moe: unknown key\(s\) \['topk'\]"):
        ModelConfig.from_yaml("moe: {topk: 3}\n")


def test_layer_selection_interval_and_first_dense():
    cfg = ModelConfig(n_layers=7, moe=MoEConfig(first_dense_layers=1, layer_interval=2))
    assert cfg.moe_layer_ids == (1, 3, 5)
    assert ModelConfig(n_layers=3).moe_layer_ids == ()


def test_capacity_is_ceil_of_factor_times_share():
    moe = MoEConfig(num_experts=4, top_k=2, capacity_factor=1.25)
    assert moe.capacity(10) == 7  # ceil(1.25 * 10 * 2 / 4) = ceil(6.25)
    assert MoEConfig().capacity(10) is None


def test_attn_head_dim_decouples_heads_from_d_model():
    cfg = ModelConfig(d_model=30, n_heads=4, attn_head_dim=16)
    assert cfg.head_dim == 16 and ModelConfig(d_model=32, n_heads=4).head_dim == 8


def test_per_layer_expert_sizes_round_trip_and_give_each_layer_its_config():
    moe = MoEConfig(num_experts=3, expert_size=[8, 16, 24], top_k=1, layer_expert_sizes=[[8, 16, 24], [5], [7, 7]])
    cfg = ModelConfig(n_layers=4, moe=dataclasses.replace(moe, first_dense_layers=1))
    assert ModelConfig.from_yaml(cfg.to_yaml()) == cfg
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    layer_3 = cfg.moe_layer_config(3)
    assert (layer_3.num_experts, layer_3.expert_size, layer_3.layer_expert_sizes) == (2, 7, None)
    assert cfg.moe_layer_config(1).expert_sizes == (8, 16, 24)
