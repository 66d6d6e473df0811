"""Study kind ``sparsity``: how much of each expert can be skipped, and what does skipping buy?

After the intra-expert activation sparsity paper (90% of an expert's neurons inactive without significant loss; 2.5x
MoE-layer, 1.2x end-to-end speedup on GPU). Per seed and model of ``models`` (pretrained here, or a model on disk), one
0-step point per rule and granularity measures (:func:`moe_lit.studies.measures.sparsity_profile`) the loss per target
and language against the dense model, the highest target within ``max_increase``, the speedups there and the inactive
fraction per language, layer and expert. Claims: 90% skipped within ``max_increase`` (TOST); the speedups are the GPU's
(untestable here); per-expert thresholds and the gate_up rule lose less (paired by seed).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path
from typing import Any

from moe_lit.config import ConfigError, ModelConfig
from moe_lit.inference.sparsity import GRANULARITIES, RULES
from moe_lit.plotting import seed_errorbar
from moe_lit.stats import format_difference, format_values, paired_difference, summarize
from moe_lit.studies import measures, plots
from moe_lit.studies import spec as check
from moe_lit.studies.identity import Call, Point, Start
from moe_lit.studies.kinds import Analysis
from moe_lit.studies.measures import SuiteSpec, token_weighted
from moe_lit.studies.records import group, language_means, select
from moe_lit.studies.verdicts import DENSE, EQUIVALENT, HIGHER, LOWER, TRAINED_MOE, Claim, Subject, about

CLAIM_TARGET = 0.9
"""The paper's 'up to 90% of the neurons inactive without significant loss'."""
CLAIM_LAYER_SPEEDUP, CLAIM_DECODE_SPEEDUP = 2.5, 1.2
"""The paper's MoE-layer and end-to-end speedups (on top of vLLM, GPU)."""
GPU_SPEEDUP = "the paper's speedups are GPU kernels on top of vLLM; this study times CPU forward passes ({})"


@dataclass
class SparsitySpec:
    """The kind's own fields."""

    models: dict[str, Any]
    """Name -> a model config (pretrained with run.train) or ``{path: <dir>}``: a model on disk (not trained)."""
    targets: list[float] = field(default_factory=lambda: [0.0, 0.5, 0.7, 0.8, 0.9, 0.95])
    """Target sparsities (fractions of neurons skipped on the calibration text), each in [0, 1)."""
    rules: list[str] = field(default_factory=lambda: list(RULES))
    """Neuron scores (moe_lit.inference.sparsity.RULES): gate = |silu(gate)|, gate_up = |silu(gate) * up|."""
    granularities: list[str] = field(default_factory=lambda: list(GRANULARITIES))
    """One threshold per layer or per expert (a dense model runs 'layer' only: one expert per layer)."""
    languages: list[str] | None = None
    """Languages of the calibration and evaluation text; null = every language of the data."""
    calibration_split: str = "test"
    """Split of the parallel text the thresholds are calibrated on (test: held out from training and validation)."""
    calibration_tokens: int = 4096
    """Calibration tokens in all (the same share of every language)."""
    eval_split: str = "val"
    """Split of the parallel text the loss is measured on."""
    eval_tokens: int = 4096
    """Evaluation tokens per language (the model's own tokenizer; fewer when a language has fewer)."""
    max_increase: float = 0.01
    """Largest relative loss increase in every language that counts as no loss (0.01 = 1%): the 90% claim's margin."""
    statistics_target: float = 0.9
    """Target at which the inactive fraction per language, layer and expert is recorded."""
    timing_tokens: int = 1
    """Tokens per step of the FFN-layer timing (1 = decoding)."""
    timing_rounds: int = 30
    """Interleaved rounds of the FFN-layer timing (the decode timing runs a tenth of them, at least 2)."""
    decode_tokens: int = 32
    """Tokens generated greedily (batch 1, KV cache) per round of the end-to-end timing."""
    clock: str = "cpu"
    """Timing clock (moe_lit.timing.CLOCKS): cpu = this process's CPU time (robust to other load), wall = elapsed."""
    suite: SuiteSpec | None = None
    """Local-suite accuracy (SuiteSpec) of the dense and the sparse model at statistics_target; null: loss only."""

    def __post_init__(self) -> None:
        from moe_lit.timing import CLOCKS

        why = f"must be a non-empty mapping name -> model config or {{path: dir}}, got {self.models}"
        check.require(isinstance(self.models, dict) and bool(self.models), "models", why)
        for name, value in self.models.items():
            check.label(name, "models")
            why = f"must be a model config or {{path: dir}}, got {value!r}"
            check.require(isinstance(value, (dict, ModelConfig, str)), f"models.{name}", why)
            on_disk = isinstance(value, dict) and "path" in value
            alone = not on_disk or (set(value) == {"path"} and bool(value["path"]))
            check.require(alone, f"models.{name}", f"a model on disk is {{path: <dir>}} alone, got {value!r}")
        check.distinct(self.targets, "targets", each=lambda t: check.is_number(t) and 0 <= t < 1, must="in [0, 1)")
        check.distinct(self.rules, "rules", allowed=RULES)
        check.distinct(self.granularities, "granularities", allowed=GRANULARITIES)
        check.languages(self.languages, "languages")
        for name in ("calibration_split", "eval_split"):
            check.choice(getattr(self, name), name, check.SPLITS)
        check.positive_fields(
            self, "calibration_tokens", "eval_tokens", "timing_tokens", "timing_rounds", "decode_tokens"
        )
        check.number(self.max_increase, "max_increase", 0, closed="low")
        check.choice(self.statistics_target, "statistics_target", self.targets)
        check.choice(self.clock, "clock", CLOCKS)


DEFAULT_RUN = {"data": {"seq_len": 64, "batch_size": 16, "val_batches": 4}, "train": {"max_steps": 600}}


def model_on_disk(path: str) -> ModelConfig:
    """The config of an exported model directory (its ``config.json``), for the point's accounting."""
    from moe_lit.checkpoint import CONFIG_FILE

    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise ConfigError(f"models: {path} holds no {CONFIG_FILE}; give an exported or imported model directory")
    return ModelConfig.from_dict(json.loads(file.read_text()))


_parse = check.parser(SparsitySpec, ("models",))


def parse(fields: dict[str, Any], header) -> SparsitySpec:
    """The spec; a model config gets the run's seq_len, a model on disk stays its path."""
    spec, models = _parse(fields, header), {}
    for name, value in spec.models.items():
        if isinstance(value, dict) and "path" in value:
            models[name] = str(value["path"])
            continue
        with check.errors_under(f"models.{name}."):
            models[name] = ModelConfig.from_dict(dict(value)).replace(seq_len=header.run.data.seq_len)
    spec.models = models
    return spec


KWARGS = ("targets", "languages", "calibration_split", "calibration_tokens", "eval_split", "eval_tokens")
KWARGS += ("max_increase", "statistics_target", "timing_tokens", "timing_rounds", "decode_tokens", "clock")


def expand(spec: SparsitySpec, header) -> list[Point]:
    kwargs = {"data_dir": str(header.run.data.resolved_dir()), **{name: getattr(spec, name) for name in KWARGS}}
    suite = spec.suite
    kwargs |= {"suite_limit": suite and suite.limit, "suite_batch_size": suite and suite.batch_size}
    points = []
    for seed in header.seeds:
        run = header.seeded_run(seed).replace(train={"max_steps": 0})
        for name, model in spec.models.items():
            if isinstance(model, str):
                start, model_cfg = Start(path=model, mode="init"), model_on_disk(model)
            else:
                info = {"arm": "pretrain", "model_name": name}
                points.append(header.point(f"{name}/pretrain", seed, model, header.seeded_run(seed), info))
                start, model_cfg = header.start(f"{name}/pretrain", seed), model
            granularities = list(spec.granularities) if model_cfg.moe is not None else ["layer"]
            for rule, granularity in ((r, g) for r in spec.rules for g in granularities):
                info = {"arm": "sparsity", "model_name": name, "rule": rule, "granularity": granularity}
                measure = Call.of(measures.measure_sparsity, **kwargs, rule=rule, granularity=granularity, seed=seed)
                config = f"{name}/{rule}/{granularity}"
                points.append(header.point(config, seed, model_cfg, run, info, start, measure=measure))
    return points


# ----------------------------------------------------------------------------- analysis
Arm = tuple[str, str, str]
"""(model name, rule, granularity)."""


def overall_at(record: dict[str, Any], target: float, key: str = "loss") -> float:
    """Token-weighted mean of ``key`` over the languages at ``target`` (NaN when not measured)."""
    rows = [r for r in record["curve"] if r["target"] == target]
    return token_weighted(rows, target, record["eval_tokens_per_language"], key) if rows else math.nan


def increase_at(record: dict[str, Any], target: float) -> float:
    """Relative increase of the overall loss at ``target`` over the dense loss (0.01 = 1%)."""
    return overall_at(record, target) / overall_at(record, target, "dense_loss") - 1.0


def _pct(values: list[float]) -> str:
    scaled = [100 * v for v in values]
    return format_values(scaled, 2).replace(" (", " % (", 1) if summarize(scaled).n else "n/a"


def _field_values(recs: list[dict[str, Any]], key: str) -> list[float]:
    return [math.nan if r.get(key) is None else float(r[key]) for r in recs]


def _targets(recs: list[dict[str, Any]]) -> list[float]:
    return sorted({r["target"] for rec in recs for r in rec["curve"]})


def _language_row(recs: list[dict[str, Any]], target: float) -> dict[str, str]:
    """The loss increase per language at ``target`` (%, over the seeds)."""
    at = [{c["language"]: c["increase"] for c in r["curve"] if c["target"] == target} for r in recs]
    return {lang: _pct([by.get(lang, math.nan) for by in at]) for lang in recs[0]["eval_tokens_per_language"]}


def _curve_rows(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for t in _targets(recs):
        worst = [max((r["increase"] for r in rec["curve"] if r["target"] == t), default=math.nan) for rec in recs]
        row = {"target": f"{t:g}", "val loss": format_values([overall_at(r, t) for r in recs])}
        row |= {"increase": _pct([increase_at(r, t) for r in recs]), "worst language": _pct(worst)}
        rows.append(row | {"inactive reached": format_values([overall_at(r, t, "inactive") for r in recs], 3)})
    return rows


def _best_row(recs: list[dict[str, Any]], max_increase: float) -> dict[str, Any]:
    row = {f"highest target within {max_increase:.0%}": format_values(_field_values(recs, "best_target"), 3)}
    row |= {"inactive there": format_values(_field_values(recs, "best_inactive"), 3)}
    speeds = {"FFN-layer speedup": "layer_speedup", "decode speedup": "decode_speedup"}
    return row | {title: format_values(_field_values(recs, key), 2) for title, key in speeds.items()}


def _suite_row(recs: list[dict[str, Any]]) -> dict[str, Any] | None:
    measured = [r for r in recs if "suite" in r]
    if not measured:
        return None
    dense, sparse = ([r["suite"][k]["mean_acc"] for r in measured] for k in ("dense", "sparse"))
    row = {"items per task": measured[0]["suite"]["dense"]["limit"]}
    row |= {"dense acc": format_values(dense), "sparse acc": format_values(sparse)}
    one = f"{sparse[0] - dense[0]:+.4f} (1 seed)"
    paired = format_difference(paired_difference(sparse, dense)) if len(measured) > 1 else one
    return row | {"sparse - dense (paired by seed)": paired}


def _layer_rows(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Inactive fraction per FFN and language at the statistics target (mean over seeds)."""
    by_ffn: dict[str, dict[int, dict[str, float]]] = {}
    for record in recs:
        totals: dict[tuple[str, str], tuple[float, float]] = {}
        for stat, key in ((stat, (stat["ffn"], stat["language"])) for stat in record["statistics"]):
            n, inactive = totals.get(key, (0.0, 0.0))
            totals[key] = (n + stat["assignments"], inactive + stat["inactive"] * stat["assignments"])
        for (ffn, language), (n, inactive) in totals.items():
            by_ffn.setdefault(ffn, {}).setdefault(record["seed"], {})[language] = inactive / max(n, 1)
    target = f"{recs[0]['statistics_target']:g}"
    return [{"target": target, "ffn": ffn} | language_means(per_seed, 3) for ffn, per_seed in by_ffn.items()]


def _expert_rows(record: dict[str, Any], top: int = 3) -> list[dict[str, Any]]:
    """The sparsest and densest routed experts of an MoE model (first seed; expert ids do not
    match across seeds), with the language where each is sparsest."""
    experts: dict[tuple[str, int], dict[str, float]] = {}
    for stat in record["statistics"]:
        if stat["ffn"].endswith("experts") and not stat["ffn"].endswith("shared_experts") and stat["assignments"]:
            experts.setdefault((stat["ffn"], stat["expert"]), {})[stat["language"]] = stat["inactive"]
    ranked = sorted(experts.items(), key=lambda kv: -sum(kv[1].values()) / len(kv[1]))
    chosen = [("sparsest", *item) for item in ranked[:top]] + [("densest", *item) for item in ranked[::-1][:top]]
    return [
        {"seed": record["seed"], "rank": label, "ffn": ffn, "expert": expert}
        | {"inactive (mean over languages)": f"{sum(by.values()) / len(by):.3f}"}
        | {"sparsest for": max(by, key=by.get), "densest for": min(by, key=by.get)}
        for label, (ffn, expert), by in chosen
    ]


def _tables(arms, max_increase: float, target: float) -> dict[str, list[dict[str, Any]]]:
    at = f"at target {target:g}"
    tables: dict[str, list[dict[str, Any]]] = {
        "Val loss vs target sparsity (token-weighted over languages; mean ± std over seeds)": [],
        "Highest target within the loss budget in every language, and the speedup measured there": [],
        f"Loss increase per language {at}": [],
        f"Inactive fraction per FFN and language {at} (layer thresholds, seed mean)": [],
        f"Local-suite accuracy, dense vs sparse {at} (mean ± std over seeds)": [],
        f"Sparsest and densest routed experts {at} (layer thresholds)": [],
    }
    curve, best, languages, layers, suite, experts = tables.values()
    for (model, rule, granularity), recs in arms.items():
        arm = {"model": model, "rule": rule, "granularity": granularity}
        curve += [arm | row for row in _curve_rows(recs)]
        best.append(arm | _best_row(recs, max_increase))
        languages.append(arm | _language_row(recs, target))
        if granularity == "layer":
            layers += [{"model": model, "rule": rule} | row for row in _layer_rows(recs)]
            experts += [{"model": model, "rule": rule} | row for row in _expert_rows(recs[0])]
        suite += [arm | row] if (row := _suite_row(recs)) else []
    # NOTE: no suite table without suite scores, no expert table when every model is dense
    return {title: rows for title, rows in tables.items() if rows or not title.startswith(("Local-suite", "Sparsest"))}


PAPER = Subject(TRAINED_MOE, "off-the-shelf pretrained MoEs on GPU")
"""What the intra-expert sparsity paper measured: its claims are about the experts of trained MoEs."""


def _subject(recs: list[dict[str, Any]], model: str) -> Subject:
    """The model the arm measures: a trained MoE, or a dense model (whose FFN has no experts)."""
    r = recs[0]
    detail = f"{model}: {r['total_params']:,} params, {r['num_experts']} experts"
    return Subject(TRAINED_MOE if r["num_experts"] > 1 else DENSE, detail)


def _sparsity_claims(arms, max_increase: float) -> list:
    claims = []
    for model in dict.fromkeys(m for m, _, _ in arms):
        mine = {k: v for k, v in arms.items() if k[0] == model}
        claims += about(_model_claims(mine, model, max_increase), PAPER, _subject(next(iter(mine.values())), model))
    return claims


def _model_claims(arms, model: str, max_increase: float) -> list:
    claims, at = [], f"{CLAIM_TARGET:.0%}"
    for (_, rule, granularity), recs in ((k, v) for k, v in arms.items() if CLAIM_TARGET in _targets(v)):
        text = f"{model}, {rule}/{granularity}: {at} of the neurons skipped without loss"
        claim = Claim(text, "relative loss increase", ("sparse", "dense"), EQUIVALENT, max_increase, paper=0.0)
        claims.append(claim.on(_increase(recs), 0.0))
        speedups = [summarize(_field_values(recs, k)).mean for k in ("layer_speedup", "decode_speedup")]
        measured = f"measured: FFN layer {speedups[0]:.2f}x, decode {speedups[1]:.2f}x"
        speedup = f"{CLAIM_LAYER_SPEEDUP}x layer, {CLAIM_DECODE_SPEEDUP}x end-to-end speedup"
        text = f"{model}, {rule}/{granularity}: {speedup}"
        claims.append(Claim(text, "speedup", ("sparse", "dense"), HIGHER).missing(GPU_SPEEDUP.format(measured)))
    for rule in dict.fromkeys(r for _, r, _ in arms):
        text = f"{model}, {rule}: per-expert thresholds lose less than per-layer at {at}"
        claims += _less(arms, text, (model, rule, "expert"), (model, rule, "layer"), ("expert", "layer"))
    text = f"{model}: the gate_up rule loses less than gate at {at} (layer thresholds)"
    claims += _less(arms, text, (model, "gate_up", "layer"), (model, "gate", "layer"), ("gate_up", "gate"))
    return claims


def _less(arms, text: str, a: Arm, b: Arm, names: tuple[str, str]) -> list:
    """The claim that arm ``a`` loses less than ``b`` at the claim's target, where both were measured."""
    if not (arms.get(a) and arms.get(b)):
        return []
    return [Claim(text, "loss increase", names, LOWER).on(_increase(arms[a]), _increase(arms[b]))]


def _increase(recs: list[dict[str, Any]]) -> dict[int, float]:
    return {r["seed"]: increase_at(r, CLAIM_TARGET) for r in recs}


def analyse(plan: dict[str, Any], records: list[dict[str, Any]], plots_dir: Path) -> Analysis:
    arm_of = itemgetter("model_name", "rule", "granularity")
    measured = group((r for r in select(records, arm="sparsity") if "curve" in r), arm_of)
    if not (arms := {arm: sorted(rs, key=lambda r: r["seed"]) for arm, rs in measured.items()}):  # arm -> its records
        return Analysis()
    spec = plan.get("spec") if isinstance(plan.get("spec"), dict) else {}
    max_increase, target = spec.get("max_increase", 0.01), next(iter(arms.values()))[0]["statistics_target"]
    tables, plot = _tables(arms, max_increase, target), plot_curves(arms, max_increase, plots_dir)
    return Analysis(claims=_sparsity_claims(arms, max_increase), tables=tables, plots=[plot])


def plot_curves(arms, max_increase: float, plots_dir: Path) -> Path:
    """Loss increase (%) vs target sparsity, one panel per model, one line per rule/granularity,
    ± std over seeds; symlog y so that 0 and the budget line stay readable next to large increases."""
    models = list(dict.fromkeys(m for m, _, _ in arms))
    fig, axes = plots.panels(len(models), 5.0, 3.8)
    for ax, model in zip(axes, models, strict=True):
        top = 100 * max_increase
        for (_, rule, granularity), recs in ((k, v) for k, v in arms.items() if k[0] == model):
            targets = _targets(recs)
            stats = [summarize([100 * increase_at(r, t) for r in recs]) for t in targets]
            top = max([top, *(s.mean + (s.std if s.n > 1 else 0.0) for s in stats if s.n)])
            seed_errorbar(ax, targets, stats, label=f"{rule}/{granularity}")
        ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.axhline(100 * max_increase, color="red", linewidth=0.8, linestyle="--", label=f"{max_increase:.0%} budget")
        ax.set_yscale("symlog", linthresh=1.0)
        ticks = [t for t in (0, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500) if t <= 1.5 * top]
        ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
        ax.set(xlabel="target sparsity (fraction of neurons skipped)", title=model)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("val loss increase over dense (%)")
    return plots.save(fig, plots_dir, "loss_vs_sparsity")


__all__ = ["SparsitySpec", "analyse", "expand", "increase_at", "overall_at", "parse", "plot_curves"]
