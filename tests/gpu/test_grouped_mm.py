"""The torch._grouped_mm path against the torch backend's own matmuls (CPU: torch 2.13 runs it there)."""

from __future__ import annotations

import copy

import pytest
import torch

from moe_lit.model.experts import GroupedMMExperts, TorchExperts, build_experts
from moe_lit.model.experts.grouped_mm import grouped_mm_op
from moe_lit.model.experts.layout import ExpertLayout
from tests.conftest import tiny



def _grouped_mm_runs_on_cpu() -> bool:
    if grouped_mm_op() is None:
        return False
    try:
        grouped_mm_op()(torch.ones(4, 8), torch.ones(2, 8, 8), offs=torch.tensor([2, 4], dtype=torch.int32))
    except (RuntimeError, NotImplementedError):
        return False
    return True


pytestmark = pytest.mark.skipif(not _grouped_mm_runs_on_cpu(), reason="this torch has no grouped GEMM on CPU")

D, T, E, K = 32, 40, 4, 2


def _pair(expert_size: int = 16, d_model: int = D):
    torch.manual_seed(0)
    reference = TorchExperts(d_model, ExpertLayout.of([expert_size] * E))
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_(std=0.3)
    grouped = GroupedMMExperts(d_model, reference.layout, devices=("cpu",))
    grouped.load_state_dict(reference.state_dict())
    return reference, grouped


def _routing(skewed: bool):
    torch.manual_seed(1)
    probs = torch.tensor([8.0, 1.0, 1.0, 0.0]) if skewed else torch.ones(E)
    indices_TK = torch.stack([torch.multinomial(probs, K) for _ in range(T)])
    return torch.rand(T, K), indices_TK


@pytest.mark.parametrize("capacity,skewed", [(None, False), (None, True), (12, True)])
def test_grouped_mm_matches_torch_backend(capacity, skewed):
    reference, grouped = _pair()
    weights_TK, indices_TK = _routing(skewed)
    x_TD = torch.randn(T, D)
    g_TD = torch.randn(T, D)
    assert grouped.runs_grouped(x_TD)
    outs = []
    for experts in (reference, grouped):
        x = x_TD.clone().requires_grad_()
        w = weights_TK.clone().requires_grad_()
        y, plan = experts(x, w, indices_TK, capacity)
        (y * g_TD).sum().backward()
        outs.append((y, plan, x.grad, w.grad, {n: p.grad for n, p in experts.named_parameters()}))
    (y_r, plan_r, dx_r, dw_r, grads_r), (y_g, plan_g, dx_g, dw_g, grads_g) = outs
    torch.testing.assert_close(y_g, y_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx_g, dx_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw_g, dw_r, rtol=1e-5, atol=1e-5)
    for name, grad in grads_r.items():
        torch.testing.assert_close(grads_g[name], grad, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert torch.equal(plan_g.routed_counts_E, plan_r.routed_counts_E)
    assert int(plan_g.dropped) == int(plan_r.dropped)
    assert (int(plan_g.dropped) > 0) == (capacity is not None)


def test_misaligned_rows_and_other_devices_use_the_loop():
    _, grouped = _pair(expert_size=6, d_model=D)  # 6 fp32 = 24 bytes: not 16-byte aligned
    assert not grouped.runs_grouped(torch.randn(T, D))
    _, on_cuda_only = _pair()
    on_cuda_only.devices = ("cuda",)
    assert not on_cuda_only.runs_grouped(torch.randn(T, D))


def test_build_experts_uses_grouped_mm_for_uniform_layers_only():
    uniform = build_experts(D, tiny().moe)
    assert type(uniform) is GroupedMMExperts and uniform.devices == ("cuda",)
    heterogeneous = build_experts(D, tiny(expert_size=[8, 16, 16, 24]).moe)
    assert type(heterogeneous) is TorchExperts
    assert uniform.state_dict().keys() == heterogeneous.state_dict().keys()


def test_grouped_experts_copy_and_load_like_torch_experts():
    reference, grouped = _pair()
    clone = copy.deepcopy(grouped)
    assert all(torch.equal(a, b) for a, b in zip(clone.state_dict().values(), reference.state_dict().values()))
