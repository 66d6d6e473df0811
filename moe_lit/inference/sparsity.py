"""Intra-expert activation sparsity: skip the neurons of an expert whose activation is tiny.

Shape legend: T tokens, D d_model, E experts, K top-k, F one expert's hidden size, S sum of hidden
sizes, p tokens routed to one expert, A its active neurons (see ``model/experts/layout.py``).

Every SwiGLU expert computes ``(silu(x w1^T) * (x v1^T)) w2`` (``w1`` is the activated gate
projection, ``v1`` the linear up projection, ``w2`` the down projection). A neuron f of a token is
*inactive* when its score is at most the expert's threshold; the score is

* ``gate``: ``|silu(x w1_f)|`` (only the gate projection is needed to decide), or
* ``gate_up``: ``|silu(x w1_f) * (x v1_f)|`` (the up projection must be computed densely too).

Thresholds are calibrated as the ``target`` quantile of the scores on calibration tokens, one per
MoE/dense FFN layer (``granularity: layer``) or one per expert (``expert``; an expert that saw no
calibration token takes its layer's threshold). The dense SwiGLU FFN of a dense layer (and a
shared expert) is one expert, so the same holds for dense models.

:func:`sparsify` is a pure transform: a copy of the model whose FFNs run the sparse path. It
computes the gate projection densely and the up and down projections only for the neurons that
are active for at least one of an expert's tokens (gathered rows of ``v1`` and ``w2``); neurons
inactive for a token are zeroed for that token, so the result does not depend on which tokens
share a step. Guarantee: with every threshold 0 (``target`` 0) the logits equal the dense
model's up to float rounding (tested to 1e-5); above 0 it changes the model by the skipped terms,
and :func:`sparsity_loss_curve` measures by how much.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from moe_lit.configbase import ConfigBase, ConfigError
from moe_lit.model.experts.grouped_swiglu import combine_slots
from moe_lit.model.experts.layout import ExpertLayout
from moe_lit.model.experts.protocol import ExpertsBackend
from moe_lit.model.experts.torch_backend import Dispatch, plan_dispatch
from moe_lit.model.mlp import SwiGLU

Rule = Literal["gate", "gate_up"]
Granularity = Literal["layer", "expert"]
RULES = ("gate", "gate_up")
GRANULARITIES = ("layer", "expert")

# NOTE: gathering copies the active rows of v1 and w2 before the matmuls read them; when most
# neurons are active for some token of the expert (many tokens per step), the dense product with
# the inactive entries zeroed reads each weight once and gives the same result.
GATHER_MAX_FRACTION = 0.5
"""Above this fraction of active neurons (union over the expert's tokens) the gate rule runs dense, masked."""

SCORES_PER_CALL = 1 << 16
"""Scores kept per expert and forward during calibration (a seeded uniform subsample beyond it)."""


@dataclass
class SparsityConfig(ConfigBase):
    """Intra-expert activation sparsity of a model (``sparsity: {target: 0.8, rule: gate}``)."""

    section: ClassVar[str] = "sparsity"

    target: float = 0.8
    """Fraction of each expert's neurons to skip on the calibration tokens, in [0, 1)."""
    rule: Rule = "gate"
    """Neuron score: 'gate' = |silu(gate)|, 'gate_up' = |silu(gate) * up|."""
    granularity: Granularity = "layer"
    """One threshold per FFN layer ('layer') or per expert ('expert')."""
    calibration_tokens: int = 4096
    """Calibration tokens used to fit the thresholds (at most)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.target, (int, float)) and 0 <= self.target < 1):
            raise ConfigError(f"sparsity.target: must be a number in [0, 1), got {self.target!r}")
        if self.rule not in RULES:
            raise ConfigError(f"sparsity.rule: got {self.rule!r}, allowed values: {', '.join(RULES)}")
        if self.granularity not in GRANULARITIES:
            raise ConfigError(
                f"sparsity.granularity: got {self.granularity!r}, allowed values: {', '.join(GRANULARITIES)}"
            )
        if not isinstance(self.calibration_tokens, int) or self.calibration_tokens <= 0:
            raise ConfigError(
                f"sparsity.calibration_tokens: must be a positive integer, got {self.calibration_tokens!r}"
            )


# ---------------------------------------------------------------------- expert views of FFN modules
@dataclass(frozen=True)
class FFNView:
    """One FFN module seen as stacked experts: ``w1_SD`` (gate), ``v1_SD`` (up), ``w2_SD`` (down)."""

    layout: ExpertLayout
    """Row offsets of the experts."""
    w1_SD: torch.Tensor
    """Gate projection rows (activated)."""
    v1_SD: torch.Tensor
    """Up projection rows."""
    w2_SD: torch.Tensor
    """Down projection rows (a transposed view for a dense SwiGLU)."""


def ffn_view(module: nn.Module) -> FFNView:
    """A dense SwiGLU is one expert (its ``w2.weight`` is (D, F): transposed here, a view)."""
    if isinstance(module, SwiGLU):
        return FFNView(
            ExpertLayout.of([module.w1.out_features]), module.w1.weight, module.v1.weight, module.w2.weight.t()
        )
    return FFNView(module.layout, module.mlp.w1, module.mlp.v1, module.mlp.w2)


def ffn_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every dense FFN of a Transformer by module name: dense SwiGLUs, shared experts, routed experts."""
    return {name: module for name, module in model.named_modules() if isinstance(module, (SwiGLU, ExpertsBackend))}


def expert_inputs(
    x_TD: torch.Tensor, indices_TK: torch.Tensor, layout: ExpertLayout, capacity: int | None
) -> tuple[Dispatch, list[tuple[int, slice]]]:
    """The training path's routing plan (looped slots) and the slot range of every expert with tokens."""
    plan = plan_dispatch(indices_TK, layout, capacity, "looped")
    ranges, start = [], 0
    for expert, rows in enumerate(plan.slots.rows):
        if rows:
            ranges.append((expert, slice(start, start + rows)))
        start += rows
    return plan, ranges


def neuron_scores(x_pD: torch.Tensor, w1_FD: torch.Tensor, v1_FD: torch.Tensor, rule: Rule) -> torch.Tensor:
    """``(p, F)`` scores: ``|silu(x w1^T)|`` or ``|silu(x w1^T) * (x v1^T)|``."""
    gate_pF = F.silu(x_pD @ w1_FD.t())
    return gate_pF.abs() if rule == "gate" else (gate_pF * (x_pD @ v1_FD.t())).abs()


def sparse_swiglu(
    x_pD: torch.Tensor, w1_FD: torch.Tensor, v1_FD: torch.Tensor, w2_FD: torch.Tensor, threshold: float, rule: Rule
) -> torch.Tensor:
    """One expert's SwiGLU without its inactive neurons: ``(p, D)``.

    ``gate``: the up and down projections run over the A neurons active for some token (gathered
    rows); ``gate_up``: the up projection is dense (the rule needs it), the down one gathered.
    """
    gate_pF = F.silu(x_pD @ w1_FD.t())
    if rule == "gate":
        keep_pF = gate_pF.abs() > threshold
        active_A = keep_pF.any(dim=0).nonzero().squeeze(1)
        if active_A.numel() > GATHER_MAX_FRACTION * w1_FD.shape[0]:
            return (gate_pF * (x_pD @ v1_FD.t())).mul_(keep_pF) @ w2_FD
        h_pA = gate_pF.index_select(1, active_A) * (x_pD @ v1_FD.index_select(0, active_A).t())
    else:
        h_pF = gate_pF.mul_(x_pD @ v1_FD.t())
        keep_pF = h_pF.abs() > threshold
        active_A = keep_pF.any(dim=0).nonzero().squeeze(1)
        h_pA = h_pF.index_select(1, active_A)
    if x_pD.shape[0] > 1:
        # NOTE: a neuron active for one token may be inactive for another: zero it there.
        h_pA = h_pA * keep_pF.index_select(1, active_A)
    return h_pA @ w2_FD.index_select(0, active_A)


# ---------------------------------------------------------------------- sparse FFN modules
class SparseExperts(nn.Module):
    """Routed experts on the sparse path; same ``mlp`` and ``bias`` (shared), plus thresholds."""

    def __init__(self, experts: nn.Module, thresholds_E: torch.Tensor, rule: Rule) -> None:
        super().__init__()
        self.mlp, self.bias, self.layout, self.rule = experts.mlp, experts.bias, experts.layout, rule
        # NOTE: non-persistent: the state dict stays the source model's, loadable both ways.
        self.register_buffer("thresholds_E", thresholds_E.to(experts.bias.device), persistent=False)

    # NOTE: eager under torch.compile (generate(compile=True)), as TorchExperts.forward: the active
    # neurons, and so every gathered shape, change with each token; traced, they would recompile.
    @torch.compiler.disable
    def forward(
        self, x_TD: torch.Tensor, weights_TK: torch.Tensor, indices_TK: torch.Tensor, capacity: int | None
    ) -> tuple[torch.Tensor, Dispatch]:
        plan, ranges = expert_inputs(x_TD, indices_TK, self.layout, capacity)
        view = ffn_view(self)
        x_PD = x_TD.index_select(0, plan.slots.token_P)
        # NOTE: one zero row at index P: capacity-dropped assignments point there.
        o_PD = x_TD.new_zeros(plan.slots.num_slots + 1, x_TD.shape[1])
        thresholds = self.thresholds_E.tolist()
        for expert, rows in ranges:
            sl = self.layout.rows(expert)
            o_PD[rows] = sparse_swiglu(
                x_PD[rows], view.w1_SD[sl], view.v1_SD[sl], view.w2_SD[sl], thresholds[expert], self.rule
            )
        return combine_slots(plan.slots, o_PD, weights_TK.to(x_TD.dtype), self.bias), plan


class SparseSwiGLU(nn.Module):
    """A dense SwiGLU FFN on the sparse path (one expert); same ``w1``, ``v1``, ``w2`` (shared)."""

    def __init__(self, mlp: SwiGLU, threshold: float, rule: Rule) -> None:
        super().__init__()
        self.w1, self.v1, self.w2, self.rule, self.threshold = mlp.w1, mlp.v1, mlp.w2, rule, float(threshold)
        # NOTE: the down projection's neurons are columns of w2.weight (D, F); a contiguous (F, D)
        # copy makes the gather read whole rows.
        self.register_buffer("w2_FD", mlp.w2.weight.detach().t().contiguous(), persistent=False)

    @torch.compiler.disable  # the active neurons' shapes change per token (see SparseExperts.forward)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_TD = x.reshape(-1, x.shape[-1])
        y_TD = sparse_swiglu(x_TD, self.w1.weight, self.v1.weight, self.w2_FD, self.threshold, self.rule)
        return y_TD.view_as(x)


# ---------------------------------------------------------------------- calibration
@dataclass
class Thresholds:
    """Calibrated thresholds: FFN module name -> ``(E,)`` tensor (one entry for a dense FFN)."""

    rule: Rule
    """The neuron score the thresholds apply to."""
    granularity: Granularity
    """'layer': every expert of an FFN shares one value; 'expert': one value each."""
    target: float
    """The calibration target sparsity."""
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    """FFN module name -> ``(E,)`` thresholds."""


@contextmanager
def scores_hook(model: nn.Module, rule: Rule, on_scores: Callable[[str, int, torch.Tensor], None]) -> Iterator[None]:
    """Call ``on_scores(ffn name, expert, scores_pF)`` for every expert of every FFN in each forward
    inside the block (the model's own computation is unchanged; hooks removed on exit)."""
    handles = []

    def hook_for(name: str, module: nn.Module):
        def hook(_module, args):
            view = ffn_view(module)
            if isinstance(module, SwiGLU):
                x_TD = args[0].reshape(-1, args[0].shape[-1])
                ranges, x_PD = [(0, slice(0, x_TD.shape[0]))], x_TD
            else:
                x_TD, _, indices_TK, capacity = args
                plan, ranges = expert_inputs(x_TD, indices_TK, view.layout, capacity)
                x_PD = x_TD.index_select(0, plan.slots.token_P)
            for expert, rows in ranges:
                sl = view.layout.rows(expert)
                on_scores(name, expert, neuron_scores(x_PD[rows], view.w1_SD[sl], view.v1_SD[sl], rule))

        return hook

    for name, module in ffn_modules(model).items():
        handles.append(module.register_forward_pre_hook(hook_for(name, module)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class ScoreSample:
    """Neuron scores seen during calibration: (FFN name, expert) -> flat float32 samples."""

    rule: Rule
    """The neuron score that was sampled."""
    num_experts: dict[str, int]
    """FFN module name -> its number of experts (1 for a dense SwiGLU)."""
    samples: dict[tuple[str, int], list[torch.Tensor]]
    """(FFN name, expert) -> flat score samples, one tensor per forward."""


@torch.inference_mode()
def collect_scores(
    model: nn.Module, batches: Iterable[torch.Tensor], rule: Rule, max_tokens: int, seed: int = 0
) -> ScoreSample:
    """Run ``batches`` (``(B, L)`` token ids) through ``model`` until ``max_tokens`` tokens, keeping scores."""
    generator = torch.Generator().manual_seed(seed)
    samples: dict[tuple[str, int], list[torch.Tensor]] = {}

    def keep(name: str, expert: int, scores_pF: torch.Tensor) -> None:
        flat = scores_pF.reshape(-1).float().cpu()
        if flat.numel() > SCORES_PER_CALL:
            flat = flat[torch.randperm(flat.numel(), generator=generator)[:SCORES_PER_CALL]]
        samples.setdefault((name, expert), []).append(flat)

    device = next(model.parameters()).device
    seen = 0
    with scores_hook(model, rule, keep):
        for idx_BL in batches:
            if seen >= max_tokens:
                break
            model(idx_BL.to(device))
            seen += idx_BL.numel()
    if not samples:
        raise ConfigError("sparsity.calibration_tokens: no calibration tokens were given")
    num_experts = {name: ffn_view(module).layout.num_experts for name, module in ffn_modules(model).items()}
    return ScoreSample(rule, num_experts, samples)


def _quantile(values: torch.Tensor, target: float) -> float:
    """The ``target`` quantile (k-th smallest, k = ceil(target * n)); 0 for target 0."""
    k = math.ceil(target * values.numel())
    return 0.0 if k == 0 else float(values.kthvalue(k).values)


def thresholds_at(sample: ScoreSample, target: float, granularity: Granularity) -> Thresholds:
    """Thresholds for ``target`` sparsity from a calibration sample (cheap: reuse one sample)."""
    SparsityConfig(target=target, rule=sample.rule, granularity=granularity)
    values: dict[str, torch.Tensor] = {}
    for name, num_experts in sample.num_experts.items():
        per_expert = {
            e: torch.cat(sample.samples[(name, e)]) for e in range(num_experts) if (name, e) in sample.samples
        }
        if not per_expert:
            continue
        layer = _quantile(torch.cat(list(per_expert.values())), target)
        out_E = torch.full((num_experts,), layer)
        if granularity == "expert":
            for expert, scores in per_expert.items():
                out_E[expert] = _quantile(scores, target)
        values[name] = out_E
    return Thresholds(sample.rule, granularity, target, values)


def calibrate(model: nn.Module, batches: Iterable[torch.Tensor], cfg: SparsityConfig) -> Thresholds:
    """Thresholds for ``cfg`` fitted on ``batches`` (at most ``cfg.calibration_tokens`` tokens)."""
    sample = collect_scores(model, batches, cfg.rule, cfg.calibration_tokens)
    return thresholds_at(sample, cfg.target, cfg.granularity)


def sparsify(model: nn.Module, thresholds: Thresholds) -> nn.Module:
    """A copy of ``model`` whose FFNs skip their inactive neurons (``model`` is untouched)."""
    out = copy.deepcopy(model)
    modules = ffn_modules(out)
    missing = sorted(set(modules) - set(thresholds.values))
    if missing:
        raise ConfigError(f"sparsity: no calibrated threshold for {missing[:3]}; calibrate on this model")
    for name, module in modules.items():
        parent_name, _, attr = name.rpartition(".")
        parent = out.get_submodule(parent_name) if parent_name else out
        values = thresholds.values[name]
        if isinstance(module, SwiGLU):
            sparse: nn.Module = SparseSwiGLU(module, float(values[0]), thresholds.rule)
        else:
            sparse = SparseExperts(module, values, thresholds.rule)
        setattr(parent, attr, sparse)
    return out.eval()


def sparse_model(model: nn.Module, cfg: SparsityConfig | None, batches: Iterable[torch.Tensor]) -> nn.Module:
    """The model as ``cfg`` asks: itself when None, else calibrated on ``batches`` and sparsified."""
    return model if cfg is None else sparsify(model, calibrate(model, batches, cfg))


def token_batches(ids: Sequence[int], seq_len: int, batch_size: int = 8) -> list[torch.Tensor]:
    """Calibration batches ``(B, seq_len)`` cut from one token stream (a last partial row dropped,
    unless it is the only one)."""
    rows = [ids[i : i + seq_len] for i in range(0, max(len(ids) - seq_len + 1, 1), seq_len)]
    if not rows or not rows[0]:
        raise ConfigError("sparsity: the calibration text has no tokens")
    if len(rows) == 1:
        return [torch.tensor([rows[0]])]
    return [torch.tensor(rows[i : i + batch_size]) for i in range(0, len(rows), batch_size)]


def text_calibration(tokenizer, path: Any, seq_len: int, max_tokens: int) -> list[torch.Tensor]:
    """Calibration batches from a UTF-8 text file, tokenized with ``tokenizer`` (``tokenizers``)."""
    from pathlib import Path

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"sparsity calibration: no such text file {path}")
    ids = tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False).ids[:max_tokens]
    return token_batches(ids, seq_len)


# ---------------------------------------------------------------------- statistics and loss
Counts = dict[tuple[str, str, int], list[float]]


def _inactive_counter(thresholds: Sequence[Thresholds], counts: Sequence[Counts], language: str):
    """A :func:`scores_hook` callback adding, per thresholds, routed tokens and inactive fractions."""

    def count(name: str, expert: int, scores_pF: torch.Tensor) -> None:
        for limits, into in zip(thresholds, counts, strict=True):
            entry = into.setdefault((language, name, expert), [0.0, 0.0])
            entry[0] += scores_pF.shape[0]
            entry[1] += float((scores_pF <= limits.values[name][expert]).sum()) / scores_pF.shape[1]

    return count


def _statistics_rows(counts: Counts) -> list[dict[str, Any]]:
    return [
        {"language": language, "ffn": name, "expert": expert, "assignments": int(n), "inactive": inactive / n}
        for (language, name, expert), (n, inactive) in counts.items()
    ]


def _one_rule(thresholds: Sequence[Thresholds]) -> Rule:
    rules = {t.rule for t in thresholds}
    if len(rules) != 1:
        raise ConfigError(f"sparsity.rule: the thresholds must share one rule, got {sorted(rules)}")
    return rules.pop()


@torch.inference_mode()
def sparsity_statistics(
    model: nn.Module, thresholds: Thresholds, batches_by_language: Mapping[str, Iterable[torch.Tensor]]
) -> list[dict[str, Any]]:
    """Inactive-neuron fraction per (language, FFN, expert) at ``thresholds`` on the dense ``model``.

    Rows: ``language, ffn, expert, assignments`` (routed tokens), ``inactive`` (fraction of their
    neuron activations at or below the threshold). Sort by ``inactive`` for the sparsest experts.
    """
    counts: Counts = {}
    device = next(model.parameters()).device
    for language, batches in batches_by_language.items():
        with scores_hook(model, thresholds.rule, _inactive_counter([thresholds], [counts], language)):
            for idx_BL in batches:
                model(idx_BL.to(device))
    return _statistics_rows(counts)


@torch.inference_mode()
def dense_loss_and_statistics(
    model: nn.Module, thresholds: Sequence[Thresholds], eval_by_language: Mapping[str, Sequence[torch.Tensor]]
) -> tuple[dict[str, float], list[list[dict[str, Any]]]]:
    """The dense model's :func:`mean_loss` per language and, from the same forwards, the
    :func:`sparsity_statistics` rows of every thresholds (one pass for all targets)."""
    counts: list[Counts] = [{} for _ in thresholds]
    rule = _one_rule(thresholds)
    dense = {}
    for language, batches in eval_by_language.items():
        with scores_hook(model, rule, _inactive_counter(thresholds, counts, language)):
            dense[language] = mean_loss(model, batches)
    return dense, [_statistics_rows(c) for c in counts]


@torch.inference_mode()
def mean_loss(model: nn.Module, batches: Iterable[torch.Tensor]) -> float:
    """Token-weighted mean next-token cross-entropy of ``(B, L)`` batches."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for idx_BL in batches:
        idx_BL = idx_BL.to(device)
        tokens = idx_BL[:, 1:].numel()
        total += float(model(idx_BL[:, :-1], targets_BL=idx_BL[:, 1:]).ce) * tokens
        count += tokens
    if count == 0:
        raise ConfigError("sparsity: the evaluation batches hold no scored tokens")
    return total / count


def sample_loss_curve(
    model: nn.Module,
    sample: ScoreSample,
    eval_by_language: Mapping[str, Sequence[torch.Tensor]],
    targets: Sequence[float],
    granularity: Granularity = "layer",
) -> tuple[list[dict[str, Any]], dict[float, list[dict[str, Any]]]]:
    """:func:`sparsity_loss_curve` from a calibration sample, with the :func:`sparsity_statistics`
    rows of every target (target -> rows) measured on the evaluation tokens."""
    thresholds = [thresholds_at(sample, target, granularity) for target in targets]
    dense, statistics = dense_loss_and_statistics(model, thresholds, eval_by_language)
    rows = []
    for target, limits, stats in zip(targets, thresholds, statistics, strict=True):
        sparse = sparsify(model, limits)
        for language, batches in eval_by_language.items():
            mine = [r for r in stats if r["language"] == language]
            weight = sum(r["assignments"] for r in mine)
            loss = mean_loss(sparse, batches)
            rows.append(
                {
                    "target": target,
                    "rule": sample.rule,
                    "granularity": granularity,
                    "language": language,
                    "loss": loss,
                    "dense_loss": dense[language],
                    "increase": loss / dense[language] - 1.0,
                    "inactive": sum(r["inactive"] * r["assignments"] for r in mine) / max(weight, 1),
                }
            )
    return rows, dict(zip(targets, statistics, strict=True))


def sparsity_loss_curve(
    model: nn.Module,
    calibration: Iterable[torch.Tensor],
    eval_by_language: Mapping[str, Sequence[torch.Tensor]],
    targets: Sequence[float],
    rule: Rule = "gate",
    granularity: Granularity = "layer",
    calibration_tokens: int = 4096,
) -> list[dict[str, Any]]:
    """Loss per language vs target sparsity (the measurement the ``sparsity`` study reports).

    One calibration sample serves every target. Rows: ``target, rule, granularity, language, loss,
    dense_loss, increase`` (relative loss increase, 0.01 = 1%) and ``inactive`` (mean inactive
    fraction over the language's routed activations, on the evaluated positions).
    """
    sample = collect_scores(model, calibration, rule, calibration_tokens)
    return sample_loss_curve(model, sample, eval_by_language, targets, granularity)[0]


def highest_target_within(rows: Sequence[Mapping[str, Any]], max_increase: float = 0.01) -> float | None:
    """The highest target of a :func:`sparsity_loss_curve` whose loss increase is at most
    ``max_increase`` in every language (None when none is)."""
    worst: dict[float, float] = {}
    for row in rows:
        worst[row["target"]] = max(worst.get(row["target"], float("-inf")), row["increase"])
    within = [target for target, increase in worst.items() if increase <= max_increase]
    return max(within, default=None)
