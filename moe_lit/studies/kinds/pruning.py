"""Study kind ``pruning``: how much of an MoE's quality survives removing experts, per method?

Per seed: an MoE parent pretrains long enough that its experts specialise; every child starts
from its final weights (``init``) and prunes a fraction of each MoE layer's experts with one
importance method of :mod:`moe_lit.convert.importance` (calibrated on the ``calibration_split``
text of every language, the mix, or of ``calibration_languages``), through the transform
:func:`prune_by_importance`. Each pruned model is evaluated twice: as it is (``train.max_steps:
0``: the run only validates) and after a short recovery fine-tune with the plain LM loss.

Retention (:mod:`moe_lit.evaluation.retention`) = original / pruned val loss per language (1 =
nothing lost) on the same validation batches. The reference of a pruned model is the parent's
final validation; that of a recovered one is the control ``original/recovered``: the unpruned
parent fine-tuned with the same recovery run, so the extra training is not counted as retention.
Its mean and its variance across languages are MAESTRO's two claims (better retention than the
best baseline at 50% compression, lower variance across tasks), each tested against the seed
noise (paired t-test: every method prunes the same seed's parent).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_lit.config import ConfigError, ModelConfig
from moe_lit.convert.importance import METHODS
from moe_lit.errors import MoeLitError
from moe_lit.studies.engine import Call, Point, Start
from moe_lit.studies.kinds import Analysis, check_fields
from moe_lit.studies.stats import compare_paired, format_comparison, format_summary, summarize

ARMS = ("pruned", "recovered")
"""pruned: evaluated as it is; recovered: after the recovery fine-tune."""
CLAIM_FRACTION = 0.5
"""MAESTRO's claims are stated at 50% compression."""
SPLITS = ("train", "val", "test")
TRANSFORM = "moe_lit.studies.kinds.pruning:prune_by_importance"
MEASURE = "moe_lit.studies.kinds.pruning:measure_memory"
MEASURE_TASKS = "moe_lit.studies.kinds.pruning:measure_tasks"


@dataclass
class PruningSpec:
    """The kind's own fields."""

    model: ModelConfig
    """The MoE parent (seq_len from run.data.seq_len); its pretraining budget is run.train."""
    fractions: list[float] = field(default_factory=lambda: [0.25, 0.5])
    """Shares of every MoE layer's experts removed (each in (0, 1))."""
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    """Importance methods (moe_lit.convert.importance.METHODS)."""
    calibration_languages: list[str] | None = None
    """Languages of the calibration text; null = every language of the data (the mix)."""
    calibration_split: str = "test"
    """Split of the parallel text the calibration routes (test: held out from training and validation)."""
    calibration_tokens: int = 1024
    """Calibration tokens per language."""
    damping: float = 0.85
    """MAESTRO's PageRank damping (1 = none)."""
    naee_cap: int = 2000
    """NAEE searches exhaustively up to this many subsets per layer, greedily beyond."""
    recovery_steps: int = 100
    """Optimizer steps of the recovery fine-tune (LM loss, fresh optimizer and schedule)."""
    recovery_warmup: int = 10
    """Warmup steps of the recovery fine-tune's schedule."""
    recovery_lr: float | None = None
    """Peak learning rate of the recovery fine-tune; null = run.optim.lr."""
    arms: list[str] = field(default_factory=lambda: list(ARMS))
    """Which evaluations of every pruned model run: pruned (as it is), recovered (after the recovery
    fine-tune; adds the control original/recovered)."""
    tasks: bool = False
    """Also measure every point's local-suite accuracy (:func:`moe_lit.evaluation.suite.suite_scores`,
    lm-eval on the test split), for the task retention."""
    task_limit: int | None = None
    """Items per local-suite task (lm-eval's limit); null = every item."""
    task_fractions: list[float] | None = None
    """Fractions whose children measure tasks (the references always do); null = every fraction."""
    task_margin: float = 0.0
    """Task retention leaves out the tasks a seed's reference does not solve above chance by more
    than this (analysis only: changes no point)."""
    single_language_calibration: list[str] = field(default_factory=list)
    """Languages that each calibrate an extra arm alone, evaluated on every language's val loss as
    pruned at 50% removed with ``single_language_methods``; [] = no such arm."""
    single_language_methods: list[str] = field(default_factory=lambda: ["maestro", "naee"])
    """Methods of the single-language calibration arms."""
    single_language_tokens: int | None = None
    """Calibration tokens of a single-language arm; null = calibration_tokens (the mix routes that
    many per language)."""

    def __post_init__(self) -> None:
        if self.model.moe is None:
            raise ConfigError("model.moe: the parent must be an MoE (pruning removes experts)")
        if (
            not isinstance(self.fractions, list)
            or not self.fractions
            or len(set(self.fractions)) != len(self.fractions)
        ):
            raise ConfigError(f"fractions: must be a non-empty list of distinct numbers, got {self.fractions!r}")
        for fraction in self.fractions:
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction < 1.0:
                raise ConfigError(f"fractions: each must be in (0, 1), got {fraction!r}")
        if not isinstance(self.methods, list) or not self.methods or len(set(self.methods)) != len(self.methods):
            raise ConfigError(f"methods: must be a non-empty list of distinct methods, got {self.methods!r}")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ConfigError(f"methods: unknown {unknown}, allowed values: {', '.join(METHODS)}")
        languages = self.calibration_languages
        if languages is not None and (
            not isinstance(languages, list) or not languages or not all(isinstance(v, str) for v in languages)
        ):
            raise ConfigError(
                f"calibration_languages: must be null or a non-empty list of language codes, got {languages!r}"
            )
        if self.calibration_split not in SPLITS:
            raise ConfigError(f"calibration_split: got {self.calibration_split!r}, allowed values: {', '.join(SPLITS)}")
        for name in ("calibration_tokens", "naee_cap", "recovery_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}: must be a positive integer, got {value!r}")
        if (
            isinstance(self.recovery_warmup, bool)
            or not isinstance(self.recovery_warmup, int)
            or not (0 <= self.recovery_warmup <= self.recovery_steps)
        ):
            raise ConfigError(
                f"recovery_warmup: must be an integer in [0, recovery_steps], got {self.recovery_warmup!r}"
            )
        if (
            isinstance(self.damping, bool)
            or not isinstance(self.damping, (int, float))
            or not 0.0 < self.damping <= 1.0
        ):
            raise ConfigError(f"damping: must be in (0, 1], got {self.damping!r}")
        if self.recovery_lr is not None and (not isinstance(self.recovery_lr, (int, float)) or self.recovery_lr <= 0):
            raise ConfigError(f"recovery_lr: must be null or > 0, got {self.recovery_lr!r}")
        if not isinstance(self.arms, list) or not self.arms or not set(self.arms) <= set(ARMS):
            raise ConfigError(f"arms: must be a non-empty list of {', '.join(ARMS)}, got {self.arms!r}")
        if not isinstance(self.tasks, bool):
            raise ConfigError(f"tasks: must be true or false, got {self.tasks!r}")
        for name in ("task_limit", "single_language_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name}: must be null or a positive integer, got {value!r}")
        if self.task_fractions is not None and (
            not isinstance(self.task_fractions, list) or not set(self.task_fractions) <= set(self.fractions)
        ):
            raise ConfigError(f"task_fractions: must be null or a list of the fractions, got {self.task_fractions!r}")
        if isinstance(self.task_margin, bool) or not isinstance(self.task_margin, (int, float)) or self.task_margin < 0:
            raise ConfigError(f"task_margin: must be a number >= 0, got {self.task_margin!r}")
        single = self.single_language_calibration
        if (
            not isinstance(single, list)
            or not all(isinstance(v, str) for v in single)
            or len(set(single)) != len(single)
        ):
            raise ConfigError(f"single_language_calibration: must be a list of distinct language codes, got {single!r}")
        methods = self.single_language_methods
        if single and (not isinstance(methods, list) or not methods or not set(methods) <= set(self.methods)):
            raise ConfigError(
                f"single_language_methods: must be a non-empty list of the study's methods "
                f"({', '.join(self.methods)}), got {methods!r}"
            )
        if single and CLAIM_FRACTION not in self.fractions:
            raise ConfigError(
                f"single_language_calibration: its arms prune {CLAIM_FRACTION:g} of the experts, so fractions must "
                f"include {CLAIM_FRACTION:g}"
            )


def default_run() -> dict[str, Any]:
    return {"data": {"seq_len": 64, "batch_size": 16, "val_batches": 4}, "train": {"max_steps": 600}}


def parse(fields: dict[str, Any], header) -> PruningSpec:
    check_fields(PruningSpec, fields, ("model",))
    model = ModelConfig.from_dict(dict(fields["model"])).replace(seq_len=header.run.data.seq_len)
    spec = PruningSpec(**{**fields, "model": model})
    for fraction in spec.fractions:
        _check_budget(spec.model, fraction)
    return spec


def _check_budget(model: ModelConfig, fraction: float) -> None:
    """Refuse a fraction that leaves a layer no expert or fewer than top-k (before any run)."""
    from moe_lit.convert.prune import kept_count

    moe = model.moe
    try:
        kept = kept_count(moe.num_experts, 0, fraction)
    except ConfigError as exc:
        raise ConfigError(f"fractions: {exc}") from None
    if kept < moe.top_k:
        raise ConfigError(
            f"fractions: {fraction} keeps {kept} of {moe.num_experts} experts, fewer than top_k={moe.top_k}"
        )


def _label(fraction: float) -> str:
    return f"{fraction * 100:g}%"


def calibration_label(languages: list[str] | None) -> str:
    """``mix`` (every language) or the calibration languages joined by ``+``."""
    return "mix" if languages is None else "+".join(languages)


def expand(spec: PruningSpec, header) -> list[Point]:
    reference_measure = Call(MEASURE_TASKS, {"limit": spec.task_limit}) if spec.tasks else None
    mix = calibration_label(spec.calibration_languages)
    points = []
    for seed in header.seeds:
        pretrain = header.seeded_run(seed)
        runs = {
            "pruned": pretrain.replace(train={"max_steps": 0}),
            "recovered": pretrain.replace(
                train={"max_steps": spec.recovery_steps, "val_every": spec.recovery_steps},
                optim={"warmup_steps": spec.recovery_warmup, **({"lr": spec.recovery_lr} if spec.recovery_lr else {})},
            ),
        }
        parent = Point(
            header.point_name("original", seed),
            "original",
            seed,
            spec.model,
            pretrain,
            info={"arm": "original"},
            measure=reference_measure,
        )
        control = Point(
            header.point_name("original/recovered", seed),
            "original/recovered",
            seed,
            spec.model,
            runs["recovered"],
            info={"arm": "control"},
            start=Start(parent=parent.name, mode="init"),
            measure=reference_measure,
        )
        references = {"pruned": parent.name, "recovered": control.name}
        points += [parent, *([control] if "recovered" in spec.arms else [])]
        runs = {arm: run for arm, run in runs.items() if arm in spec.arms}
        for fraction in spec.fractions:
            for method in spec.methods:
                kwargs = _transform_kwargs(spec, header, method, fraction, seed)
                for arm, run in runs.items():
                    info = {"arm": arm, "method": method, "fraction": fraction, "calibration": mix}
                    name = f"{method}/{_label(fraction)}/{arm}"
                    points.append(
                        _child(spec, header, parent, name, run, {**info, "reference": references[arm]}, kwargs)
                    )
        for language in spec.single_language_calibration:
            for method in spec.single_language_methods:
                kwargs = {
                    **_transform_kwargs(spec, header, method, CLAIM_FRACTION, seed),
                    "languages": [language],
                    "calibration_tokens": spec.single_language_tokens or spec.calibration_tokens,
                }
                info = {"arm": "pruned", "method": method, "fraction": CLAIM_FRACTION, "calibration": language}
                name = f"{method}/{_label(CLAIM_FRACTION)}/pruned/calibration-{language}"
                run = pretrain.replace(train={"max_steps": 0})
                points.append(_child(spec, header, parent, name, run, {**info, "reference": parent.name}, kwargs))
    return points


def _child(spec: PruningSpec, header, parent: Point, config_name: str, run, info: dict[str, Any], kwargs) -> Point:
    """A pruned child of ``parent``: its transform prunes with ``kwargs``; it measures the memory saved,
    and the local-suite accuracy where the spec asks for tasks at its fraction (not in the
    single-language arms, which compare val loss per language)."""
    tasks = (
        spec.tasks
        and info["calibration"] == calibration_label(spec.calibration_languages)
        and (spec.task_fractions is None or info["fraction"] in spec.task_fractions)
    )
    return Point(
        header.point_name(config_name, parent.seed),
        config_name,
        parent.seed,
        spec.model,
        run,
        info=info,
        start=Start(parent=parent.name, mode="init"),
        transform=Call(TRANSFORM, kwargs),
        measure=Call(MEASURE, {"tasks": True, "task_limit": spec.task_limit} if tasks else {}),
    )


def _transform_kwargs(spec: PruningSpec, header, method: str, fraction: float, seed: int) -> dict[str, Any]:
    return {
        "method": method,
        "fraction": fraction,
        "data_dir": str(header.run.data.resolved_dir()),
        "calibration_tokens": spec.calibration_tokens,
        "languages": spec.calibration_languages,
        "split": spec.calibration_split,
        "damping": spec.damping,
        "naee_cap": spec.naee_cap,
        "seed": seed,
    }


def prune_by_importance(
    model,
    method: str,
    fraction: float,
    data_dir: str,
    calibration_tokens: int,
    damping: float,
    seed: int,
    languages: list[str] | None = None,
    split: str = "test",
    naee_cap: int = 2000,
):
    """The study's transform: route the calibration text of ``data_dir`` through ``model``, rank
    its experts by ``method`` (:func:`~moe_lit.convert.importance.plan_keep`) and remove
    ``fraction`` of every MoE layer's experts (:func:`~moe_lit.convert.prune.prune_experts`, pure)."""
    import torch

    from moe_lit.convert.importance import MaestroConfig, calibration_trace, plan_keep
    from moe_lit.convert.prune import prune_experts
    from moe_lit.data.layout import tokenizer_file
    from moe_lit.evaluation.harness import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_file(data_dir))
    with torch.no_grad():
        trace = calibration_trace(
            model, data_dir, tokenizer, languages, split, calibration_tokens, record_inputs=method in ("reap", "naee")
        )
        keep, _ = plan_keep(
            method,
            model,
            trace,
            fraction=fraction,
            seed=seed,
            maestro=MaestroConfig(damping=damping),
            naee_cap=naee_cap,
        )
        return prune_experts(model, keep)


def measure_tasks(point: Point, result: Any, run_dir: Path, limit: int | None = None) -> dict[str, Any]:
    """Local-suite accuracy of the run's final model (:func:`~moe_lit.evaluation.suite.suite_scores`
    on the test split of the run's data): the whole result under ``suite``, and its two means flat."""
    from moe_lit.checkpoint import load_model
    from moe_lit.data.layout import tokenizer_file
    from moe_lit.evaluation.suite import suite_scores

    data_dir = point.run.data.resolved_dir()
    scores = suite_scores(load_model(result.checkpoint), tokenizer_file(data_dir), data_dir, limit=limit)
    return {
        "suite": scores,
        "suite_mean_acc": scores["mean_acc"],
        "suite_mean_above_chance": scores["mean_above_chance"],
    }


def measure_memory(
    point: Point, result: Any, run_dir: Path, tasks: bool = False, task_limit: int | None = None
) -> dict[str, Any]:
    """Parameters and bytes of the parent (``point.model``) and of the pruned model (``memory_saved``),
    and with ``tasks`` its local-suite accuracy (:func:`measure_tasks`)."""
    from moe_lit.checkpoint import load_model
    from moe_lit.convert.prune import memory_saved
    from moe_lit.model import Transformer

    pruned = load_model(result.checkpoint)
    original = Transformer(point.model.replace(vocab_size=pruned.config.vocab_size))
    # NOTE: flat fields (not one nested dict), so that runs.csv keeps them as columns.
    return {
        **memory_saved(original, pruned),
        "kept_experts": [pruned.config.moe_layer_config(b).num_experts for b in pruned.config.moe_layer_ids],
        **(measure_tasks(point, result, run_dir, task_limit) if tasks else {}),
    }


# ----------------------------------------------------------------------------- analysis
MEASURES = {
    "val loss": ("mean", {"languages": "variance"}),
    "tasks": ("task_mean", {"tasks": "task_variance", "languages": "task_language_variance"}),
}
"""Retention measure -> (key of its mean, {what the variance runs across: key of that variance})."""


def _loss_retention(original: dict[str, Any], pruned: dict[str, Any]) -> dict[str, Any]:
    """Val-loss retention (mean, variance across languages, per language); NaN when a loss is not finite."""
    from moe_lit.evaluation.retention import retention

    try:
        result = retention(original["val_loss_per_language"], pruned["val_loss_per_language"], higher_is_better=False)
    except MoeLitError:
        return {"mean": math.nan, "variance": math.nan, "languages": {}}
    return {"mean": result.mean, "variance": result.variance, "languages": result.per_key}


def _task_retention(original: dict[str, Any], pruned: dict[str, Any], margin: float) -> dict[str, Any]:
    """Task retention above chance (:func:`~moe_lit.evaluation.retention.suite_retention`); NaN
    without suite scores on both sides or without a task the reference solves above the margin."""
    from moe_lit.evaluation.retention import suite_retention

    nan = {
        "task_mean": math.nan,
        "task_variance": math.nan,
        "task_language_variance": math.nan,
        "task_languages": {},
        "tasks_left_out": 0,
    }
    if "suite" not in original or "suite" not in pruned:
        return nan
    try:
        result = suite_retention(original["suite"], pruned["suite"], margin)
    except MoeLitError:
        return nan
    return {
        "task_mean": result.tasks.mean,
        "task_variance": result.tasks.variance,
        "task_language_variance": result.languages.variance,
        "task_languages": result.languages.per_key,
        "tasks_left_out": len(result.left_out),
    }


def retention_values(
    records: list[dict[str, Any]], task_margin: float = 0.0
) -> dict[tuple[float, str, str, str], dict[str, list]]:
    """(fraction, arm, method, calibration) -> per-seed lists, each child against its own reference
    (records with status ok): val-loss retention ``mean``, its ``variance`` across languages and
    its ``languages`` (per language), ``val_loss``; task retention ``task_mean``, its variance
    across tasks (``task_variance``) and across languages (``task_language_variance``), its
    ``task_languages`` and ``tasks_left_out`` (NaN / empty without suite scores)."""
    ok = {r["name"]: r for r in records if r["status"] == "ok"}
    values: dict[tuple[float, str, str, str], dict[str, list]] = {}
    for record in ok.values():
        reference = ok.get(record.get("reference") or "")
        if record.get("arm") not in ARMS or reference is None:
            continue
        measured = {
            "seed": record["seed"],
            "val_loss": record["val_loss"],
            **_loss_retention(reference, record),
            **_task_retention(reference, record, task_margin),
        }
        key = (record["fraction"], record["arm"], record["method"], record.get("calibration", "mix"))
        group = values.setdefault(key, {name: [] for name in measured})
        for name, value in measured.items():
            group[name].append(value)
    return dict(sorted(values.items()))


def _memory_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_fraction: dict[float, dict[str, Any]] = {}
    for record in records:
        if record["status"] == "ok" and "params_saved" in record:
            by_fraction.setdefault(record["fraction"], record)
    return [
        {
            "removed": _label(fraction),
            "experts per layer": ", ".join(map(str, record["kept_experts"])),
            "parameters": f"{record['params_before']:,} -> {record['params_after']:,}",
            "saved": f"{record['params_saved_fraction']:.1%}",
            "bytes": f"{record['bytes_before']:,} -> {record['bytes_after']:,}",
        }
        for fraction, record in sorted(by_fraction.items())
    ]


def _by_seed(a: dict[str, list], b: dict[str, list], key: str) -> tuple[list[float], list[float]]:
    """``key`` of two methods for the seeds both finished, seed by seed (both prune the same parent)."""
    a_by, b_by = dict(zip(a["seed"], a[key], strict=False)), dict(zip(b["seed"], b[key], strict=False))
    seeds = sorted(set(a_by) & set(b_by))
    return [a_by[s] for s in seeds], [b_by[s] for s in seeds]


def _has(group: dict[str, list], key: str) -> bool:
    return any(not math.isnan(v) for v in group[key])


def _claim_findings(values, arm: str, calibration: str, measure: str) -> list[str]:
    """MAESTRO vs the best other method at 50% removed on one retention measure: the highest mean
    retention over the seeds (random excluded; a baseline picked after the fact, which favours the
    baseline), paired by seed."""
    mean_key, variances = MEASURES[measure]
    at = {
        method: v
        for (fraction, a, method, c), v in values.items()
        if fraction == CLAIM_FRACTION and a == arm and c == calibration and _has(v, mean_key)
    }
    baselines = {m: v for m, v in at.items() if m not in ("maestro", "random")}
    if "maestro" not in at or not baselines:
        return [
            (
                f"- **MAESTRO's claims, {measure}, {arm}**: not tested (needs maestro and another non-random method "
                f"at {_label(CLAIM_FRACTION)} removed)."
            )
        ]

    def mean_retention(method: str) -> float:
        mean = summarize(baselines[method][mean_key]).mean
        return -math.inf if math.isnan(mean) else mean

    best = max(baselines, key=mean_retention)
    what = "Retention" if measure == "val loss" else "Task retention (accuracy above chance)"
    mean_cmp = compare_paired(*_by_seed(at["maestro"], baselines[best], mean_key))
    better = mean_cmp.significant and mean_cmp.diff > 0
    lines = [
        (
            f"- **{what} at {_label(CLAIM_FRACTION)} removed, {arm}, maestro vs the best baseline ({best})** "
            f"(MAESTRO: up to 10.61% better retention than the best baseline): {format_comparison(mean_cmp)}; "
            f"**{'reproduced' if better else 'not reproduced'}**."
        )
    ]
    for across, key in variances.items():
        var_cmp = compare_paired(*_by_seed(at["maestro"], baselines[best], key))
        steadier = var_cmp.significant and var_cmp.diff < 0
        lines.append(
            f"- **Variance of {what.lower()} across {across}, {arm}, maestro vs {best}** (MAESTRO: lower variance "
            f"across tasks): {format_comparison(var_cmp, digits=6)}; "
            f"**{'reproduced' if steadier else 'not reproduced'}**."
        )
    return lines


def _calibration_findings(values, main: str) -> list[str]:
    """Each single-language calibration against the main calibration, same method, paired by seed:
    retention on the calibration language itself and on the mean of the other languages."""
    lines = []
    for (fraction, arm, method, calibration), group in values.items():
        mix = values.get((fraction, arm, method, main))
        if calibration == main or mix is None:
            continue
        for measure, key in (("val-loss", "languages"), ("task", "task_languages")):
            pairs = _by_seed(group, mix, key)
            if not any(pairs[0]):
                continue
            own = compare_paired(
                [r.get(calibration, math.nan) for r in pairs[0]], [r.get(calibration, math.nan) for r in pairs[1]]
            )
            others = compare_paired(*([_mean_except(r, calibration) for r in side] for side in pairs))
            lines.append(
                f"- **{method} calibrated on {calibration} only vs {main}, {_label(fraction)} {arm}, "
                f"{measure} retention**: on {calibration} {format_comparison(own)}; "
                f"on the other languages (mean) {format_comparison(others)}."
            )
    return lines


def _mean_except(per_language: dict[str, float], language: str) -> float:
    others = [v for lang, v in per_language.items() if lang != language]
    return sum(others) / len(others) if others else math.nan


def _main_rows(values, main: str, tasks: bool) -> list[dict[str, Any]]:
    rows = []
    for (fraction, arm, method, calibration), v in values.items():
        if calibration != main:
            continue
        row = {
            "removed": _label(fraction),
            "arm": arm,
            "method": method,
            "retention (mean over languages)": format_summary(summarize(v["mean"])),
            "variance across languages": format_summary(summarize(v["variance"]), digits=6),
        }
        if tasks:
            row |= {
                "task retention (mean over tasks)": format_summary(summarize(v["task_mean"])),
                "variance across tasks": format_summary(summarize(v["task_variance"]), digits=6),
                "task variance across languages": format_summary(summarize(v["task_language_variance"]), digits=6),
            }
        rows.append(row | {"val loss": format_summary(summarize(v["val_loss"]))})
    return rows


def _language_rows(values, key: str) -> list[dict[str, Any]]:
    """Mean over seeds of each language's retention at 50% removed, every calibration (blank where
    no seed has the language: a task retention without a task above the margin there)."""
    groups = {k: [r for r in v[key] if r] for k, v in values.items() if k[0] == CLAIM_FRACTION}
    groups = {k: per_seed for k, per_seed in groups.items() if per_seed}
    languages = sorted({lang for per_seed in groups.values() for r in per_seed for lang in r})
    rows = []
    for (_, arm, method, calibration), per_seed in groups.items():
        means = {lang: summarize([r.get(lang, math.nan) for r in per_seed]).mean for lang in languages}
        rows.append(
            {"arm": arm, "method": method, "calibration": calibration}
            | {lang: "" if math.isnan(mean) else f"{mean:.4f}" for lang, mean in means.items()}
        )
    return rows


def analyse(plan: dict[str, Any], records: list[dict[str, Any]], plots_dir: Path) -> Analysis:
    spec = plan.get("spec", {})
    values = retention_values(records, spec.get("task_margin", 0.0))
    main = calibration_label(spec.get("calibration_languages"))
    tasks = any(_has(v, "task_mean") for v in values.values())
    measures = [m for m in MEASURES if tasks or m == "val loss"]
    arms = [arm for arm in ARMS if any(key[1] == arm for key in values)]
    findings = [line for m in measures for arm in arms for line in _claim_findings(values, arm, main, m)]
    findings += _calibration_findings(values, main)
    main_values = {key[:3]: v for key, v in values.items() if key[3] == main}
    plots = [plot_retention(main_values, Path(plots_dir) / "retention.png")] if main_values else []
    at = _label(CLAIM_FRACTION)
    title = "Retention = original / pruned val loss per language" + (
        "; task retention = (pruned - chance) / (original - chance) per local-suite task" if tasks else ""
    )
    tables = {f"{title} (mean ± std over seeds)": _main_rows(values, main, tasks)}
    tables[f"Val-loss retention per language at {at} removed (mean over seeds)"] = _language_rows(values, "languages")
    if tasks:
        plots.append(plot_retention(main_values, Path(plots_dir) / "task_retention.png", "task_mean"))
        tables[f"Task retention per language at {at} removed (mean over seeds)"] = _language_rows(
            values, "task_languages"
        )
    tables["Memory saved (parameters and persistent buffers)"] = _memory_rows(records)
    return Analysis(findings=findings if values else [], tables=tables, plots=plots)


def plot_retention(values, path: Path, key: str = "mean") -> Path:
    """Mean retention (``key``) per method, one panel per arm present, one marker per fraction, ± std over seeds."""
    from moe_lit.plotting import pyplot, save_figure, seed_errorbar, spread_note

    plt = pyplot()
    fractions = sorted({f for f, _, _ in values})
    methods = list(dict.fromkeys(m for _, _, m in values))
    arms = [arm for arm in ARMS if any(k[1] == arm for k in values)]
    fig, axes = plt.subplots(1, len(arms), figsize=(max(6, 5 * len(arms)), 4), sharey=True, squeeze=False)
    axes = axes[0]
    offset = 0.6 / len(fractions)
    counts = []
    for ax, arm in zip(axes, arms, strict=True):
        for i, fraction in enumerate(fractions):
            stats = [summarize(values.get((fraction, arm, m), {key: []})[key]) for m in methods]
            counts += [s.n for s in stats if s.n]
            xs = [j + (i - (len(fractions) - 1) / 2) * offset for j in range(len(methods))]
            seed_errorbar(ax, xs, stats, linestyle="none", label=f"{_label(fraction)} removed")
        ax.set_xticks(range(len(methods)), methods, rotation=30)
        ax.set_title(f"{arm} (vs {'the parent' if arm == 'pruned' else 'the recovered unpruned control'})")
        ax.axhline(1.0, color="grey", linewidth=0.8, label="1 = nothing lost")
        ax.grid(True, axis="y", alpha=0.3)
    what = "original / pruned val loss" if key == "mean" else "above chance: pruned / original"
    axes[0].set_ylabel(f"retention ({what})")
    axes[0].legend(fontsize=8)
    over = "languages" if key == "mean" else "tasks"
    fig.suptitle(f"Retention, mean over {over} ({spread_note(counts)})", fontsize=10)
    return save_figure(fig, path)


__all__ = [
    "PruningSpec",
    "analyse",
    "expand",
    "calibration_label",
    "measure_memory",
    "measure_tasks",
    "parse",
    "plot_retention",
    "prune_by_importance",
    "retention_values",
]
