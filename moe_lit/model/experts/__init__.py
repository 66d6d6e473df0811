"""Expert backends. ``build_experts`` is the one place that chooses the implementation.

Every backend implements :class:`~moe_lit.model.experts.protocol.ExpertsBackend` (forward, the
weight layout, ``shard_experts``, ``supports(cfg, device)``) and holds the same parameters under the
same names (``mlp.w1|v1|w2`` of shape (S, D), ``bias``), so the choice never changes a checkpoint.
:data:`BACKENDS` registers them by the name ``moe.backend`` gives:

* ``torch``: :class:`TorchExperts`, CPU and GPU, any expert sizes, dropless or capacity-limited; its
  matmuls run as grouped GEMMs (``torch._grouped_mm``, as torchtitan uses it; bf16 on CUDA), padded
  ``bmm`` chunks or a per-expert loop, chosen per batch (``torch_backend.choose_geometry``).
* ``megablocks``: :class:`~moe_lit.model.experts.megablocks_backend.MegaBlocksExperts` (CUDA
  tensors, equal experts, dropless), megablocks imported lazily.
* ``auto``: chosen by device. MegaBlocks where the machine has CUDA and megablocks and the layer is
  supported, else torch; a MegaBlocks layer whose input is not on CUDA (a model evaluated, converted
  or loaded on the CPU) runs the torch backend's forward on the same parameters, so no CPU tensor
  reaches a CUDA-only kernel. On a CUDA machine a fallback to torch at build warns once with the
  reason (it costs speed there); on a CPU machine torch is simply the backend.

``backend: megablocks`` where MegaBlocks cannot run (no CUDA or megablocks, an unsupported config,
an input off CUDA) is a one-line ``moe.backend`` error.
"""

from __future__ import annotations

import warnings

import torch

from moe_lit.config import ConfigError, MoEConfig
from moe_lit.model.experts.layout import ExpertLayout
from moe_lit.model.experts.megablocks_backend import MegaBlocksExperts
from moe_lit.model.experts.protocol import AUTO, ExpertsBackend, backend_registry
from moe_lit.model.experts.torch_backend import TorchExperts

BACKENDS = backend_registry(MegaBlocksExperts, TorchExperts)
"""The experts backends by ``moe.backend`` name, in ``auto``'s order of preference."""


def resolve_backend(cfg: MoEConfig) -> str:
    """The name of the backend that builds this config's experts on this machine (module docstring).

    NOTE: the device asked is the best one here (CUDA when present): a layer built on the CPU is
    usually moved to the GPU before it trains; MegaBlocks layers handle CPU inputs per call.
    """
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.backend != AUTO:
        reason = BACKENDS[cfg.backend].supports(cfg, device)
        if reason is not None:
            raise ConfigError(f"moe.backend: {cfg.backend!r} cannot run here: {reason}; use backend: auto or torch")
        return cfg.backend
    reasons: list[str] = []
    for name, backend in BACKENDS.items():
        reason = backend.supports(cfg, device)
        if reason is None:
            if reasons and device.type == "cuda":
                # NOTE: on a CPU machine the torch backend is simply the backend; on a GPU machine the
                # fallback costs speed, so say why (warnings show one identical message once).
                warnings.warn(f"moe.backend=auto: using the {name} backend: {'; '.join(reasons)}", stacklevel=3)
            return name
        reasons.append(reason)
    raise ConfigError(f"moe.backend: no backend runs this layer here: {'; '.join(reasons)}")


def build_experts(d_model: int, cfg: MoEConfig) -> ExpertsBackend:
    """Routed experts for one MoE layer, in the shared ``mlp.w1/v1/w2`` + ``bias`` layout."""
    return BACKENDS[resolve_backend(cfg)].from_config(d_model, cfg)


__all__ = ["BACKENDS", "ExpertLayout", "ExpertsBackend", "TorchExperts", "build_experts", "resolve_backend"]
