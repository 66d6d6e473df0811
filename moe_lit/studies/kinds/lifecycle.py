"""Study kind ``lifecycle``: a pretrained dense model (an imported SmolLM2-135M) through one chain.

Partitioned into MoEs (``shapes`` x ``methods``; ``pruning``: the same active width) and distilled
from the dense model; the ``prune_source`` MoE pruned (a global budget; naee per layer), turned dense
against dense->dense pruning at its width, and sparsified. Every model: bits per byte per language
and the suite's items; with one seed the claims pair models item by item (the sparsity's: languages).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_lit.config import ModelConfig
from moe_lit.convert import recipes
from moe_lit.convert.importance import METHODS as PRUNE_METHODS
from moe_lit.convert.moe_to_dense import MoeToDenseConfig
from moe_lit.convert.partition import ASSIGNMENTS, partitioned_config
from moe_lit.convert.recipes import PRUNING, prune_by_importance
from moe_lit.errors import MoeLitError
from moe_lit.inference.sparsity import RULES
from moe_lit.studies import measures, plots
from moe_lit.studies import spec as check
from moe_lit.studies.identity import TRANSFORMED_START, Call, Point, Start
from moe_lit.studies.kinds import Analysis
from moe_lit.studies.records import select
from moe_lit.studies.verdicts import CONVERTED_MOE, EQUIVALENT, HIGHER, TRAINED_MOE, Claim, Subject, about, finding

DOT_MOE, METHODS = "dot_moe", (*ASSIGNMENTS, "dot_moe", PRUNING)
SPARSE_TARGET, TARGETS, DAMPING, CALIBRATION_BATCH = 0.9, [0.0, 0.5, 0.7, 0.8, 0.9], 0.85, 4
"""The 90% claim's target, the sparsity targets, MAESTRO's damping (the pruning study's), DOT-MoE's batch."""


@dataclass
class LifecycleSpec:
    """The kind's own fields."""

    model: str
    """The dense model: an exported / imported model directory (``make smollm2``), every recovery's teacher."""
    shapes: list[list[int]]
    """``[E, k]`` MoEs the dense FFNs are partitioned into (E experts of d_ff / E neurons, k active)."""
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    """random | kmeans | coactivation (centroid routers) | dot_moe | pruning (once per active width)."""
    conversion_seeds: list[int] = field(default_factory=list)
    """Seeds of the partition stage only, beside the study's seeds (each a new partition init, DOT-MoE training
    and distillation order; the dense model is measured once): the partition claims take the seed as the unit."""
    prune_source: str = "E8k4/dot_moe"
    """``E<E>k<k>/<method>``: the recovered MoE pruned, turned dense and sparsified (named before it runs)."""
    fractions: list[float] = field(default_factory=lambda: [0.25, 0.5])
    """Fractions of its experts removed."""
    prune_methods: list[str] = field(default_factory=lambda: ["maestro", "frequency", "router_weighted", "reap"])
    """Expert importance methods (moe_lit.convert.importance.METHODS); the first is the claimed best."""
    to_dense: dict[str, Any] = field(default_factory=lambda: {"keep": 4, "groups": 4})
    """MoeToDenseConfig fields of the MoE->dense arm; width = groups x expert size (the dense arm's too)."""
    calibration_tokens: int = 4096
    """Calibration tokens (per language of ``calibration_split``; co-activation, pruning: of the train stream)."""
    calibration_split: str = "train"
    """The split the expert pruning and MoE->dense (and dense->dense) calibrate on: train, never the test text the
    suite's items are drawn from; test: how configs/studies/lifecycle-smollm2.yaml's records were made."""
    train_tokens: int = 65_536
    """DOT-MoE: training tokens of its assignment and routers (the dense model as teacher)."""
    recovery: check.FineTune = field(default_factory=lambda: check.FineTune(steps=96, lr=1e-4, warmup=10))
    """The distillation of every recovered model (tokens: steps x run.data batch_size x seq_len)."""
    max_increase: float = 0.01
    """Sparsity: the relative loss increase that counts as none; the margin of the 90% claim."""
    languages: list[str] | None = None
    """Languages of every measure; null: every language of the data."""
    bpb_tokens: int = 4096
    """Bits per byte: tokens per language of the val split (also the sparsity's evaluation tokens)."""
    tasks: list[str] = field(default_factory=lambda: ["moe_lit_pairs"])
    """Local-suite tasks or tags (test split) with an accuracy."""
    suite_languages: list[str] | None = None
    """Languages of the suite's tasks; null: those of ``languages``."""
    limit: int | None = 500
    """Suite items per task (the first ones); null: every item."""

    def __post_init__(self) -> None:
        check.distinct(self.shapes, "shapes", each=lambda s: len(s) == 2 and all(map(check.is_int, s)), must="[E, k]")
        check.distinct(self.methods, "methods", allowed=METHODS)
        check.ints(self.conversion_seeds, "conversion_seeds", 0, empty=True)
        moes = [f"E{e}k{k}/{m}" for e, k in self.shapes for m in self.methods if m != PRUNING]
        check.choice(self.prune_source, "prune_source", moes)
        check.fractions(self.fractions, "fractions")
        check.distinct(self.prune_methods, "prune_methods", allowed=PRUNE_METHODS)
        check.build(MoeToDenseConfig, self.to_dense, "to_dense")
        check.positive_fields(self, "calibration_tokens", "train_tokens", "bpb_tokens")
        check.choice(self.calibration_split, "calibration_split", ["train", "test"])
        check.number(self.max_increase, "max_increase", 0)
        check.languages(self.languages, "languages")
        check.languages(self.suite_languages, "suite_languages")
        check.distinct(self.tasks, "tasks", each=lambda t: isinstance(t, str), what="task names")
        check.positive_int(self.limit, "limit", optional=True)


DEFAULT_RUN = {"data": {"seq_len": 256, "batch_size": 4, "val_batches": 2}, "optim": {"warmup_steps": 10}}
parse = check.parser(LifecycleSpec, ("model", "shapes"))


# ----------------------------------------------------------------------------- points
def expand(spec: LifecycleSpec, header) -> list[Point]:
    from moe_lit.checkpoint import load_config

    dense, data_dir, points = load_config(spec.model), str(header.run.data.resolved_dir()), []
    quality = {"data_dir": data_dir, "languages": spec.languages, "bpb_split": "val", "bpb_tokens": spec.bpb_tokens}
    quality |= {"tasks": spec.tasks, "limit": spec.limit, "suite_languages": spec.suite_languages or spec.languages}
    calibration, on_disk = {"calibration_tokens": spec.calibration_tokens}, Start(path=spec.model, mode="init")
    text = calibration | {"split": spec.calibration_split}
    first = {k / e: [e, k] for e, k in reversed(spec.shapes)}
    extra = [s for s in spec.conversion_seeds if s not in header.seeds]
    for seed in [*header.seeds, *extra]:
        runs = {False: header.seeded_run(seed).replace(train={"max_steps": 0})}
        runs[True] = spec.recovery.run(header.seeded_run(seed))
        modules = {False: None, True: Call.of(distill_module, teacher=spec.model)}

        def add(config, model, info, start, transform=None, recovered=False, measure=None, seed=seed) -> None:
            measure = measure or Call.of(measure_model, before=recovered, **quality)
            run, module = runs[recovered], modules[recovered]  # noqa: B023 - called within this iteration only
            point = header.point(config, seed, model, run, info, start, transform, (), measure, module)
            extra_seed = seed in extra  # noqa: B023 - called within this iteration only
            points.append(dataclasses.replace(point, name=f"{config}/s{seed}") if extra_seed else point)

        if seed in header.seeds:  # measured once a seed of the study; deterministic (no training)
            add("dense", dense, {"stage": "dense", "method": "dense"}, on_disk)
        for (experts, top_k), method in itertools.product(spec.shapes, spec.methods):
            if method == PRUNING and first[top_k / experts] != [experts, top_k]:
                continue  # pruning once per active width (at its first shape)
            kwargs = {"method": method, "experts": experts, "top_k": top_k, "data_dir": data_dir, "seed": seed}
            kwargs |= {"batch_size": CALIBRATION_BATCH}
            kwargs |= {"train_tokens": spec.train_tokens} if method == DOT_MOE else {}
            kwargs |= calibration if method in ("coactivation", PRUNING) else {}
            model = partitioned_config(dense, experts, top_k)
            model = dense.replace(d_ff=dense.d_ff * top_k // experts) if method == PRUNING else model
            shape, transform = f"E{experts}k{top_k}", Call.of(measures.partition_on_stream, **kwargs)
            info = {"stage": "partition", "method": method, "shape": shape, "active_ffn": top_k / experts}
            add(f"{shape}/{method}", model, info, on_disk, transform, recovered=True)
        if seed in extra:
            continue  # a conversion seed: the partition stage only
        moe = next(p for p in points if p.config_name == spec.prune_source).model
        from_source = header.start(spec.prune_source, seed)
        for fraction in spec.fractions:
            for method in spec.prune_methods:
                kwargs = {"method": method, "fraction": fraction, "data_dir": data_dir, "seed": seed, **text}
                kwargs |= {"damping": DAMPING, "global_budget": method != "naee"}
                info = {"stage": "prune", "method": method, "fraction": fraction}
                add(f"prune/{fraction:g}/{method}", moe, info, from_source, Call.of(prune_by_importance, **kwargs))
        width = spec.to_dense["groups"] * moe.moe_section().expert_size
        to_dense = Call.of(recipes.moe_to_dense_on_text, data_dir=data_dir, **text, **spec.to_dense)
        pruned = Call.of(recipes.prune_dense_to_width, width=width, data_dir=data_dir, **text)
        info = {"stage": "to_dense", "width": width}
        add("to_dense/moe", dense.replace(d_ff=width), info | {"method": "moe"}, from_source, to_dense, True)
        add("to_dense/dense", dense.replace(d_ff=width), info | {"method": "dense"}, on_disk, pruned, True)
        sparsity = {"data_dir": data_dir, "targets": TARGETS, "granularity": "layer", "seed": seed, "clock": "cpu"}
        sparsity |= {"calibration_split": "test", "eval_split": "val", "languages": spec.languages}
        sparsity |= {"calibration_tokens": spec.calibration_tokens, "eval_tokens": spec.bpb_tokens, "timing_tokens": 1}
        sparsity |= {"timing_rounds": 20, "decode_tokens": 16, "max_increase": spec.max_increase}
        for rule in RULES:
            measure = Call.of(measures.measure_sparsity, rule=rule, statistics_target=SPARSE_TARGET, **sparsity)
            add(f"sparsity/{rule}", moe, {"stage": "sparsity", "method": rule}, from_source, measure=measure)
    return points


def distill_module(cfg: ModelConfig, optim, parent: Path | None, teacher: str):
    """A DistillModule whose frozen teacher is the dense model ``teacher`` (whatever the point starts from)."""
    from moe_lit.lit.distill import DistillModule

    return DistillModule(cfg, optim, teacher=teacher)


def measure_model(point: Point, result: Any, run_dir: Path, before: bool, **options: Any) -> dict[str, Any]:
    """:func:`~moe_lit.studies.measures.model_quality` of the final weights; ``before``: of the start's too."""
    out = measures.model_quality(measures.final_checkpoint(result), **options)
    return out | ({"before": measures.model_quality(Path(run_dir) / TRANSFORMED_START, **options)} if before else {})


# ----------------------------------------------------------------------------- analysis
def _items(scores: dict[str, Any], task: str | None = None) -> dict[int, float]:
    """Every scored item's 0/1 accuracy (of ``task``, else of all, in task name order): the units claims pair."""
    tasks = [task] if task else sorted(scores["outcomes"])
    return dict(enumerate(float(o) for t in tasks for o in scores["outcomes"][t]))


def _acc(quality: dict[str, Any] | None) -> str:
    return f"{quality['task_acc']:.4f} ± {quality['task_acc_se']:.4f} ({quality['task_items']})" if quality else ""


def _retention_row(config: str, r: dict[str, Any], source: dict[str, Any]) -> dict[str, Any]:
    """A pruned model's bits-per-byte (mean, per language) and per-task above-chance accuracy retention
    (:func:`~moe_lit.evaluation.retention.suite_retention`: the tasks where the source beats chance)."""
    from moe_lit.evaluation.retention import suite_retention

    row = {"point": config, "bpb retention": f"{source['bpb_mean'] / r['bpb_mean']:.4f}"}
    row |= {f"bpb {lang}": f"{source['bpb'][lang] / v:.4f}" for lang, v in r["bpb"].items()}
    try:
        tasks = suite_retention(source["suite"], r["suite"]).tasks
    except MoeLitError:  # no task above chance
        return row | {"cross-task variance": ""}
    row |= {t.removeprefix("moe_lit_"): f"{v:.3f}" for t, v in tasks.per_key.items()}
    return row | {"cross-task variance": f"{tasks.variance:.5f}"}


CONVERSION_SEEDS = 3
"""Conversion seeds (partition init, DOT-MoE training, distillation order) a partition-stage claim needs:
the seed is its unit, so the conversion's own noise is in the error bar."""
UNIT_WEIGHTS = (
    "the prune source's router weights are all 1.0 (unit_weights, no renormalisation), so router-weighted "
    "frequency is frequency"
)
FORCED_BUDGET = (
    "at {fraction:g} pruned every layer keeps exactly top_k = {top_k} experts (total = active parameters): no "
    "cross-layer allocation is left and routing picks every kept expert, so the methods' choice plays no part"
)
CONVERSION_UNIT = (
    "the claims take each conversion seed's mean accuracy as the unit ({n} seeds needed); below, the same "
    "contrasts item by item within one conversion, as findings."
)
PARTITION_PAPER = Subject(CONVERTED_MOE, "DOT-MoE: pretrained dense LMs cut into experts")
PRUNE_PAPER = Subject(TRAINED_MOE, "MAESTRO / REAP / NAEE: pretrained MoE LLMs")
TO_DENSE_PAPER = Subject(
    TRAINED_MOE, "Qwen3-30B-A3B, DeepSeek-V2-Lite, GPT-OSS-20B; distilled from the MoE, ~4B tokens"
)
SPARSITY_PAPER = Subject(TRAINED_MOE, "off-the-shelf pretrained MoEs")


def _here(spec: dict[str, Any], recovery_tokens: int) -> Subject:
    """The study's object: the dense model cut into experts and distilled from itself."""
    return Subject(CONVERTED_MOE, f"{spec['model']} cut into experts, {recovery_tokens:,} distillation tokens")


def _on_items(text: str, arms: dict[str, dict[str, Any]], a: str, b: str, task: str | None = None, **claim_fields):
    """``a`` beats ``b`` on task accuracy, items of one seed as the units."""
    claim = Claim(text, "task acc (items)", (a, b), HIGHER, **claim_fields)
    if "suite" not in arms.get(a, {}) or "suite" not in arms.get(b, {}):
        return claim.missing("an arm has no measurement (not run yet, or failed)")
    return claim.on(_items(arms[a]["suite"], task), _items(arms[b]["suite"], task))


def _on_seeds(text: str, seeds: dict[int, dict[str, dict[str, Any]]], a: str, b: str, task: str | None = None):
    """``a`` beats ``b`` on task accuracy, conversion seeds as the units (each seed's mean over items)."""
    claim = Claim(text, "task acc (seeds)", (a, b), HIGHER)
    mean = {
        s: {arm: _mean(arms[arm]["suite"], task) for arm in (a, b) if "suite" in arms.get(arm, {})}
        for s, arms in seeds.items()
    }
    shared = sorted(s for s, arms in mean.items() if len(arms) == 2)
    if not shared:
        return claim.missing("an arm has no measurement (not run yet, or failed)")
    evidence = claim.on({s: mean[s][a] for s in shared}, {s: mean[s][b] for s in shared})
    if len(shared) < CONVERSION_SEEDS:
        why = f"{len(shared)} conversion seed(s), {CONVERSION_SEEDS} needed: the conversion's own noise is not measured"
        return dataclasses.replace(evidence.untestable(why), reason=why)  # the seed count is the reason
    return evidence


def _mean(scores: dict[str, Any], task: str | None) -> float:
    values = list(_items(scores, task).values())
    return sum(values) / len(values)


def _partition_claims(seeds: dict[int, dict[str, dict[str, Any]]], spec: dict[str, Any]) -> tuple[list, list]:
    """(claims on seeds, the same contrasts on the items of the first seed: within-conversion findings)."""
    first_seed = seeds[min(seeds)]
    claims, items, pruning = [], [], {k / e: f"E{e}k{k}/{PRUNING}" for e, k in reversed(spec["shapes"])}
    tasks = sorted(first_seed.get("dense", {}).get("suite", {}).get("outcomes", {}))
    for experts, top_k in spec["shapes"]:
        shape = f"E{experts}k{top_k}"
        pairs = [
            (
                f"{shape}: the dense model scores above a random partition" + (f" ({t})" if t else ""),
                "dense",
                f"{shape}/random",
                t,
            )
            for t in tasks or [None]
        ]
        baselines = [f"{shape}/{m}" for m in ASSIGNMENTS if m in spec["methods"]]
        baselines += [pruning[top_k / experts]] if PRUNING in spec["methods"] else []
        pairs += [(f"{shape}: DOT-MoE beats {b.split('/')[1]}", f"{shape}/{DOT_MOE}", b, None) for b in baselines]
        claims += [_on_seeds(text, seeds, a, b, t) for text, a, b, t in pairs]
        items += [_on_items(text, first_seed, a, b, t) for text, a, b, t in pairs]
    return claims, items


def _prune_claims(arms: dict[str, dict[str, Any]], spec: dict[str, Any]) -> list:
    """The first prune method against each other, per fraction; a budget that keeps exactly top-k experts in
    every layer (total = active parameters) leaves no choice to compare."""
    source = arms.get(spec["prune_source"], {}).get("model", {}).get("moe") or {}
    unit = source.get("unit_weights") and not source.get("renormalize")
    same = UNIT_WEIGHTS if unit else ""
    claims, (first, *others) = [], spec["prune_methods"]
    for fraction in spec["fractions"]:
        arm = f"prune/{fraction:g}/"
        made = [
            _on_items(f"{fraction:g} pruned: {first} beats {m}", arms, arm + first, arm + m, same_outcomes=same)
            for m in others
        ]
        pruned = [arms[arm + m] for m in spec["prune_methods"] if arm + m in arms]
        if pruned and all(r["total_params"] == r["active_params"] for r in pruned):
            why = FORCED_BUDGET.format(fraction=fraction, top_k=pruned[0]["top_k"])
            made = [e.untestable(why) for e in made]
        claims += made
    return claims


def _chain_claims(
    seeds: dict[int, dict[str, dict[str, Any]]], spec: dict[str, Any], recovery_tokens: int
) -> tuple[list, list]:
    """(the claims, within-conversion item-level contrasts of the partition stage)."""
    arms, here = seeds[min(seeds)], _here(spec, recovery_tokens)
    partition, items = _partition_claims(seeds, spec)
    claims = about(partition, PARTITION_PAPER, here)
    claims += about(_prune_claims(arms, spec), PRUNE_PAPER, here)
    text = "MoE->dense beats dense->dense at the same width"
    claims += about([_on_items(text, arms, "to_dense/moe", "to_dense/dense")], TO_DENSE_PAPER, here)
    sparsity = []
    for rule in RULES:
        text, metric = f"{rule}: 90% of the neurons skipped within the margin", "loss increase (languages)"
        claim = Claim(text, metric, (f"sparsity/{rule}", "0"), EQUIVALENT, margin=spec["max_increase"])
        curve = arms.get(f"sparsity/{rule}", {}).get("curve", [])
        rows = [r["increase"] for r in curve if r["target"] == SPARSE_TARGET]
        sparsity.append(claim.on(dict(enumerate(rows)), 0.0) if rows else claim.missing("not measured yet"))
    return claims + about(sparsity, SPARSITY_PAPER, here), items


def _model_row(config: str, r: dict[str, Any]) -> dict[str, Any]:
    before = r.get("before") or {}
    row = {"point": config, "params": f"{r.get('params', r['total_params']):,}", "bpb (mean)": f"{r['bpb_mean']:.4f}"}
    row |= {"task acc ± SE (items)": _acc(r), "bpb before": f"{before['bpb_mean']:.4f}" if before else ""}
    row |= {"task acc before": _acc(before)}
    return row | {f"bpb {lang}": f"{v:.4f}" for lang, v in r.get("bpb", {}).items()}


def _sparsity_rows(config: str, r: dict[str, Any]) -> list[dict[str, Any]]:
    """Per target: the inactive fraction and relative loss increase (mean over languages, and per
    language); the highest target within the margin and the speedups there on that target's row."""
    speedups = (r.get("layer_speedup"), r.get("decode_speedup"))
    shown = "x, ".join(f"{v:.2f}" for v in speedups) + "x" if None not in speedups else "no target > 0 within it"
    rows = []
    for target in sorted({c["target"] for c in r.get("curve", [])}):
        at = [c for c in r["curve"] if c["target"] == target]
        row = {"point": config, "target": f"{target:g}"}
        row["inactive"] = f"{sum(c['inactive'] for c in at) / len(at):.3f}"
        row["loss increase"] = f"{sum(c['increase'] for c in at) / len(at):+.2%}"
        row |= {f"increase {c['language']}": f"{c['increase']:+.2%}" for c in at}
        row["highest within margin: FFN-layer, decode speedup"] = shown if target == r.get("best_target") else ""
        rows.append(row)
    return rows


def analyse(plan: dict[str, Any], records: list[dict[str, Any]], plots_dir: Path) -> Analysis:
    seed = min(plan["seeds"])
    arms = {r["config_name"]: r for r in select(records, seed=seed)}
    models = [_model_row(config, r) for config, r in arms.items() if r.get("stage") != "sparsity"]
    sparse = [row for c, r in arms.items() if r.get("stage") == "sparsity" for row in _sparsity_rows(c, r)]
    tables = {f"Every model of the chain (seed {seed}; task acc over the suite's items, item-level SE)": models}
    source, pruned = arms.get(plan["spec"]["prune_source"]), [(c, r) for c, r in arms.items() if r["stage"] == "prune"]
    tables["Pruned: retention against the prune source"] = [_retention_row(c, r, source) for c, r in pruned if source]
    tables["Intra-expert activation sparsity of the prune source (per-layer thresholds; loss increase relative)"] = (
        sparse
    )
    measured = sorted({*plan["seeds"], *plan["spec"].get("conversion_seeds", [])})
    seeds = {s: {r["config_name"]: r for r in select(records, seed=s)} for s in measured}
    seeds = {s: ({"dense": arms["dense"]} if "dense" in arms else {}) | a for s, a in seeds.items()}  # measured once
    recovery = plan["spec"]["recovery"]["steps"] * plan["run"]["data"]["batch_size"] * plan["run"]["data"]["seq_len"]
    claims, items = _chain_claims({s: a for s, a in seeds.items() if a} or {seed: {}}, plan["spec"], recovery)
    within = f"Within one conversion (seed {seed}; items as units, the conversion's noise not in the CI)"
    note = [f"- Partition stage: {CONVERSION_UNIT.format(n=CONVERSION_SEEDS)}"]
    note += [finding(e.untestable("within one conversion"), within) for e in items]
    plotted = [(c, r) for c, r in arms.items() if r.get("stage") != "sparsity" and "task_acc" in r]
    plot = [plot_chain(plotted, plots_dir)] if plotted else []
    return Analysis(claims=claims, findings=note, tables=tables, plots=plot)


def plot_chain(models: list[tuple[str, dict[str, Any]]], plots_dir: Path) -> Path:
    """Task accuracy (± its item-level SE) against bits per byte, one marker per model (its shape by
    stage); a recovered model's arrow starts at the hollow marker of right after its conversion."""
    import matplotlib

    fig, (ax,) = plots.panels(1, 9.0, 6.5)
    shapes, colours = {"dense": "*", "partition": "o", "prune": "s", "to_dense": "^"}, matplotlib.colormaps["tab20"]
    for i, (config, r) in enumerate(models):
        style = {"marker": shapes.get(r.get("stage"), "o"), "color": colours(i % 20), "capsize": 3}
        ax.errorbar(r["bpb_mean"], r["task_acc"], yerr=r["task_acc_se"], label=config, **style)
        if before := r.get("before"):
            ax.plot(before["bpb_mean"], before["task_acc"], style["marker"], mfc="none", color=style["color"])
            tail, head = (before["bpb_mean"], before["task_acc"]), (r["bpb_mean"], r["task_acc"])
            ax.annotate("", head, tail, arrowprops={"arrowstyle": "->", "color": style["color"], "alpha": 0.5})
    ax.set(xlabel="bits per byte (mean over languages; lower is better)", ylabel="task accuracy (items)")
    ax.set_title("Every model of the chain: after recovery (filled), right after conversion (hollow)", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return plots.save(fig, plots_dir, "chain")
