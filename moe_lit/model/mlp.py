"""Dense SwiGLU FFN, named like one MegaBlocks GLU expert.

``w1`` is the activated projection (Llama's ``gate_proj``), ``v1`` the linear one (``up_proj``),
``w2`` the down projection: ``w2(silu(w1 x) * v1 x)``. Stored as ``nn.Linear`` weights, so
``w2.weight`` is (D, F) here and its transpose (F, D) inside the stacked expert layout.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_lit.model.invariant import swiglu


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.v1 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.v1(x)))
