"""The torch backend's slot geometries (padded bmm "batched", packed "looped"; "grouped" GEMMs in
tests/gpu/test_grouped_mm.py) agree with each other and with autograd's own derivatives, in
dropless and capacity mode, uniform and heterogeneous."""

import pytest
import torch

from moe_lit.model.experts import grouped_swiglu as grouped_swiglu_module
from moe_lit.model.experts.grouped_swiglu import CHUNK_OVERHEAD_ROWS, choose_chunking
from moe_lit.model.experts.layout import ExpertLayout
from moe_lit.model.experts.ops import routed_swiglu
from moe_lit.model.experts.torch_backend import TorchExperts, plan_dispatch

D = 8


def _experts(sizes, strategy, seed=0, dtype=torch.float32) -> TorchExperts:
    experts = TorchExperts(D, ExpertLayout.of(sizes), strategy=strategy).to(dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=dtype) * 0.3)
    return experts


def _routing(num_tokens, num_experts, top_k, seed=1, skew=None):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    if skew is not None:
        logits[:, skew] += 4.0
    weights, indices = logits.softmax(-1).topk(top_k, dim=-1)
    return weights, indices


def _run(experts, x, weights, indices, capacity):
    """Output, gradients and routing counts of the experts, and the routing plan of their geometry."""
    x = x.clone().requires_grad_(True)
    weights = weights.clone().requires_grad_(True)
    y, counts = experts(x, weights, indices, capacity)
    loss = (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum()
    names, params = zip(*experts.named_parameters(), strict=False)
    grads = torch.autograd.grad(loss, [x, weights, *params])
    plan = plan_dispatch(indices, experts.layout, capacity, experts.strategy)
    assert torch.equal(counts.routed_counts_E, plan.routed_counts_E) and torch.equal(counts.dropped, plan.dropped)
    return y.detach(), dict(zip(("x", "weights", *names), grads, strict=False)), plan


@pytest.mark.parametrize("capacity", [None, 30])
@pytest.mark.parametrize("skew", [None, 2], ids=["balanced", "skewed"])
def test_batched_and_looped_paths_agree(capacity, skew):
    weights, indices = _routing(96, 4, 2, skew=skew)
    x = torch.randn(96, D, generator=torch.Generator().manual_seed(3))
    batched, looped = _experts([6] * 4, "batched"), _experts([6] * 4, "looped")
    y_b, grads_b, plan_b = _run(batched, x, weights, indices, capacity)
    y_l, grads_l, plan_l = _run(looped, x, weights, indices, capacity)
    assert plan_b.slots.batched and not plan_l.slots.batched
    if capacity is None:  # the skewed routing splits the busy expert into several chunks
        assert (plan_b.slots.chunk_expert is not None) == (skew is not None)
    assert plan_b.kept_counts == plan_l.kept_counts
    assert int(plan_b.dropped) == int(plan_l.dropped) == sum(plan_b.routed_counts_E.tolist()) - sum(plan_b.kept_counts)
    assert (y_b - y_l).abs().max().item() < 1e-5
    assert set(grads_b) == {"x", "weights", "bias", "mlp.w1", "mlp.v1", "mlp.w2"}
    for name, g_b in grads_b.items():
        assert (g_b - grads_l[name]).abs().max().item() < 1e-5, name


def _force_chunks(monkeypatch, chunk_rows):
    """Bypass the cost model: chunks of ``chunk_rows`` (0: one chunk per expert, idle ones included)."""

    def chunking(counts):
        if chunk_rows == 0:
            return max(counts), [1] * len(counts)
        return chunk_rows, [-(-n // chunk_rows) for n in counts]

    monkeypatch.setattr(grouped_swiglu_module, "choose_chunking", chunking)


@pytest.mark.parametrize(
    "strategy,sizes,chunk_rows,tokens",
    [
        ("batched", [3] * 3, 0, 7),
        ("batched", [3] * 3, 2, 7),
        ("looped", [3, 5, 2], None, 7),
        ("looped", [3] * 8, None, 1),  # a decoding step: 2 of 8 experts filled, views of those only
    ],
    ids=["batched-direct", "batched-chunks-of-2", "looped-hetero", "looped-one-token"],
)
@pytest.mark.parametrize("capacity", [None, 3])
def test_hand_written_backward_matches_numerical_gradients(monkeypatch, strategy, sizes, chunk_rows, tokens, capacity):
    if chunk_rows is not None:
        _force_chunks(monkeypatch, chunk_rows)
    experts = _experts(sizes, strategy, dtype=torch.float64)
    weights, indices = _routing(tokens, len(sizes), 2, seed=4)
    layout = experts.layout
    plan = plan_dispatch(indices, layout, capacity, strategy)
    assert (plan.slots.chunk_expert is not None) == (chunk_rows == 2)
    gen = torch.Generator().manual_seed(5)
    inputs = (
        torch.randn(tokens, D, generator=gen, dtype=torch.float64).requires_grad_(True),
        weights.double().requires_grad_(True),
        *(p.detach().clone().requires_grad_(True) for p in (experts.mlp.w1, experts.mlp.v1, experts.mlp.w2)),
        torch.randn(D, generator=gen, dtype=torch.float64).requires_grad_(True),
    )

    def experts_fn(x, gate, w1, v1, w2, bias):
        return routed_swiglu(x, gate, indices, w1, v1, w2, layout, strategy, capacity)[0] + bias

    assert torch.autograd.gradcheck(experts_fn, inputs, fast_mode=True)


@pytest.mark.parametrize("capacity", [None, 2])
@pytest.mark.parametrize("geometry", ["looped", "grouped"])
def test_a_small_routing_is_planned_on_the_host_exactly_as_with_tensor_ops(monkeypatch, capacity, geometry):
    _, indices = _routing(9, 4, 2, skew=1)
    layout = ExpertLayout.of([4] * 4)
    assert indices.numel() <= grouped_swiglu_module.HOST_PLAN_ASSIGNMENTS
    host = plan_dispatch(indices, layout, capacity, geometry)
    monkeypatch.setattr(grouped_swiglu_module, "HOST_PLAN_ASSIGNMENTS", 0)
    device = plan_dispatch(indices, layout, capacity, geometry)
    assert host.kept_counts == device.kept_counts and host.slots.rows == device.slots.rows
    assert (int(host.dropped) > 0) == (capacity is not None)
    for name in ("routed_counts_E", "dropped"):
        assert torch.equal(getattr(host, name), getattr(device, name)), name
    for name in ("assign_P", "slot_TK", "token_P"):
        assert torch.equal(getattr(host.slots, name), getattr(device.slots, name)), name


def test_chunking_pads_balanced_routing_to_the_max_and_splits_busy_experts():
    # balanced: one chunk per expert, no weight copy (4 * (11 + 64) rows either way: ties go direct)
    assert choose_chunking([10, 9, 11, 10]) == (11, [1, 1, 1, 1])
    # skewed: chunks * (C + 64) is least for C=50: 5 * 114 = 570 < 8 * (100 + 64) (one chunk each)
    assert CHUNK_OVERHEAD_ROWS == 64
    assert choose_chunking([100, 10, 10, 10, 0, 0, 0, 0]) == (50, [2, 1, 1, 1, 0, 0, 0, 0])
    assert choose_chunking([0, 0]) == (1, [0, 0])  # no tokens: no chunk at all


@pytest.mark.parametrize("chunk_rows", [0, 2], ids=["direct", "chunks-of-2"])
def test_padding_slots_and_idle_experts_contribute_exact_zeros(monkeypatch, chunk_rows):
    _force_chunks(monkeypatch, chunk_rows)
    experts = _experts([5] * 4, "batched")
    indices = torch.tensor([[0], [0], [0], [1], [2]])  # expert 3 idle, every other expert padded
    y, grads, plan = _run(experts, torch.randn(5, D), torch.ones(5, 1), indices, None)
    assert plan.slots.rows == ((3, 3, 3, 3) if chunk_rows == 0 else (4, 2, 2, 0))
    idle = experts.layout.rows(3)
    for name in ("mlp.w1", "mlp.v1", "mlp.w2"):
        assert grads[name][idle].abs().max().item() == 0.0
        assert grads[name][: idle.start].abs().max().item() > 0.0


def test_dropped_assignments_get_zero_gate_gradient_and_add_nothing():
    experts = _experts([4, 4], "batched")
    indices = torch.tensor([[0, 1], [0, 1], [0, 1], [1, 0]])
    weights = torch.full((4, 2), 0.5)
    y, grads, plan = _run(experts, torch.randn(4, D), weights, indices, capacity=3)
    assert int(plan.dropped) == 2  # token 3's assignments come 4th in both experts
    assert torch.equal(y[3], experts.bias.detach())
    assert grads["weights"][3].abs().max().item() == 0.0 and grads["x"][3].abs().max().item() == 0.0
    assert grads["weights"][:3].abs().min().item() > 0.0


def test_batched_strategy_rejects_heterogeneous_layouts_and_unknown_names():
    with pytest.raises(ValueError, match="equal expert sizes"):
        TorchExperts(D, ExpertLayout.of([2, 3]), strategy="batched")
    with pytest.raises(ValueError, match="allowed values: auto, grouped, batched, looped"):
        TorchExperts(D, ExpertLayout.of([2, 2]), strategy="bmm")


def test_autocast_runs_the_experts_in_bfloat16():
    experts = _experts([8] * 4, "auto")
    weights, indices = _routing(16, 4, 2)
    x = torch.randn(16, D)
    y_fp32, _ = experts(x, weights, indices, None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_bf16, _ = experts(x, weights, indices, None)
    assert y_bf16.dtype == torch.bfloat16
    assert (y_bf16.float() - y_fp32).abs().max().item() < 0.05


@pytest.mark.parametrize("strategy", ["batched", "looped"])
def test_empty_batch_gives_empty_output_and_zero_weight_gradients(strategy):
    experts = _experts([4] * 3, strategy)
    y, grads, plan = _run(experts, torch.randn(0, D), torch.rand(0, 2), torch.zeros(0, 2, dtype=torch.long), None)
    assert y.shape == (0, D) and plan.kept_counts == [0, 0, 0]
    assert all(grads[name].abs().sum().item() == 0.0 for name in ("mlp.w1", "mlp.v1", "mlp.w2", "bias"))
