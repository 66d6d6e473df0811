"""Calibration tokens for the dense-FFN transforms: what every dense SwiGLU block sees and computes.

Shape legend: T calibration tokens, D d_model, F d_ff (neurons of one dense FFN), B/L batch /
sequence (a calibration batch holds L+1 tokens; its inputs are ``[:, :-1]``).

``ffn_inputs`` runs the model over calibration batches and keeps the input of every dense FFN
(the normalised residual stream, ``(T, D)`` per block); ``neuron_activations`` turns one block's
inputs into its hidden activations ``H = silu(x w1^T) * (x v1^T)``, the quantity the
co-activation clustering, the trained router and the structured-pruning ranking all read.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from moe_lit.errors import MoeLitError
from moe_lit.model import Transformer
from moe_lit.model.mlp import SwiGLU


def dense_ffn_ids(model: Transformer) -> tuple[int, ...]:
    """Indices of the blocks whose FFN is a dense SwiGLU."""
    return tuple(i for i, block in enumerate(model.blocks) if isinstance(block.ffn, SwiGLU))


@torch.no_grad()
def ffn_inputs(model: Transformer, batches: Iterable[torch.Tensor], max_tokens: int) -> dict[int, torch.Tensor]:
    """The ``(T, D)`` inputs of every dense FFN over up to ``max_tokens`` tokens of ``(B, L+1)`` batches.

    The model runs in eval mode (restored afterwards); the hooks are removed on exit.
    """
    if max_tokens < 1:
        raise MoeLitError(f"calibration tokens: need at least 1, got {max_tokens}")
    layer_ids = dense_ffn_ids(model)
    seen: dict[int, list[torch.Tensor]] = {i: [] for i in layer_ids}
    handles = [
        model.dense_ffn(i).register_forward_pre_hook(
            lambda _module, args, i=i: seen[i].append(args[0].reshape(-1, args[0].shape[-1]).float().cpu())
        )
        for i in layer_ids
    ]
    was_training, device, num_tokens = model.training, next(model.parameters()).device, 0
    model.eval()
    try:
        for batch_BL1 in batches:
            if num_tokens >= max_tokens:
                break
            model(batch_BL1[:, :-1].to(device))
            num_tokens += batch_BL1[:, :-1].numel()
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    if num_tokens == 0:
        raise MoeLitError("calibration: the calibration batches are empty")
    return {i: torch.cat(chunks)[:max_tokens] for i, chunks in seen.items()}


@torch.no_grad()
def neuron_activations(ffn: SwiGLU, x_TD: torch.Tensor) -> torch.Tensor:
    """``(T, F)`` hidden activations ``silu(x w1^T) * (x v1^T)`` of a dense FFN, in fp32."""
    w1_FD, v1_FD = ffn.w1.weight.float().cpu(), ffn.v1.weight.float().cpu()
    return F.silu(x_TD @ w1_FD.t()) * (x_TD @ v1_FD.t())


__all__ = ["dense_ffn_ids", "ffn_inputs", "neuron_activations"]
