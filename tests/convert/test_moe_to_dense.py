import pytest
import torch
import torch.nn.functional as F

from moe_lit.accounting import count_config_params, count_model_params
from moe_lit.config import ConfigError
from moe_lit.convert.common import next_token_loss
from moe_lit.convert.importance import reap_scores, selection_frequency
from moe_lit.convert.moe_to_dense import (
    GROUPINGS,
    SCALINGS,
    SCORES,
    MoeToDenseConfig,
    conditional_gate_weight,
    d_optimal_gains,
    grid,
    group_scales,
    kmeans_groups,
    moe_expert_scores,
    moe_to_dense,
    nearest_centre_groups,
    router_probability,
    screen,
    taylor_scores,
)
from moe_lit.errors import MoeLitError
from moe_lit.evaluation.routing_trace import RoutingTrace, routing_trace
from moe_lit.model import Transformer
from tests.helpers.models import tiny


def _model(seed=0, **fields) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(tiny(**fields)).eval()


def _trace(model, seed=1, batch=3, length=12, probs=False) -> RoutingTrace:
    idx_BL = torch.randint(0, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad(), routing_trace(model, record_probs=probs, record_inputs=True) as recorder:
        model(idx_BL)
    return recorder.trace()


def _constant_routing(**fields) -> Transformer:
    """E = top_k, renormalised softmax of a zero router: every expert weighs exactly 1/E."""
    model = _model(num_experts=4, top_k=4, expert_output_bias=False, **fields)
    with torch.no_grad():
        for layer in model.moe_layers():
            layer.router.layer.weight.zero_()
    return model


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("shared", [0, 8])
def test_constant_routing_converts_exactly(scaling, shared):
    model = _constant_routing(shared_expert_size=shared)
    trace = _trace(model)
    dense, report = moe_to_dense(model, trace, MoeToDenseConfig(score="frequency", keep=4, groups=4, scaling=scaling))
    assert dense.config.moe is None and dense.config.d_ff == 4 * 16 + shared
    assert all(s == pytest.approx(0.25) for plan in report["layers"].values() for s in plan["scales"])
    x_BLD = torch.randn(2, 5, 32)
    with torch.no_grad():
        for block in model.config.moe_layer_ids:
            moe_y, _ = model.blocks[block].ffn(x_BLD)
            torch.testing.assert_close(dense.blocks[block].ffn(x_BLD), moe_y, atol=1e-5, rtol=1e-5)
        idx = torch.randint(0, 97, (2, 10))
        torch.testing.assert_close(dense(idx).logits_BLV, model(idx).logits_BLV, atol=1e-5, rtol=1e-5)


def test_source_untouched_and_accounting():
    model = _model(num_experts=6, top_k=2, shared_expert_size=8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trace = _trace(model)
    cfg = MoeToDenseConfig(score="taylor", keep=4, groups=2, grouping="kmeans", scaling="gate_mean")
    dense, _ = moe_to_dense(model, trace, cfg)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert all(p.grad is None for p in model.parameters())
    assert dense.config.d_ff == 2 * 16 + 8
    assert dense.blocks[0].ffn.w1.weight.shape == (40, 32) and dense.blocks[0].ffn.w2.weight.shape == (32, 40)
    counts = count_model_params(dense)
    assert counts == count_config_params(dense.config)
    assert counts.total == count_config_params(model.config.replace(moe=None, d_ff=40)).total


def test_blocks_are_the_scaled_groups():
    model = _model(num_experts=4, top_k=2)
    trace = _trace(model)
    cfg = MoeToDenseConfig(score="frequency", keep=2, groups=2, scaling="gate_mass")
    dense, report = moe_to_dense(model, trace, cfg)
    plan = report["layers"]["0"]
    mlp, layout = model.blocks[0].ffn.experts.mlp, model.blocks[0].ffn.experts.layout
    first, scale = plan["groups"][0][0], plan["scales"][0]
    torch.testing.assert_close(dense.blocks[0].ffn.v1.weight[:16], mlp.v1[layout.rows(first)])
    torch.testing.assert_close(dense.blocks[0].ffn.w2.weight[:, :16], scale * mlp.w2[layout.rows(first)].T)
    assert plan["kept"] == sorted(range(4), key=lambda e: (-float(selection_frequency(trace)[0, e]), e))[:2]


# ----------------------------------------------------------------------------- the seven scores
def _hand_trace(indices_MNK, weights_MNK, num_experts=3) -> RoutingTrace:
    n = indices_MNK.shape[1]
    return RoutingTrace(
        (0,),
        num_experts,
        indices_MNK,
        weights_MNK,
        torch.zeros(n, dtype=torch.long),
        torch.arange(n),
        torch.zeros(n, dtype=torch.long),
        probs_MNE=torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]]]),
    )


def test_frequency_gate_weight_and_router_probability_on_a_hand_trace():
    trace = _hand_trace(torch.tensor([[[0], [1]]]), torch.tensor([[[0.8], [0.4]]]))
    torch.testing.assert_close(selection_frequency(trace), torch.tensor([[0.5, 0.5, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(conditional_gate_weight(trace), torch.tensor([[0.8, 0.4, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(router_probability(None, trace), torch.tensor([[0.3, 0.45, 0.25]], dtype=torch.float64))


def test_router_probability_recomputed_from_inputs_equals_recorded():
    model = _model()
    recorded = router_probability(model, _trace(model, probs=True))
    torch.testing.assert_close(router_probability(model, _trace(model)), recorded, atol=1e-6, rtol=1e-6)


def test_activation_score_is_reap():
    model = _model()
    trace = _trace(model)
    cfg = MoeToDenseConfig(score="activation")
    torch.testing.assert_close(moe_expert_scores(model, trace, cfg), reap_scores(model, trace))


def test_taylor_score_of_a_zeroed_expert_is_zero_and_matches_finite_difference():
    model = _model(num_experts=4, top_k=2, n_layers=1).double()
    with torch.no_grad():
        rows = model.blocks[0].ffn.experts.layout.rows(2)
        for w in ("w1", "v1", "w2"):
            getattr(model.blocks[0].ffn.experts.mlp, w)[rows] = 0
    trace = _trace(model)
    scores_ME = taylor_scores(model, trace)
    assert not scores_ME.requires_grad
    assert scores_ME[0, 2] == 0 and (scores_ME[0, [0, 1, 3]] > 0).all()
    # NOTE: theta . grad is the directional derivative of the loss along theta: scaling the expert's
    # matrices by (1 + h) changes the loss by h * (theta . grad) to first order.
    idx = trace.tokens_N.view(3, 12)
    mlp, rows = model.blocks[0].ffn.experts.mlp, model.blocks[0].ffn.experts.layout.rows(1)
    h, losses = 1e-3, []
    for sign in (1, -1):
        scaled = _model(num_experts=4, top_k=2, n_layers=1).double()
        scaled.load_state_dict(model.state_dict())
        with torch.no_grad():
            for w in ("w1", "v1", "w2"):
                getattr(scaled.blocks[0].ffn.experts.mlp, w)[rows] *= 1 + sign * h
            logits = [scaled(s[None, :-1]).logits_BLV[0].double() for s in idx]
            losses.append(sum(float(F.cross_entropy(z, s[1:])) for z, s in zip(logits, idx, strict=False)) / 3)
    derivative = (losses[0] - losses[1]) / (2 * h)
    assert float(scores_ME[0, 1]) == pytest.approx(abs(derivative), rel=1e-3)
    assert all(p.grad is None for p in mlp.parameters())


def test_d_optimal_prefers_a_diverse_expert_over_a_duplicate():
    # experts 0 and 1 point the same way, 2 is orthogonal; activation 1.0, 0.9, 0.5
    features = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    gains = d_optimal_gains(features, torch.tensor([1.0, 0.9, 0.5]), ridge=1e-6)
    order = sorted(range(3), key=lambda e: -float(gains[e]))
    assert order == [0, 2, 1]
    assert gains[0] == pytest.approx(1.0, rel=1e-4) and gains[2] == pytest.approx(0.25, rel=1e-4)
    assert float(gains[1]) < 1e-5


def test_do_acp_keeps_the_greedy_selection():
    model = _model(num_experts=4, top_k=2)
    trace = _trace(model)
    scores_ME = moe_expert_scores(model, trace, MoeToDenseConfig(score="do_acp"))
    assert (scores_ME > 0).all()
    assert scores_ME.shape == (2, 4)


def test_random_score_is_seeded():
    model = _model()
    trace = _trace(model)
    a = moe_expert_scores(model, trace, MoeToDenseConfig(score="random", seed=3))
    b = moe_expert_scores(model, trace, MoeToDenseConfig(score="random", seed=3))
    c = moe_expert_scores(model, trace, MoeToDenseConfig(score="random", seed=4))
    assert torch.equal(a, b) and not torch.equal(a, c)


# ----------------------------------------------------------------------------- groups and scales
def test_groupings_on_constructed_features():
    # positions 0, 1 are centres; 2 resembles 1, 3 resembles 0
    features = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.1, 1.0], [1.0, 0.2]])
    assert nearest_centre_groups(features, 2) == [[0, 3], [1, 2]]
    assert kmeans_groups(features, 2, 10) == [[0, 3], [1, 2]]
    # two identical seeds: the second cluster is empty after the first assignment and takes the
    # point farthest from its centre, so every group keeps an expert
    assert kmeans_groups(torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]), 2, 10) == [[0, 1], [2]]


def test_scales_on_a_hand_trace():
    # top-2 over 3 experts, two tokens: (0: .6, 1: .4), (2: .7, 1: .3)
    trace = _hand_trace(torch.tensor([[[0, 1], [2, 1]]]), torch.tensor([[[0.6, 0.4], [0.7, 0.3]]]))
    groups = [[0], [1, 2]]
    assert group_scales(trace, 0, groups, "uniform") == [0.5, 0.5]
    assert group_scales(trace, 0, groups, "gate_mass") == pytest.approx([0.3, 0.7])
    assert group_scales(trace, 0, groups, "gate_mean") == pytest.approx([0.6, 0.7])


def test_merged_group_is_the_score_weighted_average():
    model = _model(num_experts=4, top_k=2)
    trace = _trace(model)
    cfg = MoeToDenseConfig(score="random", keep=3, groups=1, grouping="weight", scaling="uniform")
    dense, report = moe_to_dense(model, trace, cfg)
    scores_E = torch.tensor(report["scores"][0], dtype=torch.float64)
    group = report["layers"]["0"]["groups"][0]
    alpha = scores_E[group] / scores_E[group].sum()
    mlp, layout = model.blocks[0].ffn.experts.mlp, model.blocks[0].ffn.experts.layout
    expected = sum(float(a) * mlp.w1[layout.rows(e)] for a, e in zip(alpha, group, strict=False))
    torch.testing.assert_close(dense.blocks[0].ffn.w1.weight, expected)


def test_every_combination_is_one_config_value_and_runs():
    model = _model(num_experts=4, top_k=2)
    trace = _trace(model, batch=2, length=8)
    configs = grid(keep=3, groups=2) + grid(keep=2, groups=2)
    assert len(configs) == len(SCORES) * len(SCALINGS) * len(GROUPINGS)
    assert len({c.name for c in configs}) == len(configs)
    scores = {s: moe_expert_scores(model, trace, MoeToDenseConfig(score=s)) for s in SCORES}
    for cfg in configs:
        dense, report = moe_to_dense(model, trace, cfg, scores[cfg.score])
        assert dense.config.d_ff == 32 and report["config"] == cfg.name
        assert all(bool(p.isfinite().all()) for p in dense.parameters())
    # the shared scores are the ones the transform computes on its own
    cfg = configs[-1]
    torch.testing.assert_close(moe_to_dense(model, trace, cfg)[0].state_dict(), dense.state_dict())


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"keep": 1, "groups": 2}, "keep: must be >= groups"),
        ({"keep": 3, "groups": 2, "grouping": "single"}, "grouping: single"),
        ({"score": "nope"}, "score: got 'nope'"),
        ({"grouping": "nope"}, "grouping: got"),
        ({"scaling": "nope"}, "scaling: got"),
        ({"keep": 0}, "keep: must be a positive integer"),
    ],
)
def test_bad_configs_name_the_field(fields, match):
    with pytest.raises(ConfigError, match=match):
        MoeToDenseConfig(**fields)


def test_refusals_on_the_model():
    model = _model(num_experts=4, top_k=2)
    trace = _trace(model)
    with pytest.raises(ConfigError, match="keep: block 0 has 4 experts"):
        moe_to_dense(model, trace, MoeToDenseConfig(keep=5, groups=5))
    gated = _model(num_experts=4, top_k=2, shared_expert_size=8, shared_expert_gate=True)
    with pytest.raises(MoeLitError, match="gated shared expert"):
        moe_to_dense(gated, _trace(gated), MoeToDenseConfig(score="frequency"))
    first_dense = _model(num_experts=4, top_k=2, first_dense_layers=1)
    with pytest.raises(MoeLitError, match="d_ff=64"):
        moe_to_dense(first_dense, _trace(first_dense), MoeToDenseConfig(score="frequency"))
    hetero = _model(num_experts=4, top_k=2, expert_size=[8, 16, 8, 16])
    with pytest.raises(MoeLitError, match="needs equal expert sizes"):
        moe_to_dense(hetero, _trace(hetero), MoeToDenseConfig(score="frequency", keep=3, groups=2, grouping="weight"))
    no_inputs = RoutingTrace(**{**trace.__dict__, "inputs_MND": None})
    with pytest.raises(MoeLitError, match="record_inputs=True"):
        moe_to_dense(model, no_inputs, MoeToDenseConfig(score="activation"))


def test_heterogeneous_experts_concatenate_exactly():
    model = _constant_routing(expert_size=[8, 16, 8, 16])
    dense, _ = moe_to_dense(model, _trace(model), MoeToDenseConfig(score="random", keep=4, groups=4, scaling="uniform"))
    assert dense.config.d_ff == 48
    idx = torch.randint(0, 97, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(dense(idx).logits_BLV, model(idx).logits_BLV, atol=1e-5, rtol=1e-5)


def test_screen_ranks_the_grid_by_pre_distillation_loss():
    model = _model(num_experts=4, top_k=2)
    trace = _trace(model, batch=2, length=8)
    batches = [torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(s)) for s in (5, 6)]
    configs = [c for c in grid(keep=3, groups=2) if c.score in ("frequency", "random")]
    rows = screen(model, trace, configs, batches)
    assert len(rows) == len(configs) and [r["loss"] for r in rows] == sorted(r["loss"] for r in rows)
    best = next(c for c in configs if c.name == rows[0]["config"])
    dense, _ = moe_to_dense(model, trace, best)
    with torch.no_grad():
        expected = sum(float(next_token_loss(dense.eval(), b)) for b in batches) / 2
    assert rows[0]["loss"] == pytest.approx(expected, rel=1e-6)
    assert rows[0]["params"] == count_model_params(dense).total
    with pytest.raises(MoeLitError, match="no batches"):
        screen(model, trace, configs, [])
    with pytest.raises(MoeLitError, match="no batches"):
        screen(model, trace, configs, {"en": []})


def test_screen_with_labelled_batches_gives_each_label_its_loss():
    model = _model(num_experts=4, top_k=2)
    trace = _trace(model, batch=2, length=8)
    batches = [torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(s)) for s in (5, 6, 7)]
    configs = [c for c in grid(keep=2, groups=2) if c.score == "frequency"]
    flat = screen(model, trace, configs, batches)
    rows = screen(model, trace, configs, {"en": batches[:1], "de": batches[1:]})
    assert [r["config"] for r in rows] == [r["config"] for r in flat]
    for row, plain in zip(rows, flat, strict=True):
        assert row["loss"] == pytest.approx(plain["loss"], rel=1e-6)  # the mean over all batches
        dense, _ = moe_to_dense(model, trace, next(c for c in configs if c.name == row["config"]))
        with torch.no_grad():
            en = float(next_token_loss(dense.eval(), batches[0]))
            de = (float(next_token_loss(dense, batches[1])) + float(next_token_loss(dense, batches[2]))) / 2
        assert row["loss_per_label"] == pytest.approx({"en": en, "de": de}, rel=1e-6)
    assert "loss_per_label" not in flat[0]
