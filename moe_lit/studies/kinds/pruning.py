"""Study kind ``pruning``: how much of an MoE's quality survives removing experts, per method?

Per seed an MoE parent pretrains; every child removes a fraction of each MoE layer's experts from its final weights by
one method of :mod:`moe_lit.convert.importance` (calibrated on the mix or ``calibration_languages``), evaluated as it is
and after a short LM-loss recovery. Retention = original / pruned val loss per language against the seed's reference
(the parent, or the parent recovered the same way). Claims, paired by seed: MAESTRO retains more than the best other
method at 50% removed, varying less across languages (and tasks); a language calibrated alone retains itself better.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_lit.config import ModelConfig
from moe_lit.convert import recipes
from moe_lit.convert.importance import METHODS
from moe_lit.errors import MoeLitError
from moe_lit.stats import format_values
from moe_lit.studies import plots
from moe_lit.studies import spec as check
from moe_lit.studies.identity import Call, Point
from moe_lit.studies.kinds import Analysis
from moe_lit.studies.measures import final_model, suite_fields
from moe_lit.studies.records import best, collect, language_means, select
from moe_lit.studies.verdicts import HIGHER, LOWER, TRAINED_MOE, Claim, Subject, about

ARMS = ("pruned", "recovered")
"""pruned: evaluated as it is; recovered: after the recovery fine-tune."""
REFERENCES = {"pruned": "original", "recovered": "original/recovered"}
"""The reference point of each arm's retention."""
CLAIM_FRACTION = 0.5
"""MAESTRO's claims are stated at 50% compression."""
PAPER_GAIN = 0.1061
"""MAESTRO: up to 10.61 points better retention than the best baseline."""
MEASURES = {"val loss": ("mean", {"languages": "variance"})}
MEASURES["tasks"] = ("task_mean", {"tasks": "task_variance", "languages": "task_language_variance"})
"""Retention measure -> (key of its mean, {what the variance runs across: key of that variance})."""


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
    """Evaluations of every pruned model: pruned (as it is), recovered (after the recovery; adds original/recovered)."""
    tasks: bool = False
    """Also measure every point's local-suite accuracy (moe_lit.evaluation.suite), for the task retention."""
    task_limit: int | None = None
    """Items per local-suite task (lm-eval's limit); null = every item."""
    task_fractions: list[float] | None = None
    """Fractions whose children measure tasks (the references always do); null = every fraction."""
    task_margin: float = 0.0
    """Task retention leaves out the tasks a seed's reference does not beat chance by more than (analysis only)."""
    single_language_calibration: list[str] = field(default_factory=list)
    """Languages that each calibrate an extra arm alone, evaluated on every language's val loss as
    pruned at 50% removed with ``single_language_methods``; [] = no such arm."""
    single_language_methods: list[str] = field(default_factory=lambda: ["maestro", "naee"])
    """Methods of the single-language calibration arms."""
    single_language_tokens: int | None = None
    """Calibration tokens of a single-language arm; null = calibration_tokens (the mix's per language)."""

    def __post_init__(self) -> None:
        from moe_lit.convert.prune import kept_count

        check.require(self.model.moe is not None, "model.moe", "the parent must be an MoE (pruning removes experts)")
        check.fractions(self.fractions, "fractions")
        check.distinct(self.methods, "methods", allowed=METHODS, what="methods")
        check.languages(self.calibration_languages, "calibration_languages")
        check.choice(self.calibration_split, "calibration_split", check.SPLITS)
        check.positive_fields(self, "calibration_tokens", "naee_cap", "recovery_steps")
        check.int_in(self.recovery_warmup, "recovery_warmup", 0, self.recovery_steps, "recovery_steps", closed=True)
        check.number(self.damping, "damping", 0, 1, closed="high")
        check.number(self.recovery_lr, "recovery_lr", 0, optional=True)
        check.distinct(self.arms, "arms", allowed=ARMS, what=", ".join(ARMS))
        check.boolean(self.tasks, "tasks")
        check.positive_fields(self, "task_limit", "single_language_tokens", optional=True)
        check.distinct(self.task_fractions, "task_fractions", allowed=self.fractions, what="fractions", optional=True)
        check.number(self.task_margin, "task_margin", 0, closed="low")
        single = self.single_language_calibration
        check.distinct(single, "single_language_calibration", what="language codes", empty=True)
        if single:
            check.distinct(self.single_language_methods, "single_language_methods", allowed=self.methods)
            why = f"its arms prune {CLAIM_FRACTION:g}, so fractions must include it"
            check.require(CLAIM_FRACTION in self.fractions, "single_language_calibration", why)
        for fraction, moe in ((f, self.model.moe) for f in self.fractions):  # NOTE: refused before any run
            with check.errors_under("fractions: "):
                kept = kept_count(moe.num_experts, 0, fraction)
            why = f"{fraction} keeps {kept} of {moe.num_experts} experts, fewer than top_k={moe.top_k}"
            check.require(kept >= moe.top_k, "fractions", why)


DEFAULT_RUN = {"data": {"seq_len": 64, "batch_size": 16, "val_batches": 4}, "train": {"max_steps": 600}}
PAPER, HERE = (
    Subject(TRAINED_MOE, "MAESTRO / REAP / NAEE: pretrained MoE LLMs"),
    "scale and budget in the description above",
)
"""What the paper tested its claims on, and the study's scale (its object: :func:`analyse`)."""
parse = check.parser(PruningSpec, ("model",))


def _share(fraction: float) -> str:
    return f"{fraction * 100:g}%"


def calibration_label(languages: list[str] | None) -> str:
    """``mix`` (every language) or the calibration languages joined by ``+``."""
    return "mix" if languages is None else "+".join(languages)


def expand(spec: PruningSpec, header) -> list[Point]:
    reference_measure = Call.of(measure_tasks, limit=spec.task_limit) if spec.tasks else None
    mix, data_dir, points = calibration_label(spec.calibration_languages), str(header.run.data.resolved_dir()), []
    pruning = {"data_dir": data_dir, "calibration_tokens": spec.calibration_tokens}
    pruning |= {"languages": spec.calibration_languages, "split": spec.calibration_split}
    pruning |= {"damping": spec.damping, "naee_cap": spec.naee_cap}
    single = {"calibration_tokens": spec.single_language_tokens or spec.calibration_tokens}
    tasks = {"tasks": True, "task_limit": spec.task_limit} if spec.tasks else {}
    arms = [(f, m, a, mix, {}) for f in spec.fractions for m in spec.methods for a in ARMS if a in spec.arms]
    alone = ((lang, m) for lang in spec.single_language_calibration for m in spec.single_language_methods)
    arms += [(CLAIM_FRACTION, m, "pruned", lang, {**single, "languages": [lang]}) for lang, m in alone]
    recovery = {"train": {"max_steps": spec.recovery_steps, "val_every": spec.recovery_steps}}
    recovery["optim"] = {"warmup_steps": spec.recovery_warmup} | ({"lr": spec.recovery_lr} if spec.recovery_lr else {})
    for seed in header.seeds:
        pretrain, start = header.seeded_run(seed), header.start("original", seed)
        runs = {"pruned": pretrain.replace(train={"max_steps": 0}), "recovered": pretrain.replace(**recovery)}
        references = {arm: header.point_name(name, seed) for arm, name in REFERENCES.items()}
        controls = [("original", pretrain, {"arm": "original"}, None)]
        controls += [("original/recovered", runs["recovered"], {"arm": "control"}, start)] * ("recovered" in spec.arms)
        for name, run, info, parent in controls:
            points.append(header.point(name, seed, spec.model, run, info, parent, measure=reference_measure))
        for fraction, method, arm, calibration, changes in arms:
            name = f"{method}/{_share(fraction)}/{arm}" + (f"/calibration-{calibration}" if calibration != mix else "")
            info = {"arm": arm, "method": method, "fraction": fraction, "calibration": calibration}
            # NOTE: the suite only where the spec asks for tasks at the fraction (not the single-language arms)
            scored = calibration == mix and (spec.task_fractions is None or fraction in spec.task_fractions)
            kwargs = {"method": method, "fraction": fraction, **pruning, "seed": seed, **changes}
            transform = Call.of(recipes.prune_by_importance, **kwargs)
            measure, info["reference"] = Call.of(measure_memory, **(tasks if scored else {})), references[arm]
            points.append(header.point(name, seed, spec.model, runs[arm], info, start, transform, measure=measure))
    return points


def measure_tasks(point: Point, result: Any, run_dir: Path, limit: int | None = None) -> dict[str, Any]:
    """Local-suite accuracy of the run's final model (:func:`moe_lit.studies.measures.suite_fields`)."""
    return suite_fields(final_model(result), point.run.data.resolved_dir(), limit)


def measure_memory(point: Point, result: Any, run_dir: Path, tasks: bool = False, task_limit: int | None = None):
    """Parameters and bytes of the parent (``point.model``) and of the pruned model (``memory_saved``),
    and with ``tasks`` its local-suite accuracy (:func:`measure_tasks`)."""
    from moe_lit.convert.prune import memory_saved
    from moe_lit.model import Transformer

    pruned = final_model(result)
    original = Transformer(point.model.replace(vocab_size=pruned.config.vocab_size))
    # NOTE: flat fields (not one nested dict), so that runs.csv keeps them as columns.
    kept = [pruned.config.moe_layer_config(b).num_experts for b in pruned.config.moe_layer_ids]
    suite = measure_tasks(point, result, run_dir, task_limit) if tasks else {}
    return {**memory_saved(original, pruned), "kept_experts": kept, **suite}


# ----------------------------------------------------------------------------- analysis
Key = tuple[float, str, str, str]
"""(fraction, arm, method, calibration)."""
NAN_TASKS = {"task_mean": math.nan, "task_variance": math.nan, "task_language_variance": math.nan}
NAN_TASKS |= {"task_languages": {}, "tasks_left_out": 0}


def _retention_fields(original: dict[str, Any], pruned: dict[str, Any], margin: float) -> dict[str, Any]:
    """Val-loss retention (mean, variance across languages, per language) and task retention above
    chance (:func:`~moe_lit.evaluation.retention.suite_retention`); NaN where not measured."""
    from moe_lit.evaluation.retention import retention, suite_retention

    try:
        loss = retention(original["val_loss_per_language"], pruned["val_loss_per_language"], higher_is_better=False)
        out: dict[str, Any] = {"mean": loss.mean, "variance": loss.variance, "languages": loss.per_key}
    except MoeLitError:
        out = {"mean": math.nan, "variance": math.nan, "languages": {}}
    try:
        tasks = suite_retention(original["suite"], pruned["suite"], margin)
    except (KeyError, MoeLitError):
        return out | NAN_TASKS
    out |= {"task_mean": tasks.tasks.mean, "task_variance": tasks.tasks.variance}
    out |= {"task_language_variance": tasks.languages.variance, "task_languages": tasks.languages.per_key}
    return out | {"tasks_left_out": len(tasks.left_out)}


def retention_values(records: list[dict[str, Any]], task_margin: float = 0.0) -> dict[Key, dict[str, dict[int, Any]]]:
    """(fraction, arm, method, calibration) -> measure -> seed -> value against the child's reference: ``val_loss``,
    retention ``mean``, ``variance``, ``languages``, task retention ``task_mean``, ``task_variance`` (across tasks),
    ``task_language_variance``, ``task_languages``, ``tasks_left_out``."""
    ok, items = {r["name"]: r for r in select(records)}, []
    for record in ok.values():
        if record.get("arm") in ARMS and (reference := ok.get(record.get("reference") or "")) is not None:
            measured = {"val_loss": record["val_loss"], **_retention_fields(reference, record, task_margin)}
            key = (record["fraction"], record["arm"], record["method"], record.get("calibration", "mix"))
            items.append((key, record["seed"], measured))
    return dict(sorted(collect(items).items()))


def _has(group: dict[str, dict[int, Any]], key: str) -> bool:
    return any(not math.isnan(v) for v in group.get(key, {}).values())


def _maestro_claims(values, arm: str, calibration: str, measure: str) -> list:
    """MAESTRO vs the best other method at 50% removed (the highest mean retention, random
    excluded: a baseline picked after the runs, which favours the baseline), paired by seed."""
    (mean_key, variances), here = MEASURES[measure], (CLAIM_FRACTION, arm, calibration)
    at = {m: v for (f, a, m, c), v in values.items() if (f, a, c) == here and _has(v, mean_key)}
    baselines = {m: v for m, v in at.items() if m not in ("maestro", "random")}
    what, removed = "retention" if measure == "val loss" else "task retention", _share(CLAIM_FRACTION)
    if "maestro" not in at or not baselines:
        why = f"needs maestro and another non-random method at {removed} removed"
        return [Claim(f"{arm}: MAESTRO retains more", what, ("maestro", "best"), HIGHER).missing(why)]
    rival = best({m: v[mean_key] for m, v in baselines.items()}, lowest=False)
    mean = Claim(f"{removed} removed, {arm}: MAESTRO retains more", what, ("maestro", rival), HIGHER, paper=PAPER_GAIN)
    claims = [mean.on(at["maestro"][mean_key], baselines[rival][mean_key])]
    for across, key in variances.items():
        text = f"{arm}: MAESTRO varies less across {across}"
        claim = Claim(text, f"variance of {what}", ("maestro", rival), LOWER, digits=6)
        claims.append(claim.on(at["maestro"][key], baselines[rival][key]))
    return claims


def _calibration_claims(values, main: str) -> list:
    """Each single-language calibration against the main one, same method, paired by seed: the
    calibration language's own retention (higher) and the mean of the other languages' (lower)."""
    claims = []
    for (fraction, arm, method, language), group in values.items():
        mix = values.get((fraction, arm, method, main))
        for measure, key in (("val-loss", "languages"), ("task", "task_languages")) if language != main and mix else ():
            if any(group[key].values()):
                arms, text = (f"{method}@{language}", f"{method}@{main}"), f"{method} calibrated on {language} alone"
                own, rest = ({s: r.get(language, math.nan) for s, r in g[key].items()} for g in (group, mix))
                claim = Claim(f"{text}: {language} retains more", f"{measure} retention", arms, HIGHER)
                claims.append(claim.on(own, rest))
                own, rest = ({s: _mean_except(r, language) for s, r in g[key].items()} for g in (group, mix))
                claim = Claim(f"{text}: the others retain less", f"{measure} retention (others)", arms, LOWER)
                claims.append(claim.on(own, rest))
    return claims


def _mean_except(per_language: dict[str, float], language: str) -> float:
    others = [v for lang, v in per_language.items() if lang != language]
    return sum(others) / len(others) if others else math.nan


COLUMNS = {"retention (mean over languages)": ("mean", 4), "variance across languages": ("variance", 6)}
TASK_COLUMNS = {"task retention (mean over tasks)": ("task_mean", 4), "variance across tasks": ("task_variance", 6)}
TASK_COLUMNS["task variance across languages"] = ("task_language_variance", 6)
PLOTS = {"mean": ("retention", "original / pruned val loss", "languages")}
PLOTS["task_mean"] = ("task_retention", "above chance: pruned / original", "tasks")
"""The retention plot of a mean: (file name, what the retention is, what the mean runs over)."""
REFERENCE = (1.0, "1 = nothing lost")
PER_LANGUAGE = (("Val-loss", "mean", "languages"), ("Task", "task_mean", "task_languages"))
"""The retention per language tables (and plots): (title, key of the mean, key of the per-language values)."""


def _main_rows(values, main: str, tasks: bool) -> list[dict[str, Any]]:
    columns = {**COLUMNS, **(TASK_COLUMNS if tasks else {}), "val loss": ("val_loss", 4)}
    return [
        {"removed": _share(f), "arm": arm, "method": m}
        | {t: format_values(list(v[k].values()), d) for t, (k, d) in columns.items()}
        for (f, arm, m, c), v in values.items()
        if c == main
    ]


def _language_rows(values, key: str) -> list[dict[str, Any]]:
    """Mean over seeds of each language's retention at 50% removed, every calibration (blank where
    no seed has the language: a task retention without a task above the margin there)."""
    groups = {k: {s: r for s, r in v[key].items() if r} for k, v in values.items() if k[0] == CLAIM_FRACTION}
    groups = {k: per_seed for k, per_seed in groups.items() if per_seed}
    languages = sorted({lang for per_seed in groups.values() for r in per_seed.values() for lang in r})
    rows = (({"arm": arm, "method": m, "calibration": c}, per_seed) for (_, arm, m, c), per_seed in groups.items())
    return [row | language_means(per_seed, 4, languages) for row, per_seed in rows]


def _memory_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_fraction: dict[float, dict[str, Any]] = {}
    for record in (r for r in select(records) if "params_saved" in r):
        by_fraction.setdefault(record["fraction"], record)
    arrow = "{:,} -> {:,}".format
    return [
        {"removed": _share(fraction), "experts per layer": ", ".join(map(str, r["kept_experts"]))}
        | {"parameters": arrow(r["params_before"], r["params_after"]), "saved": f"{r['params_saved_fraction']:.1%}"}
        | {"bytes": arrow(r["bytes_before"], r["bytes_after"])}
        for fraction, r in sorted(by_fraction.items())
    ]


def analyse(plan: dict[str, Any], records: list[dict[str, Any]], plots_dir: Path) -> Analysis:
    spec = plan.get("spec", {})
    values = retention_values(records, spec.get("task_margin", 0.0))
    main = calibration_label(spec.get("calibration_languages"))
    tasks = any(_has(v, "task_mean") for v in values.values())
    arms = [arm for arm in ARMS if any(key[1] == arm for key in values)]
    measures = [m for m in MEASURES if tasks or m == "val loss"]
    claims = [c for m in measures for arm in arms for c in _maestro_claims(values, arm, main, m)]
    claims += _calibration_claims(values, main)
    main_values, at, written = {key[:3]: v for key, v in values.items() if key[3] == main}, _share(CLAIM_FRACTION), []
    title = "Retention = original / pruned val loss per language"
    title += "; task retention = (pruned - chance) / (original - chance) per local-suite task" if tasks else ""
    tables = {f"{title} (mean ± std over seeds)": _main_rows(values, main, tasks)}
    for what, key, languages in PER_LANGUAGE[: 1 + tasks]:
        written += [plot_retention(main_values, plots_dir, key)] if main_values else []
        tables[f"{what} retention per language at {at} removed (mean over seeds)"] = _language_rows(values, languages)
    tables["Memory saved (parameters and persistent buffers)"] = _memory_rows(records)
    claims = about(claims, PAPER, Subject(TRAINED_MOE, HERE)) if values else []
    return Analysis(claims=claims, tables=tables, plots=written)


def plot_retention(values, plots_dir: Path, key: str = "mean") -> Path:
    """Mean retention (``key``) per method, one panel per arm present, one marker per fraction, ± std over seeds."""
    fractions, methods = sorted({f for f, _, _ in values}), list(dict.fromkeys(m for _, _, m in values))
    (name, what, over), panels = PLOTS[key], []
    for arm in (arm for arm in ARMS if any(k[1] == arm for k in values)):
        title = f"{arm} (vs {'the parent' if arm == 'pruned' else 'the recovered unpruned control'})"
        series = {f"{_share(f)} removed": [values.get((f, arm, m), {key: {}})[key] for m in methods] for f in fractions}
        panels.append({"names": methods, "series": series, "title": title, "rotation": 30} | {"reference": REFERENCE})
    suptitle = f"Retention, mean over {over}"
    return plots.category_figure(plots_dir, name, panels, sharey=True, ylabel=f"retention ({what})", suptitle=suptitle)


__all__ = ["PruningSpec", "analyse", "calibration_label", "expand", "measure_memory", "measure_tasks", "parse"]
