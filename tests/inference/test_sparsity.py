import pytest
import torch
import torch.nn.functional as F

from moe_lit.config import ConfigError
from moe_lit.inference import generate
from moe_lit.inference.sparsity import (
    SparseExperts,
    SparseSwiGLU,
    SparsityConfig,
    calibrate,
    collect_scores,
    ffn_modules,
    highest_target_within,
    sparse_swiglu,
    sparsify,
    sparsity_loss_curve,
    sparsity_statistics,
    thresholds_at,
)
from moe_lit.model import Transformer
from tests.helpers.decoding import assert_compiled_decoding_repeats_eager
from tests.helpers.models import tiny


def build(kind):
    torch.manual_seed(0)
    cfgs = {
        "moe": tiny(shared_expert_size=8),
        "dense": tiny(dense=True),
        "hetero": tiny(expert_size=[8, 16, 24, 16], first_dense_layers=1),
        "capacity": tiny(capacity_factor=1.0),
    }
    return Transformer(cfgs[kind]).eval()


def batches(seed, n=2, length=16):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (2, length), generator=gen) for _ in range(n)]


@pytest.mark.parametrize("kind", ["moe", "dense", "hetero", "capacity"])
@pytest.mark.parametrize("rule", ["gate", "gate_up"])
def test_threshold_zero_is_exact(kind, rule):
    model = build(kind)
    sparse = sparsify(model, calibrate(model, batches(0), SparsityConfig(target=0.0, rule=rule)))
    idx = batches(1)[0]
    with torch.no_grad():
        assert (sparse(idx).logits_BLV - model(idx).logits_BLV).abs().max() < 1e-5
    assert sparse.state_dict().keys() == model.state_dict().keys()
    kinds = {type(m) for m in sparse.modules()}
    assert (SparseSwiGLU in kinds) == (kind != "capacity") and (SparseExperts in kinds) == (kind != "dense")
    assert not any(isinstance(m, (SparseSwiGLU, SparseExperts)) for m in model.modules())  # source untouched


@pytest.mark.parametrize("rule", ["gate", "gate_up"])
def test_sparse_expert_equals_dense_swiglu_with_inactive_neurons_zeroed(rule):
    from moe_lit.inference.sparsity import GATHER_MAX_FRACTION

    torch.manual_seed(0)
    x, w1, v1, w2 = torch.randn(5, 8), torch.randn(12, 8), torch.randn(12, 8), torch.randn(12, 8)
    gate, up = F.silu(x @ w1.T), x @ v1.T
    score = gate.abs() if rule == "gate" else (gate * up).abs()
    union_fractions = set()
    for q in (0.05, 0.5, 0.9, 0.99):
        threshold = float(score.quantile(q))
        for rows in (slice(None), slice(0, 1)):
            keep = score[rows] > threshold
            union_fractions.add(bool(keep.any(0).float().mean() > GATHER_MAX_FRACTION))
            want = (gate[rows] * up[rows] * keep) @ w2
            assert torch.allclose(sparse_swiglu(x[rows], w1, v1, w2, threshold, rule), want, atol=1e-5)
    assert union_fractions == {True, False}  # both the gathered and the dense masked branch ran


@pytest.mark.parametrize("granularity", ["layer", "expert"])
def test_calibrated_thresholds_reach_the_target_on_calibration_tokens(granularity):
    model = build("moe")
    calib = batches(0, n=4)
    thresholds = calibrate(model, calib, SparsityConfig(target=0.8, granularity=granularity))
    assert set(thresholds.values) == set(ffn_modules(model))
    stats = sparsity_statistics(model, thresholds, {"all": calib})
    layer_of = {}
    for row in stats:
        layer_of.setdefault(row["ffn"], []).append(row)
    for rows in layer_of.values():
        n = sum(r["assignments"] for r in rows)
        assert sum(r["inactive"] * r["assignments"] for r in rows) / n == pytest.approx(0.8, abs=0.01)
        if granularity == "expert":
            assert all(r["inactive"] == pytest.approx(0.8, abs=0.02) for r in rows)
    routed = [r for r in stats if r["ffn"] == "blocks.0.ffn.experts"]
    assert sum(r["assignments"] for r in routed) == 4 * 2 * 16 * 2  # every token's top-2 assignments


def test_statistics_per_language_and_more_sparsity_costs_loss():
    model = build("moe")
    by_language = {"a": batches(5), "b": [b % 10 for b in batches(6)]}
    rows = sparsity_loss_curve(model, batches(0, n=4), by_language, targets=[0.0, 0.5, 0.95])
    assert {(r["target"], r["language"]) for r in rows} == {(t, lang) for t in (0.0, 0.5, 0.95) for lang in "ab"}
    for lang in "ab":
        mine = {r["target"]: r for r in rows if r["language"] == lang}
        assert abs(mine[0.0]["increase"]) < 1e-5
        assert mine[0.0]["inactive"] < mine[0.5]["inactive"] < mine[0.95]["inactive"]
        assert mine[0.95]["loss"] != mine[0.0]["loss"]
    assert highest_target_within(rows, max_increase=1e-5) is not None  # target 0 is exact
    worst = {t: max(r["increase"] for r in rows if r["target"] == t) for t in (0.0, 0.5, 0.95)}
    assert highest_target_within(rows, max_increase=worst[0.5]) == max(t for t in worst if worst[t] <= worst[0.5])
    assert highest_target_within(rows, max_increase=-1.0) is None


def test_sparse_model_generates_and_one_sample_serves_every_target():
    model = build("moe")
    sample = collect_scores(model, batches(0), "gate", max_tokens=10_000)
    low, high = thresholds_at(sample, 0.3, "layer"), thresholds_at(sample, 0.9, "layer")
    assert all((high.values[n] > low.values[n]).all() for n in low.values)
    exact = sparsify(model, thresholds_at(sample, 0.0, "layer"))
    assert generate(exact, [[5, 6, 7]], 6) == generate(model, [[5, 6, 7]], 6)
    assert len(generate(sparsify(model, high), [[5, 6, 7], [1]], 6)[1]) == 6


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_compiled_sparse_decoding_gives_the_eager_tokens_without_a_graph_per_step(kind):
    model = build(kind)
    sparse = sparsify(model, thresholds_at(collect_scores(model, batches(0), "gate", 10_000), 0.7, "layer"))
    # the active neurons change every step: traced, each new set of shapes would compile again
    assert_compiled_decoding_repeats_eager(sparse, [[5, 6, 7], [1]], 12)


@pytest.mark.parametrize(
    "fields, name",
    [
        ({"target": 1.0}, "sparsity.target"),
        ({"rule": "up"}, "sparsity.rule"),
        ({"granularity": "row"}, "sparsity.granularity"),
        ({"calibration_tokens": 0}, "sparsity.calibration_tokens"),
    ],
)
def test_bad_config_names_the_field(fields, name):
    with pytest.raises(ConfigError, match=name):
        SparsityConfig(**fields)
    with pytest.raises(ConfigError, match="unknown"):
        SparsityConfig.from_dict({"targte": 0.5})
