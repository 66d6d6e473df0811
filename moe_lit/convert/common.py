"""Helpers shared by the model transforms: rebuilding a model in a new shape, the LM loss."""

from __future__ import annotations

import torch

from moe_lit.config import ModelConfig
from moe_lit.model import Transformer


def rebuild(model: Transformer, cfg: ModelConfig) -> Transformer:
    """A new ``Transformer(cfg)`` on ``model``'s device and dtype, in ``model``'s train/eval mode.

    Every tensor whose name and shape are unchanged is copied from ``model``; the transform that
    calls this overwrites the rest (the freshly initialised tensors of the new shape).
    """
    reference = next(model.parameters())
    devices = [reference.device] if reference.device.type == "cuda" else []
    # NOTE: a transform is a pure function: the throw-away initialisation of the new model must
    # not advance the caller's global RNG (a callback mid-run would otherwise change its data order).
    with torch.random.fork_rng(devices=devices), torch.device(reference.device):
        new = Transformer(cfg)
    new.to(dtype=reference.dtype)
    new_state = new.state_dict()
    kept = {k: v for k, v in model.state_dict().items() if k in new_state and new_state[k].shape == v.shape}
    new.load_state_dict(kept, strict=False)
    return new.train(model.training)


def dropless(model: Transformer) -> Transformer:
    """The same weights with ``moe.capacity_factor: null``: every routed token reaches its experts
    (``model`` keeps its capacity)."""
    return rebuild(model, model.config.replace(moe={"capacity_factor": None}))


def next_token_loss(model: Transformer, batch_BL1: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of a ``(B, L+1)`` token batch (inputs ``[:, :-1]``)."""
    return model(batch_BL1[:, :-1], batch_BL1[:, 1:]).ce


__all__ = ["dropless", "next_token_loss", "rebuild"]
