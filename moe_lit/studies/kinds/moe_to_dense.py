"""Study kind ``moe_to_dense``: which way of turning a trained MoE into a dense model keeps most?

Per seed, two parents pretrain on the same tokens (the study's ``run``, same seed: same data
stream): the MoE (``model``, E experts of F neurons in every layer) and the dense baseline of the
MoE's total FFN width (``model`` with ``moe: null, d_ff = E * F``). Children start from a
parent's final weights (``init``):

* ``screen/<score>``: one evaluate-only point per expert score (``train.max_steps: 0``); its
  measurement (:func:`measure_screen`) converts the MoE with every grouping x scaling of that
  score (:func:`moe_lit.convert.moe_to_dense.screen`, scores shared) and records each dense
  model's validation loss, overall and per language, on the run's validation batches. Every
  conversion has the same final width W = groups * F: ``single`` keeps ``groups`` experts, the
  merging groupings keep ``keep`` experts and average them into ``groups`` groups;
* ``distill/<score>/<grouping>/<scaling>`` (the ``distill`` list, fixed in the study file):
  the converted model distilled from the frozen MoE parent (:class:`~moe_lit.lit.distill.DistillModule`,
  a per-point module of the engine) for the ``distillation`` budget;
* ``finetune/<...>`` (``finetune``, optional): the same conversion trained the same budget with
  the plain LM loss (does the teacher matter?);
* ``distill/dense_to_dense``: the dense parent structured-pruned to W (neurons ranked by mean
  |activation| on the same calibration text, :func:`~moe_lit.convert.prune_dense.prune_dense_ffn`)
  and distilled from its own dense parent with the same budget.

Matched: the final model config (``model`` with ``moe: null, d_ff = W``; so exactly the same
parameters), the pretraining tokens and the distillation tokens (same run, same seed). Not
matched: the parents (an E-expert MoE with k active vs a dense model of its total width).
Every distilled point also records its validation loss before distillation (the converted start
weights) and, with ``suite``, its local-suite accuracy after distillation on ``suite_limit`` items
per task (:func:`measure_distilled`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_lit.accounting import count_config_params
from moe_lit.config import ConfigError, ModelConfig
from moe_lit.convert.moe_to_dense import GROUPINGS, SCALINGS, SCORES, MoeToDenseConfig
from moe_lit.lit.run_config import _build
from moe_lit.studies.engine import Call, Point, Start
from moe_lit.studies.kinds import Analysis, check_fields
from moe_lit.studies.stats import compare_paired, format_comparison, format_summary, summarize

MODULE = "moe_lit.studies.kinds.moe_to_dense"
BASELINE = "dense_to_dense"
SPLITS = ("train", "val", "test")
DIVERSITY_SCORE = "do_acp"


@dataclass
class DistillationSpec:
    """The budget and loss of every distilled (and fine-tuned) child, identical for all of them."""

    steps: int = 150
    """Optimizer steps (batch and sequence: run.data), from a fresh optimizer and schedule."""
    lr: float = 1e-3
    """Peak learning rate of the fresh schedule."""
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

        if not isinstance(self.steps, int) or isinstance(self.steps, bool) or self.steps < 1:
            raise ConfigError(f"distillation.steps: must be an integer >= 1, got {self.steps!r}")
        if not isinstance(self.warmup, int) or isinstance(self.warmup, bool) or not 0 <= self.warmup < self.steps:
            raise ConfigError(f"distillation.warmup: must be an integer in [0, steps), got {self.warmup!r}")
        if not self.lr > 0:
            raise ConfigError(f"distillation.lr: must be > 0, got {self.lr!r}")
        try:
            DistillConfig(self.temperature, self.kl_weight, self.ce_weight)
        except ConfigError as exc:
            raise ConfigError(f"distillation.{str(exc).removeprefix('distill.')}") from None


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
    """Conversions distilled, as ``score/grouping/scaling`` (fixed in the study file; e.g. the
    screen's best on seed 0). The first is the one compared with the dense->dense baseline."""
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
        _check_parent(self.model)
        moe = self.model.moe
        for name in ("keep", "groups", "calibration_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}: must be a positive integer, got {value!r}")
        if not self.groups <= self.keep <= moe.num_experts:
            raise ConfigError(
                f"keep: must be in [groups={self.groups}, num_experts={moe.num_experts}], got {self.keep}"
            )
        for name, allowed in (("scores", SCORES), ("groupings", GROUPINGS), ("scalings", SCALINGS)):
            _check_choices(name, getattr(self, name), allowed)
        if self.keep == self.groups and any(g != "single" for g in self.groupings):
            raise ConfigError(f"groupings: merging groupings need keep > groups, got keep = groups = {self.groups}")
        if not isinstance(self.distill, list) or len(set(self.distill)) != len(self.distill):
            raise ConfigError(f"distill: must be a list of distinct score/grouping/scaling, got {self.distill!r}")
        for label in self.distill:
            self.conversion(label, "distill")
        if self.finetune is not None and self.finetune not in self.distill:
            raise ConfigError(f"finetune: must be null or one of distill {self.distill}, got {self.finetune!r}")
        languages = self.calibration_languages
        if languages is not None and (
            not isinstance(languages, list) or not languages or not all(isinstance(v, str) for v in languages)
        ):
            raise ConfigError(
                f"calibration_languages: must be null or a non-empty list of language codes, got {languages!r}"
            )
        if self.suite_limit is not None and (
            isinstance(self.suite_limit, bool) or not isinstance(self.suite_limit, int) or self.suite_limit < 1
        ):
            raise ConfigError(f"suite_limit: must be null or a positive integer, got {self.suite_limit!r}")
        if self.calibration_split not in SPLITS:
            raise ConfigError(f"calibration_split: got {self.calibration_split!r}, allowed values: {', '.join(SPLITS)}")

    @property
    def width(self) -> int:
        """W: the dense FFN width of every converted and pruned model."""
        return self.groups * self.model.moe.expert_size

    @property
    def final_model(self) -> ModelConfig:
        """The config of every converted and pruned model (so their parameters match exactly)."""
        return self.model.replace(moe=None, d_ff=self.width)

    @property
    def dense_parent(self) -> ModelConfig:
        """The dense baseline parent: the MoE's total FFN width E * F."""
        return self.model.replace(moe=None, d_ff=self.model.moe.total_expert_size)

    def conversion(self, label: str, name: str = "distill") -> MoeToDenseConfig:
        """The :class:`MoeToDenseConfig` of a ``score/grouping/scaling`` label (``single`` keeps ``groups``)."""
        parts = label.split("/") if isinstance(label, str) else []
        if len(parts) != 3:
            raise ConfigError(f"{name}: expected 'score/grouping/scaling', got {label!r}")
        score, grouping, scaling = parts
        keep = self.groups if grouping == "single" else self.keep
        try:
            return MoeToDenseConfig(score=score, keep=keep, groups=self.groups, grouping=grouping, scaling=scaling)
        except ConfigError as exc:
            raise ConfigError(f"{name}: {label!r}: {exc}") from None


def _check_parent(model: ModelConfig) -> None:
    moe = model.moe
    if moe is None:
        raise ConfigError("model.moe: the parent must be an MoE (its experts become the dense FFN)")
    if model.moe_layer_ids != tuple(range(model.n_layers)):
        raise ConfigError("model.moe: every layer must be MoE (first_dense_layers: 0, layer_interval: 1)")
    if not isinstance(moe.expert_size, int) or moe.layer_expert_sizes is not None:
        raise ConfigError("model.moe.expert_size: the experts must have one size (W = groups * expert_size)")
    if moe.shared_expert_size:
        raise ConfigError("model.moe.shared_expert_size: must be 0 (the baseline would not match a shared expert)")


def _check_choices(name: str, values: Any, allowed: tuple[str, ...]) -> None:
    if not isinstance(values, list) or not values or len(set(values)) != len(values):
        raise ConfigError(f"{name}: must be a non-empty list of distinct values, got {values!r}")
    unknown = [v for v in values if v not in allowed]
    if unknown:
        raise ConfigError(f"{name}: unknown {unknown}, allowed values: {', '.join(allowed)}")


def default_run() -> dict[str, Any]:
    return {"data": {"seq_len": 64, "batch_size": 16, "val_batches": 4}, "train": {"max_steps": 1000}}


def parse(fields: dict[str, Any], header) -> MoeToDenseSpec:
    check_fields(MoeToDenseSpec, fields, ("model",))
    model = ModelConfig.from_dict(dict(fields["model"])).replace(seq_len=header.run.data.seq_len)
    distillation = _build(DistillationSpec, fields.get("distillation"), "distillation")
    return MoeToDenseSpec(**{**fields, "model": model, "distillation": distillation})


# ----------------------------------------------------------------------------- points
def _calibration(spec: MoeToDenseSpec, header) -> dict[str, Any]:
    return {
        "data_dir": str(header.run.data.resolved_dir()),
        "calibration_tokens": spec.calibration_tokens,
        "languages": spec.calibration_languages,
        "split": spec.calibration_split,
    }


def _conversion_kwargs(cfg: MoeToDenseConfig) -> dict[str, Any]:
    # NOTE: not a record field as a whole: runs.csv reads a record's "groups" as a list of names.
    return {k: getattr(cfg, k) for k in ("score", "keep", "groups", "grouping", "scaling")}


def expand(spec: MoeToDenseSpec, header) -> list[Point]:
    calibration = _calibration(spec, header)
    dist = spec.distillation
    module = Call(
        f"{MODULE}:teacher_module",
        {"temperature": dist.temperature, "kl_weight": dist.kl_weight, "ce_weight": dist.ce_weight},
    )
    measure = Call(
        f"{MODULE}:measure_distilled",
        {"data_dir": calibration["data_dir"], "suite": spec.suite, "suite_limit": spec.suite_limit},
    )
    final = spec.final_model
    points = []
    for seed in header.seeds:
        pretrain = header.seeded_run(seed)
        distill_run = pretrain.replace(
            train={"max_steps": dist.steps, "val_every": dist.steps},
            optim={"lr": dist.lr, "warmup_steps": dist.warmup},
        )
        moe_parent, dense_parent = header.point_name("moe/pretrain", seed), header.point_name("dense/pretrain", seed)
        points.append(Point(moe_parent, "moe/pretrain", seed, spec.model, pretrain, info={"arm": "moe_parent"}))
        if spec.baseline:
            points.append(
                Point(dense_parent, "dense/pretrain", seed, spec.dense_parent, pretrain, info={"arm": "dense_parent"})
            )
        for score in spec.scores:
            name = f"screen/{score}"
            points.append(
                Point(
                    header.point_name(name, seed),
                    name,
                    seed,
                    spec.model,
                    pretrain.replace(train={"max_steps": 0}),
                    info={"arm": "screen", "score": score},
                    start=Start(parent=moe_parent, mode="init"),
                    measure=Call(
                        f"{MODULE}:measure_screen",
                        {
                            **calibration,
                            "score": score,
                            "keep": spec.keep,
                            "groups": spec.groups,
                            "groupings": spec.groupings,
                            "scalings": spec.scalings,
                            "seed": seed,
                        },
                    ),
                )
            )
        arms = [("distill", label, module) for label in spec.distill]
        if spec.finetune is not None:
            arms.append(("finetune", spec.finetune, None))
        for arm, label, arm_module in arms:
            cfg = spec.conversion(label)
            name = f"{arm}/{label}"
            points.append(
                Point(
                    header.point_name(name, seed),
                    name,
                    seed,
                    final,
                    distill_run,
                    info={
                        "arm": arm,
                        "method": "moe_to_dense",
                        "conversion": label,
                        **{k: getattr(cfg, k) for k in ("score", "grouping", "scaling", "keep")},
                    },
                    start=Start(parent=moe_parent, mode="init"),
                    transform=Call(f"{MODULE}:convert", {**calibration, **_conversion_kwargs(cfg), "seed": seed}),
                    module=arm_module,
                    measure=measure,
                )
            )
        if spec.baseline:
            name = f"distill/{BASELINE}"
            points.append(
                Point(
                    header.point_name(name, seed),
                    name,
                    seed,
                    final,
                    distill_run,
                    info={"arm": "distill", "method": BASELINE, "conversion": BASELINE},
                    start=Start(parent=dense_parent, mode="init"),
                    transform=Call(f"{MODULE}:prune_baseline", {**calibration, "width": spec.width}),
                    module=module,
                    measure=measure,
                )
            )
    _check_matched(spec)
    return points


def _check_matched(spec: MoeToDenseSpec) -> None:
    """The baseline's pruned config is the converted one: the same parameters, exactly."""
    pruned = spec.dense_parent.replace(d_ff=spec.width)
    if pruned != spec.final_model or count_config_params(pruned) != count_config_params(spec.final_model):
        raise ConfigError("model: the pruned baseline and the converted model would not match in parameters")


# ----------------------------------------------------------------------------- transforms, module, measure
def _trace(model, data_dir: str, calibration_tokens: int, languages, split: str):
    from moe_lit.convert.importance import calibration_trace
    from moe_lit.data.layout import tokenizer_file
    from moe_lit.evaluation.harness import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_file(data_dir))
    return calibration_trace(model, data_dir, tokenizer, languages, split, calibration_tokens, record_inputs=True)


def convert(
    model,
    score: str,
    keep: int,
    groups: int,
    grouping: str,
    scaling: str,
    data_dir: str,
    calibration_tokens: int,
    seed: int,
    languages: list[str] | None = None,
    split: str = "test",
):
    """The study's MoE -> dense transform: route the calibration text of ``data_dir`` through
    ``model`` and convert it (:func:`~moe_lit.convert.moe_to_dense.moe_to_dense`, pure)."""
    import torch

    from moe_lit.convert.moe_to_dense import moe_to_dense

    cfg = MoeToDenseConfig(score=score, keep=keep, groups=groups, grouping=grouping, scaling=scaling, seed=seed)
    with torch.no_grad():
        trace = _trace(model, data_dir, calibration_tokens, languages, split)
    return moe_to_dense(model, trace, cfg)[0]


def prune_baseline(
    model,
    width: int,
    data_dir: str,
    calibration_tokens: int,
    languages: list[str] | None = None,
    split: str = "test",
):
    """The dense -> dense baseline: ``model``'s FFNs cut to their ``width`` most active neurons
    (mean |activation|) on the same calibration text as the MoE's (every document window)."""
    import torch

    from moe_lit.analysis.routing import document_windows, tokenize_documents
    from moe_lit.convert.calibration import ffn_inputs
    from moe_lit.convert.prune_dense import prune_dense_ffn
    from moe_lit.data.layout import tokenizer_file
    from moe_lit.evaluation.harness import load_tokenizer, resolve_eot_id
    from moe_lit.evaluation.tasks import read_parallel

    tokenizer = load_tokenizer(tokenizer_file(data_dir))
    docs = tokenize_documents(
        read_parallel(data_dir, split, languages), tokenizer, resolve_eot_id(tokenizer), calibration_tokens
    )
    windows = [
        torch.tensor(window)[None]
        for by_doc in docs.values()
        for tokens in by_doc.values()
        for window in document_windows(tokens, model.config.seq_len)
        if len(window) > 1
    ]
    calibration = ffn_inputs(model, windows, sum(w.numel() for w in windows))
    return prune_dense_ffn(model, calibration, width)


def teacher_module(
    cfg: ModelConfig, optim, parent: Path | None, temperature: float, kl_weight: float, ce_weight: float
):
    """The distilled children's LightningModule: a DistillModule whose frozen teacher is the parent
    point's checkpoint (the engine's ``Point.module``)."""
    from moe_lit.errors import MoeLitError
    from moe_lit.lit.distill import DistillConfig, DistillModule

    if parent is None:
        raise MoeLitError("teacher_module: the point has no parent checkpoint to distil from")
    return DistillModule(cfg, optim, DistillConfig(temperature, kl_weight, ce_weight), teacher=str(parent))


def validation_batches(run) -> dict[str, list]:
    """``{language: [(B, L+1) batches]}``: the validation batches train_run validates on."""
    from moe_lit.lit.datamodule import MoEDataModule

    data = run.data
    datamodule = MoEDataModule(
        data.resolved_dir(),
        seq_len=data.seq_len,
        batch_size=data.batch_size,
        languages=data.languages,
        val_batches=data.val_batches,
        seed=run.train.seed,
    )
    return {lang: list(loader) for lang, loader in zip(datamodule.languages, datamodule.val_dataloader(), strict=True)}


def measure_distilled(
    point: Point, result: Any, run_dir: Path, data_dir: str, suite: bool, suite_limit: int | None
) -> dict[str, Any]:
    """Validation loss before distillation (the converted start weights,
    :func:`~moe_lit.studies.kinds.partition.measure_converted`) and, with ``suite``, the local
    task suite's accuracy after it (:func:`~moe_lit.evaluation.suite.suite_scores`, ``suite_limit``
    items per task)."""
    from moe_lit.studies.kinds.partition import measure_converted

    out = measure_converted(point, result, run_dir)
    if suite:
        from moe_lit.checkpoint import load_model
        from moe_lit.data.layout import tokenizer_file
        from moe_lit.evaluation.suite import suite_scores

        scores = suite_scores(load_model(result.checkpoint), str(tokenizer_file(data_dir)), data_dir, limit=suite_limit)
        out |= {
            "suite_mean_acc": scores["mean_acc"],
            "suite_mean_above_chance": scores["mean_above_chance"],
            "suite": scores,
        }
    return out


def measure_screen(
    point: Point,
    result: Any,
    run_dir: Path,
    score: str,
    keep: int,
    groups: int,
    groupings: list[str],
    scalings: list[str],
    data_dir: str,
    calibration_tokens: int,
    seed: int,
    languages: list[str] | None = None,
    split: str = "test",
) -> dict[str, Any]:
    """The screen of one score: the MoE (the point's 0-step checkpoint: its parent's weights)
    converted with every grouping x scaling, each dense model's validation loss (mean over the
    validation batches, overall and per language) before any training."""
    import time

    import torch

    from moe_lit.checkpoint import load_model
    from moe_lit.convert.moe_to_dense import screen

    start = time.perf_counter()
    model = load_model(result.checkpoint).eval()
    configs = [
        MoeToDenseConfig(
            score=score, keep=groups if g == "single" else keep, groups=groups, grouping=g, scaling=c, seed=seed
        )
        for g, c in itertools.product(groupings, scalings)
    ]
    with torch.no_grad():
        trace = _trace(model, data_dir, calibration_tokens, languages, split)
    rows = screen(model, trace, configs, validation_batches(point.run))
    return {
        "screen": [
            {
                "grouping": row["grouping"],
                "scaling": row["scaling"],
                "params": row["params"],
                "val_loss": row["loss"],
                "val_loss_per_language": row["loss_per_label"],
            }
            for row in rows
        ],
        "screen_wall_s": round(time.perf_counter() - start, 3),
    }


# ----------------------------------------------------------------------------- analysis
def screen_values(records: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    """(score, grouping, scaling) -> params and per-seed ``seed``, ``loss`` and ``per_language`` lists."""
    values: dict[tuple[str, str, str], dict[str, Any]] = {}
    for record in records:
        if record["status"] != "ok" or record.get("arm") != "screen":
            continue
        for row in record["screen"]:
            entry = values.setdefault(
                (record["score"], row["grouping"], row["scaling"]),
                {"params": row["params"], "seed": [], "loss": [], "per_language": {}},
            )
            entry["seed"].append(record["seed"])
            entry["loss"].append(row["val_loss"])
            for lang, loss in row["val_loss_per_language"].items():
                entry["per_language"].setdefault(lang, []).append(loss)
    return values


def _per_seed(values, key_of) -> dict[Any, dict[int, float]]:
    """level -> {seed: mean screen loss over the other factors} (marginal means per seed)."""
    sums: dict[Any, dict[int, list[float]]] = {}
    for key, entry in values.items():
        for seed, loss in zip(entry["seed"], entry["loss"], strict=True):
            sums.setdefault(key_of(key), {}).setdefault(seed, []).append(loss)
    return {level: {s: sum(v) / len(v) for s, v in by_seed.items()} for level, by_seed in sums.items()}


def _common_seeds(*groups: dict[int, float]) -> list[int]:
    return sorted(set.intersection(*(set(g) for g in groups))) if groups else []


FACTORS = {"score": 0, "grouping": 1, "scaling": 2}


def factor_spreads(values) -> dict[str, dict[int, float]]:
    """factor -> {seed: max - min of its levels' marginal mean screen loss}."""
    spreads = {}
    for factor, index in FACTORS.items():
        marginal = _per_seed(values, lambda key, i=index: key[i])
        seeds = _common_seeds(*marginal.values())
        spreads[factor] = {
            s: max(m[s] for m in marginal.values()) - min(m[s] for m in marginal.values()) for s in seeds
        }
    return spreads


def _paired(a: dict[int, float], b: dict[int, float]):
    seeds = _common_seeds(a, b)
    return compare_paired([a[s] for s in seeds], [b[s] for s in seeds])


def _verdict(ok: bool) -> str:
    return f"**{'reproduced' if ok else 'not reproduced'}**"


def _scoring_findings(values) -> list[str]:
    if not values:
        return []
    findings = []
    spreads = factor_spreads(values)
    if all(len({k[i] for k in values}) > 1 for i in FACTORS.values()):
        lines = []
        ok = True
        for other in ("grouping", "scaling"):
            cmp = _paired(spreads["score"], spreads[other])
            ok = ok and cmp.significant and cmp.diff > 0
            lines.append(f"score vs {other} {format_comparison(cmp)}")
        findings.append(
            "- **Scoring matters most** (paper: the scoring method matters most): spread (max - min) of the "
            "marginal mean pre-distillation val loss across the levels of each factor, per seed: "
            + "; ".join(f"{f} {format_summary(summarize(list(s.values())))}" for f, s in spreads.items())
            + f". Paired by seed: {'; '.join(lines)}; {_verdict(ok)}."
        )
    by_score = _per_seed(values, lambda key: key[0])
    others = {s: v for s, v in by_score.items() if s != DIVERSITY_SCORE}
    if DIVERSITY_SCORE in by_score and others:
        best = min(others, key=lambda s: summarize(list(others[s].values())).mean)
        cmp = _paired(by_score[DIVERSITY_SCORE], others[best])
        findings.append(
            f"- **{DIVERSITY_SCORE} is the best score** (paper: the diversity-aware score is best): its marginal "
            f"mean screen loss (over groupings x scalings) vs the best other score ({best}), paired by seed: "
            f"{format_comparison(cmp)}; {_verdict(cmp.significant and cmp.diff < 0)}."
        )
    return findings


def distilled_values(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """config_name of the distilled / fine-tuned children -> one record and per-seed values."""
    out: dict[str, dict[str, Any]] = {}
    for record in records:
        if record["status"] != "ok" or record.get("arm") not in ("distill", "finetune"):
            continue
        entry = out.setdefault(
            record["config_name"],
            {"record": record, "seed": [], "after": {}, "before": {}, "wall_s": [], "per_language": {}},
        )
        entry["seed"].append(record["seed"])
        entry["after"][record["seed"]] = record["val_loss"]
        entry["before"][record["seed"]] = record.get("val_loss_converted", math.nan)
        entry["wall_s"].append(record["wall_s"])
        entry.setdefault("suite", []).append(record.get("suite_mean_above_chance", math.nan))
        for lang, loss in (record.get("val_loss_per_language") or {}).items():
            entry["per_language"].setdefault(lang, []).append(loss)
    return out


def _distill_findings(plan: dict[str, Any], distilled) -> list[str]:
    spec = plan.get("spec", {})
    findings = []
    first = f"distill/{spec['distill'][0]}" if spec.get("distill") else None
    baseline = distilled.get(f"distill/{BASELINE}")
    if first in distilled and baseline is not None:
        for when in ("before", "after"):
            cmp = _paired(distilled[first][when], baseline[when])
            findings.append(
                f"- **MoE->dense beats dense->dense at matched parameters, {when} distillation** (paper: +6.3 pp "
                f"after distillation): {first} vs distill/{BASELINE}, val loss paired by seed: "
                f"{format_comparison(cmp)}; {_verdict(cmp.significant and cmp.diff < 0)}."
            )
    finetune = spec.get("finetune")
    if finetune and f"distill/{finetune}" in distilled and f"finetune/{finetune}" in distilled:
        cmp = _paired(distilled[f"distill/{finetune}"]["after"], distilled[f"finetune/{finetune}"]["after"])
        better = cmp.significant and cmp.diff < 0
        findings.append(
            f"- **Distillation vs the plain LM loss** for {finetune}, same steps and tokens, val loss paired by seed: "
            f"{format_comparison(cmp)}; the teacher {'helps' if better else 'makes no significant difference'}."
        )
    return findings


def _fmt(values) -> str:
    values = list(values.values()) if isinstance(values, dict) else list(values)
    return format_summary(summarize(values)) if values else ""


def _screen_rows(values) -> list[dict[str, Any]]:
    rows = []
    for (score, grouping, scaling), entry in sorted(values.items(), key=lambda kv: summarize(kv[1]["loss"]).mean):
        row = {
            "score": score,
            "grouping": grouping,
            "scaling": scaling,
            "params": f"{entry['params']:,}",
            "val loss": _fmt(entry["loss"]),
        }
        row.update({lang: f"{summarize(v).mean:.3f}" for lang, v in entry["per_language"].items()})
        rows.append(row)
    return rows


def _marginal_rows(values) -> list[dict[str, Any]]:
    rows = []
    for factor, index in FACTORS.items():
        for level, by_seed in sorted(_per_seed(values, lambda key, i=index: key[i]).items()):
            rows.append({"factor": factor, "level": level, "mean screen val loss": _fmt(by_seed)})
    return rows


def _distilled_rows(distilled) -> list[dict[str, Any]]:
    rows = []
    for name, entry in distilled.items():
        r = entry["record"]
        row = {
            "point": name,
            "loss": "KD (frozen parent)" if r["arm"] == "distill" else "LM only",
            "params": f"{r['total_params']:,}",
            "val loss before": _fmt(entry["before"]),
            "val loss after": _fmt(entry["after"]),
            "suite acc - chance": _fmt([v for v in entry["suite"] if not math.isnan(v)]),
            "wall s": f"{summarize(entry['wall_s']).mean:.0f}",
        }
        row.update({lang: f"{summarize(v).mean:.3f}" for lang, v in entry["per_language"].items()})
        rows.append(row)
    return rows


def analyse(plan: dict[str, Any], records: list[dict[str, Any]], plots_dir: Path) -> Analysis:
    values = screen_values(records)
    distilled = distilled_values(records)
    teacher = [r["val_loss"] for r in records if r["status"] == "ok" and r.get("arm") == "moe_parent"]
    dense = [r["val_loss"] for r in records if r["status"] == "ok" and r.get("arm") == "dense_parent"]
    parents = [
        {"parent": name, "val loss": _fmt(v)} for name, v in (("MoE", teacher), ("dense (E*F wide)", dense)) if v
    ]
    plots = [p for p in (plot_screen(values, plots_dir), plot_distilled(distilled, plots_dir)) if p]
    return Analysis(
        findings=_scoring_findings(values) + _distill_findings(plan, distilled),
        tables={
            "Parents after pretraining (mean ± std over seeds)": parents,
            "Screen: every conversion before distillation, val loss (mean ± std over seeds; languages: mean)": (
                _screen_rows(values)
            ),
            "Screen: marginal means per factor level (over the other factors; mean ± std over seeds)": (
                _marginal_rows(values)
            ),
            "Distilled children, same budget (mean ± std over seeds; languages: mean after)": (
                _distilled_rows(distilled)
            ),
        },
        plots=plots,
    )


def plot_screen(values, plots_dir: Path) -> Path | None:
    """Screen val loss by score, one marker per grouping, one panel per scaling (± std over seeds)."""
    if not values:
        return None
    from moe_lit.studies.report import pyplot, save_figure

    plt = pyplot()
    scores = list(dict.fromkeys(k[0] for k in values))
    groupings = list(dict.fromkeys(k[1] for k in values))
    scalings = list(dict.fromkeys(k[2] for k in values))
    fig, axes = plt.subplots(1, len(scalings), figsize=(4.5 * len(scalings), 3.8), sharey=True, squeeze=False)
    offset = 0.7 / len(groupings)
    for ax, scaling in zip(axes[0], scalings, strict=True):
        for i, grouping in enumerate(groupings):
            stats = [summarize(values.get((s, grouping, scaling), {"loss": []})["loss"]) for s in scores]
            xs = [j + (i - (len(groupings) - 1) / 2) * offset for j in range(len(scores))]
            ax.errorbar(
                xs,
                [s.mean for s in stats],
                yerr=[s.std if s.n > 1 else 0.0 for s in stats],
                fmt="o",
                markersize=4,
                capsize=2,
                label=grouping,
            )
        ax.set_xticks(range(len(scores)), scores, rotation=40, ha="right")
        ax.set_title(f"scaling: {scaling}")
    axes[0][0].set_ylabel("val loss before distillation")
    axes[0][0].legend(fontsize=7, title="grouping", title_fontsize=7)
    return save_figure(fig, Path(plots_dir) / "screen.png")


def plot_distilled(distilled, plots_dir: Path) -> Path | None:
    """Val loss before and after the same distillation budget per child (± std over seeds)."""
    if not distilled:
        return None
    from moe_lit.studies.report import pyplot, save_figure

    plt = pyplot()
    names = list(distilled)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(names)), 4.0))
    for shift, when in ((-0.12, "before"), (0.12, "after")):
        stats = [summarize(list(distilled[n][when].values())) for n in names]
        ax.errorbar(
            [i + shift for i in range(len(names))],
            [s.mean for s in stats],
            yerr=[s.std if s.n > 1 else 0.0 for s in stats],
            fmt="o",
            capsize=3,
            label=f"{when} distillation",
        )
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("val loss")
    ax.legend(fontsize=8)
    return save_figure(fig, Path(plots_dir) / "distilled.png")


__all__ = [
    "DistillationSpec",
    "MoeToDenseSpec",
    "analyse",
    "convert",
    "distilled_values",
    "expand",
    "factor_spreads",
    "measure_distilled",
    "measure_screen",
    "parse",
    "plot_distilled",
    "plot_screen",
    "prune_baseline",
    "screen_values",
    "teacher_module",
    "validation_batches",
]
