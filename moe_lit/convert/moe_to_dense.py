"""MoE -> dense: score, select, group, scale and concatenate experts into one dense SwiGLU FFN.

Shape legend: M traced MoE layers, N traced tokens, P tokens kept for output features, K top-k
of the trace, E experts of a layer, D d_model, F one expert's hidden size, W dense width
(sum of the groups' sizes + the shared expert's), C kept experts (``keep``), G groups.

``moe_to_dense(model, trace, cfg)`` turns every MoE block of ``model`` into a dense SwiGLU FFN,
a pure function (``model`` untouched), all statistics read from one :class:`RoutingTrace` of
calibration text (record it with ``record_inputs=True``; see ``importance.calibration_trace``):

1. **Score** every expert of the layer (``cfg.score``, larger = keep):
   ``frequency`` (share of routed assignments), ``router_prob`` (mean pre-selection router score
   over all tokens), ``gate_weight`` (mean combine weight when selected), ``activation``
   (REAP: gate x ||expert output||), ``taylor`` (first-order Taylor estimate of the LM loss change
   when the expert is removed: ``|sum_theta theta * dL/dtheta|`` over its w1/v1/w2 on the traced
   sequences), ``do_acp`` (diversity-aware: greedy D-optimal selection maximising
   ``log det(diag(a) U U^T diag(a) + eps I)`` over the selected experts, ``U`` the unit-normalised
   output vectors on P calibration tokens, ``a`` the activation score; an expert's score is its
   gain ``det(S + e) / det(S)`` when greedily added, non-increasing along the greedy order, so
   the top C scores are the greedy selection of C), ``random`` (seeded uniform).
2. **Select** the ``keep`` best experts (ties to the lower id).
3. **Group** them into ``groups`` groups: ``single`` (keep = groups, one expert each), ``weight`` /
   ``output`` (the ``groups`` best-scored experts are centres; every other kept expert joins the
   centre of highest cosine similarity of its flattened w1/v1/w2, or of its outputs on the P
   tokens), ``kmeans`` / ``kmeans_output`` (k-means on the unit-normalised weight or output
   features, seeded with the best-scored centres). A group of several experts becomes their
   score-weighted average (``w = sum_e s_e w_e / sum_e s_e``, uniform when the scores sum to 0).
4. **Scale** each group's down projection by ``gate_mean`` (mean gate mass the group gets on the
   tokens that select any of its experts: ``E[sum_{e in G} g_e 1{e sel}] / P(some e in G sel)``),
   ``gate_mass`` (its marginal gate mass ``E[sum_{e in G} g_e 1{e sel}]``) or ``uniform`` (1/groups).
5. **Concatenate** the groups' w1/v1 rows and w2 columns (group order: best centre first) and the
   shared expert's, unscaled, into one dense FFN of width W; ``d_ff`` becomes W.

Guarantee (tested to 1e-5): an MoE whose routing gives every expert the constant weight 1/E
(E = top_k, renormalised softmax, zero router) and zero expert output bias converts with
``keep = groups = E``, ``single`` and any scaling to a dense model with the same logits: the dense
FFN is ``sum_e (1/E) f_e(x)`` (+ the shared expert), the MoE's combine. What is not carried: the
routed experts' output bias (a dense SwiGLU has none; its norm is reported as ``dropped_bias_norm``).
``screen(model, trace, configs, batches)`` is the grid's cheap pre-distillation screen: each
config's dense model and its next-token loss, best first.

Refused: a gated shared expert (the dense FFN has no gate), dense blocks whose ``d_ff`` differs from
W (one ``d_ff`` per model), averaging experts of different sizes, ``keep`` > E or < ``groups``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from moe_lit.accounting import count_model_params
from moe_lit.config import ConfigError
from moe_lit.convert.common import next_token_loss, rebuild
from moe_lit.convert.importance import expert_output, random_scores, reap_scores, selection_frequency
from moe_lit.errors import MoeLitError
from moe_lit.evaluation.routing_trace import RoutingTrace
from moe_lit.model import MoELayer, Transformer

SCORES = ("frequency", "router_prob", "gate_weight", "activation", "taylor", "do_acp", "random")
GROUPINGS = ("single", "weight", "output", "kmeans", "kmeans_output")
SCALINGS = ("gate_mean", "gate_mass", "uniform")


@dataclass
class MoeToDenseConfig:
    """One MoE -> dense conversion: a score, a selection size, a grouping and a scaling."""

    score: str = "do_acp"
    """Expert score: frequency | router_prob | gate_weight | activation | taylor | do_acp | random."""
    keep: int = 2
    """Experts C kept per MoE layer (groups <= keep <= the layer's experts)."""
    groups: int = 2
    """Groups G per layer; the dense width is the sum of the groups' expert sizes."""
    grouping: str = "single"
    """How kept experts form groups: single (keep = groups) | weight | output | kmeans | kmeans_output."""
    scaling: str = "gate_mass"
    """Down-projection scale of a group: gate_mean | gate_mass | uniform (1/groups)."""
    seed: int = 0
    """Seed of the random score."""
    max_tokens: int = 1024
    """Calibration tokens P of the output features (do_acp, output groupings)."""
    ridge: float = 1e-6
    """do_acp: eps of the log-det, relative to the largest squared activation score."""
    kmeans_iterations: int = 50
    """Lloyd iterations of the k-means groupings."""

    def __post_init__(self) -> None:
        for name, allowed in (("score", SCORES), ("grouping", GROUPINGS), ("scaling", SCALINGS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name}: got {getattr(self, name)!r}, allowed values: {', '.join(allowed)}")
        for name in ("keep", "groups", "max_tokens", "kmeans_iterations"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
                raise ConfigError(f"{name}: must be a positive integer, got {value!r}")
        if self.keep < self.groups:
            raise ConfigError(f"keep: must be >= groups={self.groups} (each group needs an expert), got {self.keep}")
        if self.grouping == "single" and self.keep != self.groups:
            raise ConfigError(
                f"grouping: single puts one expert in each group and needs keep = groups, got keep={self.keep}, "
                f"groups={self.groups}; pick weight | output | kmeans | kmeans_output to merge experts"
            )
        if not self.ridge > 0:
            raise ConfigError(f"ridge: must be > 0, got {self.ridge!r}")

    @property
    def name(self) -> str:
        """A stable label of the combination, e.g. ``do_acp-single-gate_mass-C2-G2``."""
        return f"{self.score}-{self.grouping}-{self.scaling}-C{self.keep}-G{self.groups}"


def grid(keep: int, groups: int, seed: int = 0) -> list[MoeToDenseConfig]:
    """Every valid score x grouping x scaling combination at one ``keep`` / ``groups``."""
    groupings = ("single",) if keep == groups else tuple(g for g in GROUPINGS if g != "single")
    return [
        MoeToDenseConfig(score=s, keep=keep, groups=groups, grouping=g, scaling=c, seed=seed)
        for s, g, c in itertools.product(SCORES, groupings, SCALINGS)
    ]


# ----------------------------------------------------------------------------- scores
def router_probability(model: Transformer, trace: RoutingTrace) -> torch.Tensor:
    """``(M, E)`` mean pre-selection router score (recorded, else recomputed from the layer inputs)."""
    if trace.probs_MNE is not None:
        return trace.probs_MNE.double().mean(1)
    inputs_MND = _inputs(trace, "router_prob")
    rows = []
    with torch.no_grad():
        for m, block in enumerate(trace.layer_ids):
            router = model.moe_layer(block).router
            scores_NE = router(inputs_MND[m].to(router.layer.weight)).scores_TE
            rows.append(F.pad(scores_NE.double().cpu().mean(0), (0, trace.num_experts - scores_NE.shape[-1])))
    return torch.stack(rows)


def conditional_gate_weight(trace: RoutingTrace) -> torch.Tensor:
    """``(M, E)`` mean combine weight of expert e over the assignments that select it (0 if never)."""
    mass_ME = torch.zeros(trace.num_layers, trace.num_experts, dtype=torch.float64)
    for m in range(trace.num_layers):
        mass_ME[m].index_add_(0, trace.indices_MNK[m].reshape(-1), trace.weights_MNK[m].reshape(-1).double())
    return mass_ME / trace.counts_ME().double().clamp_min(1)


def traced_sequences(trace: RoutingTrace, max_tokens: int) -> list[torch.Tensor]:
    """The traced token sequences (``(L,)`` each, in order), up to ``max_tokens`` tokens in all."""
    sequences, total = [], 0
    for seq in trace.seq_N.unique().tolist():
        mask_N = trace.seq_N == seq
        tokens_L = trace.tokens_N[mask_N][trace.pos_N[mask_N].argsort()]
        if tokens_L.numel() < 2 or total >= max_tokens:
            continue
        sequences.append(tokens_L)
        total += tokens_L.numel()
    return sequences


def taylor_scores(model: Transformer, trace: RoutingTrace, max_tokens: int = 4096) -> torch.Tensor:
    """``(M, E)`` ``|sum_theta theta * dL/dtheta|`` over each expert's rows, L the traced sequences' LM loss."""
    sequences = traced_sequences(trace, max_tokens)
    if not sequences:
        raise MoeLitError("taylor: the routing trace holds no sequence of two or more tokens")
    names = [f"blocks.{b}.ffn.experts.mlp.{w}" for b in trace.layer_ids for w in ("w1", "v1", "w2")]
    params = dict(model.named_parameters())
    # NOTE: gradients w.r.t. detached copies of the expert matrices (torch.func.functional_call):
    # the source model's .grad fields and requires_grad flags stay untouched (a pure function).
    leaves = {name: params[name].detach().requires_grad_(True) for name in names}
    grads = {name: torch.zeros_like(leaf) for name, leaf in leaves.items()}
    device, was_training = params[names[0]].device, model.training
    model.eval()
    try:
        with torch.enable_grad():
            for tokens_L in sequences:
                tokens_1L = tokens_L[None].to(device)
                out = torch.func.functional_call(model, leaves, (tokens_1L[:, :-1], tokens_1L[:, 1:]))
                weight = (tokens_L.numel() - 1) / sum(s.numel() - 1 for s in sequences)
                for name, grad in zip(
                    leaves, torch.autograd.grad(out.ce * weight, list(leaves.values())), strict=False
                ):
                    grads[name] += grad
    finally:
        model.train(was_training)
    scores_ME = torch.zeros(trace.num_layers, trace.num_experts, dtype=torch.float64)
    for m, block in enumerate(trace.layer_ids):
        layout = model.moe_layer(block).experts.layout
        prefix = f"blocks.{block}.ffn.experts.mlp."
        taylor_S = torch.stack(
            [(leaves[prefix + w].detach() * grads[prefix + w]).double().sum(-1) for w in ("w1", "v1", "w2")]
        ).sum(0)
        for e in range(layout.num_experts):
            scores_ME[m, e] = taylor_S[layout.rows(e)].sum().abs().cpu()
    return scores_ME


def output_features(layer: MoELayer, x_PD: torch.Tensor) -> torch.Tensor:
    """``(E, P*D)`` every expert's output on the P calibration tokens, flattened (fp64)."""
    with torch.no_grad():
        x_PD = x_PD.to(layer.experts.mlp.w1)
        outputs = [expert_output(layer, e, x_PD).double().flatten().cpu() for e in range(layer.cfg.num_experts)]
    return torch.stack(outputs)


def d_optimal_gains(features_EX: torch.Tensor, activation_E: torch.Tensor, ridge: float) -> torch.Tensor:
    """``(E,)`` greedy D-optimal gains ``det(S + e) / det(S)`` of ``diag(a) U U^T diag(a) + eps I``."""
    unit_EX = features_EX / features_EX.norm(dim=-1, keepdim=True).clamp_min(1e-300)
    a_E = activation_E.double()
    eps = ridge * max(float(a_E.square().max()), 1e-300)
    gram_EE = a_E[:, None] * (unit_EX @ unit_EX.T) * a_E[None, :] + eps * torch.eye(len(a_E), dtype=torch.float64)
    chosen: list[int] = []
    gains_E = torch.zeros(len(a_E), dtype=torch.float64)
    logdet = 0.0
    while len(chosen) < len(a_E):
        remaining = [e for e in range(len(a_E)) if e not in chosen]
        best, best_logdet = remaining[0], -float("inf")
        for e in remaining:
            subset = chosen + [e]
            value = float(torch.linalg.slogdet(gram_EE[subset][:, subset]).logabsdet)
            if value > best_logdet:
                best, best_logdet = e, value
        gains_E[best] = math.exp(best_logdet - logdet)
        chosen.append(best)
        logdet = best_logdet
    return gains_E


def do_acp_scores(model: Transformer, trace: RoutingTrace, max_tokens: int, ridge: float) -> torch.Tensor:
    """``(M, E)`` diversity-aware scores (module docstring, step 1)."""
    activation_ME = reap_scores(model, trace)
    tokens_P = _feature_tokens(trace, max_tokens)
    inputs_MND = _inputs(trace, "do_acp")
    scores_ME = torch.zeros_like(activation_ME)
    for m, block in enumerate(trace.layer_ids):
        layer = model.moe_layer(block)
        features_EX = output_features(layer, inputs_MND[m][tokens_P])
        experts = layer.cfg.num_experts
        scores_ME[m, :experts] = d_optimal_gains(features_EX, activation_ME[m, :experts], ridge)
    return scores_ME


def moe_expert_scores(model: Transformer, trace: RoutingTrace, cfg: MoeToDenseConfig) -> torch.Tensor:
    """``(M, E)`` the score ``cfg.score`` of every expert of every traced MoE layer."""
    if cfg.score == "frequency":
        return selection_frequency(trace)
    if cfg.score == "router_prob":
        return router_probability(model, trace)
    if cfg.score == "gate_weight":
        return conditional_gate_weight(trace)
    if cfg.score == "activation":
        return reap_scores(model, trace)
    if cfg.score == "taylor":
        return taylor_scores(model, trace)
    if cfg.score == "do_acp":
        return do_acp_scores(model, trace, cfg.max_tokens, cfg.ridge)
    return random_scores(trace, cfg.seed)


# ----------------------------------------------------------------------------- groups
def select_experts(scores_E: torch.Tensor, keep: int) -> list[int]:
    """The ``keep`` best experts, best first (ties to the lower id)."""
    return sorted(range(scores_E.numel()), key=lambda e: (-float(scores_E[e]), e))[:keep]


def weight_features(layer: MoELayer, experts: list[int]) -> torch.Tensor:
    """``(C, 3*F*D)`` the flattened w1/v1/w2 rows of each expert (fp64)."""
    mlp, layout = layer.experts.mlp, layer.experts.layout
    return torch.stack(
        [
            torch.cat([getattr(mlp, w)[layout.rows(e)].detach().double().flatten().cpu() for w in ("w1", "v1", "w2")])
            for e in experts
        ]
    )


def nearest_centre_groups(features_CX: torch.Tensor, groups: int) -> list[list[int]]:
    """Positions ``0..groups-1`` are centres; every other position joins its most cosine-similar centre."""
    unit_CX = F.normalize(features_CX, dim=-1)
    members = [[g] for g in range(groups)]
    for c in range(groups, len(unit_CX)):
        members[int((unit_CX[:groups] @ unit_CX[c]).argmax())].append(c)
    return members


def kmeans_groups(features_CX: torch.Tensor, groups: int, iterations: int) -> list[list[int]]:
    """k-means (cosine: unit features) seeded at positions ``0..groups-1``; no group is ever empty."""
    unit_CX = F.normalize(features_CX, dim=-1)
    centres_GX = unit_CX[:groups].clone()
    assign_C = torch.arange(len(unit_CX))
    for _ in range(iterations):
        new_C = (unit_CX @ centres_GX.T).argmax(-1)
        for g in range(groups):
            if not (new_C == g).any():
                # NOTE: an emptied cluster takes the point farthest from its centre among clusters of
                # two or more (one exists: C >= G), so no other cluster empties and every group keeps one.
                movable_C = torch.bincount(new_C, minlength=groups)[new_C] > 1
                similarity_C = (unit_CX * centres_GX[new_C]).sum(-1).masked_fill(~movable_C, float("inf"))
                new_C[int(similarity_C.argmin())] = g
        if torch.equal(new_C, assign_C):
            break
        assign_C = new_C
        centres_GX = torch.stack([unit_CX[assign_C == g].mean(0) for g in range(groups)])
    return [[c for c in range(len(unit_CX)) if int(assign_C[c]) == g] for g in range(groups)]


def plan_groups(
    layer: MoELayer, kept: list[int], features_CX: torch.Tensor | None, cfg: MoeToDenseConfig
) -> list[list[int]]:
    """Expert ids of each group (each group ordered best score first, groups by their best)."""
    if cfg.grouping == "single":
        return [[e] for e in kept]
    if not layer.cfg.uniform:
        raise MoeLitError(
            f"grouping: {cfg.grouping} averages experts, which needs equal expert sizes; this layer has "
            f"{list(layer.cfg.expert_sizes)} (use single with keep = groups)"
        )
    if features_CX is None:
        features_CX = weight_features(layer, kept)
    if cfg.grouping in ("weight", "output"):
        positions = nearest_centre_groups(features_CX, cfg.groups)
    else:
        positions = kmeans_groups(features_CX, cfg.groups, cfg.kmeans_iterations)
    return sorted(([kept[p] for p in sorted(group)] for group in positions), key=lambda g: kept.index(g[0]))


# ----------------------------------------------------------------------------- scales
def group_scales(trace: RoutingTrace, m: int, groups: list[list[int]], scaling: str) -> list[float]:
    """Down-projection scale of each group (module docstring, step 4)."""
    if scaling == "uniform":
        return [1 / len(groups)] * len(groups)
    indices_NK, weights_NK = trace.indices_MNK[m], trace.weights_MNK[m].double()
    tokens = max(trace.num_tokens, 1)
    scales = []
    for group in groups:
        in_group_NK = torch.isin(indices_NK, torch.tensor(group))
        mass = float((weights_NK * in_group_NK).sum())
        if scaling == "gate_mass":
            scales.append(mass / tokens)
        else:
            selected = int(in_group_NK.any(-1).sum())
            scales.append(mass / selected if selected else 0.0)
    return scales


# ----------------------------------------------------------------------------- transform
def _inputs(trace: RoutingTrace, what: str) -> torch.Tensor:
    if trace.inputs_MND is None:
        raise MoeLitError(f"{what}: the routing trace has no layer inputs; trace with record_inputs=True")
    return trace.inputs_MND


def _feature_tokens(trace: RoutingTrace, max_tokens: int) -> torch.Tensor:
    """``(P,)`` evenly spaced traced tokens for the output features."""
    if trace.num_tokens == 0:
        raise MoeLitError("moe_to_dense: the routing trace is empty")
    return torch.linspace(0, trace.num_tokens - 1, min(max_tokens, trace.num_tokens)).round().long().unique()


def check_convertible(model: Transformer, cfg: MoeToDenseConfig) -> None:
    """Refuse what ``cfg`` cannot do on ``model`` (dense model, gated shared expert, keep > E)."""
    mcfg = model.config
    if mcfg.moe is None:
        raise MoeLitError("moe_to_dense: the model is dense (model.moe is null); nothing to convert")
    if mcfg.moe.shared_expert_gate:
        raise MoeLitError("moe_to_dense: a gated shared expert (moe.shared_expert_gate) has no dense equivalent")
    for block in mcfg.moe_layer_ids:
        experts = mcfg.moe_layer_config(block).num_experts
        if cfg.keep > experts:
            raise ConfigError(f"keep: block {block} has {experts} experts, cannot keep {cfg.keep}")


def _merged(layer: MoELayer, group: list[int], scores_E: torch.Tensor) -> dict[str, torch.Tensor]:
    """The score-weighted average ``(F, D)`` w1/v1/w2 of a group's experts."""
    mlp, layout = layer.experts.mlp, layer.experts.layout
    alpha_G = scores_E[group].double().clamp_min(0)
    alpha_G = alpha_G / alpha_G.sum() if alpha_G.sum() > 0 else torch.full_like(alpha_G, 1 / len(group))
    return {
        w: sum(float(a) * getattr(mlp, w)[layout.rows(e)] for a, e in zip(alpha_G, group, strict=False))
        for w in ("w1", "v1", "w2")
    }


def _layer_plan(model, trace, m, block, scores_E, cfg) -> dict[str, Any]:
    layer = model.moe_layer(block)
    kept = select_experts(scores_E, cfg.keep)
    features_CX = None
    if cfg.grouping in ("output", "kmeans_output"):
        x_PD = _inputs(trace, cfg.grouping)[m][_feature_tokens(trace, cfg.max_tokens)]
        features_CX = output_features(layer, x_PD)[kept]
    groups = plan_groups(layer, kept, features_CX, cfg)
    return {"kept": kept, "groups": groups, "scales": group_scales(trace, m, groups, cfg.scaling)}


@torch.no_grad()
def moe_to_dense(
    model: Transformer, trace: RoutingTrace, cfg: MoeToDenseConfig, scores_ME: torch.Tensor | None = None
) -> tuple[Transformer, dict[str, Any]]:
    """The dense model of ``cfg`` and a JSON-ready report (scores, kept experts, groups, scales).

    ``scores_ME``: the ``cfg.score`` scores already computed by :func:`moe_expert_scores` (a grid
    shares them across its groupings and scalings); None computes them.
    """
    check_convertible(model, cfg)
    if tuple(trace.layer_ids) != model.config.moe_layer_ids:
        raise MoeLitError(
            f"moe_to_dense: traced layers {list(trace.layer_ids)} are not the model's MoE blocks "
            f"{list(model.config.moe_layer_ids)}; trace this model"
        )
    if scores_ME is None:
        scores_ME = moe_expert_scores(model, trace, cfg)
    plans = {}
    for m, block in enumerate(trace.layer_ids):
        experts = model.config.moe_layer_config(block).num_experts
        plans[block] = _layer_plan(model, trace, m, block, scores_ME[m, :experts], cfg)
    widths = {block: _width(model.moe_layer(block), plan["groups"]) for block, plan in plans.items()}
    width = _one_width(model, widths)
    new = rebuild(model, model.config.replace(moe=None, d_ff=width))
    for m, (block, plan) in enumerate(plans.items()):
        layer, target = model.moe_layer(block), new.dense_ffn(block)
        experts = model.config.moe_layer_config(block).num_experts
        parts = []
        for group, scale in zip(plan["groups"], plan["scales"], strict=False):
            merged = _merged(layer, group, scores_ME[m, :experts])
            parts.append({**merged, "w2": merged["w2"] * scale})
        if layer.shared_expert is not None:
            shared = layer.shared_expert
            parts.append({"w1": shared.w1.weight, "v1": shared.v1.weight, "w2": shared.w2.weight.T})
        target.w1.weight.copy_(torch.cat([p["w1"] for p in parts]))
        target.v1.weight.copy_(torch.cat([p["v1"] for p in parts]))
        target.w2.weight.copy_(torch.cat([p["w2"] for p in parts]).T)
        plan["dropped_bias_norm"] = float(layer.experts.bias.norm())
    report = {
        "config": cfg.name,
        "width": width,
        "scores": scores_ME.tolist(),
        "layers": {str(block): plan for block, plan in plans.items()},
    }
    return new, report


def screen(
    model: Transformer,
    trace: RoutingTrace,
    configs: Sequence[MoeToDenseConfig],
    batches: Sequence[torch.Tensor] | Mapping[str, Sequence[torch.Tensor]],
) -> list[dict[str, Any]]:
    """The pre-distillation screen of a grid: every config's dense model and its mean next-token
    loss on the ``(B, L+1)`` token ``batches``, best (lowest loss) first. Scores are computed once
    per score setting and shared by that score's groupings and scalings. ``batches`` given as
    ``{label: batches}`` (e.g. one entry per language) also gives each row ``loss_per_label``;
    ``loss`` is then the mean over all batches."""
    labelled = dict(batches) if isinstance(batches, Mapping) else {"": list(batches)}
    if not any(labelled.values()):
        raise MoeLitError("screen: no batches to measure the loss on")
    scores: dict[tuple, torch.Tensor] = {}
    rows = []
    for cfg in configs:
        key = (cfg.score, cfg.seed, cfg.max_tokens, cfg.ridge)
        if key not in scores:
            scores[key] = moe_expert_scores(model, trace, cfg)
        dense, _ = moe_to_dense(model, trace, cfg, scores[key])
        dense.eval()
        with torch.no_grad():
            losses = {
                label: [float(next_token_loss(dense, batch_BL1)) for batch_BL1 in group]
                for label, group in labelled.items()
            }
        every = [loss for group in losses.values() for loss in group]
        row = {
            "config": cfg.name,
            "score": cfg.score,
            "grouping": cfg.grouping,
            "scaling": cfg.scaling,
            "keep": cfg.keep,
            "groups": cfg.groups,
            "params": count_model_params(dense).total,
            "loss": sum(every) / len(every),
        }
        if isinstance(batches, Mapping):
            row["loss_per_label"] = {label: sum(group) / len(group) for label, group in losses.items() if group}
        rows.append(row)
    return sorted(rows, key=lambda row: row["loss"])


def _width(layer: MoELayer, groups: list[list[int]]) -> int:
    shared = layer.shared_expert.w1.weight.shape[0] if layer.shared_expert is not None else 0
    return sum(layer.experts.layout.sizes[g[0]] for g in groups) + shared


def _one_width(model: Transformer, widths: dict[int, int]) -> int:
    """The dense width shared by every block (converted MoE blocks and existing dense ones)."""
    values = set(widths.values())
    if len(values) > 1:
        raise MoeLitError(
            f"moe_to_dense: the converted blocks would have different widths {widths}; one d_ff per model"
        )
    width = values.pop()
    dense_blocks = [b for b in range(model.config.n_layers) if b not in widths]
    if dense_blocks and model.config.d_ff != width:
        raise MoeLitError(
            f"moe_to_dense: dense blocks {dense_blocks} have d_ff={model.config.d_ff} but the converted FFN is "
            f"{width} wide; choose keep/groups so that the width equals d_ff"
        )
    return width


__all__ = [
    "GROUPINGS",
    "SCALINGS",
    "SCORES",
    "MoeToDenseConfig",
    "check_convertible",
    "conditional_gate_weight",
    "d_optimal_gains",
    "do_acp_scores",
    "grid",
    "group_scales",
    "kmeans_groups",
    "moe_expert_scores",
    "moe_to_dense",
    "nearest_centre_groups",
    "output_features",
    "plan_groups",
    "router_probability",
    "screen",
    "select_experts",
    "taylor_scores",
    "traced_sequences",
]
