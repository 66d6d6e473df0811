"""Dense -> MoE upcycling: every dense SwiGLU FFN becomes an MoE layer built from its weights.

Shape legend: D d_model, F dense d_ff, G granularity (shards of F), f = F/G one expert's hidden
size, E experts, R = E/G virtual groups, S = E*f stacked expert rows (see ``experts/layout.py``).

Recipes (``dense_to_moe(model, recipe=...)``):

* ``copy`` — sparse upcycling: every expert is an exact copy of the dense FFN (f = F) and the
  router is new (normal(0, init_std)). Guarantee: with ``renormalize=True`` the k weights of a
  token sum to one and all experts are equal, so the MoE layer computes the dense FFN exactly,
  whatever the router picks: upcycled logits == dense logits.
* ``granular`` — virtual-group upcycling (Megatron-LM's ``--moe-upcycling-granularity``, He et al.
  2024): F is cut into G shards of f = F/G neurons; expert ``e = r*G + g`` holds shard ``g`` and
  the G experts of virtual group ``r`` share one router row. Tied rows tie the scores, so a top-k
  of ``k_v * G`` takes the k_v best groups whole: one copy of every shard per group. The dense
  output is the sum of its shards' outputs; after renormalisation each shard of a picked group
  weighs ``w_r / G`` (sum_r w_r = 1), so scaling the down projection ``w2`` by G makes the layer
  compute the dense FFN exactly. NOTE: the whole factor G goes on ``w2``, the linear end of
  SwiGLU; spreading it as G^(1/3) over w1, v1 and w2 would be exact only for a homogeneous
  activation, and silu is not one. Guarantee: exact with ``renormalize=True``; needs
  ``E % G == 0``, ``top_k % G == 0``, ``F % G == 0``.
* ``drop`` — drop-upcycling (Nakamura et al. 2025, used by Marco-MoE): the ``granular`` experts
  (``copy`` when G = 1), then in every expert a random fraction r of its f neurons is
  re-initialised — their w1 and v1 rows and their w2 row — from a normal with the mean and std
  of that expert matrix. Breaks the symmetry of the copies at once; the function is no longer
  preserved.

Only the FFNs of the blocks that the new config makes MoE (``first_dense_layers``,
``layer_interval`` pass through ``moe_fields``) are converted; every other tensor is copied.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from moe_lit.config import ModelConfig, MoEConfig
from moe_lit.configbase import ConfigBase, ConfigError, require, require_choice, require_positive_int
from moe_lit.convert.common import rebuild
from moe_lit.errors import MoeLitError
from moe_lit.model import MoELayer, Transformer
from moe_lit.model.mlp import SwiGLU

RECIPES = ("copy", "granular", "drop")
Recipe = Literal["copy", "granular", "drop"]
SET_BY_UPCYCLING = ("expert_size", "shared_expert_size", "num_experts", "top_k")
"""MoEConfig fields that follow from an :class:`UpcyclingConfig` and the dense d_ff (never in its ``moe``)."""


@dataclass
class UpcyclingConfig(ConfigBase):
    """One dense -> MoE upcycling: the recipe and the MoE it builds (see the module docstring)."""

    recipe: Recipe = "copy"
    """How the dense FFN becomes experts: copy | granular | drop."""
    num_experts: int = 8
    """Experts E per MoE layer (a multiple of granularity)."""
    top_k: int = 2
    """Experts routed per token (a multiple of granularity)."""
    granularity: int = 1
    """Shards G of d_ff per expert group (granular and drop; copy keeps 1)."""
    drop_fraction: float = 0.5
    """Fraction of each expert's neurons re-initialised, in [0, 1] (drop)."""
    seed: int = 0
    """Seed of the new routers and of the dropped neurons."""
    moe: dict[str, Any] = field(default_factory=dict)
    """Further MoEConfig fields of the new layers (balancing, aux_loss_coef, first_dense_layers, ...);
    expert_size, shared_expert_size, num_experts and top_k follow from the fields above."""

    def __post_init__(self) -> None:
        require_choice(self.recipe, "recipe", RECIPES)
        granularity = self.granularity
        require_positive_int(granularity, "granularity")
        copy_whole = f"recipe 'copy' keeps whole FFNs (granularity 1), got {granularity}"
        require(self.recipe != "copy" or granularity == 1, "granularity", copy_whole)
        for name in ("num_experts", "top_k"):
            value = getattr(self, name)
            require_positive_int(value, name)
            require(value % granularity == 0, name, f"must be a multiple of granularity={granularity}, got {value}")
        in_range = self.recipe != "drop" or 0.0 <= self.drop_fraction <= 1.0
        require(in_range, "drop_fraction", f"must be in [0, 1], got {self.drop_fraction}")
        for name in SET_BY_UPCYCLING:
            require(
                name not in self.moe, f"moe.{name}", "set by dense_to_moe (from its arguments and d_ff), do not pass it"
            )


def dense_to_moe(
    model: Transformer,
    recipe: Recipe = "copy",
    num_experts: int = 8,
    top_k: int = 2,
    granularity: int = 1,
    drop_fraction: float = 0.5,
    seed: int = 0,
    **moe_fields: Any,
) -> Transformer:
    """The MoE upcycling of a dense ``model``: :func:`upcycle` of the :class:`UpcyclingConfig` of
    these arguments (``moe_fields``: its ``moe``)."""
    return upcycle(model, UpcyclingConfig(recipe, num_experts, top_k, granularity, drop_fraction, seed, moe_fields))


def upcycle(model: Transformer, config: UpcyclingConfig) -> Transformer:
    """The MoE upcycling of a dense ``model`` (see the module docstring for the recipes).

    ``model`` is not modified; the result is on its device, dtype and train/eval mode.
    """
    new = rebuild(model, upcycled_config(model.config, config))
    generator = torch.Generator().manual_seed(config.seed)
    for layer_id in new.config.moe_layer_ids:
        layer = new.moe_layer(layer_id)
        _upcycle_layer(model.dense_ffn(layer_id), layer, config.granularity, model.config.init_std, generator)
        if config.recipe == "drop":
            drop_neurons(layer, config.drop_fraction, generator)
    return new


def upcycled_config(cfg: ModelConfig, config: UpcyclingConfig) -> ModelConfig:
    """The model config :func:`upcycle` produces from a dense ``cfg`` (checks ``config`` against it)."""
    if cfg.moe is not None:
        raise MoeLitError("dense_to_moe: the model is already an MoE (model.moe is set); pass a dense model")
    if cfg.d_ff % config.granularity:
        raise ConfigError(f"model.d_ff: must be a multiple of granularity={config.granularity}, got {cfg.d_ff}")
    moe = MoEConfig(
        num_experts=config.num_experts,
        expert_size=cfg.d_ff // config.granularity,
        top_k=config.top_k,
        **config.moe,
    )
    return cfg.replace(moe=moe)


@torch.no_grad()
def _upcycle_layer(dense: SwiGLU, layer: MoELayer, granularity: int, init_std: float, generator) -> None:
    """Fill ``layer`` (E experts of f = F/G rows) from the dense FFN; router rows tied per group."""
    num_experts, d_model = layer.cfg.num_experts, dense.w1.weight.shape[1]
    shard_size = dense.w1.weight.shape[0] // granularity
    shard_of_expert = torch.arange(num_experts) % granularity
    neurons_S = (shard_of_expert[:, None] * shard_size + torch.arange(shard_size)).reshape(-1)
    copy_neurons(dense, layer, neurons_S, w2_scale=granularity)
    rows_RD = torch.randn(num_experts // granularity, d_model, generator=generator) * init_std
    set_router(layer, rows_RD.repeat_interleave(granularity, dim=0))


@torch.no_grad()
def copy_neurons(dense: SwiGLU, layer: MoELayer, neurons_S: torch.Tensor, w2_scale: float = 1.0) -> None:
    """Stacked expert row ``s`` of ``layer`` becomes dense neuron ``neurons_S[s]``: its w1 and v1
    rows and its w2 column (times ``w2_scale``); the expert output bias is zeroed."""
    mlp = layer.experts.mlp
    neurons_S = neurons_S.to(dense.w1.weight.device)
    mlp.w1.copy_(dense.w1.weight[neurons_S])
    mlp.v1.copy_(dense.v1.weight[neurons_S])
    mlp.w2.copy_(dense.w2.weight[:, neurons_S].t() * w2_scale)
    layer.experts.bias.zero_()


@torch.no_grad()
def set_router(layer: MoELayer, rows_ED: torch.Tensor) -> None:
    """Router rows of ``layer`` set to ``rows_ED``; a balancing bias starts at zero."""
    router = layer.router
    router.layer.weight.copy_(rows_ED)
    if router.expert_bias is not None:
        router.expert_bias.zero_()


@torch.no_grad()
def drop_neurons(layer: MoELayer, fraction: float, generator, experts: Sequence[int] | None = None) -> None:
    """Re-initialise ``round(fraction * f)`` random neurons of each expert (default: every expert)
    from that expert's own weight statistics (drop-upcycling)."""
    layout, mlp = layer.experts.layout, layer.experts.mlp
    for expert in range(layout.num_experts) if experts is None else experts:
        rows = layout.rows(expert)
        size = layout.sizes[expert]
        dropped = torch.randperm(size, generator=generator)[: round(fraction * size)] + rows.start
        for w_SD in (mlp.w1, mlp.v1, mlp.w2):
            w_fD = w_SD[rows]
            fresh = torch.randn(len(dropped), w_SD.shape[1], generator=generator)
            w_SD[dropped.to(w_SD.device)] = fresh.to(w_SD) * w_fD.std() + w_fD.mean()


__all__ = ["RECIPES", "UpcyclingConfig", "copy_neurons", "dense_to_moe", "set_router", "upcycle", "upcycled_config"]
