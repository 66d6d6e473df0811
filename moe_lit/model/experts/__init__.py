"""Expert backends. ``build_experts`` is the one place that chooses the implementation."""

from __future__ import annotations

from torch import nn

from moe_lit.config import ConfigError, MoEConfig
from moe_lit.model.experts.layout import ExpertLayout
from moe_lit.model.experts.torch_backend import TorchExperts


def build_experts(d_model: int, cfg: MoEConfig) -> nn.Module:
    """Routed experts for one MoE layer, in the shared ``mlp.w1/v1/w2`` + ``bias`` layout."""
    if cfg.backend == "megablocks":
        raise ConfigError("moe.backend: 'megablocks' is not available in this build; allowed values: auto, torch")
    return TorchExperts(d_model, ExpertLayout.of(cfg.expert_sizes))


__all__ = ["ExpertLayout", "TorchExperts", "build_experts"]
