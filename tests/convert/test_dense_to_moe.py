import pytest
import torch

from moe_lit.config import ConfigError
from moe_lit.convert import dense_to_moe
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


@pytest.mark.parametrize(
    "recipe, fields",
    [
        ("copy", dict(num_experts=4, top_k=2)),
        ("copy", dict(num_experts=3, top_k=1, balancing="bias")),
        ("granular", dict(num_experts=8, top_k=4, granularity=4)),
        ("granular", dict(num_experts=8, top_k=4, granularity=2)),  # two virtual groups per token
        ("granular", dict(num_experts=4, top_k=2, granularity=2, score_func="sigmoid")),
    ],
    ids=["copy-top2", "copy-top1-bias", "granular-G4", "granular-G2-kv2", "granular-sigmoid"],
)
def test_upcycled_logits_equal_dense_logits(dense, idx, recipe, fields):
    moe = dense_to_moe(dense, recipe, **fields)
    assert moe.config.moe.num_experts == fields["num_experts"]
    assert moe.config.moe.expert_size == 64 // fields.get("granularity", 1)
    assert (moe(idx).logits_BLV - dense(idx).logits_BLV).abs().max().item() < 1e-5


def test_granular_layout_shards_scaling_and_tied_router_rows(dense):
    moe = dense_to_moe(dense, "granular", num_experts=4, top_k=2, granularity=2, seed=3)
    layer, ffn = moe.blocks[1].ffn, dense.blocks[1].ffn
    w1 = layer.experts.mlp.w1.view(4, 32, 32)
    w2 = layer.experts.mlp.w2.view(4, 32, 32)
    for expert in range(4):
        shard = slice(32 * (expert % 2), 32 * (expert % 2 + 1))
        assert torch.equal(w1[expert], ffn.w1.weight[shard])
        assert torch.equal(w2[expert], ffn.w2.weight[:, shard].t() * 2)
    router = layer.router.layer.weight
    assert torch.equal(router[0], router[1]) and torch.equal(router[2], router[3])
    assert not torch.equal(router[0], router[2])


def test_everything_outside_the_ffns_is_copied_and_source_untouched(dense):
    before = {k: v.clone() for k, v in dense.state_dict().items()}
    moe = dense_to_moe(dense, "copy", num_experts=2, top_k=1, first_dense_layers=1)
    assert moe.config.moe_layer_ids == (1,)
    moe_state = moe.state_dict()
    for name, value in before.items():
        assert torch.equal(dense.state_dict()[name], value)
        if ".1.ffn." not in name:
            assert torch.equal(moe_state[name], value), name


def test_drop_reinitialises_the_requested_fraction_of_neurons(dense):
    copy = dense_to_moe(dense, "copy", num_experts=4, top_k=2, seed=0)
    drop = dense_to_moe(dense, "drop", num_experts=4, top_k=2, drop_fraction=0.25, seed=0)
    again = dense_to_moe(dense, "drop", num_experts=4, top_k=2, drop_fraction=0.25, seed=0)
    assert torch.equal(drop.blocks[0].ffn.experts.mlp.w1, again.blocks[0].ffn.experts.mlp.w1)
    for name in ("w1", "v1", "w2"):
        changed_S = (
            getattr(drop.blocks[0].ffn.experts.mlp, name) != getattr(copy.blocks[0].ffn.experts.mlp, name)
        ).any(-1)
        assert changed_S.view(4, 64).sum(-1).tolist() == [16, 16, 16, 16]
    rows = drop.blocks[0].ffn.experts.mlp.w1.view(4, 64, 32)
    assert not torch.equal(rows[0], rows[1])  # different neurons dropped in each copy


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(recipe="clone"), "recipe: got 'clone', allowed values: copy, granular, drop"),
        (dict(recipe="copy", granularity=2), "granularity: recipe 'copy'"),
        (dict(recipe="granular", num_experts=6, top_k=4, granularity=4), "num_experts: must be a multiple"),
        (dict(recipe="granular", num_experts=8, top_k=2, granularity=4), "top_k: must be a multiple"),
        (dict(recipe="drop", drop_fraction=1.5), "drop_fraction: must be in [0, 1]"),
        (dict(expert_size=8), "moe.expert_size: set by dense_to_moe"),
    ],
)
def test_bad_arguments_name_the_field(dense, kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        dense_to_moe(dense, **{"num_experts": 4, "top_k": 2, **kwargs})


def test_moe_input_is_refused():
    with pytest.raises(MoeLitError, match="already an MoE"):
        dense_to_moe(Transformer(tiny()), "copy")
