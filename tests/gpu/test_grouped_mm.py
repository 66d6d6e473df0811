"""The grouped-GEMM geometry (``torch._grouped_mm``) against the per-expert loop (CPU: torch 2.13 runs it there)."""

from __future__ import annotations

import pytest
import torch

from moe_lit._compat import grouped_mm_op
from moe_lit.model.experts import TorchExperts, build_experts
from moe_lit.model.experts.layout import ExpertLayout
from moe_lit.model.experts.torch_backend import choose_geometry
from tests.helpers.models import tiny


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
CPU = torch.device("cpu")


def _experts(strategy: str, expert_size: int = 16) -> TorchExperts:
    torch.manual_seed(0)
    experts = TorchExperts(D, ExpertLayout.of([expert_size] * E), strategy=strategy)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(std=0.3)
    return experts


def _routing(skewed: bool):
    torch.manual_seed(1)
    probs = torch.tensor([8.0, 1.0, 1.0, 0.0]) if skewed else torch.ones(E)  # skewed: expert 3 idle
    indices_TK = torch.stack([torch.multinomial(probs, K) for _ in range(T)])
    return torch.rand(T, K), indices_TK


@pytest.mark.parametrize("capacity,skewed", [(None, False), (None, True), (12, True)])
def test_grouped_geometry_matches_the_loop(capacity, skewed):
    weights_TK, indices_TK = _routing(skewed)
    x_TD, g_TD = torch.randn(T, D), torch.randn(T, D)
    outs = []
    for strategy in ("looped", "grouped"):
        experts = _experts(strategy)
        x = x_TD.clone().requires_grad_()
        w = weights_TK.clone().requires_grad_()
        y, plan = experts(x, w, indices_TK, capacity)
        (y * g_TD).sum().backward()
        outs.append((y, plan, x.grad, w.grad, {n: p.grad for n, p in experts.named_parameters()}))
    (y_r, plan_r, dx_r, dw_r, grads_r), (y_g, plan_g, dx_g, dw_g, grads_g) = outs
    assert choose_geometry("grouped", ExpertLayout.of([16] * E), D, x_TD.dtype, CPU) == "grouped"  # no fallback
    torch.testing.assert_close(y_g, y_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx_g, dx_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw_g, dw_r, rtol=1e-5, atol=1e-5)
    for name, grad in grads_r.items():
        torch.testing.assert_close(grads_g[name], grad, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    if skewed and capacity is None:  # the idle expert's weights get exact zeros
        assert grads_g["mlp.w1"][ExpertLayout.of([16] * E).rows(3)].abs().max().item() == 0.0
    assert (int(plan_g.dropped) > 0) == (capacity is not None)


def test_grouped_geometry_needs_aligned_equal_experts():
    with pytest.raises(ValueError, match="'grouped' needs equal expert sizes, torch._grouped_mm, 16-byte"):
        _experts("grouped", expert_size=6)(torch.randn(T, D), *_routing(False), None)  # 6 fp32 = 24 bytes
    with pytest.raises(ValueError, match="needs equal expert sizes"):
        TorchExperts(D, ExpertLayout.of([8, 16]), strategy="grouped")


def test_auto_geometry():
    uniform, hetero = ExpertLayout.of([16] * E), ExpertLayout.of([8, 16, 16, 24])
    cuda = torch.device("cuda")  # only the device *type* matters here: nothing runs
    assert choose_geometry("auto", uniform, D, torch.float32, CPU) == "looped"
    assert choose_geometry("auto", uniform, D, torch.bfloat16, CPU) == "batched"  # one bmm, not E small bf16 GEMMs
    assert choose_geometry("auto", hetero, D, torch.bfloat16, CPU) == "looped"
    assert choose_geometry("auto", uniform, D, torch.bfloat16, cuda) == "grouped"
    assert choose_geometry("auto", uniform, D, torch.float32, cuda) == "batched"  # CUDA grouped GEMM: bf16 only
    assert choose_geometry("auto", ExpertLayout.of([6] * E), D, torch.bfloat16, cuda) == "batched"  # unaligned
    assert choose_geometry("auto", hetero, D, torch.bfloat16, cuda) == "looped"
    assert choose_geometry("batched", uniform, D, torch.float32, CPU) == "batched"


def test_build_experts_gives_one_layout_for_every_geometry():
    uniform = build_experts(D, tiny().moe)
    heterogeneous = build_experts(D, tiny(expert_size=[8, 16, 16, 24]).moe)
    assert type(uniform) is type(heterogeneous) is TorchExperts
    assert uniform.state_dict().keys() == heterogeneous.state_dict().keys()
