"""The forward-only expert path (no gradient needed, the SwiGLU product in place) equals the training path's forward."""

import pytest
import torch

from moe_lit.model.experts.layout import ExpertLayout
from moe_lit.model.experts.torch_backend import TorchExperts

D = 16


def experts(sizes, strategy):
    torch.manual_seed(0)
    module = TorchExperts(D, ExpertLayout.of(sizes), strategy=strategy)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return module


CASES = [((8, 8, 8, 8), "looped"), ((8, 8, 8, 8), "batched"), ((8, 8, 8, 8), "grouped"), ((4, 12, 8, 16), "looped")]


@pytest.mark.parametrize("sizes, strategy", CASES)
@pytest.mark.parametrize("tokens", [1, 3, 64])
@pytest.mark.parametrize("capacity", [None, 2])
def test_forward_only_equals_training_forward(sizes, strategy, tokens, capacity):
    module = experts(sizes, strategy)
    gen = torch.Generator().manual_seed(tokens)
    x_TD = torch.randn(tokens, D, generator=gen)
    indices_TK = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(tokens)])
    weights_TK = torch.rand(tokens, 2, generator=gen)
    trained, counts = module(x_TD, weights_TK, indices_TK, capacity)
    assert trained.grad_fn is not None
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            fast, fast_counts = module(x_TD, weights_TK, indices_TK, capacity)
        assert fast.grad_fn is None
        assert torch.allclose(fast, trained, atol=1e-6, rtol=0)
        assert torch.equal(fast_counts.routed_counts_E, counts.routed_counts_E)
        assert torch.equal(fast_counts.dropped, counts.dropped)
