"""DOT-MoE: a dense model becomes an MoE by a learned, exactly balanced neuron-to-expert assignment.

Shape legend: T tokens, D d_model, F dense d_ff (neurons), E experts, f = F/E neurons per expert.

Every dense SwiGLU FFN of the student is a :class:`DotMoELayer`:

* a learnable affinity ``A_FE``; the entropic transport plan ``P = sinkhorn(A / tau)`` (log domain,
  rows sum to 1: each neuron is one unit of mass; columns sum to f: every expert gets F/E) with the
  temperature tau annealed from ``temperature_start`` to ``temperature_end`` (geometrically) over
  the first ``anneal_fraction`` of the training steps (:class:`SinkhornAnnealing`);
* ``M_FE`` the greedy rounding of P to an exactly balanced 0/1 assignment
  (:func:`~moe_lit.convert.partition.balanced_assignment`), used through the straight-through
  estimator ``M_ste = M + P - sg(P)``;
* the router (our :class:`~moe_lit.model.router.Router`: softmax scores s, top-k), used as
  ``R_ste = topk_mask(s) + s - sg(s)``;
* ``Y = (H * (R_ste M_ste^T)) W_down`` with ``H = silu(x w1^T) * (x v1^T)`` the dense hidden
  activations.

The forward values are the hard ones (M and the top-k mask are exactly 0/1), so the training
forward *is* the converted MoE's forward: a token gets the neurons of its k experts with weight 1
(the ``unit_weights`` gating of :mod:`moe_lit.convert.partition`), and with k = E the student is
the dense model. The backward reaches A through P and the router through all E scores.

Training (:func:`~moe_lit.lit.distill.fit_dot_moe`, in the Lightning layer) is
:class:`~moe_lit.lit.distill.DistillModule` with the dense model as frozen teacher:
``kl_weight * KL + ce_weight * LM loss + aux_weight * (load balancing + z-loss)``,
whose coefficients are ``moe.aux_loss_coef`` / ``moe.z_loss_coef`` of the target config.
``DotMoEConfig.train_dense`` says what learns: false (default) — only the affinities and the
routers; every dense weight (FFNs, attention, embeddings) stays the teacher's, so the export is a
pure re-arrangement of the pretrained neurons; true — every student weight trains as well.

``export_dot_moe(student)`` slices the FFN weights by M into the ordinary experts of
:func:`~moe_lit.convert.partition.partition_ffn` and copies the routers. **Guarantee** (tested):
the exported MoE's logits equal the student's (1e-5).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from typing_extensions import override

from moe_lit.config import ConfigError, MoEConfig
from moe_lit.convert.common import rebuild
from moe_lit.convert.partition import (
    assign_neurons,
    balanced_assignment,
    build_routers,
    partition_ffn,
    partitioned_config,
)
from moe_lit.errors import MoeLitError
from moe_lit.model import MoELayer, Transformer
from moe_lit.model.mlp import SwiGLU
from moe_lit.model.router import Router, routed_counts, straight_through

AffinityInit = Literal["kmeans", "random"]
AFFINITY_INITS = ("kmeans", "random")


@dataclass
class DotMoEConfig:
    """The DOT-MoE assignment: Sinkhorn transport, its temperature schedule, what trains."""

    sinkhorn_iterations: int = 20
    """Sinkhorn-Knopp iterations (column then row normalisation) per forward."""
    temperature_start: float = 1.0
    """Temperature tau of the transport plan softmax(A / tau) at the first step."""
    temperature_end: float = 0.1
    """Temperature after the annealing (kept until the end)."""
    anneal_fraction: float = 0.2
    """Fraction of the training steps over which tau goes from start to end (geometrically)."""
    affinity_init: AffinityInit = "kmeans"
    """Initial affinity: kmeans (one-hot of the balanced k-means assignment of the gate rows, times
    affinity_scale; the routers start at its centroids) | random (normal(0, affinity_scale),
    centroid routers of a random split)."""
    affinity_scale: float = 2.0
    """Scale of the initial affinities."""
    train_dense: bool = False
    """false: only the affinities and the routers learn (the dense weights stay the teacher's);
    true: every student weight trains too."""

    def __post_init__(self) -> None:
        if not (isinstance(self.sinkhorn_iterations, int) and self.sinkhorn_iterations >= 1):
            raise ConfigError(f"dot_moe.sinkhorn_iterations: must be an integer >= 1, got {self.sinkhorn_iterations!r}")
        for name in ("temperature_start", "temperature_end", "affinity_scale"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"dot_moe.{name}: must be > 0, got {getattr(self, name)}")
        if not 0 <= self.anneal_fraction <= 1:
            raise ConfigError(f"dot_moe.anneal_fraction: must be in [0, 1], got {self.anneal_fraction}")
        if self.affinity_init not in AFFINITY_INITS:
            raise ConfigError(
                f"dot_moe.affinity_init: got {self.affinity_init!r}, allowed values: {', '.join(AFFINITY_INITS)}"
            )

    def temperature(self, step: int, total_steps: int) -> float:
        """tau before optimizer step ``step`` of ``total_steps``."""
        anneal_steps = self.anneal_fraction * total_steps
        progress = 1.0 if anneal_steps <= 0 else min(1.0, step / anneal_steps)
        return self.temperature_start * (self.temperature_end / self.temperature_start) ** progress


# ----------------------------------------------------------------------------- transport and rounding
def sinkhorn(logits_FE: torch.Tensor, iterations: int) -> torch.Tensor:
    """Log-domain Sinkhorn-Knopp: the plan ``(F, E)`` with rows summing to 1, columns to F/E.

    Each iteration normalises the columns, then the rows, so the rows are exact and the columns
    converge.
    """
    num_neurons, num_experts = logits_FE.shape
    log_column_mass = math.log(num_neurons / num_experts)
    log_p_FE = logits_FE.float()
    for _ in range(iterations):
        log_p_FE = log_p_FE - torch.logsumexp(log_p_FE, dim=0, keepdim=True) + log_column_mass
        log_p_FE = log_p_FE - torch.logsumexp(log_p_FE, dim=1, keepdim=True)
    return log_p_FE.exp()


def hard_assignment(plan_FE: torch.Tensor) -> torch.Tensor:
    """The 0/1 ``(F, E)`` rounding of a plan: exactly F/E neurons per expert, one expert per neuron."""
    experts_F = balanced_assignment(plan_FE)
    return F.one_hot(experts_F, plan_FE.shape[1]).to(device=plan_FE.device, dtype=plan_FE.dtype)


# ----------------------------------------------------------------------------- the layer
class DotMoELayer(MoELayer):
    """A dense SwiGLU FFN under a learned balanced expert mask and a top-k router (module docstring).

    Returns ``(y_BLD, losses)`` like :class:`MoELayer`, whose auxiliary losses it computes.
    """

    temperature: torch.Tensor
    """The Sinkhorn temperature (a buffer set by :class:`SinkhornAnnealing`)."""

    def __init__(
        self,
        dense: SwiGLU,
        cfg: MoEConfig,
        num_moe_layers: int,
        affinity_FE: torch.Tensor,
        router_ED: torch.Tensor,
        sinkhorn_iterations: int,
        temperature: float,
    ) -> None:
        # NOTE: an MoE layer to the Transformer (auxiliary losses, router, moe_layers()) whose
        # experts are the dense FFN under a mask: MoELayer's expert tensors are never built.
        nn.Module.__init__(self)
        self.cfg = cfg
        self.num_moe_layers = num_moe_layers
        self.sinkhorn_iterations = sinkhorn_iterations
        self.dense = copy.deepcopy(dense)
        self.router = Router(dense.w1.weight.shape[1], cfg).to(dense.w1.weight)
        with torch.no_grad():
            self.router.layer.weight.copy_(router_ED)
        self.affinity = nn.Parameter(affinity_FE.to(dense.w1.weight).clone())
        self.register_buffer("temperature", torch.tensor(float(temperature)))
        self.shared_expert = None

    def plan(self) -> torch.Tensor:
        """The soft assignment P ``(F, E)`` at the current temperature."""
        return sinkhorn(self.affinity / self.temperature, self.sinkhorn_iterations)

    def assignment(self) -> torch.Tensor:
        """``(F,)`` expert of every neuron: the rounding of the current plan."""
        return balanced_assignment(self.plan())

    def forward(self, x_BLD: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        x_TD = x_BLD.reshape(-1, x_BLD.shape[-1])
        routing = self.router(x_TD)
        plan_FE = self.plan()
        mask_FE = straight_through(hard_assignment(plan_FE.detach()), plan_FE)
        top_k_TE = torch.zeros_like(routing.scores_TE).scatter(1, routing.indices_TK, 1.0)
        gate_TE = straight_through(top_k_TE, routing.scores_TE)
        gate_TF = (gate_TE @ mask_FE.t()).to(x_TD.dtype)
        dense = self.dense
        h_TF = F.silu(dense.w1(x_TD)) * dense.v1(x_TD)
        y_TD = dense.w2(h_TF * gate_TF)
        counts_E = routed_counts(routing.indices_TK, self.cfg.num_experts)
        if self.training:
            self.router.record(counts_E, torch.zeros((), device=x_TD.device))
        return y_TD.view_as(x_BLD), self._losses(routing, counts_E)


def dot_layers(model: Transformer) -> list[DotMoELayer]:
    return [layer for layer in model.moe_layers() if isinstance(layer, DotMoELayer)]


# ----------------------------------------------------------------------------- student and export
def dot_moe_student(
    dense: Transformer,
    num_experts: int,
    top_k: int,
    cfg: DotMoEConfig = DotMoEConfig(),  # noqa: B008 - never mutated
    seed: int = 0,
    **moe_fields: Any,
) -> Transformer:
    """The trainable DOT-MoE student of a dense model (``dense`` is not modified).

    Its config is the target MoE's (:func:`~moe_lit.convert.partition.partitioned_config`); its
    FFN blocks are :class:`DotMoELayer`. With ``train_dense: false`` only the affinities and the
    router rows require gradients.
    """
    moe_cfg = partitioned_config(dense.config, num_experts, top_k, **moe_fields)
    student = rebuild(dense, moe_cfg)
    layer_ids = moe_cfg.moe_layer_ids
    generator = torch.Generator().manual_seed(seed)
    init = assign_neurons(
        dense, "kmeans" if cfg.affinity_init == "kmeans" else "random", num_experts, seed=seed, layer_ids=layer_ids
    )
    routers = build_routers(dense, init, "centroid", num_experts)
    for layer_id in layer_ids:
        if cfg.affinity_init == "kmeans":
            affinity_FE = F.one_hot(init[layer_id], num_experts).float() * cfg.affinity_scale
        else:
            affinity_FE = torch.randn(dense.config.d_ff, num_experts, generator=generator) * cfg.affinity_scale
        student.blocks[layer_id].ffn = DotMoELayer(
            dense.dense_ffn(layer_id),
            moe_cfg.moe_section(),
            len(layer_ids),
            affinity_FE,
            routers[layer_id],
            cfg.sinkhorn_iterations,
            cfg.temperature_start,
        )
    student.requires_grad_(cfg.train_dense)
    for layer in dot_layers(student):
        layer.affinity.requires_grad_(True)
        layer.router.layer.weight.requires_grad_(True)
    return student.train(dense.training)


@torch.no_grad()
def export_dot_moe(student: Transformer) -> Transformer:
    """The ordinary MoE of a DOT-MoE student: experts sliced by its current assignments M."""
    layers = {i: block.ffn for i, block in enumerate(student.blocks) if isinstance(block.ffn, DotMoELayer)}
    if not layers:
        raise MoeLitError("export_dot_moe: the model has no DOT-MoE layers (build it with dot_moe_student)")
    moe = student.config.moe_section()
    dense = rebuild(student, student.config.replace(moe=None))
    for layer_id, layer in layers.items():
        dense.dense_ffn(layer_id).load_state_dict(layer.dense.state_dict())
    fields = {
        k: v
        for k, v in dataclasses.asdict(moe).items()
        if k not in ("num_experts", "expert_size", "top_k", "shared_expert_size")
    }
    assignment = {i: layer.assignment() for i, layer in layers.items()}
    moe_model = partition_ffn(dense, assignment, moe.num_experts, moe.top_k, **fields)
    for layer_id, layer in layers.items():
        moe_model.moe_layer(layer_id).router.load_state_dict(layer.router.state_dict())
    return moe_model.train(student.training)


# ----------------------------------------------------------------------------- training
class SinkhornAnnealing(Callback):
    """Sets the temperature of every DOT-MoE layer before each optimizer step (``DotMoEConfig``).

    Stateless: tau is a function of the global step and the run's steps, so a resumed run
    continues the schedule where it stopped.
    """

    def __init__(self, cfg: DotMoEConfig) -> None:
        self.cfg = cfg

    @override
    def on_fit_start(self, trainer, pl_module) -> None:
        if not dot_layers(pl_module.model):
            raise MoeLitError("SinkhornAnnealing: the trained model has no DOT-MoE layers")
        if not math.isfinite(trainer.estimated_stepping_batches):
            raise ConfigError("trainer.max_steps: the Sinkhorn temperature schedule needs a known number of steps")

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        tau = self.cfg.temperature(trainer.global_step, int(trainer.estimated_stepping_batches))
        for layer in dot_layers(pl_module.model):
            layer.temperature.fill_(tau)
        pl_module.log("dot_moe/temperature", tau, batch_size=batch.shape[0])


__all__ = [
    "AFFINITY_INITS",
    "DotMoEConfig",
    "DotMoELayer",
    "SinkhornAnnealing",
    "dot_layers",
    "dot_moe_student",
    "export_dot_moe",
    "hard_assignment",
    "sinkhorn",
]
