"""MoE layer: router + routed experts (+ optional shared expert), dropless or capacity-limited.

Shape legend: B batch, L sequence, T = B*L tokens, D d_model, E experts, K top-k.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_lit.config import MoEConfig
from moe_lit.model.experts import build_experts
from moe_lit.model.mlp import SwiGLU
from moe_lit.model.router import Router, balancing_scores, load_balancing_loss, z_loss


class MoELayer(nn.Module):
    """Returns ``(y_BLD, losses)``; the losses dict holds already-weighted auxiliary terms."""

    def __init__(self, d_model: int, cfg: MoEConfig, num_moe_layers: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_moe_layers = num_moe_layers
        self.router = Router(d_model, cfg)
        self.experts = build_experts(d_model, cfg)
        self.shared_expert = SwiGLU(d_model, cfg.shared_expert_size) if cfg.shared_expert_size else None
        self.shared_expert_gate = nn.Linear(d_model, 1, bias=False) if cfg.shared_expert_gate else None

    def forward(self, x_BLD: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        x_TD = x_BLD.reshape(-1, x_BLD.shape[-1])
        routing = self.router(x_TD)
        capacity = self.cfg.capacity(x_TD.shape[0])
        y_TD, counts = self.experts(x_TD, routing.weights_TK, routing.indices_TK, capacity)
        if self.shared_expert is not None:
            y_TD = y_TD + self._shared(self.shared_expert, x_TD)
        if self.training:
            self.router.record(counts.routed_counts_E, counts.dropped)
        return y_TD.view_as(x_BLD), self._losses(routing, counts.routed_counts_E)

    def _shared(self, shared_expert: SwiGLU, x_TD: torch.Tensor) -> torch.Tensor:
        """The shared expert's output, scaled by its sigmoid gate when it has one (Qwen2-MoE)."""
        out_TD = shared_expert(x_TD)
        if self.shared_expert_gate is None:
            return out_TD
        return torch.sigmoid(self.shared_expert_gate(x_TD)) * out_TD

    def _losses(self, routing, routed_counts_E: torch.Tensor) -> dict[str, torch.Tensor]:
        losses: dict[str, torch.Tensor] = {}
        cfg = self.cfg
        if cfg.balancing == "aux_loss" and cfg.aux_loss_coef > 0:
            scores_TE = balancing_scores(routing.scores_TE, cfg.score_func)
            losses["load_balancing"] = load_balancing_loss(
                scores_TE, routed_counts_E, cfg.top_k, self.num_moe_layers, cfg.aux_loss_coef
            )
        if cfg.z_loss_coef > 0:
            losses["z_loss"] = z_loss(routing.logits_TE, self.num_moe_layers, cfg.z_loss_coef)
        return losses
