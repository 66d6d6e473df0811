import pytest
import torch

from moe_lit.config import ConfigError
from moe_lit.convert import allocate_copies, expand_experts, expert_utility, plan_expansion
from moe_lit.convert.common import next_token_loss
from moe_lit.convert.expand import ExpansionConfig
from moe_lit.errors import MoeLitError
from moe_lit.model import Transformer
from tests.helpers.models import tiny


def _model(**fields) -> Transformer:
    torch.manual_seed(0)
    return Transformer(tiny(**fields)).eval()


@pytest.fixture(scope="module")
def idx():
    return torch.randint(0, 97, (3, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    "fields, expansion",
    [
        (dict(top_k=1), dict(factor=2)),
        (dict(top_k=1), dict(counts=[3, 1, 2, 1])),
        (dict(top_k=1, score_func="sigmoid", balancing="bias"), dict(factor=3)),
        (dict(top_k=1, expert_size=[8, 16, 24, 12], shared_expert_size=8), dict(counts=[1, 2, 1, 4])),
    ],
    ids=["factor2", "counts", "sigmoid-bias", "hetero-shared"],
)
def test_top1_expansion_preserves_the_function_exactly(idx, fields, expansion):
    model = _model(**fields)
    expanded = expand_experts(model, **expansion, noise=0.0)
    assert (expanded(idx).logits_BLV - model(idx).logits_BLV).abs().max().item() < 1e-5
    counts = expansion.get("counts") or [expansion["factor"]] * 4
    assert expanded.config.moe.num_experts == sum(counts)
    assert expanded.config.moe.top_k == 1
    assert expanded.config.moe.balancing == "bias"


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_top1_expansion_is_exact_with_trained_selection_biases(idx, score_func):
    model = _model(top_k=1, balancing="bias", score_func=score_func)
    with torch.no_grad():
        for layer in model.moe_layers():
            layer.router.expert_bias.copy_(torch.tensor([0.02, -0.01, 0.015, -0.03]))
    expanded = expand_experts(model, factor=3, noise=0.0)
    assert (expanded(idx).logits_BLV - model(idx).logits_BLV).abs().max().item() < 1e-5


def test_copies_hold_their_sources_rows_router_rows_and_jittered_bias():
    model = _model(top_k=2, expert_size=[8, 16, 24, 12], balancing="bias")
    with torch.no_grad():
        model.blocks[0].ffn.router.expert_bias.copy_(torch.tensor([0.1, 0.2, 0.3, 0.4]))
    expanded = expand_experts(model, counts=[1, 3, 1, 2], noise=1e-3, seed=5)
    old, new = model.blocks[0].ffn, expanded.blocks[0].ffn
    sources = [0, 1, 2, 3, 1, 1, 3]
    assert new.experts.layout.sizes == (8, 16, 24, 12, 16, 16, 12)
    for expert, source in enumerate(sources):
        for name in ("w1", "v1", "w2"):
            new_rows = getattr(new.experts.mlp, name)[new.experts.layout.rows(expert)]
            assert torch.equal(new_rows, getattr(old.experts.mlp, name)[old.experts.layout.rows(source)])
        assert torch.equal(new.router.layer.weight[expert], old.router.layer.weight[source])
    bias, old_bias = new.router.expert_bias, old.router.expert_bias * 4 / 7  # softmax: biases scaled by E/M
    assert torch.allclose(bias[:4], old_bias)  # originals: no noise
    jitter = bias[4:] - old_bias[sources[4:]]
    assert jitter.abs().max().item() <= 1e-3 and jitter.abs().min().item() > 0
    assert model.config.moe.num_experts == 4  # the source is not modified


def test_top2_expansion_picks_both_copies_of_the_best_expert(idx):
    """The documented failure of exactness for k > 1: tied copies crowd out the second expert."""
    model = _model(top_k=2)
    expanded = expand_experts(model, factor=2, noise=0.0)
    layer, old = expanded.blocks[0].ffn, model.blocks[0].ffn
    x_TD = torch.randn(20, 32, generator=torch.Generator().manual_seed(0))
    routing = layer.router(x_TD)
    assert torch.equal(routing.indices_TK.sort(-1).values % 4, old.router(x_TD).indices_TK[:, :1].expand(-1, 2))
    best_only = old.experts(x_TD, torch.ones(20, 1), old.router(x_TD).indices_TK[:, :1], None)[0]
    assert (layer(x_TD[None])[0][0] - best_only).abs().max().item() < 1e-5


def test_utility_selection_gives_copies_to_the_most_useful_experts():
    assert allocate_copies(torch.tensor([1.0, 1.0, 1.0, 1.0]), 4) == [2, 2, 2, 2]
    assert allocate_copies(torch.tensor([8.0, 1.0, 2.0, 0.5]), 4) == [4, 1, 2, 1]  # 8 > 4 > 2.67 > 2 = 2
    assert allocate_copies(torch.tensor([100.0, 1.0, 0.0, 0.0]), 4) == [4, 2, 1, 1]  # at most 3 copies
    with pytest.raises(ConfigError, match="max_copies=3"):
        allocate_copies(torch.ones(2), 7)


def test_expert_utility_is_the_mean_squared_gradient_norm_per_expert():
    model = _model(top_k=2)
    batches = [torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    utility = expert_utility(model, iter(batches), num_batches=2)
    assert utility.num_batches == 2
    expected = torch.zeros(4)
    for batch in batches[:2]:
        model.zero_grad()
        next_token_loss(model, batch).backward()
        mlp = model.blocks[1].ffn.experts.mlp
        per_row = sum(getattr(mlp, n).grad.square().sum(-1) for n in ("w1", "v1", "w2"))
        expected += per_row.view(4, 16).sum(-1) / 2
    assert torch.allclose(utility.grad_sq[1], expected, rtol=1e-4)
    assert utility.frequency[0].sum().item() == pytest.approx(1.0)
    plan = plan_expansion(model, ExpansionConfig(factor=2, selection="utility"), utility)
    for block in (0, 1):
        copies = plan.copies(block)
        assert sum(copies) == 4 and max(copies) <= 3
        ranked = utility.grad_sq[block].argsort(descending=True).tolist()
        assert copies[ranked[0]] >= copies[ranked[-1]]


def test_row_sources_map_every_expanded_row_to_its_source_row():
    model = _model(top_k=2, expert_size=[2, 3, 1, 2])
    plan = plan_expansion(model, ExpansionConfig(counts=[1, 2, 1, 1]))
    rows = plan.row_sources(model)
    assert rows["blocks.0.ffn.router.layer.weight"].tolist() == [0, 1, 2, 3, 1]
    assert rows["blocks.1.ffn.experts.mlp.w2"].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 2, 3, 4]


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(), ConfigError, "give exactly one of factor"),
        (dict(factor=2, counts=[1, 1, 1, 1]), ConfigError, "give exactly one of factor"),
        (dict(factor=1), ConfigError, "factor: must be an integer >= 2"),
        (dict(counts=[1, 2]), ConfigError, "counts: need 4 integers >= 1"),
        (dict(factor=2, selection="random"), ConfigError, "selection: got 'random', allowed values: uniform, utility"),
        (dict(factor=2, selection="utility"), ConfigError, "selection='utility' needs an ExpertUtility"),
        (dict(factor=2, balancing="aux_loss"), ConfigError, "noise: goes on the copies' selection bias"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, error, message):
    with pytest.raises(error, match=message):
        expand_experts(_model(), **kwargs)


def test_dense_input_is_refused():
    with pytest.raises(MoeLitError, match="the model is dense"):
        expand_experts(Transformer(tiny(dense=True)), factor=2)


def test_symmetry_breaking_perturbs_only_the_copies():
    model = _model(top_k=2, balancing="bias")
    plain = expand_experts(model, factor=2, noise=0.0)
    broken = expand_experts(model, factor=2, noise=0.0, router_noise=0.1, drop_fraction=0.5)
    for block_plain, block_broken in zip(plain.blocks, broken.blocks, strict=False):
        old, new = block_plain.ffn, block_broken.ffn
        w_old, w_new = old.router.layer.weight, new.router.layer.weight
        assert torch.equal(w_old[:4], w_new[:4]) and not torch.allclose(w_old[4:], w_new[4:])
        layout = new.experts.layout
        for e in range(8):
            same = torch.equal(old.experts.mlp.w1[layout.rows(e)], new.experts.mlp.w1[layout.rows(e)])
            assert same == (e < 4)  # sources untouched, half of every copy's neurons re-initialised
    with pytest.raises(ConfigError, match="drop_fraction"):
        expand_experts(model, factor=2, drop_fraction=1.0)
