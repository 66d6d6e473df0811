"""Expert backends. ``build_experts`` is the one place that chooses the implementation.

Every backend holds the same parameters under the same names (``mlp.w1|v1|w2`` of shape (S, D),
``bias``), so the choice never changes a checkpoint:

* ``torch``: :class:`TorchExperts`, CPU and GPU, any expert sizes, dropless or capacity-limited; its
  matmuls run as grouped GEMMs (``torch._grouped_mm``, as torchtitan uses it; bf16 on CUDA), padded
  ``bmm`` chunks or a per-expert loop, chosen per batch (``torch_backend.choose_geometry``).
* ``megablocks``: :class:`~moe_lit.model.experts.megablocks_backend.MegaBlocksExperts` (CUDA,
  equal experts, dropless), imported lazily.
* ``auto``: MegaBlocks when CUDA and megablocks are present and the layer is supported, else torch;
  on a CUDA machine a fallback warns once with the reason.
"""

from __future__ import annotations

import warnings

import torch

from moe_lit.config import ConfigError, MoEConfig
from moe_lit.model.experts.layout import ExpertLayout
from moe_lit.model.experts.megablocks_backend import MegaBlocksExperts, unavailable_reason, unsupported_reason
from moe_lit.model.experts.torch_backend import TorchExperts


def resolve_backend(cfg: MoEConfig) -> str:
    """``'torch'`` or ``'megablocks'`` for this config on this machine (see the module docstring)."""
    if cfg.backend == "torch":
        return "torch"
    reason: str | None = unsupported_reason(cfg) or unavailable_reason()
    if cfg.backend == "megablocks":
        if reason is not None:
            raise ConfigError(f"moe.backend: 'megablocks' cannot run here: {reason}; use backend: auto or torch")
        return "megablocks"
    if reason is None:
        return "megablocks"
    if torch.cuda.is_available():
        # NOTE: on a CPU machine the torch backend is simply the backend; on a GPU machine the
        # fallback costs speed, so say why (warnings show one identical message once).
        warnings.warn(f"moe.backend=auto: using the torch backend: {reason}", stacklevel=3)
    return "torch"


def build_experts(d_model: int, cfg: MoEConfig) -> TorchExperts | MegaBlocksExperts:
    """Routed experts for one MoE layer, in the shared ``mlp.w1/v1/w2`` + ``bias`` layout."""
    if resolve_backend(cfg) == "megablocks":
        return MegaBlocksExperts(d_model, cfg)
    return TorchExperts(d_model, ExpertLayout.of(cfg.expert_sizes), output_bias=cfg.expert_output_bias)


__all__ = ["ExpertLayout", "TorchExperts", "build_experts", "resolve_backend"]
