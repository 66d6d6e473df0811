import random

import pytest
import torch

from moe_lit.config import ConfigError
from moe_lit.convert.importance import (
    MaestroConfig,
    expert_output,
    expert_scores,
    maestro_scores,
    naee_keep,
    next_token_index,
    reap_scores,
    router_weighted_frequency,
    selection_frequency,
)
from moe_lit.convert.prune import prune_experts
from moe_lit.errors import MoeLitError
from moe_lit.evaluation.routing_trace import RoutingTrace, routing_trace
from moe_lit.model import Transformer
from tests.helpers.models import tiny


def _trace(indices_MNK, weights_MNK=None, seq_N=None, num_experts=3) -> RoutingTrace:
    indices_MNK = torch.as_tensor(indices_MNK)
    n = indices_MNK.shape[1]
    seq_N = torch.zeros(n, dtype=torch.long) if seq_N is None else torch.as_tensor(seq_N)
    pos_N = torch.cat([torch.arange(int((seq_N == s).sum())) for s in seq_N.unique()])
    weights = torch.ones(indices_MNK.shape) / indices_MNK.shape[-1] if weights_MNK is None else weights_MNK
    return RoutingTrace(
        (0, 1, 2)[: indices_MNK.shape[0]],
        num_experts,
        indices_MNK,
        weights,
        seq_N,
        pos_N,
        torch.zeros(n, dtype=torch.long),
    )


def _path_trace(paths) -> RoutingTrace:
    """One sequence, two layers, top-1: ``paths`` holds each token's (layer-0, layer-1) expert."""
    paths = list(paths)
    random.Random(0).shuffle(paths)
    return _trace(torch.tensor(paths).T[:, :, None])


def _random_trace(renormalised: bool = True, layers=3, experts=4, top_k=2, seqs=3, length=40) -> RoutingTrace:
    gen = torch.Generator().manual_seed(0)
    n = seqs * length
    indices = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(layers * n)])
    gates = torch.rand(layers * n, top_k, generator=gen) + 0.1
    gates = gates / gates.sum(-1, keepdim=True) if renormalised else gates * 0.5
    return _trace(
        indices.view(layers, n, top_k),
        gates.view(layers, n, top_k),
        torch.arange(seqs).repeat_interleave(length),
        num_experts=experts,
    )


# ----------------------------------------------------------------------------- frequency scores
def test_frequency_and_router_weighted_by_hand():
    trace = _trace([[[0, 1], [0, 2]]], torch.tensor([[[0.75, 0.25], [0.5, 0.5]]]))
    assert selection_frequency(trace).tolist() == [[0.5, 0.25, 0.25]]
    assert router_weighted_frequency(trace).tolist() == [[0.625, 0.125, 0.25]]


def test_random_scores_are_seeded():
    trace = _random_trace()
    a, b, c = (expert_scores("random", trace, seed=s).scores_ME for s in (1, 1, 2))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_naee_is_not_a_score_and_unknown_methods_are_refused():
    with pytest.raises(ConfigError, match="naee searches subsets"):
        expert_scores("naee", _random_trace())
    with pytest.raises(ConfigError, match="method: got 'magic'"):
        expert_scores("magic", _random_trace())


# ----------------------------------------------------------------------------- MAESTRO
def test_next_token_links_within_a_sequence_and_wraps_at_its_end():
    trace = _trace(torch.zeros(1, 5, 1, dtype=torch.long), seq_N=[0, 0, 0, 1, 1])
    assert next_token_index(trace).tolist() == [1, 2, 0, 4, 3]


def test_the_trap_count_weights_without_damping_give_selection_frequency():
    trace = _random_trace()
    scores, info = maestro_scores(trace, MaestroConfig(damping=1.0, weighting="count"))
    assert info["converged"] and info["residual"] < 1e-10 and info["iterations"] > 1
    assert torch.allclose(scores, selection_frequency(trace), atol=1e-8)
    assert torch.allclose(
        torch.tensor(info["layer_mass"], dtype=torch.float64), torch.full((3,), 1 / 3, dtype=torch.float64)
    )


def test_the_trap_gate_weights_without_damping_give_router_weighted_frequency_when_gates_sum_to_one():
    trace = _random_trace(renormalised=True)
    scores, _ = maestro_scores(trace, MaestroConfig(damping=1.0, weighting="gate"))
    assert torch.allclose(scores, router_weighted_frequency(trace), atol=1e-8)
    unnormalised = _random_trace(renormalised=False)  # the flow breaks: the equality is gone
    scores, _ = maestro_scores(unnormalised, MaestroConfig(damping=1.0, weighting="gate"))
    assert (scores - router_weighted_frequency(unnormalised)).abs().max() > 1e-3


def test_maestro_and_frequency_disagree_on_a_constructed_trace():
    """Layer 0: expert 0 takes 70% of the tokens, experts 1 and 2 15% each. Layer 1: expert 1 serves
    exactly the tokens of the two rare layer-0 experts (30%), experts 0 and 2 split expert 0's (35% each).
    Frequency ranks layer-1 expert 1 last; with damping the uniform jump lands on the rare layer-0
    experts too and all of their mass flows into layer-1 expert 1, which MAESTRO ranks first."""
    trace = _path_trace([(0, 0)] * 35 + [(0, 2)] * 35 + [(1, 1)] * 15 + [(2, 1)] * 15)
    frequency = selection_frequency(trace)[1]
    assert frequency.tolist() == pytest.approx([0.35, 0.30, 0.35])
    maestro, info = maestro_scores(trace, MaestroConfig(damping=0.85, weighting="count"))
    assert info["converged"]
    assert maestro[1, 1] > maestro[1, 0] and maestro[1, 1] > maestro[1, 2]
    assert frequency.argmin() == 1 and maestro[1].argmax() == 1
    undamped, _ = maestro_scores(trace, MaestroConfig(damping=1.0, weighting="count"))
    assert torch.allclose(undamped, selection_frequency(trace), atol=1e-8)  # the trap on the same trace


def test_power_iteration_reports_non_convergence():
    _, info = maestro_scores(_random_trace(), MaestroConfig(max_iterations=2))
    assert info["iterations"] == 2 and not info["converged"] and info["residual"] > 1e-10


@pytest.mark.parametrize("field, value", [("damping", 0.0), ("damping", 1.5), ("weighting", "x"), ("tol", 0.0)])
def test_maestro_config_errors_name_the_field(field, value):
    with pytest.raises(ConfigError, match=f"maestro.{field}"):
        MaestroConfig(**{field: value})


# ----------------------------------------------------------------------------- model-based scores
@pytest.fixture(scope="module")
def traced():
    torch.manual_seed(0)
    model = Transformer(tiny(num_experts=6, n_layers=2, top_k=2)).eval()
    idx = torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), routing_trace(model, record_inputs=True) as recorder:
        model(idx)
    return model, recorder.trace()


def test_expert_output_matches_the_layer_forward(traced):
    model, trace = traced
    layer = model.blocks[0].ffn
    x_ND = trace.inputs_MND[0]
    y_ND, _ = layer.experts(x_ND, trace.weights_MNK[0], trace.indices_MNK[0], None)
    by_hand = (
        sum(
            trace.weights_MNK[0][:, k, None]
            * torch.stack(
                [expert_output(layer, int(e), x_ND[n : n + 1])[0] for n, e in enumerate(trace.indices_MNK[0][:, k])]
            )
            for k in range(2)
        )
        + layer.experts.bias
    )
    assert (y_ND - by_hand).abs().max() < 1e-5


def test_reap_follows_the_expert_output_norm(traced):
    model, trace = traced
    base = reap_scores(model, trace)
    scaled = prune_experts(model, {b: list(range(6)) for b in (0, 1)})  # an identical copy
    with torch.no_grad():
        rows = scaled.blocks[1].ffn.experts.layout.rows(4)
        scaled.blocks[1].ffn.experts.mlp.w2[rows] *= 10
    after = reap_scores(scaled, trace)
    assert torch.allclose(after[1, 4], 10 * base[1, 4]) and base[1, 4] > 0
    assert torch.equal(after[0], base[0])
    assert torch.allclose(after[1, :4], base[1, :4])
    with pytest.raises(MoeLitError, match="record_inputs=True"):
        reap_scores(model, trace.__class__(**{**trace.__dict__, "inputs_MND": None}))


def _pruned_layer_error(model, trace, block, m, keep) -> float:
    """The reconstruction error measured on the real pruned model's layer."""
    pruned = prune_experts(model, {b: keep if b == block else list(range(6)) for b in (0, 1)})
    x_ND = trace.inputs_MND[m]
    with torch.no_grad():
        full, _ = model.blocks[block].ffn(x_ND[None])
        cut, _ = pruned.blocks[block].ffn(x_ND[None])
    return float((full - cut).double().square().sum(-1).mean())


def test_naee_exhaustive_search_minimises_the_real_pruned_layer_error(traced):
    model, trace = traced
    rng = torch.random.get_rng_state()
    result = naee_keep(model, trace, {0: 3, 1: 3}, exhaustive_cap=1000)
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert result.searches == {0: "exhaustive", 1: "exhaustive"}
    for m, block in enumerate((0, 1)):
        measured = _pruned_layer_error(model, trace, block, m, result.keep[block])
        assert result.errors[block] == pytest.approx(measured, rel=1e-4, abs=1e-9)
        others = [[0, 1, 2], [3, 4, 5], [0, 2, 4], [1, 3, 5]]
        assert all(measured <= _pruned_layer_error(model, trace, block, m, k) + 1e-9 for k in others)
    assert naee_keep(model, trace, {0: 6, 1: 6}).errors == {
        0: pytest.approx(0, abs=1e-9),
        1: pytest.approx(0, abs=1e-9),
    }


def test_naee_goes_greedy_beyond_the_cap(traced):
    model, trace = traced
    exhaustive = naee_keep(model, trace, {0: 3, 1: 3}, exhaustive_cap=1000)
    greedy = naee_keep(model, trace, {0: 3, 1: 3}, exhaustive_cap=19)  # C(6, 3) = 20
    assert greedy.searches == {0: "greedy", 1: "greedy"}
    assert all(greedy.errors[b] >= exhaustive.errors[b] - 1e-12 for b in (0, 1))


def test_trace_with_inputs_round_trips_and_filters(traced, tmp_path):
    model, trace = traced
    assert trace.inputs_MND.shape == (2, 64, 32)
    loaded = RoutingTrace.load(trace.save(tmp_path / "t.pt"))
    assert torch.equal(loaded.inputs_MND, trace.inputs_MND)
    first = trace.select(trace.seq_N == 0)
    assert torch.equal(first.inputs_MND, trace.inputs_MND[:, :16])
    assert RoutingTrace.concat([first, first]).inputs_MND.shape == (2, 32, 32)
    x = model.tok_embeddings(torch.zeros(1, 1, dtype=torch.long))
    with torch.no_grad(), routing_trace(model, record_inputs=True) as recorder:
        model(torch.zeros(1, 1, dtype=torch.long))
    block = model.blocks[0]
    with torch.no_grad():
        h = x + block.attn(block.attn_norm(x))
        assert torch.allclose(recorder.trace().inputs_MND[0], block.ffn_norm(h)[0])
