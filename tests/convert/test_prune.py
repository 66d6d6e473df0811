import copy

import pytest
import torch

from moe_lit.accounting import count_config_params, count_model_params
from moe_lit.checkpoint import export_model, load_model
from moe_lit.config import ConfigError
from moe_lit.convert.prune import memory_saved, model_bytes, plan_pruning, prune_experts
from moe_lit.model import Transformer
from tests.helpers.models import tiny

SETTINGS = [
    dict(),
    dict(renormalize=False),
    dict(score_func="sigmoid", balancing="bias"),
    dict(score_func="sigmoid", balancing="bias", renormalize=False),
    dict(expert_size=[8, 16, 24, 12, 20, 4], shared_expert_size=8),
]
IDS = ["softmax", "softmax-no-renorm", "sigmoid-bias", "sigmoid-bias-no-renorm", "hetero-shared"]


def _model(**fields) -> Transformer:
    torch.manual_seed(0)
    fields = {"num_experts": 6, "n_layers": 3, **fields}
    model = Transformer(tiny(**fields)).eval()
    if model.config.moe.balancing == "bias":
        with torch.no_grad():
            for layer in model.moe_layers():
                layer.router.expert_bias.copy_(torch.randn(6) * 0.3)
    return model


@pytest.fixture(scope="module")
def idx():
    return torch.randint(0, 97, (3, 16), generator=torch.Generator().manual_seed(1))


def _masked_reference(model: Transformer, keep: dict[int, list[int]]) -> Transformer:
    """The original with pruned logits -inf before the scores and pruned selections -inf before top-k."""
    reference = copy.deepcopy(model)
    for block, kept in keep.items():
        router = reference.blocks[block].ffn.router
        pruned = torch.ones(router.num_experts, dtype=torch.bool)
        pruned[kept] = False
        router.layer.register_forward_hook(lambda _m, _a, out, pruned=pruned: out.masked_fill(pruned, float("-inf")))
        if router.expert_bias is not None:
            with torch.no_grad():
                router.expert_bias.masked_fill_(pruned, float("-inf"))
    return reference


def test_pruning_nothing_is_the_identity(idx):
    model = _model()
    rng = torch.random.get_rng_state()
    pruned = prune_experts(model, {b: list(range(6)) for b in model.config.moe_layer_ids})
    assert torch.equal(torch.random.get_rng_state(), rng)  # a pure function: the caller's RNG is untouched
    assert pruned.config == model.config
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), pruned.state_dict().values(), strict=False)
    )
    assert torch.equal(pruned(idx).logits_BLV, model(idx).logits_BLV)


@pytest.mark.parametrize("fields", SETTINGS, ids=IDS)
def test_pruned_model_equals_the_original_with_pruned_logits_at_minus_inf(idx, fields):
    model = _model(**fields)
    keep = {0: [0, 2, 3, 5], 1: [1, 2, 4, 5], 2: [0, 1, 3, 4]}
    pruned = prune_experts(model, keep)
    reference = _masked_reference(model, keep)
    assert pruned.config.moe.num_experts == 4 and pruned.config.moe.top_k == 2
    assert (pruned(idx).logits_BLV - reference(idx).logits_BLV).abs().max().item() < 1e-5
    assert (pruned(idx).logits_BLV - model(idx).logits_BLV).abs().max().item() > 1e-3  # it did change


def test_masking_after_the_softmax_differs_without_renormalisation(idx):
    """The equality above is about logits at -inf; zeroing the weights after the softmax is another model."""
    model = _model(renormalize=False, top_k=1)
    keep = {b: [0, 1, 2] for b in model.config.moe_layer_ids}
    pruned = prune_experts(model, keep)
    after_softmax = copy.deepcopy(model)
    for layer in after_softmax.moe_layers():
        forward = layer.router.forward

        def masked(x_TD, forward=forward):
            out = forward(x_TD + 0)
            scores = out.scores_TE.clone()
            scores[:, 3:] = float("-inf")
            out.indices_TK = scores.topk(1, dim=-1).indices
            out.weights_TK = out.scores_TE.gather(-1, out.indices_TK)
            return out

        layer.router.forward = masked
    assert (pruned(idx).logits_BLV - after_softmax(idx).logits_BLV).abs().max().item() > 1e-4


def test_source_untouched_and_rows_sliced():
    model = _model(expert_size=[8, 16, 24, 12, 20, 4], score_func="sigmoid", balancing="bias")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pruned = prune_experts(model, {0: [1, 4], 1: [0, 5], 2: [2, 3]})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    old, new = model.blocks[0].ffn, pruned.blocks[0].ffn
    assert new.experts.layout.sizes == (16, 20)
    assert torch.equal(new.experts.mlp.w2[:16], old.experts.mlp.w2[8:24])
    assert torch.equal(new.experts.mlp.v1[16:], old.experts.mlp.v1[60:80])
    assert torch.equal(new.router.layer.weight, old.router.layer.weight[[1, 4]])
    assert torch.equal(new.router.expert_bias, old.router.expert_bias[[1, 4]])
    assert pruned.config.moe.layer_expert_sizes == [[16, 20], [8, 4], [24, 12]]


def test_global_budget_keeps_different_counts_and_round_trips(tmp_path, idx):
    model = _model()
    scores = {
        0: torch.tensor([6.0, 5, 4, 3, 2, 1]),
        1: torch.tensor([9.0, 9, 9, 9, 9, 9]),
        2: torch.tensor([0.5, 8, 0.1, 7, 6, 0.2]),
    }
    keep = plan_pruning(scores, num=8, global_budget=True, min_keep=2)
    # the 8 lowest scores, except block 0's expert 1 (score 5): block 0 is at min_keep by then
    assert keep == {0: [0, 1], 1: [0, 1, 2, 3, 4, 5], 2: [1, 3]}
    pruned = prune_experts(model, keep)
    assert pruned.config.moe.num_experts == 6
    assert pruned.config.moe.layer_expert_sizes == [[16] * 2, [16] * 6, [16] * 2]
    assert count_config_params(pruned.config) == count_model_params(pruned)
    assert (pruned(idx).logits_BLV - _masked_reference(model, keep)(idx).logits_BLV).abs().max().item() < 1e-5
    export_model(pruned, tmp_path / "pruned")
    loaded = load_model(tmp_path / "pruned")
    assert loaded.config == pruned.config
    assert torch.equal(loaded(idx).logits_BLV, pruned(idx).logits_BLV)


def test_pruned_model_trains_validates_and_checkpoints_with_lightning(tmp_path, idx):
    """Global budget (per-layer counts): Lightning fits, validates, saves a .ckpt that loads back."""
    import lightning.pytorch as pl

    from moe_lit.lit.module import MoELitModule
    from moe_lit.lit.optim import OptimConfig
    from tests.lit.fakes import RandomTokenDataModule

    pruned = prune_experts(_model(vocab_size=64), {0: [0, 1, 2], 1: [1, 2, 3, 4, 5], 2: [0, 2]})
    module = MoELitModule(pruned.config, OptimConfig(lr=1e-2, warmup_steps=1))
    module.model.load_state_dict(pruned.state_dict())
    data = RandomTokenDataModule(vocab_size=64, seq_len=16, batch_size=4)
    trainer = pl.Trainer(
        max_steps=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=1,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, datamodule=data)
    val_loss = trainer.validate(module, datamodule=data, verbose=False)[0]["val/loss"]
    assert 0 < val_loss < 10
    router_0 = module.model.blocks[0].ffn.router.layer.weight
    assert not torch.equal(router_0, pruned.blocks[0].ffn.router.layer.weight)  # the optimizer stepped
    trainer.save_checkpoint(tmp_path / "pruned.ckpt")
    loaded = load_model(tmp_path / "pruned.ckpt")
    assert loaded.config.moe.layer_expert_sizes == [[16] * 3, [16] * 5, [16] * 2]
    idx = idx % 64
    assert torch.equal(loaded(idx).logits_BLV, module.model.eval()(idx).logits_BLV)


@pytest.mark.parametrize("fields", [dict(), dict(expert_size=[8, 16, 24, 12, 20, 4], balancing="bias")])
def test_accounting_of_pruned_model_equals_built_model_and_memory_saved(fields):
    model = _model(**fields)
    pruned = prune_experts(model, plan_pruning({b: torch.arange(6.0) for b in (0, 1, 2)}, fraction=0.5))
    assert count_config_params(pruned.config) == count_model_params(pruned)
    saved = memory_saved(model, pruned)
    rows = sum(fields.get("expert_size", [16] * 6)[:3])  # experts 0, 1, 2 (the lowest scores) go
    per_layer = 3 * 32 * rows + 3 * 32 + (3 if "balancing" in fields else 0)
    assert saved["params_saved"] == 3 * (3 * 32 * rows + 3 * 32)
    assert saved["bytes_saved"] == 4 * 3 * per_layer
    assert saved["bytes_before"] == model_bytes(model)


def test_top_k_above_the_survivors_is_refused_or_clamped(idx):
    model = _model(top_k=3)
    keep = {0: [0, 1], 1: [0, 1, 2, 3], 2: [2, 3, 4]}
    with pytest.raises(ConfigError, match="top_k: block 0 keeps 2 experts, fewer than top_k=3"):
        prune_experts(model, keep)
    clamped = prune_experts(model, keep, clamp_top_k=True)
    assert clamped.config.moe.top_k == 2
    assert clamped(idx).logits_BLV.isfinite().all()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(fraction=1.0), "fraction: must be in \\[0, 1\\)"),
        (dict(fraction=-0.1), "fraction: must be in \\[0, 1\\)"),
        (dict(num=6), "removing 6 of the 6 experts of block 0 leaves none"),
        (dict(num=13, global_budget=True, min_keep=2), "at most 12 can go"),
        (dict(fraction=0.5, num=2), "give exactly one"),
    ],
)
def test_bad_budgets_are_one_line_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        plan_pruning({b: torch.arange(6.0) for b in (0, 1, 2)}, **kwargs)


def test_bad_keep_sets_are_refused():
    model = _model()
    with pytest.raises(ConfigError, match="keep\\[1\\]: needs distinct expert ids"):
        prune_experts(model, {0: [0, 1], 1: [1, 1], 2: [0, 1]})
    with pytest.raises(ConfigError, match="missing \\[2\\]"):
        prune_experts(model, {0: [0, 1], 1: [0, 1]})
