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


def expand(spec: PruningSpec, header) -> list[Point]:
    measure = Call(MEASURE)
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
        parent = header.point_name("original", seed)
        control = header.point_name("original/recovered", seed)
        references = {"pruned": parent, "recovered": control}
        points += [
            Point(parent, "original", seed, spec.model, pretrain, info={"arm": "original"}),
            Point(
                control,
                "original/recovered",
                seed,
                spec.model,
                runs["recovered"],
                info={"arm": "control"},
                start=Start(parent=parent, mode="init"),
            ),
        ]
        for fraction in spec.fractions:
            for method in spec.methods:
                transform = Call(TRANSFORM, _transform_kwargs(spec, header, method, fraction, seed))
                for arm, run in runs.items():
                    config_name = f"{method}/{_label(fraction)}/{arm}"
                    points.append(
                        Point(
                            header.point_name(config_name, seed),
                            config_name,
                            seed,
                            spec.model,
                            run,
                            info={"arm": arm, "method": method, "fraction": fraction, "reference": references[arm]},
                            start=Start(parent=parent, mode="init"),
                            transform=transform,
                            measure=measure,
                        )
                    )
    return points


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


def measure_memory(point: Point, result: Any, run_dir: Path) -> dict[str, Any]:
    """Parameters and bytes of the parent (``point.model``) and of the pruned model (``memory_saved``)."""
    from moe_lit.checkpoint import load_model
    from moe_lit.convert.prune import memory_saved
    from moe_lit.model import Transformer

    pruned = load_model(result.checkpoint)
    original = Transformer(point.model.replace(vocab_size=pruned.config.vocab_size))
    # NOTE: flat fields (not one nested dict), so that runs.csv keeps them as columns.
    return {
        **memory_saved(original, pruned),
        "kept_experts": [pruned.config.moe_layer_config(b).num_experts for b in pruned.config.moe_layer_ids],
    }


# ----------------------------------------------------------------------------- analysis
def _retention(original: dict[str, Any], pruned: dict[str, Any]) -> tuple[float, float]:
    """(mean, variance across languages) of the val-loss retention; NaN when a loss is not finite."""
    from moe_lit.evaluation.retention import retention

    try:
        result = retention(original["val_loss_per_language"], pruned["val_loss_per_language"], higher_is_better=False)
    except MoeLitError:
        return math.nan, math.nan
    return result.mean, result.variance


def retention_values(records: list[dict[str, Any]]) -> dict[tuple[float, str, str], dict[str, list[float]]]:
    """(fraction, arm, method) -> per-seed lists of retention ``mean``, its ``variance`` across
    languages, and ``val_loss``, each child against its own reference (records with status ok)."""
    ok = {r["name"]: r for r in records if r["status"] == "ok"}
    values: dict[tuple[float, str, str], dict[str, list[float]]] = {}
    for record in ok.values():
        reference = ok.get(record.get("reference") or "")
        if record.get("arm") not in ARMS or reference is None:
            continue
        mean, variance = _retention(reference, record)
        group = values.setdefault(
            (record["fraction"], record["arm"], record["method"]),
            {"mean": [], "variance": [], "val_loss": [], "seed": []},
        )
        group["seed"].append(record["seed"])
        group["mean"].append(mean)
        group["variance"].append(variance)
        group["val_loss"].append(record["val_loss"])
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


def _claim_findings(values, arm: str) -> list[str]:
    """MAESTRO vs the best other method at 50% removed: the highest mean retention over the seeds
    (random excluded; a baseline picked after the fact, which favours the baseline)."""
    at = {method: v for (fraction, a, method), v in values.items() if fraction == CLAIM_FRACTION and a == arm}
    baselines = {m: v for m, v in at.items() if m not in ("maestro", "random")}
    if "maestro" not in at or not baselines:
        return [
            (
                f"- **MAESTRO's claims, {arm}**: not tested (needs maestro and another non-random method at "
                f"{_label(CLAIM_FRACTION)} removed)."
            )
        ]

    def mean_retention(method: str) -> float:
        mean = summarize(baselines[method]["mean"]).mean
        return -math.inf if math.isnan(mean) else mean

    best = max(baselines, key=mean_retention)
    mean_cmp = compare_paired(*_by_seed(at["maestro"], baselines[best], "mean"))
    var_cmp = compare_paired(*_by_seed(at["maestro"], baselines[best], "variance"))
    better = mean_cmp.significant and mean_cmp.diff > 0
    steadier = var_cmp.significant and var_cmp.diff < 0
    return [
        (
            f"- **Retention at {_label(CLAIM_FRACTION)} removed, {arm}, maestro vs the best baseline ({best})** "
            f"(MAESTRO: up to 10.61% better retention than the best baseline): {format_comparison(mean_cmp)}; "
            f"**{'reproduced' if better else 'not reproduced'}**."
        ),
        (
            f"- **Variance of retention across languages, {arm}, maestro vs {best}** (MAESTRO: lower variance across "
            f"tasks): {format_comparison(var_cmp, digits=6)}; **{'reproduced' if steadier else 'not reproduced'}**."
        ),
    ]


def analyse(plan: dict[str, Any], records: list[dict[str, Any]], plots_dir: Path) -> Analysis:
    values = retention_values(records)
    rows = [
        {
            "removed": _label(fraction),
            "arm": arm,
            "method": method,
            "retention (mean over languages)": format_summary(summarize(v["mean"])),
            "variance across languages": format_summary(summarize(v["variance"]), digits=6),
            "val loss": format_summary(summarize(v["val_loss"])),
        }
        for (fraction, arm, method), v in values.items()
    ]
    findings = [line for arm in ARMS for line in _claim_findings(values, arm)] if values else []
    plots = [plot_retention(values, Path(plots_dir) / "retention.png")] if values else []
    return Analysis(
        findings=findings,
        tables={
            "Retention = original / pruned val loss per language (mean ± std over seeds)": rows,
            "Memory saved (parameters and persistent buffers)": _memory_rows(records),
        },
        plots=plots,
    )


def plot_retention(values, path: Path) -> Path:
    """Mean retention per method, one panel per arm, one marker per fraction, ± std over seeds."""
    from moe_lit.plotting import pyplot, save_figure, seed_errorbar, spread_note

    plt = pyplot()
    fractions = sorted({f for f, _, _ in values})
    methods = list(dict.fromkeys(m for _, _, m in values))
    fig, axes = plt.subplots(1, len(ARMS), figsize=(5 * len(ARMS), 3.8), sharey=True)
    offset = 0.6 / len(fractions)
    counts = []
    for ax, arm in zip(axes, ARMS, strict=False):
        for i, fraction in enumerate(fractions):
            stats = [summarize(values.get((fraction, arm, m), {"mean": []})["mean"]) for m in methods]
            counts += [s.n for s in stats if s.n]
            xs = [j + (i - (len(fractions) - 1) / 2) * offset for j in range(len(methods))]
            seed_errorbar(ax, xs, stats, linestyle="none", label=f"{_label(fraction)} removed")
        ax.set_xticks(range(len(methods)), methods, rotation=30)
        ax.set_title(f"{arm} (vs {'the parent' if arm == 'pruned' else 'the recovered unpruned control'})")
        ax.axhline(1.0, color="grey", linewidth=0.8, label="1 = nothing lost")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].set_ylabel("retention (original / pruned val loss)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Retention, mean over languages ({spread_note(counts)})", fontsize=10)
    return save_figure(fig, path)


__all__ = [
    "PruningSpec",
    "analyse",
    "expand",
    "measure_memory",
    "parse",
    "plot_retention",
    "prune_by_importance",
    "retention_values",
]
