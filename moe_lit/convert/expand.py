"""E -> mE expert expansion ("expert upcycling"): grow an MoE by duplicating experts, top-k fixed.

Shape legend: E source experts, M expanded experts, D d_model, S / S' stacked expert rows before /
after (see ``experts/layout.py``), K top-k.

``expand_experts`` keeps the E originals as experts ``0..E-1`` and appends the copies, in source
order. A copy has its source's expert rows (w1, v1, w2) and router row; the selection bias of a
copy is its source's plus a tiny ``U(-noise, noise)``; top-k, the expert output bias and the
shared expert are unchanged.

Guarantee: with top-1, renormalised weights and ``noise=0`` the expanded model computes exactly
the source model: tied copies have equal scores, and the single picked expert — an original or a
copy of it — weighs 1. The selection ranks score + bias; sigmoid scores do not change, and
softmax scores over M experts all shrink by M/E for a uniform factor, so the selection biases are
scaled by E/M and the ranking is kept. (Softmax with unequal per-expert counts is exact only
when the source's selection biases are zero.) The noise changes the pick only of tokens whose
two best experts are closer than the noise. Exactness is
impossible for top-k > 1: the tied copies of the best expert are picked together and crowd out the
second-best expert, so the loss jumps; callbacks and the study measure and report that jump.

NOTE: copies only learn apart when they receive gradient. With tied router rows, top-k tie
breaking sends all of a group's tokens to one copy; the others get no tokens, no gradient, and
would stay clones forever. Aux-loss-free bias balancing (``balancing='bias'``, the default here)
raises the selection bias of starved copies every step until they receive tokens, and the noise
breaks the ties at random from step 0; both act on selection only, so the function is untouched.

Utility (expert upcycling's non-uniform duplication): ``u(e) = ||dL/dW_e||^2`` — the squared
gradient norm of expert e's rows of w1, v1 and w2 — averaged over a few batches (default 10);
also ``||W_e|| * ||dL/dW_e||`` and the routing frequency. ``allocate_copies`` fills the copies
greedily, highest utility first: each copy goes to the expert with the highest utility per
instance ``u(e) / n(e)``, and no expert gets more than ``max_copies`` (3) copies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from moe_lit.config import BALANCING, Balancing
from moe_lit.configbase import (
    ConfigBase,
    ConfigError,
    is_int,
    is_number,
    require,
    require_choice,
    require_number,
    require_positive_int,
)
from moe_lit.convert.common import next_token_loss, rebuild
from moe_lit.convert.dense_to_moe import drop_neurons
from moe_lit.errors import MoeLitError
from moe_lit.model import MoELayer, Transformer
from moe_lit.model.experts.layout import ExpertLayout
from moe_lit.model.router import finish_routing_step

SELECTIONS = ("uniform", "utility")
MAX_COPIES = 3
"""Default cap on the copies of one expert under utility selection."""
UTILITY_METRICS = ("grad_sq", "weight_grad", "frequency")
EXPERT_MATRICES = ("w1", "v1", "w2")


@dataclass
class ExpansionConfig(ConfigBase):
    """One E -> mE expansion: how many copies of which experts, and how the copies differ."""

    factor: int | None = None
    """m: every expert gets m-1 copies (uniform) or (m-1)*E copies are allocated (utility); an
    integer >= 2. Exactly one of factor and counts."""
    counts: list[int] | None = None
    """Instances per source expert (each >= 1, the same in every layer), e.g. 3,1,2,2."""
    selection: str = "uniform"
    """How a factor is spent: uniform (m-1 copies of every expert) | utility (greedy by expert utility)."""
    utility_metric: str = "grad_sq"
    """Utility selection's score: grad_sq | weight_grad | frequency (see the module docstring)."""
    max_copies: int = MAX_COPIES
    """Utility selection: at most this many copies of one expert."""
    noise: float = 1e-3
    """U(-noise, noise) on the copies' selection bias (needs balancing bias)."""
    balancing: Balancing | None = "bias"
    """Load balancing of the expanded MoE: bias (aux-loss-free, see the module docstring) | aux_loss |
    none | null to keep the source's."""
    seed: int = 0
    """Seed of the bias noise, the router-row noise and the dropped neurons."""
    router_noise: float = 0.0
    """Relative N(0, sigma^2) noise on the copies' router rows (symmetry breaking; not exact)."""
    drop_fraction: float = 0.0
    """Fraction of each copy's neurons re-initialised, in [0, 1) (drop-upcycling the copies; not exact)."""

    def __post_init__(self) -> None:
        give_one = "give exactly one of factor (an integer >= 2) or per-expert counts"
        require((self.factor is None) != (self.counts is None), "factor/counts", give_one)
        if self.factor is not None:
            require(is_int(self.factor) and self.factor >= 2, "factor", f"must be an integer >= 2, got {self.factor!r}")
        require_choice(self.selection, "selection", SELECTIONS)
        require_choice(self.utility_metric, "utility_metric", UTILITY_METRICS)
        if self.balancing is not None:
            require_choice(self.balancing, "balancing", BALANCING)
        require_positive_int(self.max_copies, "max_copies")
        require_number(self.noise, "noise", strictly_positive=False)
        require_number(self.router_noise, "router_noise", strictly_positive=False)
        in_range = is_number(self.drop_fraction) and 0 <= self.drop_fraction < 1
        require(in_range, "drop_fraction", f"must be in [0, 1), got {self.drop_fraction}")
        self.check_noise(self.balancing or "bias")

    def check_noise(self, balancing: str) -> None:
        """Refuse selection-bias noise under a ``balancing`` (the one the expanded model gets) with no bias."""
        if self.noise > 0 and balancing != "bias":
            raise ConfigError(
                f"noise: goes on the copies' selection bias, which needs balancing='bias' (got {balancing!r}); "
                "pass noise=0 or balancing='bias'"
            )


# ----------------------------------------------------------------------------- utility
@dataclass
class ExpertUtility:
    """Per-expert utility of every MoE block (block index -> ``(E,)`` tensor), averaged over batches."""

    grad_sq: dict[int, torch.Tensor]
    """Mean of ``||dL/dW_e||^2`` over the expert's rows of w1, v1 and w2."""
    weight_grad: dict[int, torch.Tensor]
    """Mean of ``||W_e|| * ||dL/dW_e||``."""
    frequency: dict[int, torch.Tensor]
    """Mean fraction of the routed (token, expert) assignments that went to the expert."""
    num_batches: int
    """Batches averaged."""

    def metric(self, name: str) -> dict[int, torch.Tensor]:
        if name not in UTILITY_METRICS:
            raise ConfigError(f"utility metric: got {name!r}, allowed values: {', '.join(UTILITY_METRICS)}")
        return getattr(self, name)

    def to_dict(self) -> dict:
        """JSON-ready lists, by metric then block."""
        return {
            name: {str(block): values.tolist() for block, values in getattr(self, name).items()}
            for name in UTILITY_METRICS
        } | {"num_batches": self.num_batches}


@dataclass
class UtilityAccumulator:
    """Sums per-expert statistics over batches; ``result()`` averages them."""

    sums: dict[str, dict[int, torch.Tensor]] = field(default_factory=lambda: {m: {} for m in UTILITY_METRICS})
    num_batches: int = 0

    @torch.no_grad()
    def add(self, model: Transformer, grads: dict[int, Sequence[torch.Tensor]]) -> None:
        """One batch: ``grads[block]`` holds the gradients of that block's w1, v1, w2 (S, D)."""
        for block, (g_w1, g_v1, g_w2) in grads.items():
            layer = model.moe_layer(block)
            expert_of_row_S = layer.experts.layout.expert_of_row().to(g_w1.device)
            mlp = layer.experts.mlp

            num_experts = layer.cfg.num_experts
            grad_sq_E = _squared_norm_per_expert((g_w1, g_v1, g_w2), expert_of_row_S, num_experts)
            weight_sq_E = _squared_norm_per_expert((mlp.w1, mlp.v1, mlp.w2), expert_of_row_S, num_experts)
            frequency_E = layer.router.stats().frequency_E
            for name, value in (
                ("grad_sq", grad_sq_E),
                ("weight_grad", weight_sq_E.sqrt() * grad_sq_E.sqrt()),
                ("frequency", frequency_E),
            ):
                value = value.cpu()
                self.sums[name][block] = self.sums[name].get(block, 0) + value
        self.num_batches += 1

    def result(self) -> ExpertUtility:
        if self.num_batches == 0:
            raise MoeLitError("utility: no batch was accumulated; utility needs at least one batch of gradients")
        averaged = {
            name: {b: v / self.num_batches for b, v in per_block.items()} for name, per_block in self.sums.items()
        }
        return ExpertUtility(**averaged, num_batches=self.num_batches)


def _squared_norm_per_expert(
    tensors_SD: Sequence[torch.Tensor], expert_of_row_S: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """Sum over each expert's rows of the squared entries of every tensor in ``tensors_SD``."""
    rows_S = torch.stack([t.float().square().sum(-1) for t in tensors_SD]).sum(0)
    return torch.zeros(num_experts, device=rows_S.device).index_add_(0, expert_of_row_S, rows_S)


def expert_gradients(model: Transformer) -> dict[int, tuple[torch.Tensor, ...]]:
    """The ``.grad`` of every MoE block's w1, v1, w2 (as left by a backward pass)."""
    grads = {}
    for block in model.config.moe_layer_ids:
        mlp = model.moe_layer(block).experts.mlp
        if mlp.w1.grad is not None:
            grads[block] = tuple(getattr(mlp, name).grad for name in EXPERT_MATRICES)
    return grads


def expert_utility(model: Transformer, batches: Iterable[torch.Tensor], num_batches: int = 10) -> ExpertUtility:
    """Utility of every expert from up to ``num_batches`` ``(B, L+1)`` token batches.

    Gradients of the next-token loss are taken with ``torch.autograd.grad``: the model's ``.grad``
    fields, weights and selection biases are untouched (its routers' statistics hold the last batch).
    """
    if model.config.moe is None:
        raise MoeLitError("expert_utility: the model is dense (model.moe is null)")
    accumulator = UtilityAccumulator()
    blocks = model.config.moe_layer_ids
    params = [getattr(model.moe_layer(b).experts.mlp, name) for b in blocks for name in EXPERT_MATRICES]
    was_training = model.training
    model.train()  # NOTE: routers record their counts (the routing frequency) only in training mode
    try:
        for _, batch_BL1 in zip(range(num_batches), batches, strict=False):
            grads = torch.autograd.grad(next_token_loss(model, batch_BL1), params)
            finish_routing_step([layer.router for layer in model.moe_layers()], update_biases=False)
            accumulator.add(model, {b: grads[3 * i : 3 * i + 3] for i, b in enumerate(blocks)})
    finally:
        model.train(was_training)
    return accumulator.result()


def allocate_copies(utility_E: torch.Tensor, extra: int, max_copies: int = MAX_COPIES) -> list[int]:
    """Instances per expert (>= 1) after greedily adding ``extra`` copies, highest utility first."""
    num_experts = utility_E.numel()
    if extra > max_copies * num_experts:
        raise ConfigError(
            f"factor: {extra} copies over {num_experts} experts exceed max_copies={max_copies} per expert"
        )
    counts = [1] * num_experts
    values = utility_E.tolist()
    for _ in range(extra):
        open_experts = [e for e in range(num_experts) if counts[e] - 1 < max_copies]
        best = max(open_experts, key=lambda e: (values[e] / counts[e], -e))
        counts[best] += 1
    return counts


# ----------------------------------------------------------------------------- plan + apply
@dataclass(frozen=True)
class ExpertExpansion:
    """Which source expert every new expert copies, per MoE block."""

    sources: dict[int, tuple[int, ...]]
    """Block index -> source expert of each new expert; the first E entries are ``0..E-1``."""

    @property
    def num_experts(self) -> int:
        return len(next(iter(self.sources.values())))

    def copies(self, block: int) -> list[int]:
        """Copies per source expert in ``block`` (instances - 1)."""
        counts = torch.bincount(torch.tensor(self.sources[block]))
        return (counts - 1).tolist()

    def row_sources(self, source: Transformer) -> dict[str, torch.Tensor]:
        """Parameter name (expanded model) -> index of the source row of each of its rows (dim 0).

        Covers the router weights and the stacked expert matrices: what an optimizer needs to copy
        its per-row state (e.g. AdamW moments) from the source model to the expanded one.
        """
        out = {}
        for block, src in self.sources.items():
            rows = _source_rows(source.moe_layer(block).experts.layout, src)
            prefix = f"blocks.{block}.ffn."
            out[prefix + "router.layer.weight"] = torch.tensor(src)
            for name in EXPERT_MATRICES:
                out[prefix + f"experts.mlp.{name}"] = rows
        return out


def _source_rows(layout: ExpertLayout, src: Sequence[int]) -> torch.Tensor:
    """``(S',)`` source row of every stacked row of the experts ``src`` (copied in that order)."""
    return torch.cat([torch.arange(layout.offsets[e], layout.offsets[e + 1]) for e in src])


def plan_expansion(
    model: Transformer, config: ExpansionConfig, utility: ExpertUtility | None = None
) -> ExpertExpansion:
    """Decide the copies: ``config.factor`` m (uniform: m-1 copies of each expert; utility: (m-1)*E
    copies allocated by :func:`allocate_copies` from ``utility``) or ``config.counts``."""
    moe = model.config.moe
    if moe is None:
        raise MoeLitError("expand_experts: the model is dense (model.moe is null); use dense_to_moe first")
    num_experts = moe.num_experts
    if config.counts is not None:
        counts_by_block = {b: _checked_counts(config.counts, num_experts) for b in model.config.moe_layer_ids}
    else:
        counts_by_block = _counts_from_factor(model, config, utility)
    sources = {b: _sources(c) for b, c in counts_by_block.items()}
    sizes = {tuple(moe.expert_sizes[e] for e in src) for src in sources.values()}
    if len(sizes) > 1:
        raise MoeLitError(
            "expand_experts: heterogeneous experts copied differently per layer give layers of different "
            "shapes, which one MoEConfig cannot describe; pass the same counts for every layer"
        )
    return ExpertExpansion(sources)


def _checked_counts(counts: Sequence[int], num_experts: int) -> list[int]:
    counts = list(counts)
    if len(counts) != num_experts or not all(isinstance(c, int) and c >= 1 for c in counts):
        raise ConfigError(f"counts: need {num_experts} integers >= 1 (instances per expert), got {counts}")
    return counts


def _counts_from_factor(model: Transformer, config: ExpansionConfig, utility: ExpertUtility | None) -> dict:
    num_experts, factor = model.config.moe_section().num_experts, config.factor
    assert factor is not None  # NOTE: the caller's branch: counts were not given, so a factor was
    blocks = model.config.moe_layer_ids
    if config.selection == "uniform":
        return {b: [factor] * num_experts for b in blocks}
    if utility is None:
        raise ConfigError("utility: selection='utility' needs an ExpertUtility (see expert_utility)")
    scores = utility.metric(config.utility_metric)
    missing = [b for b in blocks if b not in scores]
    if missing:
        raise MoeLitError(f"utility: no scores for MoE block(s) {missing}")
    return {b: allocate_copies(scores[b], (factor - 1) * num_experts, config.max_copies) for b in blocks}


def _sources(counts: Sequence[int]) -> tuple[int, ...]:
    originals = list(range(len(counts)))
    return tuple(originals + [e for e, c in enumerate(counts) for _ in range(c - 1)])


def apply_expansion(model: Transformer, plan: ExpertExpansion, config: ExpansionConfig) -> Transformer:
    """The expanded model (``model`` untouched); ``config.balancing`` null keeps the source's.

    Symmetry breaking beyond the selection-bias ``noise`` (each makes the expansion inexact):
    ``router_noise`` adds N(0, (router_noise * std of the row)^2) to every copy's router row, so a
    copy and its source get different gate weights; ``drop_fraction`` re-initialises that fraction
    of every copy's neurons (drop-upcycling, :func:`moe_lit.convert.dense_to_moe.drop_neurons`).
    """
    moe = model.config.moe_section()
    balancing = config.balancing or moe.balancing
    config.check_noise(balancing)
    src0 = next(iter(plan.sources.values()))
    sizes = [moe.expert_sizes[e] for e in src0]
    new_moe = dataclasses.replace(
        moe, num_experts=len(src0), expert_size=sizes[0] if moe.uniform else sizes, balancing=balancing
    )
    new = rebuild(model, model.config.replace(moe=new_moe))
    generator = torch.Generator().manual_seed(config.seed)
    for block, src in plan.sources.items():
        layer = new.moe_layer(block)
        _expand_layer(model.moe_layer(block), layer, src, config.noise, generator)
        _break_symmetry(layer, moe.num_experts, config.router_noise, config.drop_fraction, generator)
    return new


@torch.no_grad()
def _break_symmetry(layer: MoELayer, num_sources: int, router_noise: float, drop_fraction: float, generator) -> None:
    """Perturb the copies (experts ``num_sources..``) of an expanded layer; the sources stay."""
    copies = range(num_sources, layer.router.num_experts)
    if router_noise > 0:
        w_ED = layer.router.layer.weight
        for e in copies:
            fresh_D = torch.randn(w_ED.shape[1], generator=generator).to(w_ED)
            w_ED[e] += fresh_D * router_noise * w_ED[e].std()
    if drop_fraction > 0:
        drop_neurons(layer, drop_fraction, generator, experts=copies)


@torch.no_grad()
def _expand_layer(old: MoELayer, new: MoELayer, src: tuple[int, ...], noise: float, generator) -> None:
    """Expert rows, router rows and selection biases of one expanded layer."""
    device = old.router.layer.weight.device
    rows_S = _source_rows(old.experts.layout, src).to(device)
    for name in EXPERT_MATRICES:
        getattr(new.experts.mlp, name).copy_(getattr(old.experts.mlp, name)[rows_S])
    index_M = torch.tensor(src, device=device)
    new.router.layer.weight.copy_(old.router.layer.weight[index_M])
    if new.router.expert_bias is None:
        return
    num_sources = old.cfg.num_experts
    bias_M = old.router.expert_bias[index_M] if old.router.expert_bias is not None else torch.zeros(len(src))
    if old.cfg.score_func == "softmax":
        # NOTE: the selection ranks score + bias. The softmax over the M experts divides every
        # per-copy score by Z'/Z, which is M/E for every token when each expert has M/E
        # instances; dividing the biases by M/E too keeps the ranking exactly. With unequal
        # counts Z'/Z depends on the token and the mean factor is an approximation.
        bias_M = bias_M * (num_sources / len(src))
    jitter_M = torch.zeros(len(src))
    jitter_M[num_sources:] = (torch.rand(len(src) - num_sources, generator=generator) * 2 - 1) * noise
    new.router.expert_bias.copy_(bias_M + jitter_M.to(bias_M))


def expand_experts(
    model: Transformer,
    factor: int | None = None,
    counts: Sequence[int] | None = None,
    selection: str = "uniform",
    utility: ExpertUtility | None = None,
    utility_metric: str = "grad_sq",
    max_copies: int = MAX_COPIES,
    noise: float = 1e-3,
    balancing: Balancing | None = "bias",
    seed: int = 0,
    router_noise: float = 0.0,
    drop_fraction: float = 0.0,
) -> Transformer:
    """Grow every MoE layer of ``model`` from E to M experts: :func:`grow` by the
    :class:`ExpansionConfig` of these arguments."""
    counts = None if counts is None else list(counts)
    config = ExpansionConfig(
        factor, counts, selection, utility_metric, max_copies, noise, balancing, seed, router_noise, drop_fraction
    )
    return grow(model, config, utility)


def grow(model: Transformer, config: ExpansionConfig, utility: ExpertUtility | None = None) -> Transformer:
    """Grow every MoE layer of ``model`` from E to M experts (see the module docstring); ``utility``
    is what utility selection allocates the copies by."""
    return apply_expansion(model, plan_expansion(model, config, utility), config)


__all__ = [
    "ExpansionConfig",
    "ExpertExpansion",
    "ExpertUtility",
    "SELECTIONS",
    "UTILITY_METRICS",
    "UtilityAccumulator",
    "allocate_copies",
    "apply_expansion",
    "expand_experts",
    "expert_gradients",
    "expert_utility",
    "grow",
    "plan_expansion",
]
