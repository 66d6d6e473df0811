"""Study kind ``moe_to_dense``: which way of turning a trained MoE into a dense model keeps most?

Per seed two parents pretrain on the same tokens: the MoE (``model``: E experts of F neurons in every layer) and the
dense model of its total FFN width E * F. ``screen/<score>`` converts the MoE by every grouping x scaling of one score,
W = groups * F wide, and validates each; ``distill/<score>/<grouping>/<scaling>`` distils one from the frozen MoE
(``finetune/...``: LM loss), ``distill/dense_to_dense`` the dense parent pruned to W from itself. Claims, paired by
seed: scoring matters more than grouping and scaling; the diversity-aware score is best; MoE->dense beats dense->dense
(val loss before / after, suite accuracy after); the teacher beats the LM loss.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_lit.config import ModelConfig
from moe_lit.convert import recipes
from moe_lit.convert.moe_to_dense import GROUPINGS, SCALINGS, SCORES, MoeToDenseConfig
from moe_lit.stats import format_values, summarize
from moe_lit.studies import plots
from moe_lit.studies import spec as check
from moe_lit.studies.identity import Call, Point
from moe_lit.studies.kinds import Analysis
from moe_lit.studies.measures import conversion_screen, final_model, start_validation, suite_fields
from moe_lit.studies.records import best, cells, collect, language_means, select
from moe_lit.studies.verdicts import HIGHER, LOWER, TRAINED_MOE, Claim, Subject, about

BASELINE, DIVERSITY_SCORE = "dense_to_dense", "do_acp"
FACTORS = {"score": 0, "grouping": 1, "scaling": 2}
PAPER_GAIN = 0.063
"""The paper: MoE->dense is 6.3 points of accuracy better than dense->dense after distillation."""
BEATS = "MoE->dense beats dense->dense"
CONVERSION = ("score", "keep", "groups", "grouping", "scaling")
# NOTE: not a record field as a whole: runs.csv reads a record's "groups" as a list of names.
TABLES = (
    "Parents after pretraining (mean ± std over seeds)",
    "Screen: every conversion before distillation, val loss (mean ± std over seeds; languages: mean)",
    "Screen: marginal means per factor level (over the other factors; mean ± std over seeds)",
    "Distilled children, same budget (mean ± std over seeds; languages: mean after)",
)
DISTILLED = {"val loss before": "before", "val loss after": "after", "suite acc - chance": "suite"}
WHEN = ("before", "after")
"""The distilled children's val loss before and after the distillation."""


@dataclass
class DistillationSpec(check.FineTune):
    """The budget and loss of every distilled (and fine-tuned) child, identical for all of them."""

    steps: int = 150
    """Optimizer steps (batch and sequence: run.data), from a fresh optimizer and schedule."""
    warmup: int = 15
    """Warmup steps of the fresh schedule."""
    temperature: float = 1.0
    """Softmax temperature of the KL term."""
    kl_weight: float = 1.0
    """Weight of the forward KL to the frozen teacher (times temperature^2)."""
    ce_weight: float = 1.0
    """Weight of the LM cross-entropy."""

    def __post_init__(self) -> None:
        from moe_lit.lit.distill import DistillConfig

        super().__post_init__()
        with check.errors_under("", strip="distill."):
            DistillConfig(self.temperature, self.kl_weight, self.ce_weight)


@dataclass
class MoeToDenseSpec:
    """The kind's own fields."""

    model: ModelConfig
    """The MoE parent: every layer MoE, equal experts, no shared expert (seq_len from run.data.seq_len)."""
    keep: int = 4
    """Experts kept per layer by the merging groupings (weight | output | kmeans | kmeans_output)."""
    groups: int = 2
    """Groups per layer: the dense width W is groups * expert_size (single keeps exactly this many experts)."""
    scores: list[str] = field(default_factory=lambda: list(SCORES))
    """Expert scores screened (moe_lit.convert.moe_to_dense.SCORES)."""
    groupings: list[str] = field(default_factory=lambda: list(GROUPINGS))
    """Groupings screened for every score."""
    scalings: list[str] = field(default_factory=lambda: list(SCALINGS))
    """Scalings screened for every score and grouping."""
    distill: list[str] = field(default_factory=list)
    """Conversions distilled, as ``score/grouping/scaling`` (fixed in the study file); the first faces dense->dense."""
    finetune: str | None = None
    """A ``score/grouping/scaling`` of ``distill`` also trained with the plain LM loss (null: none)."""
    baseline: bool = True
    """Add the dense->dense baseline (the dense parent pruned to W, distilled from it)."""
    calibration_languages: list[str] | None = None
    """Languages of the calibration text; null = every language of the data (the mix)."""
    calibration_split: str = "test"
    """Split of the parallel text the calibration routes (test: held out from training and validation)."""
    calibration_tokens: int = 1024
    """Calibration tokens per language (scores, groups, scales and the baseline's neuron ranking)."""
    distillation: DistillationSpec = field(default_factory=DistillationSpec)
    """The same distillation budget and loss for every distilled child."""
    suite: bool = True
    """Score every distilled / fine-tuned child on the local task suite after training."""
    suite_limit: int | None = 20
    """Items per local-suite task (lm-eval's limit; null = every item)."""

    def __post_init__(self) -> None:
        model, moe = self.model, self.model.moe
        check.require(moe is not None, "model.moe", "the parent must be an MoE (its experts become the dense FFN)")
        every = model.moe_layer_ids == tuple(range(model.n_layers))
        check.require(every, "model.moe", "every layer must be MoE (first_dense_layers: 0, layer_interval: 1)")
        one_size = isinstance(moe.expert_size, int) and moe.layer_expert_sizes is None and not moe.shared_expert_size
        check.require(one_size, "model.moe", "the experts must have one size and no shared expert (W = groups * F)")
        check.positive_fields(self, "keep", "groups", "calibration_tokens")
        why = f"must be in [groups={self.groups}, num_experts={moe.num_experts}], got {self.keep}"
        check.require(self.groups <= self.keep <= moe.num_experts, "keep", why)
        for name, allowed in (("scores", SCORES), ("groupings", GROUPINGS), ("scalings", SCALINGS)):
            check.distinct(getattr(self, name), name, allowed=allowed)
        merging = self.keep == self.groups and any(g != "single" for g in self.groupings)
        why = f"merging groupings need keep > groups, got keep = groups = {self.groups}"
        check.require(not merging, "groupings", why)
        check.distinct(self.distill, "distill", what="score/grouping/scaling", empty=True)
        for label in self.distill:
            self.conversion(label, "distill")
        why = f"must be null or one of distill {self.distill}, got {self.finetune!r}"
        check.require(self.finetune is None or self.finetune in self.distill, "finetune", why)
        check.languages(self.calibration_languages, "calibration_languages")
        check.positive_int(self.suite_limit, "suite_limit", optional=True)
        check.choice(self.calibration_split, "calibration_split", check.SPLITS)

    @property
    def width(self) -> int:
        """W: the dense FFN width of every converted and pruned model."""
        return self.groups * self.model.moe.expert_size

    @property
    def dense_parent(self) -> ModelConfig:
        """The dense baseline parent: the MoE's total FFN width E * F."""
        return self.model.replace(moe=None, d_ff=self.model.moe.total_expert_size)

    def conversion(self, label: str, name: str = "distill") -> MoeToDenseConfig:
        """The :class:`MoeToDenseConfig` of a ``score/grouping/scaling`` label (``single`` keeps ``groups``)."""
        parts = label.split("/") if isinstance(label, str) else []
        check.require(len(parts) == 3, name, f"expected 'score/grouping/scaling', got {label!r}")
        score, grouping, scaling = parts
        keep = self.groups if grouping == "single" else self.keep
        with check.errors_under(f"{name}: {label!r}: "):
            return MoeToDenseConfig(score=score, keep=keep, groups=self.groups, grouping=grouping, scaling=scaling)


DEFAULT_RUN = {"data": {"seq_len": 64, "batch_size": 16, "val_batches": 4}, "train": {"max_steps": 1000}}
PAPER, HERE = (
    Subject(TRAINED_MOE, "pretrained MoE LLMs (Qwen3-30B-A3B, DeepSeek-V2-Lite, GPT-OSS-20B)"),
    "scale and budget in the description above",
)
"""What the paper tested its claims on, and the study's scale (its object: :func:`analyse`)."""
parse = check.parser(MoeToDenseSpec, ("model",))


# ----------------------------------------------------------------------------- points
def expand(spec: MoeToDenseSpec, header) -> list[Point]:
    # NOTE: one config for every converted and pruned model, so that their parameters match exactly
    final = spec.model.replace(moe=None, d_ff=spec.width)
    data_dir, dist = str(header.run.data.resolved_dir()), spec.distillation
    calibration = {"data_dir": data_dir, "calibration_tokens": spec.calibration_tokens}
    calibration |= {"languages": spec.calibration_languages, "split": spec.calibration_split}
    module = Call.of(teacher_module, temperature=dist.temperature, kl_weight=dist.kl_weight, ce_weight=dist.ce_weight)
    measure = Call.of(measure_distilled, data_dir=data_dir, suite=spec.suite, suite_limit=spec.suite_limit)
    screening = {**calibration, "keep": spec.keep, "groups": spec.groups, "groupings": spec.groupings}
    arms = [("distill", label, module) for label in spec.distill]
    arms += [("finetune", spec.finetune, None)] if spec.finetune is not None else []
    baseline = {"arm": "distill", "method": BASELINE, "conversion": BASELINE}
    parents = [("moe", spec.model, "moe_parent")] + [("dense", spec.dense_parent, "dense_parent")] * spec.baseline
    points: list[Point] = []
    for seed in header.seeds:
        pretrain = header.seeded_run(seed)
        distill_run, screen_run = dist.run(pretrain), pretrain.replace(train={"max_steps": 0})
        starts = {parent: header.start(f"{parent}/pretrain", seed) for parent in ("moe", "dense")}
        points += [header.point(f"{p}/pretrain", seed, model, pretrain, {"arm": arm}) for p, model, arm in parents]
        for score in spec.scores:
            probe = Call.of(measure_screen, **screening, score=score, scalings=spec.scalings, seed=seed)
            info = {"arm": "screen", "score": score}
            points.append(
                header.point(f"screen/{score}", seed, spec.model, screen_run, info, starts["moe"], measure=probe)
            )
        children = []  # (config name, info, parent, transform, module)
        for arm, label, arm_module in arms:
            cfg = spec.conversion(label)
            info = {"arm": arm, "method": "moe_to_dense", "conversion": label}
            info |= {k: getattr(cfg, k) for k in ("score", "grouping", "scaling", "keep")}
            conversion = {k: getattr(cfg, k) for k in CONVERSION}
            transform = Call.of(recipes.moe_to_dense_on_text, **calibration, **conversion, seed=seed)
            children.append((f"{arm}/{label}", info, "moe", transform, arm_module))
        if spec.baseline:
            transform = Call.of(recipes.prune_dense_to_width, **calibration, width=spec.width)
            children.append((f"distill/{BASELINE}", baseline, "dense", transform, module))
        for name, info, parent, transform, teacher in children:
            points.append(
                header.point(name, seed, final, distill_run, info, starts[parent], transform, (), measure, teacher)
            )
    return points


# ----------------------------------------------------------------------------- transforms, module, measures
def teacher_module(cfg, optim, parent: Path | None, temperature: float, kl_weight: float, ce_weight: float):
    """The distilled children's ``Point.module``: a DistillModule whose frozen teacher is the parent's checkpoint."""
    from moe_lit.errors import MoeLitError
    from moe_lit.lit.distill import DistillConfig, DistillModule

    if parent is None:
        raise MoeLitError("teacher_module: the point has no parent checkpoint to distil from")
    return DistillModule(cfg, optim, DistillConfig(temperature, kl_weight, ce_weight), teacher=str(parent))


def measure_distilled(point: Point, result: Any, run_dir: Path, data_dir: str, suite: bool, suite_limit: int | None):
    """Validation loss of the converted start weights (:func:`.measures.start_validation`) and, with ``suite``,
    local-suite accuracy after the distillation (:func:`.measures.suite_fields`, ``suite_limit`` items per task)."""
    scores = suite_fields(final_model(result), data_dir, suite_limit) if suite else {}
    return start_validation(point, run_dir) | scores


def measure_screen(point: Point, result: Any, run_dir: Path, score: str, keep: int, groups: int, **options: Any):
    """The screen of one score (:func:`.measures.conversion_screen`): the MoE converted with every ``groupings`` x
    ``scalings`` of it, each dense model validated (the other ``options``: its calibration)."""
    grid = itertools.product(options.pop("groupings"), options.pop("scalings"))
    one = {"score": score, "groups": groups, "seed": options.pop("seed")}
    configs = [MoeToDenseConfig(keep=groups if g == "single" else keep, grouping=g, scaling=c, **one) for g, c in grid]
    return conversion_screen(result.checkpoint, point.run, configs, **options)


# ----------------------------------------------------------------------------- analysis
Screen = dict[tuple[str, str, str], dict[str, Any]]
"""(score, grouping, scaling) -> ``params``, ``loss`` and ``per_language`` (seed -> value)."""


def screen_values(records: list[dict[str, Any]]) -> Screen:
    """The screen's conversions (:data:`Screen`) of every seed."""
    items = []
    for r, row in ((record, row) for record in select(records, arm="screen") for row in record["screen"]):
        values = {"params": row["params"], "loss": row["val_loss"], "per_language": row["val_loss_per_language"]}
        items.append(((r["score"], row["grouping"], row["scaling"]), r["seed"], values))
    return collect(items)


def marginal(values: Screen, factor: str) -> dict[str, dict[int, float]]:
    """level of ``factor`` -> seed -> its mean screen loss over the other factors."""
    sums: dict[str, dict[int, list[float]]] = {}
    for key, entry in values.items():
        for seed, loss in entry["loss"].items():
            sums.setdefault(key[FACTORS[factor]], {}).setdefault(seed, []).append(loss)
    return {level: {s: sum(v) / len(v) for s, v in by_seed.items()} for level, by_seed in sums.items()}


def factor_spreads(values: Screen) -> dict[str, dict[int, float]]:
    """factor -> seed -> max - min of its levels' marginal mean screen loss."""
    spreads = {}
    for factor in FACTORS:
        levels = marginal(values, factor).values()
        seeds = sorted(set.intersection(*(set(m) for m in levels))) if levels else []
        spreads[factor] = {s: max(m[s] for m in levels) - min(m[s] for m in levels) for s in seeds}
    return spreads


def _screen_claims(values: Screen) -> list:
    claims, spreads, by_score = [], factor_spreads(values), marginal(values, "score")
    if all(len({k[i] for k in values}) > 1 for i in FACTORS.values()):
        for other in ("grouping", "scaling"):
            text = f"scoring matters more than {other} (spread of marginal screen loss)"
            claims.append(Claim(text, "spread", ("score", other), HIGHER).on(spreads["score"], spreads[other]))
    others = {s: v for s, v in by_score.items() if s != DIVERSITY_SCORE}
    if DIVERSITY_SCORE in by_score and (rival := best(others)) is not None:
        text = f"the diversity-aware score ({DIVERSITY_SCORE}) is best"
        claim = Claim(text, "marginal screen loss", (DIVERSITY_SCORE, rival), LOWER)
        claims.append(claim.on(by_score[DIVERSITY_SCORE], others[rival]))
    return claims


def distilled_values(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Distilled / fine-tuned children: config_name -> record, after / before, wall_s, suite, per_language (by seed)."""
    items = []
    for r in (r for r in select(records) if r.get("arm") in ("distill", "finetune")):
        values = {"record": r, "after": r["val_loss"], "before": r.get("val_loss_converted", math.nan)}
        values |= {"wall_s": r["wall_s"], "suite": r.get("suite_mean_above_chance", math.nan)}
        items.append((r["config_name"], r["seed"], values | {"per_language": r.get("val_loss_per_language") or {}}))
    return collect(items)


def _distill_claims(plan: dict[str, Any], distilled) -> list:
    spec, claims = plan.get("spec", {}), []
    first, baseline = f"distill/{(spec.get('distill') or [''])[0]}", distilled.get(f"distill/{BASELINE}")
    if first in distilled and baseline is not None:
        arms = (first, f"distill/{BASELINE}")
        for when in WHEN:
            claim = Claim(f"{BEATS} at matched parameters, {when} distillation", "val loss", arms, LOWER)
            claims.append(claim.on(distilled[first][when], baseline[when]))
        suite = {s: v for s, v in distilled[first]["suite"].items() if not math.isnan(v)}
        text = f"{BEATS} after distillation (paper: +6.3 points)"
        claim = Claim(text, "suite acc above chance", arms, HIGHER, paper=PAPER_GAIN)
        claims.append(claim.on(suite, baseline["suite"]) if suite else claim.missing("no suite accuracy measured"))
    tuned = [f"{arm}/{spec.get('finetune')}" for arm in ("distill", "finetune")]
    if spec.get("finetune") and all(name in distilled for name in tuned):
        claim = Claim(f"distillation beats the plain LM loss ({spec['finetune']})", "val loss", tuple(tuned), LOWER)
        claims.append(claim.on(distilled[tuned[0]]["after"], distilled[tuned[1]]["after"]))
    return claims


def _distilled_row(name: str, entry: dict[str, Any]) -> dict[str, Any]:
    r, suite = next(iter(entry["record"].values())), {s: v for s, v in entry["suite"].items() if not math.isnan(v)}
    row = {"point": name, "loss": "KD (frozen parent)" if r["arm"] == "distill" else "LM only"}
    row |= {"params": f"{r['total_params']:,}"} | cells(entry | {"suite": suite}, DISTILLED)
    wall = {"wall s": f"{summarize(list(entry['wall_s'].values())).mean:.0f}"}
    return row | wall | language_means(entry["per_language"], 3)


def analyse(plan: dict[str, Any], records: list[dict[str, Any]], plots_dir: Path) -> Analysis:
    values, distilled = screen_values(records), distilled_values(records)
    parents = [("MoE", select(records, arm="moe_parent")), ("dense (E*F wide)", select(records, arm="dense_parent"))]
    parents = [{"parent": name, "val loss": format_values([r["val_loss"] for r in rs])} for name, rs in parents if rs]
    screen_rows = [
        {"score": k[0], "grouping": k[1], "scaling": k[2], "params": f"{next(iter(e['params'].values())):,}"}
        | cells(e, {"val loss": "loss"})
        | language_means(e["per_language"], 3)
        for k, e in sorted(values.items(), key=lambda kv: summarize(list(kv[1]["loss"].values())).mean)
    ]
    marginal_rows = [
        {"factor": factor, "level": level, "mean screen val loss": format_values(list(by_seed.values()))}
        for factor in FACTORS
        for level, by_seed in sorted(marginal(values, factor).items())
    ]
    rows = [parents, screen_rows, marginal_rows, [_distilled_row(n, e) for n, e in distilled.items()]]
    scores, groupings, scalings = (list(dict.fromkeys(k[i] for k in values)) for i in range(3))
    screen = [
        {"names": scores, "title": f"scaling: {c}", "rotation": 40}
        | {"series": {g: [values.get((s, g, c), {"loss": {}})["loss"] for s in scores] for g in groupings}}
        for c in scalings
    ]
    ylabel, width = "val loss before distillation", max(5.0, 1.1 * len(distilled))
    written = [plots.category_figure(plots_dir, "screen", screen, 4.5, 3.8, sharey=True, ylabel=ylabel)] * bool(values)
    after = {"names": list(distilled), "ylabel": "val loss", "rotation": 30}
    after["series"] = {f"{w} distillation": [e[w] for e in distilled.values()] for w in WHEN}
    written += [plots.category_figure(plots_dir, "distilled", [after], width, 4.0)] if distilled else []
    claims = about(_screen_claims(values) + _distill_claims(plan, distilled), PAPER, Subject(TRAINED_MOE, HERE))
    return Analysis(claims=claims, tables=dict(zip(TABLES, rows, strict=True)), plots=written)


__all__ = ["MoeToDenseSpec", "analyse", "expand", "measure_distilled", "measure_screen", "parse"]
