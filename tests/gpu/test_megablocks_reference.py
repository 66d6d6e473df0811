"""MegaBlocks' real dMoE code (CPU stand-ins for its kernels) against our layer and our adapter.

1. A real ``megablocks.layers.dmoe.dMoE`` built from ``megablocks_arguments`` loads our MoE layer's
   state dict strictly (same keys, same layout) and gives the same outputs, load-balancing loss,
   z-loss and gradients as our torch backend.
2. Our ``MegaBlocksExperts`` adapter (MegaBlocks' GroupedGLU + routing ops on our parameters) gives
   the torch backend's outputs, gradients and router counts, and leaves MegaBlocks' module-global
   loss lists empty.
"""

from __future__ import annotations

import copy

import pytest
import torch

from moe_lit.config import MoEConfig
from moe_lit.model.experts.megablocks_backend import MegaBlocksExperts, megablocks_arguments
from moe_lit.model.experts.torch_backend import TorchExperts
from moe_lit.model.moe import MoELayer
from tests.gpu import megablocks_standins

D, T = 32, 24


@pytest.fixture(scope="module")
def megablocks():
    with megablocks_standins.installed() as module:
        yield module


def _cfg(**fields) -> MoEConfig:
    # NOTE: dMoE's constructor needs num_experts * expert_size >= 128 (its sparse block size).
    base = dict(num_experts=4, expert_size=32, top_k=2, aux_loss_coef=0.05, z_loss_coef=0.01, backend="torch")
    base.update(fields)
    return MoEConfig(**base)


def _layer(cfg: MoEConfig, num_moe_layers: int, seed: int) -> MoELayer:
    torch.manual_seed(seed)
    layer = MoELayer(D, cfg, num_moe_layers)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(std=0.3)
    return layer


def _clear_megablocks_losses(megablocks) -> None:
    megablocks.layers.moe.clear_load_balancing_loss()
    megablocks.layers.router.clear_router_zloss()


@pytest.mark.parametrize("top_k,renormalize", [(2, True), (1, False), (3, True)])
def test_real_dmoe_matches_our_layer(megablocks, top_k, renormalize):
    cfg = _cfg(top_k=top_k, renormalize=renormalize)
    num_layers = 2
    ours = [_layer(cfg, num_layers, seed) for seed in (0, 1)]
    args = megablocks_arguments(D, cfg, num_moe_layers=num_layers, device=torch.device("cpu"))
    theirs = [megablocks.layers.dmoe.dMoE(args) for _ in ours]
    for layer, dmoe in zip(ours, theirs, strict=False):
        dmoe.load_state_dict(layer.state_dict(), strict=True)  # same keys, same shapes
    torch.manual_seed(2)
    xs = [torch.randn(T, 1, D) for _ in ours]  # MegaBlocks' [sl, bs, hs]
    g_TD = torch.randn(T, 1, D)

    our_out, our_aux = [], {}
    for layer, x in zip(ours, xs, strict=False):
        y, losses = layer(x.transpose(0, 1))
        our_out.append(y.transpose(0, 1))
        for name, value in losses.items():
            our_aux[name] = our_aux.get(name, 0) + value
    _clear_megablocks_losses(megablocks)
    their_out = [dmoe(x) for dmoe, x in zip(theirs, xs, strict=False)]
    their_lbl = megablocks.layers.moe.batched_load_balancing_loss(args)
    # NOTE: MegaBlocks returns one z-loss per router, each weighted but not averaged over layers;
    # ours averages over the MoE layers (so the weight means the same for any depth).
    their_z = megablocks.layers.router.batched_router_zloss(args)
    _clear_megablocks_losses(megablocks)

    for a, b in zip(our_out, their_out, strict=False):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(our_aux["load_balancing"], their_lbl, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(our_aux["z_loss"], their_z.sum() / num_layers, rtol=1e-5, atol=1e-7)

    def total(outs, lbl, z):
        return sum((o * g_TD).sum() for o in outs) + lbl + z

    total(our_out, our_aux["load_balancing"], our_aux["z_loss"]).backward()
    total(their_out, their_lbl, their_z.sum() / num_layers).backward()
    for layer, dmoe in zip(ours, theirs, strict=False):
        their_grads = {n: p.grad for n, p in dmoe.named_parameters()}
        for name, p in layer.named_parameters():
            torch.testing.assert_close(
                p.grad, their_grads[name], rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
            )


def test_arguments_follow_the_config(megablocks):
    args = megablocks_arguments(D, _cfg(renormalize=False, balancing="bias"), num_moe_layers=3, device="cpu")
    assert (args.hidden_size, args.ffn_hidden_size, args.moe_num_experts, args.moe_top_k) == (D, 32, 4, 2)
    assert (args.num_layers, args.mlp_type, args.mlp_impl) == (3, "glu", "grouped")
    assert args.moe_normalize_expert_weights is None and args.moe_loss_weight == 0.0
    assert args.moe_zloss_weight == 0.01 and args.activation_fn is torch.nn.functional.silu
    assert (args.fp16, args.bf16, args.device) == (False, False, "cpu")
    assert megablocks_arguments(D, _cfg(), dtype=torch.bfloat16, device="cpu").bf16


@pytest.mark.parametrize("score_func,balancing", [("softmax", "aux_loss"), ("sigmoid", "bias")])
def test_adapter_matches_torch_backend(megablocks, score_func, balancing):
    cfg = _cfg(score_func=score_func, balancing=balancing)
    ours = _layer(cfg, 1, seed=3)
    adapted = copy.deepcopy(ours)
    adapted.experts = MegaBlocksExperts(D, cfg, device=torch.device("cpu"))
    adapted.experts.load_state_dict(ours.experts.state_dict(), strict=True)
    assert isinstance(ours.experts, TorchExperts)
    assert adapted.state_dict().keys() == ours.state_dict().keys()
    assert adapted.experts.layout == ours.experts.layout

    torch.manual_seed(4)
    x_BLD = torch.randn(2, T // 2, D)
    g_BLD = torch.randn_like(x_BLD)
    results = []
    for layer in (ours, adapted):
        layer.train()
        y, losses = layer(x_BLD)
        ((y * g_BLD).sum() + sum(losses.values())).backward()
        results.append((y, losses, {n: p.grad for n, p in layer.named_parameters()}))
    (y_a, loss_a, grad_a), (y_b, loss_b, grad_b) = results
    torch.testing.assert_close(y_b, y_a, rtol=1e-5, atol=1e-6)
    assert loss_b.keys() == loss_a.keys()
    for name in loss_a:
        torch.testing.assert_close(loss_b[name], loss_a[name])
    for name, grad in grad_a.items():
        torch.testing.assert_close(grad_b[name], grad, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    assert torch.equal(adapted.router.pending_tokens_per_expert(), ours.router.pending_tokens_per_expert())
    assert ours.router.pending_tokens_per_expert().sum() == T * cfg.top_k
    # the adapter never feeds MegaBlocks' module-global loss lists, in training or in eval
    adapted.eval()
    adapted(x_BLD)
    assert megablocks.layers.moe.get_load_balancing_loss() == []
    assert megablocks.layers.router._ROUTER_LOGITS == []


def test_adapter_rejects_capacity(megablocks):
    from moe_lit.errors import MoeLitError

    experts = MegaBlocksExperts(D, _cfg(), device=torch.device("cpu"))
    indices_TK = torch.zeros(T, 2, dtype=torch.long)
    with pytest.raises(MoeLitError, match="moe.capacity_factor"):
        experts(torch.randn(T, D), torch.ones(T, 2), indices_TK, capacity=4)
