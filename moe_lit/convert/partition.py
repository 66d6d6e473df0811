"""Dense -> MoE by neuron partitioning: each dense SwiGLU FFN is cut into E experts of F/E neurons.

Shape legend: F dense d_ff (neurons), E experts, f = F/E neurons per expert, D d_model, T
calibration tokens, X feature width of a clustering, S = E*f stacked expert rows (see
``experts/layout.py``).

``partition_ffn(model, assignment, num_experts, top_k, routers)``: neuron ``i`` of block ``b`` goes
to expert ``assignment[b][i]`` (its w1 and v1 rows and its w2 column; within an expert the
neurons keep their dense order), and the router of block ``b`` gets the rows ``routers[b]``
(normal(0, init_std) when absent). Every expert must hold exactly F/E neurons.

Gating: the MoE is built with ``unit_weights: true`` (and ``renormalize: false``): every
selected expert weighs exactly 1 in the forward, the router learns through a straight-through
estimator. The FFN output is the sum of its neurons' outputs, so **guarantee**: with k = E the
MoE computes the dense model exactly (logits equal to 1e-5), whatever the router. With k < E the
output is the sum of the k selected experts' outputs *without any rescaling* (MoEfication's
choice): the neurons of the E - k other experts are simply left out for that token, as in
structured pruning, but per token.

Assignments (``assign_neurons``):

* ``random`` — a seeded random balanced split.
* ``kmeans`` — balanced spherical k-means on the L2-normalised gate rows ``w1_i`` (MoEfication /
  EMoE): neurons with similar keys share an expert.
* ``coactivation`` — balanced spherical k-means on each neuron's normalised activation magnitudes
  ``|H[:, i]|`` over calibration tokens: neurons that fire together share an expert.

Balance is exact: every assignment step is :func:`balanced_assignment`, a greedy that fills each
expert with the neurons that score it highest, up to f each.

Routers (``build_routers``): ``centroid`` — expert e's row is the mean key ``mean_{i in e} w1_i``,
so its logit is the mean gate pre-activation of its neurons (no new parameters); ``trained`` — the
centroid rows, then a few full-batch Adam steps on calibration tokens to predict each expert's
share of the activation mass ``sum_{i in e} |H_ti|`` (cross-entropy to that distribution);
``random`` — normal(0, init_std), for comparison.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from moe_lit.config import ConfigError, ModelConfig, MoEConfig
from moe_lit.convert.calibration import dense_ffn_ids, neuron_activations
from moe_lit.convert.common import rebuild
from moe_lit.convert.dense_to_moe import copy_neurons, set_router
from moe_lit.errors import MoeLitError
from moe_lit.model import Transformer

ASSIGNMENTS = ("random", "kmeans", "coactivation")
ROUTERS = ("centroid", "trained", "random")
NEEDS_CALIBRATION = {"assignment": ("coactivation",), "router": ("trained",)}
"""The assignment methods and routers that read calibration tokens."""


# ----------------------------------------------------------------------------- the transform
def partition_ffn(
    model: Transformer,
    assignment: Mapping[int, torch.Tensor],
    num_experts: int,
    top_k: int,
    routers: Mapping[int, torch.Tensor] | None = None,
    seed: int = 0,
    **moe_fields: Any,
) -> Transformer:
    """The MoE whose experts are the neuron groups of ``assignment`` (see the module docstring).

    ``assignment`` maps every converted block to an ``(F,)`` expert id per neuron; ``routers`` maps
    blocks to ``(E, D)`` router rows. ``moe_fields`` are further :class:`MoEConfig` fields
    (balancing, aux_loss_coef, first_dense_layers, ...). ``model`` is not modified.
    """
    new = rebuild(model, partitioned_config(model.config, num_experts, top_k, **moe_fields))
    generator = torch.Generator().manual_seed(seed)
    cfg = model.config
    for layer_id in new.config.moe_layer_ids:
        if layer_id not in assignment:
            raise MoeLitError(f"assignment: no neuron assignment for block {layer_id}")
        experts_F = _checked_assignment(assignment[layer_id], cfg.d_ff, num_experts, layer_id)
        layer = new.moe_layer(layer_id)
        copy_neurons(model.dense_ffn(layer_id), layer, torch.argsort(experts_F, stable=True))
        rows_ED = (routers or {}).get(layer_id)
        if rows_ED is None:
            rows_ED = torch.randn(num_experts, cfg.d_model, generator=generator) * cfg.init_std
        elif tuple(rows_ED.shape) != (num_experts, cfg.d_model):
            raise MoeLitError(
                f"routers: block {layer_id} needs ({num_experts}, {cfg.d_model}) rows, got {tuple(rows_ED.shape)}"
            )
        set_router(layer, rows_ED)
    return new


def partitioned_config(cfg: ModelConfig, num_experts: int, top_k: int, **moe_fields: Any) -> ModelConfig:
    """The config :func:`partition_ffn` produces from a dense ``cfg`` (validates every argument)."""
    if cfg.moe is not None:
        raise MoeLitError("partition: the model is already an MoE (model.moe is set); pass a dense model")
    if not (isinstance(num_experts, int) and num_experts >= 1 and cfg.d_ff % num_experts == 0):
        raise ConfigError(f"num_experts: must divide model.d_ff={cfg.d_ff}, got {num_experts!r}")
    for field in ("expert_size", "shared_expert_size", "num_experts", "top_k"):
        if field in moe_fields:
            raise ConfigError(f"moe.{field}: set by partition (from its arguments and d_ff), do not pass it")
    fields = {"renormalize": False, "unit_weights": True, **moe_fields}
    moe = MoEConfig(num_experts=num_experts, expert_size=cfg.d_ff // num_experts, top_k=top_k, **fields)
    return cfg.replace(moe=moe)


def _checked_assignment(experts_F: torch.Tensor, d_ff: int, num_experts: int, layer_id: int) -> torch.Tensor:
    experts_F = torch.as_tensor(experts_F).long().cpu()
    if experts_F.shape != (d_ff,):
        raise MoeLitError(
            f"assignment: block {layer_id} needs one expert id per neuron ({d_ff}), got {tuple(experts_F.shape)}"
        )
    in_range = bool(((experts_F >= 0) & (experts_F < num_experts)).all())
    counts_E = torch.bincount(experts_F, minlength=num_experts) if in_range else None
    if counts_E is None or (counts_E != d_ff // num_experts).any():
        got = counts_E.tolist() if counts_E is not None else "ids outside [0, num_experts)"
        raise MoeLitError(
            f"assignment: block {layer_id} must give every one of {num_experts} experts exactly "
            f"{d_ff // num_experts} neurons, got {got}"
        )
    return experts_F


# ----------------------------------------------------------------------------- balanced assignment
@torch.no_grad()
def balanced_assignment(score_FE: torch.Tensor) -> torch.Tensor:
    """``(F,)`` expert per neuron, exactly F/E per expert, greedily maximising ``score_FE``.

    Rounds: every unassigned neuron proposes its best expert that still has room; each expert
    keeps its highest-scoring proposals up to its remaining room. A round either places every
    proposer or fills an expert, so at most E rounds run.
    """
    num_neurons, num_experts = score_FE.shape
    if num_neurons % num_experts:
        raise MoeLitError(f"balanced assignment: {num_neurons} neurons do not split into {num_experts} equal experts")
    score_FE = score_FE.detach().float().cpu()
    room_E = torch.full((num_experts,), num_neurons // num_experts)
    experts_F = torch.full((num_neurons,), -1, dtype=torch.long)
    while (experts_F < 0).any():
        open_score_FE = score_FE.masked_fill(room_E[None, :] == 0, float("-inf"))
        pending_F = experts_F < 0
        best_F = open_score_FE.argmax(dim=-1)
        best_score_F = open_score_FE.gather(1, best_F[:, None]).squeeze(1)
        for expert in best_F[pending_F].unique().tolist():
            proposers = torch.nonzero(pending_F & (best_F == expert)).squeeze(1)
            order = torch.argsort(best_score_F[proposers], descending=True, stable=True)
            taken = proposers[order[: int(room_E[expert])]]
            experts_F[taken] = expert
            room_E[expert] -= len(taken)
    return experts_F


def random_assignment(num_neurons: int, num_experts: int, generator: torch.Generator) -> torch.Tensor:
    """A seeded random split of ``num_neurons`` into ``num_experts`` equal groups."""
    experts_F = torch.empty(num_neurons, dtype=torch.long)
    experts_F[torch.randperm(num_neurons, generator=generator)] = torch.arange(num_neurons) % num_experts
    return experts_F


@torch.no_grad()
def balanced_kmeans(
    features_FX: torch.Tensor, num_experts: int, generator: torch.Generator, iterations: int = 20
) -> torch.Tensor:
    """Balanced spherical k-means: cosine similarity to the centroids, :func:`balanced_assignment`."""
    points_FX = F.normalize(features_FX.float().cpu(), dim=-1)
    centroids_EX = points_FX[torch.randperm(points_FX.shape[0], generator=generator)[:num_experts]]
    experts_F = balanced_assignment(points_FX @ centroids_EX.t())
    for _ in range(iterations):
        centroids_EX = F.normalize(_group_means(points_FX, experts_F, num_experts), dim=-1)
        updated_F = balanced_assignment(points_FX @ centroids_EX.t())
        if torch.equal(updated_F, experts_F):
            break
        experts_F = updated_F
    return experts_F


def _group_means(values_FX: torch.Tensor, experts_F: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``(E, X)`` mean of the rows of each group."""
    one_hot_FE = F.one_hot(experts_F, num_experts).to(values_FX.dtype)
    return one_hot_FE.t() @ values_FX / one_hot_FE.sum(0).clamp_min(1)[:, None]


def assign_neurons(
    model: Transformer,
    method: str,
    num_experts: int,
    calibration: Mapping[int, torch.Tensor] | None = None,
    seed: int = 0,
    layer_ids: tuple[int, ...] | None = None,
) -> dict[int, torch.Tensor]:
    """``{block: (F,) expert ids}`` for every dense FFN (or ``layer_ids``) by ``method``.

    ``calibration`` holds the ``(T, D)`` FFN inputs of :func:`~moe_lit.convert.calibration.ffn_inputs`
    (needed by ``coactivation``).
    """
    _require_method(method, ASSIGNMENTS, "method")
    _require_calibration(calibration, method, "assignment")
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for layer_id in layer_ids if layer_ids is not None else dense_ffn_ids(model):
        ffn = model.dense_ffn(layer_id)
        if method == "random":
            out[layer_id] = random_assignment(ffn.w1.weight.shape[0], num_experts, generator)
        elif method == "kmeans":
            out[layer_id] = balanced_kmeans(ffn.w1.weight, num_experts, generator)
        else:
            assert calibration is not None  # _require_calibration refused None for this method
            magnitudes_TF = neuron_activations(ffn, calibration[layer_id]).abs()
            out[layer_id] = balanced_kmeans(magnitudes_TF.t(), num_experts, generator)
    return out


# ----------------------------------------------------------------------------- routers
def build_routers(
    model: Transformer,
    assignment: Mapping[int, torch.Tensor],
    kind: str,
    num_experts: int,
    calibration: Mapping[int, torch.Tensor] | None = None,
    seed: int = 0,
    steps: int = 100,
    lr: float = 1e-2,
) -> dict[int, torch.Tensor]:
    """``{block: (E, D) router rows}`` of kind ``centroid``, ``trained`` or ``random``."""
    _require_method(kind, ROUTERS, "router")
    _require_calibration(calibration, kind, "router")
    generator = torch.Generator().manual_seed(seed)
    rows = {}
    for layer_id, experts_F in assignment.items():
        ffn = model.dense_ffn(layer_id)
        w1_FD = ffn.w1.weight.detach().float().cpu()
        if kind == "random":
            rows[layer_id] = torch.randn(num_experts, w1_FD.shape[1], generator=generator) * model.config.init_std
            continue
        rows[layer_id] = _group_means(w1_FD, experts_F.long().cpu(), num_experts)
        if kind == "trained":
            assert calibration is not None  # _require_calibration refused None for this kind
            rows[layer_id] = _train_router(ffn, rows[layer_id], experts_F, calibration[layer_id], steps, lr)
    return rows


def expert_mass(ffn, experts_F: torch.Tensor, x_TD: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``(T, E)`` share of each expert in a token's activation mass ``sum_i |H_ti|``."""
    mass_TE = neuron_activations(ffn, x_TD).abs() @ F.one_hot(experts_F.long().cpu(), num_experts).float()
    return mass_TE / mass_TE.sum(-1, keepdim=True).clamp_min(1e-20)


def _train_router(ffn, rows_ED: torch.Tensor, experts_F, x_TD: torch.Tensor, steps: int, lr: float) -> torch.Tensor:
    target_TE = expert_mass(ffn, experts_F, x_TD, rows_ED.shape[0])
    weight_ED = rows_ED.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([weight_ED], lr=lr)
    with torch.enable_grad():
        for _ in range(steps):
            loss = -(target_TE * (x_TD @ weight_ED.t()).log_softmax(-1)).sum(-1).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return weight_ED.detach()


def _require_method(value: str, allowed: tuple[str, ...], name: str) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}: got {value!r}, allowed values: {', '.join(allowed)}")


def _require_calibration(calibration, method: str, what: str) -> None:
    if calibration is None and method in NEEDS_CALIBRATION[what]:
        raise MoeLitError(f"calibration: {what} {method!r} needs calibration tokens (the FFN inputs of ffn_inputs)")


__all__ = [
    "ASSIGNMENTS",
    "NEEDS_CALIBRATION",
    "ROUTERS",
    "assign_neurons",
    "balanced_assignment",
    "balanced_kmeans",
    "build_routers",
    "expert_mass",
    "partition_ffn",
    "partitioned_config",
    "random_assignment",
]
