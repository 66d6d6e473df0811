"""Tiny model configs, seeded parameters and a reference MoE forward written apart from the backends."""

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from moe_lit.config import ModelConfig, MoEConfig
from moe_lit.distributed.grad_norm import clip_grad_norm
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


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``count`` inside, restored after."""
    start = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(start)


def experts_pass(experts, indices, x, gates, dy, threads: int, bf16: bool = False) -> list[torch.Tensor]:
    """``y`` and every gradient (input, gates, parameters) of one forward and backward of ``experts`` at
    ``threads`` intra-op threads (under CPU bf16 autocast when ``bf16``)."""
    with torch_threads(threads):
        x_in, gates_in = x.clone().requires_grad_(True), gates.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            y, _ = experts(x_in, gates_in, indices, None)
        grads = torch.autograd.grad((y.float() * dy).sum(), [x_in, gates_in, *experts.parameters()])
    return [y.detach(), *grads]


def train_at_threads(model, thread_schedule: list[int], batches: list[torch.Tensor], lr: float, bf16: bool = False):
    """Optimizer steps of ``model`` on ``batches`` (AdamW, clipping 1.0; the forward under CPU bf16 autocast
    when ``bf16``, as bf16-mixed takes them), step i at ``thread_schedule[i]`` threads; the losses."""
    optim = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    losses = []
    for threads, tokens in zip(thread_schedule, batches, strict=True):
        with torch_threads(threads):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                out = model(tokens[:, :-1], tokens[:, 1:])
            loss = out.ce + out.aux_loss
            loss.backward()
            clip_grad_norm(model.parameters(), 1.0)
            optim.step()
            optim.zero_grad()
        losses.append(loss.item())
    return losses
