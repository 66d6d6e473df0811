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

Routing statistics (as OLMo-core and torchtitan keep them): every training forward *adds* its
counts, dropped assignments and score entropy to the router's pending sums, so they cover all
micro-batches of an optimizer step; :func:`finish_routing_step` then all-reduces the pending sums
of every layer in one collective over the data-parallel ranks, stores them as the step's
:class:`RoutingStats` (the one object the bias update, RoutingMonitor, utility selection and the
study records read), nudges the selection biases from them and resets the pending sums.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moe_lit.config import MoEConfig
from moe_lit.model.experts.ops import no_autocast

PENDING_EXTRA = 3
"""Pending sums after the E counts: dropped assignments, sum of per-token score entropy, tokens."""


@dataclass
class RouterOutput:
    """One routing decision for a flattened batch."""

    logits_TE: torch.Tensor
    scores_TE: torch.Tensor
    weights_TK: torch.Tensor
    indices_TK: torch.Tensor


@dataclass(frozen=True)
class RoutingStats:
    """One MoE layer's routing over the last finished optimizer step, summed over its micro-batches
    and the data-parallel ranks (equal on every rank)."""

    tokens_per_expert_E: torch.Tensor
    """Routed (token, expert) assignments per expert, before capacity dropping."""
    dropped: float
    """Assignments dropped by the capacity limit (0 when dropless)."""
    mean_entropy: float
    """Mean over tokens of the entropy (nats) of the routing score distribution."""
    num_tokens: int
    """Tokens routed."""

    @property
    def load_imbalance(self) -> float:
        """max / mean assignments per expert (1 = balanced; nan when nothing was routed)."""
        counts_E = self.tokens_per_expert_E.float()
        mean = counts_E.mean()
        return (counts_E.max() / mean).item() if mean > 0 else float("nan")

    @property
    def dropped_fraction(self) -> float:
        routed = self.tokens_per_expert_E.sum().item()
        return self.dropped / routed if routed > 0 else 0.0

    @property
    def frequency_E(self) -> torch.Tensor:
        """Fraction of the routed assignments that went to each expert."""
        counts_E = self.tokens_per_expert_E.float()
        return counts_E / counts_E.sum().clamp_min(1.0)


class Router(nn.Module):
    """Learned top-k router; accumulates its training statistics until :func:`finish_routing_step`."""

    # NOTE: buffers, declared for the type checker (nn.Module's __getattr__ types them Tensor | Module).
    expert_bias: torch.Tensor | None
    tokens_per_expert: torch.Tensor
    step_totals: torch.Tensor

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
        # NOTE: the last finished step's statistics are non-persistent buffers (they move with the
        # module, never enter a checkpoint). The pending sums are a plain attribute, not a buffer:
        # DDP broadcasts rank 0's buffers at every forward, which would overwrite the other ranks'
        # partial sums between micro-batches.
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.num_experts), persistent=False)
        self.register_buffer("step_totals", torch.zeros(PENDING_EXTRA), persistent=False)
        self._pending: torch.Tensor | None = None

    def forward(self, x_TD: torch.Tensor) -> RouterOutput:
        # NOTE: the router's matmul runs in its weights' dtype, float32 under autocast (the Switch
        # Transformer's selective precision): bf16 logits flip near-tied top-k choices, and the
        # training trajectory with them (python -m benchmarks.bf16_accuracy; docs/performance.md).
        # Through the layer's own call, so that its forward hooks still see the logits.
        with no_autocast(x_TD.device):
            logits_TE = self.layer(x_TD.to(self.layer.weight.dtype)).float()
        if self.score_func == "softmax":
            scores_TE = logits_TE.softmax(dim=-1)
        else:
            scores_TE = logits_TE.sigmoid()
        if self.training:
            self._add_entropy(scores_TE)
        selection_TE = scores_TE if self.expert_bias is None else scores_TE + self.expert_bias
        _, indices_TK = torch.topk(selection_TE, self.top_k, dim=-1)
        weights_TK = scores_TE.gather(-1, indices_TK)
        if self.renormalize:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        elif self.unit_weights:
            weights_TK = straight_through_ones(weights_TK)
        return RouterOutput(logits_TE, scores_TE, weights_TK.to(x_TD.dtype), indices_TK)

    # ------------------------------------------------------------------ statistics
    def _pending_sums(self, device: torch.device) -> torch.Tensor:
        if self._pending is None:
            # NOTE: float64 keeps integer counts exact far beyond any step's token count.
            self._pending = torch.zeros(self.num_experts + PENDING_EXTRA, dtype=torch.float64, device=device)
        return self._pending

    @torch.no_grad()
    def _add_entropy(self, scores_TE: torch.Tensor) -> None:
        pending = self._pending_sums(scores_TE.device)
        pending[-2] += token_entropy(scores_TE, self.score_func).sum().double()
        pending[-1] += scores_TE.shape[0]

    @torch.no_grad()
    def record(self, routed_counts_E: torch.Tensor, dropped: torch.Tensor) -> None:
        """Add the counts of a training forward to the pending sums (called by the MoE layer).

        NOTE: activation checkpointing re-runs the forward in the backward pass and so adds every
        micro-batch twice; every statistic read from the sums is a ratio, which that leaves equal."""
        pending = self._pending_sums(routed_counts_E.device)
        pending[: self.num_experts] += routed_counts_E.double()
        pending[-3] += dropped.double()

    def pending_tokens_per_expert(self) -> torch.Tensor:
        """Assignments per expert routed on this rank since the last finished step."""
        if self._pending is None:
            return torch.zeros_like(self.tokens_per_expert)
        return self._pending[: self.num_experts].to(self.tokens_per_expert.dtype)

    def take_pending(self) -> torch.Tensor | None:
        """The pending sums (counts E, dropped, entropy sum, tokens), reset to nothing."""
        pending, self._pending = self._pending, None
        return pending

    @torch.no_grad()
    def finish_step(self, totals: torch.Tensor, update_bias: bool = True) -> None:
        """Store the reduced sums of a step as its statistics, then take the balancing step."""
        self.tokens_per_expert.copy_(totals[: self.num_experts])
        self.step_totals.copy_(totals[self.num_experts :])
        if update_bias:
            self.update_bias()

    def stats(self) -> RoutingStats:
        """The statistics of the last finished step."""
        dropped, entropy_sum, tokens = self.step_totals.tolist()
        return RoutingStats(
            self.tokens_per_expert.clone(), dropped, entropy_sum / tokens if tokens else 0.0, int(tokens)
        )

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


@torch.no_grad()
def finish_routing_step(
    routers: Sequence[Router], group: dist.ProcessGroup | None = None, update_biases: bool = True
) -> bool:
    """End an optimizer step's routing: one all-reduce of every router's pending sums over ``group``
        (default: all ranks, when torch.distributed is initialized), stats stored, biases updated
        (unless ``update_biases`` is false), sums reset. A no-op returning False when nothing was routed
    since the last call, so that a
        second call in the same step (a callback that needed the step's stats first) changes nothing.

        Every rank must call it at the same point: the statistics, and so the biases, then agree."""
    pending = [router.take_pending() for router in routers]
    if not routers or all(p is None for p in pending):
        return False
    like = next(p for p in pending if p is not None)
    filled = [
        torch.zeros(r.num_experts + PENDING_EXTRA, dtype=like.dtype, device=like.device) if p is None else p
        for r, p in zip(routers, pending, strict=False)
    ]
    flat = torch.cat(filled)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flat, group=group)
    for router, totals in zip(routers, flat.split([p.numel() for p in filled]), strict=False):
        router.finish_step(totals, update_biases)
    return True


def token_entropy(scores_TE: torch.Tensor, score_func: str) -> torch.Tensor:
    """Per-token entropy (nats) of the routing distribution (sigmoid scores normalised per token)."""
    probs_TE = balancing_scores(scores_TE.float(), score_func)
    return -(probs_TE * probs_TE.clamp_min(1e-20).log()).sum(dim=-1)


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
    "RoutingStats",
    "balancing_scores",
    "finish_routing_step",
    "load_balancing_loss",
    "routed_counts",
    "straight_through",
    "straight_through_ones",
    "token_entropy",
    "z_loss",
]
