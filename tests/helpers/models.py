"""Tiny model configs, seeded parameters and a reference MoE forward written apart from the backends."""

import torch
import torch.nn.functional as F

from moe_lit.config import ModelConfig, MoEConfig
from moe_lit.model.moe import MoELayer


def tiny(**moe_fields) -> ModelConfig:
    """A tiny model config; MoE when moe fields are given (``dense=True`` for a dense model)."""
    dense = moe_fields.pop("dense", False)
    model_fields = {k: moe_fields.pop(k) for k in list(moe_fields) if k in ModelConfig.__dataclass_fields__}
    base = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, seq_len=16, d_ff=64)
    base.update(model_fields)
    if dense:
        return ModelConfig(**base)
    moe = dict(num_experts=4, expert_size=16, top_k=2)
    moe.update(moe_fields)
    return ModelConfig(moe=MoEConfig(**moe), **base)


def random_init(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter drawn from N(0, 0.1^2) with its own seeded generator (the global RNG is untouched)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return module


def reference_moe(layer: MoELayer, x_TD: torch.Tensor) -> torch.Tensor:
    """A plain loop over tokens and their k experts, written independently of the backend."""
    routing = layer.router(x_TD)
    mlp, layout = layer.experts.mlp, layer.experts.layout
    rows = []
    for t in range(x_TD.shape[0]):
        y = layer.experts.bias.clone()
        for k in range(routing.indices_TK.shape[1]):
            e = int(routing.indices_TK[t, k])
            sl = layout.rows(e)
            h = F.silu(mlp.w1[sl] @ x_TD[t]) * (mlp.v1[sl] @ x_TD[t])
            y = y + routing.weights_TK[t, k] * (h @ mlp.w2[sl])
        if layer.shared_expert is not None:
            y = y + layer.shared_expert(x_TD[t])
        rows.append(y)
    return torch.stack(rows)


def skewed_routing(num_tokens: int, small: list[int], num_experts: int) -> torch.Tensor:
    """Top-2 indices (T, 2): expert e < len(small) gets exactly ``small[e]`` tokens, the others share the rest."""
    big = num_experts - len(small)
    t = torch.arange(num_tokens)
    second = len(small) + t % big
    first = len(small) + (t + 1 + t // big % (big - 1)) % big  # never the token's second expert
    first[: sum(small)] = torch.repeat_interleave(torch.arange(len(small)), torch.tensor(small))
    return torch.stack([first, second], dim=1)
