"""Expert importance for pruning, every score computed from one :class:`RoutingTrace` of calibration text.

Shape legend: M traced MoE layers, N traced tokens, K top-k, E experts, D d_model,
S = M*E Markov states (layer, expert); N' tokens kept for the NAEE search.

Scores are ``(M, E)``, larger = more important, and comparable across layers (what a global
budget ranks):

* ``frequency``: the share of layer m's N*K routed assignments that go to expert e (sums to 1).
* ``router_weighted``: the share of layer m's gate mass (the combine weights) expert e receives.
* ``reap`` (REAP): mean over the tokens routed to e of ``gate * ||f_e(x)||_2``, the expert's
  output recomputed from the traced layer input (needs ``inputs_MND``); 0 for unused experts.
* ``random``: seeded uniform scores (the baseline).
* ``maestro`` (MAESTRO): ``M * pi`` for the stationary distribution ``pi`` of a Markov chain on
  the S states (layer, expert): each token's trajectory moves from the experts it uses at layer m
  to those it uses at m+1, and from its last layer to the first layer of the next token of its
  sequence (the last token of a sequence links back to the first, so every sequence is a closed
  trajectory). Edge weight per token: ``gate_src * gate_dst`` (``weighting='gate'``) or 1
  (``'count'``); rows are normalised, rows without any edge are uniform, and PageRank damping
  ``alpha`` mixes in a uniform jump: ``G = alpha P + (1 - alpha) / S``. ``pi`` comes from power
  iteration on the lazy chain ``(I + G) / 2`` (same stationary distribution, never periodic — the
  undamped layer cycle has period M), stopped when ``||pi G - pi||_1 < tol``; iterations and the
  final residual are reported.

The trap (documented and tested): for every state, the trace's edges carry as much weight in as out
— each token enters and leaves each of its experts once — so an undamped chain (``alpha = 1``)
whose trajectories connect all used states has the stationary distribution *proportional to that
flow*: ``M * pi = frequency`` with ``'count'`` weights, and ``M * pi = router_weighted`` with
``'gate'`` weights when the gates of every token sum to 1 (``renormalize=True``). Such a MAESTRO
is a plain frequency score with extra steps. Cross-layer information enters only where the flow
is broken: damping (the uniform jump lands on rare experts too, and the chain then follows *their*
trajectories, so experts downstream of rare paths gain), or gates that do not sum to 1.

``naee`` (NAEE) is not a score but a search: per layer, the subset of ``keep`` experts whose
routing-restricted output (top-k among the subset, the pruned router's weights) best reconstructs
the layer's original routed output on N' calibration tokens, squared error; exhaustive when
``C(E, keep) <= exhaustive_cap``, else greedy backward elimination (drop the expert whose removal
costs least, repeat). Dropless routing is assumed (capacity is ignored).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F

from moe_lit.config import ConfigError
from moe_lit.convert.prune import copy_router_rows, kept_count, plan_pruning
from moe_lit.errors import MoeLitError
from moe_lit.evaluation.routing_trace import RoutingTrace
from moe_lit.model import MoELayer, Transformer
from moe_lit.model.router import Router

METHODS = ("maestro", "frequency", "router_weighted", "reap", "naee", "random")
SCORE_METHODS = tuple(m for m in METHODS if m != "naee")
WEIGHTINGS = ("gate", "count")
Weighting = Literal["gate", "count"]


@dataclass
class ExpertScores:
    """Importance of every expert of every traced MoE layer."""

    method: str
    """Which score (one of SCORE_METHODS)."""
    layer_ids: tuple[int, ...]
    """Block index of each row."""
    scores_ME: torch.Tensor
    """Importance, larger = keep (float64)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Method details (MAESTRO: damping, weighting, iterations, residual, converged)."""

    def by_block(self, model: Transformer) -> dict[int, torch.Tensor]:
        """Block -> ``(E_layer,)`` scores (a layer narrower than the trace keeps its first experts)."""
        if tuple(self.layer_ids) != model.config.moe_layer_ids:
            raise MoeLitError(
                f"scores: traced layers {list(self.layer_ids)} are not the model's MoE blocks "
                f"{list(model.config.moe_layer_ids)}; trace this model"
            )
        return {
            block: self.scores_ME[m, : model.config.moe_layer_config(block).num_experts]
            for m, block in enumerate(self.layer_ids)
        }


# ----------------------------------------------------------------------------- frequency scores
def selection_frequency(trace: RoutingTrace) -> torch.Tensor:
    """``(M, E)`` share of each layer's routed assignments per expert."""
    counts_ME = trace.counts_ME().double()
    return counts_ME / counts_ME.sum(-1, keepdim=True).clamp_min(1)


def router_weighted_frequency(trace: RoutingTrace) -> torch.Tensor:
    """``(M, E)`` share of each layer's gate mass per expert."""
    mass_ME = torch.zeros(trace.num_layers, trace.num_experts, dtype=torch.float64)
    for m in range(trace.num_layers):
        mass_ME[m].index_add_(0, trace.indices_MNK[m].reshape(-1), trace.weights_MNK[m].reshape(-1).double())
    return mass_ME / mass_ME.sum(-1, keepdim=True).clamp_min(1e-300)


def random_scores(trace: RoutingTrace, seed: int = 0) -> torch.Tensor:
    """``(M, E)`` seeded uniform scores."""
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(trace.num_layers, trace.num_experts, generator=generator, dtype=torch.float64)


# ----------------------------------------------------------------------------- REAP
def expert_output(layer: MoELayer, expert: int, x_ND: torch.Tensor) -> torch.Tensor:
    """``(N, D)`` output of one routed expert (SwiGLU, see ``experts/layout.py``), without the bias."""
    mlp, rows = layer.experts.mlp, layer.experts.layout.rows(expert)
    return (F.silu(x_ND @ mlp.w1[rows].T) * (x_ND @ mlp.v1[rows].T)) @ mlp.w2[rows]


def _layer_inputs(trace: RoutingTrace, method: str) -> torch.Tensor:
    if trace.inputs_MND is None:
        raise MoeLitError(f"{method}: the routing trace has no layer inputs; trace with record_inputs=True")
    return trace.inputs_MND


@torch.no_grad()
def reap_scores(model: Transformer, trace: RoutingTrace) -> torch.Tensor:
    """``(M, E)`` REAP: mean over the tokens routed to e of ``gate * ||f_e(x)||``."""
    inputs_MND = _layer_inputs(trace, "reap")
    scores_ME = torch.zeros(trace.num_layers, trace.num_experts, dtype=torch.float64)
    for m, block in enumerate(trace.layer_ids):
        layer = model.moe_layer(block)
        weight = layer.experts.mlp.w1
        x_ND = inputs_MND[m].to(weight)
        for expert in range(layer.cfg.num_experts):
            token_R, slot_R = (trace.indices_MNK[m] == expert).nonzero(as_tuple=True)
            if token_R.numel():
                norms_R = expert_output(layer, expert, x_ND[token_R]).norm(dim=-1).double().cpu()
                scores_ME[m, expert] = (trace.weights_MNK[m][token_R, slot_R].double() * norms_R).mean()
    return scores_ME


# ----------------------------------------------------------------------------- MAESTRO
@dataclass
class MaestroConfig:
    """The Markov chain of MAESTRO importance."""

    damping: float = 0.85
    """PageRank damping alpha in (0, 1]: follow a trajectory with probability alpha, else jump to
    a uniform state; 1 = no damping (see the trap in the module docstring)."""
    weighting: Weighting = "gate"
    """Edge weight per token: gate (gate_src * gate_dst) | count (1 per pair of used experts)."""
    tol: float = 1e-10
    """Stop when the stationarity residual ``||pi G - pi||_1`` is below this."""
    max_iterations: int = 100_000
    """Power-iteration budget; the result says whether it converged."""

    def __post_init__(self) -> None:
        if not (isinstance(self.damping, (int, float)) and 0 < self.damping <= 1):
            raise ConfigError(f"maestro.damping: must be in (0, 1], got {self.damping!r}")
        if self.weighting not in WEIGHTINGS:
            raise ConfigError(f"maestro.weighting: got {self.weighting!r}, allowed values: {', '.join(WEIGHTINGS)}")
        if not self.tol > 0:
            raise ConfigError(f"maestro.tol: must be > 0, got {self.tol!r}")
        if not (isinstance(self.max_iterations, int) and self.max_iterations > 0):
            raise ConfigError(f"maestro.max_iterations: must be a positive integer, got {self.max_iterations!r}")


@dataclass
class Stationary:
    """A stationary distribution found by power iteration."""

    pi_S: torch.Tensor
    """Probability of each state (float64, sums to 1)."""
    iterations: int
    """Power iterations run."""
    residual: float
    """``||pi G - pi||_1`` at the end."""
    converged: bool
    """Whether the residual fell below the tolerance."""


def next_token_index(trace: RoutingTrace) -> torch.Tensor:
    """``(N,)`` the next traced token of the same sequence; a sequence's last token links to its first."""
    seq_N = trace.seq_N
    n = torch.arange(trace.num_tokens)
    same_next = torch.zeros(trace.num_tokens, dtype=torch.bool)
    same_next[:-1] = seq_N[1:] == seq_N[:-1]
    starts = torch.ones(trace.num_tokens, dtype=torch.bool)
    starts[1:] = ~same_next[:-1]
    first_of_run_N = torch.cummax(torch.where(starts, n, torch.zeros_like(n)), dim=0).values
    return torch.where(same_next, n + 1, first_of_run_N)


def maestro_transitions(trace: RoutingTrace, weighting: Weighting = "gate") -> torch.Tensor:
    """``(S, S)`` edge weights between the states ``m * E + e`` (see the module docstring)."""
    if trace.num_tokens == 0 or trace.num_layers == 0:
        raise MoeLitError("maestro: the routing trace is empty")
    num_layers, num_experts = trace.num_layers, trace.num_experts
    states = num_layers * num_experts
    gates_MNK = trace.weights_MNK.double() if weighting == "gate" else torch.ones_like(trace.weights_MNK.double())
    next_N = next_token_index(trace)
    weights_SS = torch.zeros(states * states, dtype=torch.float64)
    for m in range(num_layers):
        src_NK, src_gate_NK = trace.indices_MNK[m] + m * num_experts, gates_MNK[m]
        if m + 1 < num_layers:
            dst_NK, dst_gate_NK = trace.indices_MNK[m + 1] + (m + 1) * num_experts, gates_MNK[m + 1]
        else:
            dst_NK, dst_gate_NK = trace.indices_MNK[0][next_N], gates_MNK[0][next_N]
        codes = (src_NK[:, :, None] * states + dst_NK[:, None, :]).reshape(-1)
        weights_SS.index_add_(0, codes, (src_gate_NK[:, :, None] * dst_gate_NK[:, None, :]).reshape(-1))
    return weights_SS.view(states, states)


def stationary_distribution(weights_SS: torch.Tensor, damping: float, tol: float, max_iterations: int) -> Stationary:
    """Power iteration for ``pi = pi G``, ``G = damping * P + (1 - damping) / S`` (rows without edges uniform)."""
    states = weights_SS.shape[0]
    out_S = weights_SS.sum(-1, keepdim=True)
    transition_SS = torch.where(
        out_S > 0, weights_SS / out_S.clamp_min(1e-300), torch.full_like(weights_SS, 1 / states)
    )
    pi_S = torch.full((states,), 1 / states, dtype=torch.float64)
    residual = math.inf
    for iteration in range(1, max_iterations + 1):
        step_S = damping * (pi_S @ transition_SS) + (1 - damping) / states
        residual = float((step_S - pi_S).abs().sum())
        # NOTE: the lazy step (I + G) / 2 keeps pi and is aperiodic: without damping the chain
        # cycles through the M layers and plain power iteration would oscillate.
        pi_S = (pi_S + step_S) / 2
        if residual < tol:
            return Stationary(pi_S / pi_S.sum(), iteration, residual, True)
    return Stationary(pi_S / pi_S.sum(), max_iterations, residual, False)


def maestro_scores(trace: RoutingTrace, cfg: MaestroConfig | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """``(M, E)`` MAESTRO importance ``M * pi`` and the chain's report."""
    cfg = cfg or MaestroConfig()
    result = stationary_distribution(
        maestro_transitions(trace, cfg.weighting), cfg.damping, cfg.tol, cfg.max_iterations
    )
    info = dataclasses.asdict(cfg) | {
        "iterations": result.iterations,
        "residual": result.residual,
        "converged": result.converged,
        "layer_mass": result.pi_S.view(trace.num_layers, -1).sum(-1).tolist(),
    }
    return trace.num_layers * result.pi_S.view(trace.num_layers, trace.num_experts), info


# ----------------------------------------------------------------------------- dispatch
def expert_scores(
    method: str,
    trace: RoutingTrace,
    model: Transformer | None = None,
    seed: int = 0,
    maestro: MaestroConfig | None = None,
) -> ExpertScores:
    """The ``(M, E)`` importance of ``method`` (NAEE is a subset search: :func:`naee_keep`)."""
    if method not in SCORE_METHODS:
        hint = "; naee searches subsets (naee_keep)" if method == "naee" else ""
        raise ConfigError(f"method: got {method!r}, allowed values: {', '.join(SCORE_METHODS)}{hint}")
    info: dict[str, Any] = {}
    if method == "frequency":
        scores_ME = selection_frequency(trace)
    elif method == "router_weighted":
        scores_ME = router_weighted_frequency(trace)
    elif method == "random":
        scores_ME, info = random_scores(trace, seed), {"seed": seed}
    elif method == "reap":
        if model is None:
            raise MoeLitError("reap: needs the model (expert outputs are recomputed from the traced inputs)")
        scores_ME = reap_scores(model, trace)
    else:
        scores_ME, info = maestro_scores(trace, maestro)
    return ExpertScores(method, tuple(trace.layer_ids), scores_ME, info)


# ----------------------------------------------------------------------------- NAEE
@dataclass
class NaeeResult:
    """Kept experts per block and how they were found."""

    keep: dict[int, list[int]]
    """Block -> kept expert ids (ascending)."""
    errors: dict[int, float]
    """Block -> mean squared reconstruction error per token of the kept subset."""
    searches: dict[int, str]
    """Block -> 'exhaustive' or 'greedy'."""


@torch.no_grad()
def naee_keep(
    model: Transformer,
    trace: RoutingTrace,
    keep_counts: Mapping[int, int],
    exhaustive_cap: int = 2000,
    max_tokens: int = 2048,
) -> NaeeResult:
    """Per block, the ``keep_counts[block]`` experts that best reconstruct the layer output (see the docstring)."""
    inputs_MND = _layer_inputs(trace, "naee")
    if exhaustive_cap < 1 or max_tokens < 1:
        raise ConfigError(f"naee: exhaustive_cap and max_tokens must be >= 1, got {exhaustive_cap}, {max_tokens}")
    tokens_P = torch.linspace(0, trace.num_tokens - 1, min(max_tokens, trace.num_tokens)).round().long().unique()
    result = NaeeResult({}, {}, {})
    for m, block in enumerate(trace.layer_ids):
        layer = model.moe_layer(block)
        keep = keep_counts[block]
        if not 1 <= keep <= layer.cfg.num_experts:
            raise ConfigError(f"naee: block {block} has {layer.cfg.num_experts} experts, cannot keep {keep}")
        weight = layer.experts.mlp.w1
        x_PD = inputs_MND[m][tokens_P].to(weight)
        outputs_PED = torch.stack([expert_output(layer, e, x_PD) for e in range(layer.cfg.num_experts)], dim=1)
        error = _SubsetError(layer, x_PD, outputs_PED, trace.indices_MNK[m][tokens_P], trace.weights_MNK[m][tokens_P])
        del outputs_PED
        if math.comb(layer.cfg.num_experts, keep) <= exhaustive_cap:
            subsets = itertools.combinations(range(layer.cfg.num_experts), keep)
            best = min(subsets, key=error)
            result.searches[block] = "exhaustive"
        else:
            best = _greedy_elimination(error, layer.cfg.num_experts, keep)
            result.searches[block] = "greedy"
        result.keep[block] = sorted(best)
        result.errors[block] = error(best)
    return result


def _combine(outputs_PED: torch.Tensor, indices_PK: torch.Tensor, weights_PK: torch.Tensor) -> torch.Tensor:
    """``sum_k w_pk * out[p, e_pk]``."""
    picked_PKD = outputs_PED.gather(
        1, indices_PK.to(outputs_PED.device)[..., None].expand(-1, -1, outputs_PED.shape[-1])
    )
    return (weights_PK.to(picked_PKD)[..., None] * picked_PKD).sum(1)


class _SubsetError:
    """Reconstruction error of a kept subset, routed by that subset's pruned router.

    NOTE: ``||y - sum_k w_k o_k||^2 = ||y||^2 - 2 sum_k w_k <y, o_k> + sum_kl w_k w_l <o_k, o_l>``: with
    the per-token inner products precomputed once (float64), a subset costs O(K^2) per token
    instead of O(K * D), which is what makes the exhaustive search affordable.
    """

    def __init__(self, layer: MoELayer, x_PD, outputs_PED, indices_PK, weights_PK) -> None:
        self.layer, self.x_PD = layer, x_PD
        outputs_PED = outputs_PED.double()
        target_PD = _combine(outputs_PED, indices_PK, weights_PK)
        self.target_sq_P = target_PD.square().sum(-1)
        self.cross_PE = torch.einsum("pd,ped->pe", target_PD, outputs_PED)
        self.gram_PEE = torch.einsum("ped,pfd->pef", outputs_PED, outputs_PED)
        self._routers: dict[int, Router] = {}

    def _router(self, size: int) -> Router:
        if size not in self._routers:
            cfg = self.layer.cfg
            sub = dataclasses.replace(
                cfg, num_experts=size, expert_size=cfg.expert_sizes[0], top_k=min(cfg.top_k, size)
            )
            # NOTE: a throw-away init: it must not advance the caller's RNG (pure function).
            with torch.random.fork_rng(devices=[]):
                self._routers[size] = Router(self.x_PD.shape[-1], sub).to(self.x_PD)
        return self._routers[size]

    def __call__(self, subset: Sequence[int]) -> float:
        router = self._router(len(subset))
        copy_router_rows(self.layer.router, router, subset)
        routing = router(self.x_PD)
        experts_PK = torch.tensor(list(subset), device=self.x_PD.device)[routing.indices_TK].to(self.cross_PE.device)
        w_PK = routing.weights_TK.to(self.cross_PE)
        cross_P = (w_PK * self.cross_PE.gather(1, experts_PK)).sum(-1)
        tokens_P1 = torch.arange(experts_PK.shape[0], device=experts_PK.device)[:, None, None]
        gram_PKK = self.gram_PEE[tokens_P1, experts_PK[:, :, None], experts_PK[:, None, :]]
        error_P = self.target_sq_P - 2 * cross_P + torch.einsum("pk,pkl,pl->p", w_PK, gram_PKK, w_PK)
        return float(error_P.mean())


def _greedy_elimination(error: _SubsetError, num_experts: int, keep: int) -> tuple[int, ...]:
    subset = list(range(num_experts))
    while len(subset) > keep:
        drop = min(subset, key=lambda e: (error([x for x in subset if x != e]), e))
        subset.remove(drop)
    return tuple(subset)


# ----------------------------------------------------------------------------- calibration + plan
def calibration_trace(
    model: Transformer,
    data_dir,
    tokenizer,
    languages: Sequence[str] | None = None,
    split: str = "val",
    max_tokens: int = 4096,
    batch_size: int = 8,
    record_inputs: bool = False,
) -> RoutingTrace:
    """Route calibration text: the parallel ``split`` of a prepared data dir, ``languages`` (None =
    all of them, the mix), the same documents in every language up to ``max_tokens`` per language;
    sequences are labelled ``language`` so per-language scores are ``trace.where(language=...)``."""
    from moe_lit.analysis.routing import tokenize_documents, trace_languages
    from moe_lit.data.tokenizer import resolve_eot_id
    from moe_lit.evaluation.tasks import read_parallel

    parallel = read_parallel(data_dir, split, languages)
    token_docs = tokenize_documents(parallel, tokenizer, resolve_eot_id(tokenizer), max_tokens)
    return trace_languages(model, token_docs, batch_size, record_inputs=record_inputs)


def plan_keep(
    method: str,
    model: Transformer,
    trace: RoutingTrace,
    fraction: float | None = None,
    num: int | None = None,
    global_budget: bool = False,
    clamp_top_k: bool = False,
    seed: int = 0,
    maestro: MaestroConfig | None = None,
    naee_cap: int = 2000,
) -> tuple[dict[int, list[int]], dict[str, Any]]:
    """Kept experts per block for ``method`` and a JSON-ready report (scores, MAESTRO chain, NAEE errors).

    A global budget never takes a layer below top-k experts (below one with ``clamp_top_k``).
    """
    if method not in METHODS:
        raise ConfigError(f"method: got {method!r}, allowed values: {', '.join(METHODS)}")
    if method != "naee":
        scores = expert_scores(method, trace, model, seed, maestro)
        min_keep = 1 if clamp_top_k else model.config.moe_section().top_k
        keep = plan_pruning(scores.by_block(model), fraction, num, global_budget, min_keep)
        return keep, {"scores": scores.scores_ME.tolist(), **scores.info}
    if global_budget:
        raise ConfigError("global: naee searches each layer's subset on its own; use a per-layer budget")
    counts = {
        block: kept_count(model.config.moe_layer_config(block).num_experts, block, fraction, num)
        for block in model.config.moe_layer_ids
    }
    result = naee_keep(model, trace, counts, exhaustive_cap=naee_cap)
    return result.keep, {"errors": result.errors, "searches": result.searches, "exhaustive_cap": naee_cap}


__all__ = [
    "METHODS",
    "SCORE_METHODS",
    "ExpertScores",
    "MaestroConfig",
    "NaeeResult",
    "Stationary",
    "calibration_trace",
    "expert_output",
    "expert_scores",
    "maestro_scores",
    "maestro_transitions",
    "naee_keep",
    "next_token_index",
    "plan_keep",
    "random_scores",
    "reap_scores",
    "router_weighted_frequency",
    "selection_frequency",
    "stationary_distribution",
]
