"""Property-based parity (hypothesis): the MoE layer equals the plain reference loop on random token
counts, widths, expert counts, (heterogeneous) expert sizes, top-k, score functions and shared experts."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_lit.config import MoEConfig
from moe_lit.model.moe import MoELayer
from tests.helpers.models import random_init, reference_moe


@st.composite
def layers(draw):
    num_experts = draw(st.integers(1, 6))
    sizes = st.integers(1, 9)
    return (
        MoEConfig(
            num_experts=num_experts,
            expert_size=draw(st.one_of(sizes, st.lists(sizes, min_size=num_experts, max_size=num_experts))),
            top_k=draw(st.integers(1, num_experts)),
            shared_expert_size=draw(st.sampled_from([0, 3])),
            score_func=draw(st.sampled_from(["softmax", "sigmoid"])),
            renormalize=draw(st.booleans()),
            balancing=draw(st.sampled_from(["aux_loss", "bias"])),
            backend="torch",
        ),
        draw(st.sampled_from([4, 8, 12])),  # d_model
        draw(st.integers(1, 3)),  # batch
        draw(st.integers(1, 6)),  # sequence
        draw(st.integers(0, 2**16)),  # seed
    )


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(layers())
def test_dropless_layer_equals_the_reference_loop(case):
    cfg, d_model, batch, seq, seed = case
    layer = random_init(MoELayer(d_model, cfg, 1), seed=seed)
    if cfg.balancing == "bias":
        with torch.no_grad():
            layer.router.expert_bias.uniform_(-0.1, 0.1, generator=torch.Generator().manual_seed(seed))
    x_BLD = torch.randn(batch, seq, d_model, generator=torch.Generator().manual_seed(seed + 1))
    x_fast, x_ref = x_BLD.clone().requires_grad_(True), x_BLD.clone().requires_grad_(True)
    y_fast, _ = layer(x_fast)
    y_ref = reference_moe(layer, x_ref.view(-1, d_model)).view_as(x_BLD)
    torch.testing.assert_close(y_fast, y_ref, rtol=1e-5, atol=1e-5)
    params = [p for p in layer.parameters() if p.requires_grad]
    grads_fast = torch.autograd.grad(y_fast.square().sum(), [x_fast, *params], allow_unused=True)
    grads_ref = torch.autograd.grad(y_ref.square().sum(), [x_ref, *params], allow_unused=True)
    for g_fast, g_ref in zip(grads_fast, grads_ref, strict=False):
        if g_fast is None or g_ref is None:
            assert g_fast is None or not g_fast.any(), "a gradient the reference does not have"
            continue
        torch.testing.assert_close(g_fast, g_ref, rtol=1e-4, atol=1e-5)
