"""Top-k router, load-balancing losses and aux-loss-free bias balancing.

Shape legend: T tokens, D d_model, E experts, K top-k (see ``experts/layout.py``).

The router matches MegaBlocks' ``LearnedRouter`` where the two overlap: one bias-free linear layer
``layer.weight (E, D)``, softmax scores, top-k, optional renormalisation of the k weights (p=1),
and the load-balancing loss ``w * E / (n_moe_layers * T * K) * sum_e count_e * mean_t(score_te)``.
It extends it with sigmoid scores (DeepSeek-V3; for the balancing loss the sigmoid scores are
normalised per token so the formula keeps its meaning) and aux-loss-free bias balancing, where a
persistent ``expert_bias`` shifts only the *selection* of experts, never the weights. With
``unit_weights`` every selected expert weighs exactly 1 (straight-through to the scores), the
gating of FFNs partitioned into experts (``moe_lit.convert.partition``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moe_lit.config import MoEConfig


@dataclass
class RouterOutput:
    """One routing decision for a flattened batch."""

    logits_TE: torch.Tensor
    scores_TE: torch.Tensor
    weights_TK: torch.Tensor
    indices_TK: torch.Tensor


class Router(nn.Module):
    """Learned top-k router. Counts of the last training forward sit in non-persistent buffers."""

    def __init__(self, d_model: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        self.top_k = cfg.top_k
        self.score_func = cfg.score_func
        self.renormalize = cfg.renormalize
        self.unit_weights = cfg.unit_weights
        self.bias_update_rate = cfg.bias_update_rate
        self.layer = nn.Linear(d_model, cfg.num_experts, bias=False)
        # NOTE: the balancing bias is routing state that must survive a checkpoint, so it is a
        # persistent buffer; it exists only with balancing=bias so that softmax/aux-loss layers keep
        # exactly MegaBlocks' state-dict keys.
        if cfg.balancing == "bias":
            self.register_buffer("expert_bias", torch.zeros(cfg.num_experts))
        else:
            self.expert_bias = None
        # NOTE: observation buffers are non-persistent: they describe the last training forward
        # (monitoring, bias updates) and are never part of a checkpoint.
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.num_experts), persistent=False)
        self.register_buffer("dropped_tokens", torch.zeros(()), persistent=False)

    def forward(self, x_TD: torch.Tensor) -> RouterOutput:
        logits_TE = self.layer(x_TD).float()
        if self.score_func == "softmax":
            scores_TE = logits_TE.softmax(dim=-1)
        else:
            scores_TE = logits_TE.sigmoid()
        selection_TE = scores_TE if self.expert_bias is None else scores_TE + self.expert_bias
        _, indices_TK = torch.topk(selection_TE, self.top_k, dim=-1)
        weights_TK = scores_TE.gather(-1, indices_TK)
        if self.renormalize:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        elif self.unit_weights:
            weights_TK = straight_through_ones(weights_TK)
        return RouterOutput(logits_TE, scores_TE, weights_TK.to(x_TD.dtype), indices_TK)

    @torch.no_grad()
    def record(self, routed_counts_E: torch.Tensor, dropped: torch.Tensor) -> None:
        """Store the counts of a training forward (called by the MoE layer)."""
        self.tokens_per_expert.copy_(routed_counts_E)
        self.dropped_tokens.copy_(dropped)

    @torch.no_grad()
    def update_bias(self) -> None:
        """Aux-loss-free balancing step: raise under-loaded experts, lower over-loaded ones."""
        if self.expert_bias is None:
            return
        load_E = self.tokens_per_expert.float()
        self.expert_bias.add_(self.bias_update_rate * torch.sign(load_E.mean() - load_E))


def straight_through(hard: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:
    """Exactly ``hard`` in the forward, the gradient of ``soft`` in the backward: ``hard + soft - sg(soft)``."""
    # NOTE: soft - sg(soft) is exactly 0, so the forward value is hard bit for bit.
    return hard + (soft - soft.detach())


def straight_through_ones(scores: torch.Tensor) -> torch.Tensor:
    """Exactly 1 in the forward, the gradient of ``scores`` in the backward: ``1 + s - sg(s)``."""
    return straight_through(torch.ones_like(scores), scores)


def load_balancing_loss(
    scores_TE: torch.Tensor, routed_counts_E: torch.Tensor, top_k: int, num_moe_layers: int, coef: float
) -> torch.Tensor:
    """MegaBlocks' load-balancing loss for one layer; summing over layers gives its batched loss."""
    num_tokens, num_experts = scores_TE.shape
    scale = coef * num_experts / (num_moe_layers * num_tokens * top_k)
    return scale * torch.dot(routed_counts_E.to(scores_TE.dtype), scores_TE.mean(dim=0))


def z_loss(logits_TE: torch.Tensor, num_moe_layers: int, coef: float) -> torch.Tensor:
    """Router z-loss ``coef * mean_t(logsumexp(logits_t)^2)``, averaged over MoE layers."""
    return coef / num_moe_layers * torch.logsumexp(logits_TE, dim=-1).square().mean()


def balancing_scores(scores_TE: torch.Tensor, score_func: str) -> torch.Tensor:
    """Scores as a per-token distribution (sigmoid scores are normalised) for the balancing loss."""
    if score_func == "softmax":
        return scores_TE
    return scores_TE / scores_TE.sum(dim=-1, keepdim=True).clamp_min(1e-20)


def routed_counts(indices_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens assigned to each expert before any capacity dropping."""
    return torch.bincount(indices_TK.reshape(-1), minlength=num_experts)


__all__ = [
    "Router",
    "RouterOutput",
    "balancing_scores",
    "load_balancing_loss",
    "routed_counts",
    "straight_through",
    "straight_through_ones",
    "z_loss",
]
