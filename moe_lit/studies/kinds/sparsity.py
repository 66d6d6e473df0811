"""Study kind ``sparsity``: how much of each expert can be skipped, and what does skipping buy?

After the intra-expert activation sparsity paper (up to 90% of the neurons inside an expert
inactive without significant loss; up to 2.5x MoE-layer and 1.2x end-to-end speedup). Per seed
and per model of ``models``: the model is pretrained by the study (a model config) or taken from
disk (``{path: <exported model dir>}``, e.g. an imported HF model; its own ``tokenizer.json``).
One measurement point per (model, rule, granularity) -- a dense model is one expert per layer, so
it has the ``layer`` granularity only -- starts from those weights with ``train.max_steps: 0`` and
runs :func:`measure_sparsity`:

* calibration: ``calibration_tokens`` of the ``calibration_split`` text, the same share of every
  language, whole documents in a seeded order (the seed picks the calibration text);
* the loss curve (:func:`~moe_lit.inference.sparsity.sparsity_loss_curve`): for each target, the
  val loss per language on ``eval_tokens`` tokens of every language of the ``eval_split`` text,
  tokenized with the model's own tokenizer, against the dense model on the same tokens, and the
  inactive fraction actually reached;
* the highest target whose loss increase is at most ``max_increase`` in every language, and there
  the FFN-layer (one middle block, ``timing_tokens`` tokens per step) and end-to-end greedy decode
  speedups, dense and sparse timed interleaved in one process (:mod:`moe_lit.timing`);
* the inactive fraction per (language, layer, expert) at ``statistics_target``.

Timings inside a study run under the study's own load (other workers, other jobs): the ratios are
measured side by side, the absolute times are not benchmarks.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_lit.config import ConfigError, ModelConfig
from moe_lit.inference.sparsity import GRANULARITIES, RULES
from moe_lit.lit.run_config import _build
from moe_lit.studies.engine import Call, Point, Start
from moe_lit.studies.kinds import Analysis, check_fields
from moe_lit.studies.measures import SuiteSpec
from moe_lit.studies.stats import compare_paired, format_comparison, format_summary, summarize

SPLITS = ("train", "val", "test")
MEASURE = "moe_lit.studies.kinds.sparsity:measure_sparsity"
CLAIM_TARGET = 0.9
"""The paper's 'up to 90% of the neurons inactive without significant loss'."""
CLAIM_LAYER_SPEEDUP, CLAIM_DECODE_SPEEDUP = 2.5, 1.2
"""The paper's MoE-layer and end-to-end speedups (on top of vLLM, GPU)."""
EVAL_BATCH = 8
"""Evaluation windows per forward."""


@dataclass
class SparsitySpec:
    """The kind's own fields."""

    models: dict[str, Any]
    """Name -> a model config (pretrained by the study with run.train) or ``{path: <dir>}`` (an
    exported / imported model on disk, relative to the working directory; not trained)."""
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
    """Largest relative loss increase (in every language) that counts as no loss (0.01 = 1%)."""
    statistics_target: float = 0.9
    """Target at which the inactive fraction per language, layer and expert is recorded."""
    timing_tokens: int = 1
    """Tokens per step of the FFN-layer timing (1 = decoding)."""
    timing_rounds: int = 30
    """Interleaved rounds of the FFN-layer timing (the decode timing runs a tenth of them, at least 2)."""
    decode_tokens: int = 32
    """Tokens generated greedily (batch 1, KV cache) per round of the end-to-end timing."""
    clock: str = "cpu"
    """Timing clock (moe_lit.timing.CLOCKS): cpu = this process's CPU time (robust to other load
    with one thread per worker), wall = elapsed time."""
    suite: SuiteSpec | None = None
    """Local-suite accuracy (moe_lit.studies.measures.SuiteSpec) of the dense and the sparse model
    at statistics_target, in the same measurement; null: loss only."""

    def __post_init__(self) -> None:
        from moe_lit.timing import CLOCKS

        if not isinstance(self.models, dict) or not self.models:
            raise ConfigError(
                f"models: must be a non-empty mapping name -> model config or {{path: dir}}, got {self.models!r}"
            )
        for name, value in self.models.items():
            if not isinstance(name, str) or not name or "/" in name:
                raise ConfigError(f"models: names must be non-empty strings without '/', got {name!r}")
            if not isinstance(value, (dict, ModelConfig)):
                raise ConfigError(f"models.{name}: must be a model config or {{path: dir}}, got {value!r}")
            if isinstance(value, dict) and "path" in value and (set(value) != {"path"} or not value["path"]):
                raise ConfigError(f"models.{name}: a model on disk is {{path: <dir>}} alone, got {value!r}")
        _distinct_in("targets", self.targets, lambda t: isinstance(t, (int, float)) and 0 <= t < 1, "in [0, 1)")
        _distinct_in("rules", self.rules, lambda r: r in RULES, f"one of {', '.join(RULES)}")
        _distinct_in(
            "granularities", self.granularities, lambda g: g in GRANULARITIES, f"one of {', '.join(GRANULARITIES)}"
        )
        if self.languages is not None:
            _distinct_in("languages", self.languages, lambda v: isinstance(v, str) and bool(v), "a language code")
        for name in ("calibration_split", "eval_split"):
            if getattr(self, name) not in SPLITS:
                raise ConfigError(f"{name}: got {getattr(self, name)!r}, allowed values: {', '.join(SPLITS)}")
        for name in ("calibration_tokens", "eval_tokens", "timing_tokens", "timing_rounds", "decode_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}: must be a positive integer, got {value!r}")
        if (
            isinstance(self.max_increase, bool)
            or not isinstance(self.max_increase, (int, float))
            or self.max_increase < 0
        ):
            raise ConfigError(f"max_increase: must be a number >= 0, got {self.max_increase!r}")
        if self.statistics_target not in self.targets:
            raise ConfigError(
                f"statistics_target: must be one of targets {self.targets}, got {self.statistics_target!r}"
            )
        if self.clock not in CLOCKS:
            raise ConfigError(f"clock: got {self.clock!r}, allowed values: {', '.join(CLOCKS)}")


def _distinct_in(name: str, values: Any, ok, allowed: str) -> None:
    if not isinstance(values, list) or not values or len(set(values)) != len(values):
        raise ConfigError(f"{name}: must be a non-empty list of distinct values, got {values!r}")
    bad = [v for v in values if isinstance(v, bool) or not ok(v)]
    if bad:
        raise ConfigError(f"{name}: {bad} not allowed, each must be {allowed}")


def default_run() -> dict[str, Any]:
    return {"data": {"seq_len": 64, "batch_size": 16, "val_batches": 4}, "train": {"max_steps": 600}}


def model_on_disk(path: str) -> ModelConfig:
    """The config of an exported model directory (its ``config.json``), for the point's accounting."""
    from moe_lit.checkpoint import CONFIG_FILE

    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise ConfigError(f"models: {path} holds no {CONFIG_FILE}; give an exported or imported model directory")
    return ModelConfig.from_dict(json.loads(file.read_text()))


def parse(fields: dict[str, Any], header) -> SparsitySpec:
    check_fields(SparsitySpec, fields, ("models",))
    suite = fields.get("suite")
    spec = SparsitySpec(**{**fields, "suite": _build(SuiteSpec, suite, "suite") if suite is not None else None})
    models: dict[str, Any] = {}
    for name, value in spec.models.items():
        if isinstance(value, dict) and "path" in value:
            models[name] = str(value["path"])
        else:
            try:
                models[name] = ModelConfig.from_dict(dict(value)).replace(seq_len=header.run.data.seq_len)
            except ConfigError as exc:
                raise ConfigError(f"models.{name}.{exc}") from None
    spec.models = models
    return spec


def _granularities(spec: SparsitySpec, model: ModelConfig) -> list[str]:
    return list(spec.granularities) if model.moe is not None else ["layer"]


def expand(spec: SparsitySpec, header) -> list[Point]:
    points = []
    for seed in header.seeds:
        measure_run = header.seeded_run(seed).replace(train={"max_steps": 0})
        for name, model in spec.models.items():
            if isinstance(model, str):
                start, model_cfg = Start(path=model, mode="init"), model_on_disk(model)
            else:
                parent = header.point_name(f"{name}/pretrain", seed)
                points.append(
                    Point(
                        parent,
                        f"{name}/pretrain",
                        seed,
                        model,
                        header.seeded_run(seed),
                        {"arm": "pretrain", "model_name": name},
                    )
                )
                start, model_cfg = Start(parent=parent, mode="init"), model
            for rule in spec.rules:
                for granularity in _granularities(spec, model_cfg):
                    config_name = f"{name}/{rule}/{granularity}"
                    kwargs = _measure_kwargs(spec, header, rule, granularity, seed)
                    points.append(
                        Point(
                            header.point_name(config_name, seed),
                            config_name,
                            seed,
                            model_cfg,
                            measure_run,
                            info={"arm": "sparsity", "model_name": name, "rule": rule, "granularity": granularity},
                            start=start,
                            measure=Call(MEASURE, kwargs),
                        )
                    )
    return points


def _measure_kwargs(spec: SparsitySpec, header, rule: str, granularity: str, seed: int) -> dict[str, Any]:
    return {
        "data_dir": str(header.run.data.resolved_dir()),
        "targets": list(spec.targets),
        "rule": rule,
        "granularity": granularity,
        "languages": spec.languages,
        "calibration_split": spec.calibration_split,
        "calibration_tokens": spec.calibration_tokens,
        "eval_split": spec.eval_split,
        "eval_tokens": spec.eval_tokens,
        "max_increase": spec.max_increase,
        "statistics_target": spec.statistics_target,
        "timing_tokens": spec.timing_tokens,
        "timing_rounds": spec.timing_rounds,
        "decode_tokens": spec.decode_tokens,
        "clock": spec.clock,
        "seed": seed,
        # NOTE: only when set, so that the points of a study without it keep their hashes.
        **({"suite_limit": spec.suite.limit, "suite_batch_size": spec.suite.batch_size} if spec.suite else {}),
    }


# ----------------------------------------------------------------------------- the measurement
def model_tokenizer(checkpoint: str | Path, data_dir: str | Path):
    """The tokenizer beside an exported model directory, else the data's (a study checkpoint)."""
    from moe_lit.checkpoint import TOKENIZER_FILE
    from moe_lit.data.layout import tokenizer_file
    from moe_lit.evaluation.harness import load_tokenizer

    beside = Path(checkpoint) / TOKENIZER_FILE
    return load_tokenizer(beside if beside.is_file() else tokenizer_file(data_dir))


def language_tokens(
    data_dir, split: str, languages: list[str] | None, tokenizer, tokens: int, seed: int | None = None
) -> dict[str, list[int]]:
    """Per language, the first ``tokens`` tokens of the parallel ``split`` text (whole documents,
    paragraphs each followed by EOS); ``seed`` shuffles the document order (the same in every language)."""
    from moe_lit.analysis.routing import tokenize_documents
    from moe_lit.evaluation.harness import resolve_eot_id
    from moe_lit.evaluation.tasks import documents, read_parallel

    parallel = read_parallel(Path(data_dir), split, languages)
    if seed is not None:
        order = list(documents(next(iter(parallel.values()))).values())
        random.Random(seed).shuffle(order)
        positions = [p for doc in order for p in doc]
        parallel = {lang: [paras[p] for p in positions] for lang, paras in parallel.items()}
    # NOTE: documents are taken while the first language is under its budget; twice the budget
    # leaves every other language (tokenized to more or fewer tokens) enough to cut at ``tokens``.
    docs = tokenize_documents(parallel, tokenizer, resolve_eot_id(tokenizer), 2 * tokens)
    return {lang: [t for ids in by_doc.values() for t in ids][:tokens] for lang, by_doc in docs.items()}


def measure_sparsity(
    point: Point,
    result: Any,
    run_dir: Path,
    *,
    data_dir: str,
    targets: list[float],
    rule: str,
    granularity: str,
    calibration_split: str,
    calibration_tokens: int,
    eval_split: str,
    eval_tokens: int,
    max_increase: float,
    statistics_target: float,
    timing_tokens: int,
    timing_rounds: int,
    decode_tokens: int,
    clock: str,
    seed: int,
    languages: list[str] | None = None,
    suite_limit: int | None = None,
    suite_batch_size: int | None = None,
) -> dict[str, Any]:
    """The study's measurement on the point's start weights (see the module docstring); with
    ``suite_batch_size``, also the local-suite accuracy of the dense and the sparse model at
    ``statistics_target`` (``suite_limit`` items per task)."""
    import torch

    from moe_lit.checkpoint import load_model
    from moe_lit.inference.sparsity import collect_scores, highest_target_within, sample_loss_curve, token_batches

    checkpoint = result["checkpoint"] if isinstance(result, dict) else result.checkpoint
    torch.manual_seed(seed)
    model = load_model(checkpoint).eval()
    tokenizer = model_tokenizer(checkpoint, data_dir)
    window = model.config.seq_len
    evaluation = language_tokens(data_dir, eval_split, languages, tokenizer, eval_tokens)
    share = max(1, calibration_tokens // len(evaluation))
    calibration = language_tokens(data_dir, calibration_split, languages, tokenizer, share, seed)
    calibration_batches = [b for ids in calibration.values() for b in token_batches(ids, window, EVAL_BATCH)]
    eval_batches = {lang: token_batches(ids, window + 1, EVAL_BATCH) for lang, ids in evaluation.items()}
    sample = collect_scores(model, calibration_batches, rule, calibration_tokens, seed=seed)
    curve, statistics = sample_loss_curve(model, sample, eval_batches, targets, granularity)
    best = highest_target_within(curve, max_increase)
    weights = {lang: sum(b[:, 1:].numel() for b in batches) for lang, batches in eval_batches.items()}
    suite = {}
    if suite_batch_size is not None:
        suite = {
            "suite": _suite_at(
                model,
                sample,
                statistics_target,
                granularity,
                tokenizer,
                data_dir,
                languages,
                suite_limit,
                suite_batch_size,
            )
        }
    return {
        **suite,
        "curve": [_rounded(row) for row in curve],
        "eval_tokens_per_language": weights,
        "calibration_tokens_used": sum(b.numel() for b in calibration_batches),
        "dense_loss": _overall(curve, targets[0], weights, "dense_loss"),
        "best_target": best,
        "best_inactive": None if best is None else _overall(curve, best, weights, "inactive"),
        **_timings(model, sample, best, granularity, eval_batches, timing_tokens, timing_rounds, decode_tokens, clock),
        "statistics_target": statistics_target,
        "statistics": [{**r, "inactive": round(r["inactive"], 5)} for r in statistics[statistics_target]],
    }


def _suite_at(model, sample, target, granularity, tokenizer, data_dir, languages, limit, batch_size) -> dict[str, Any]:
    """Local-suite scores of ``model`` dense and sparsified at ``target`` (thresholds from ``sample``)."""
    from moe_lit.evaluation.suite import suite_scores
    from moe_lit.inference.sparsity import sparsify, thresholds_at

    def scores(m):
        return suite_scores(m, tokenizer, data_dir, limit=limit, batch_size=batch_size, languages=languages)

    sparse = sparsify(model, thresholds_at(sample, target, granularity))
    return {"target": target, "dense": scores(model), "sparse": scores(sparse)}


def _overall(curve: list[dict[str, Any]], target: float, weights: dict[str, int], key: str) -> float:
    rows = [r for r in curve if r["target"] == target]
    return sum(r[key] * weights[r["language"]] for r in rows) / sum(weights[r["language"]] for r in rows)


def _rounded(row: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()}


def _timings(model, sample, best, granularity, eval_batches, timing_tokens, rounds, decode_tokens, clock):
    """FFN-layer and end-to-end decode speedup (dense time / sparse time) at ``best`` (None when no
    target above 0 is within the loss budget)."""
    import torch

    from moe_lit.inference import generate
    from moe_lit.inference.sparsity import sparsify, thresholds_at
    from moe_lit.timing import interleaved_times, paired_ratio

    if best is None or best == 0:
        return {"layer_speedup": None, "decode_speedup": None}
    sparse = sparsify(model, thresholds_at(sample, best, granularity))
    first = next(iter(eval_batches.values()))[0][:1]
    block = len(model.blocks) // 2
    captured = {}

    def capture(_module, args) -> None:
        captured["x"] = args[0]

    handle = model.blocks[block].ffn.register_forward_pre_hook(capture)
    with torch.inference_mode():
        model(first[:, :timing_tokens])
    handle.remove()
    x = captured["x"]
    layers = {"dense": model.blocks[block].ffn, "sparse": sparse.blocks[block].ffn}

    def call(layer):
        def run():
            with torch.inference_mode():
                layer(x)

        return run

    layer_times = interleaved_times({k: call(v) for k, v in layers.items()}, rounds, 3, clock)
    prompt = first[0, :16].tolist()
    cases = {k: (lambda m=m: generate(m, [prompt], decode_tokens)) for k, m in (("dense", model), ("sparse", sparse))}
    decode_times = interleaved_times(cases, max(2, rounds // 10), 1, clock)
    return {
        "layer_speedup": paired_ratio(layer_times, "dense", "sparse"),
        "decode_speedup": paired_ratio(decode_times, "dense", "sparse"),
        "timing_block": block,
        "timing_clock": clock,
    }


# ----------------------------------------------------------------------------- analysis
Arm = tuple[str, str, str]
"""(model name, rule, granularity)."""


def _measured(records: list[dict[str, Any]]) -> dict[Arm, list[dict[str, Any]]]:
    """Arm -> its ok measurement records (seed order)."""
    arms: dict[Arm, list[dict[str, Any]]] = {}
    for record in records:
        if record.get("status") == "ok" and record.get("arm") == "sparsity" and "curve" in record:
            arms.setdefault((record["model_name"], record["rule"], record["granularity"]), []).append(record)
    return {arm: sorted(rs, key=lambda r: r["seed"]) for arm, rs in arms.items()}


def overall_at(record: dict[str, Any], target: float, key: str = "loss") -> float:
    """Token-weighted mean of ``key`` over the languages at ``target`` (NaN when not measured)."""
    weights = record["eval_tokens_per_language"]
    rows = [r for r in record["curve"] if r["target"] == target]
    if not rows:
        return math.nan
    return _overall(rows, target, weights, key)


def increase_at(record: dict[str, Any], target: float) -> float:
    """Relative increase of the overall loss at ``target`` over the dense loss (0.01 = 1%)."""
    return overall_at(record, target) / overall_at(record, target, "dense_loss") - 1.0


def _worst_increase(record: dict[str, Any], target: float) -> float:
    return max((r["increase"] for r in record["curve"] if r["target"] == target), default=math.nan)


def _pct(summary) -> str:
    if summary.n == 0:
        return "n/a"
    scaled = type(summary)(summary.mean * 100, summary.std * 100, summary.n, summary.sem * 100, summary.n_nan)
    return format_summary(scaled, digits=2).replace(" (", " % (", 1)


def _value(x: Any) -> float:
    return math.nan if x is None else float(x)


def _targets(arms: dict[Arm, list[dict[str, Any]]]) -> list[float]:
    return sorted({r["target"] for rs in arms.values() for rec in rs for r in rec["curve"]})


def _curve_table(arms) -> list[dict[str, Any]]:
    rows = []
    for (model, rule, granularity), recs in arms.items():
        for target in _targets({0: recs}):
            rows.append(
                {
                    "model": model,
                    "rule": rule,
                    "granularity": granularity,
                    "target": f"{target:g}",
                    "val loss": format_summary(summarize([overall_at(r, target) for r in recs])),
                    "increase": _pct(summarize([increase_at(r, target) for r in recs])),
                    "worst language": _pct(summarize([_worst_increase(r, target) for r in recs])),
                    "inactive reached": format_summary(summarize([overall_at(r, target, "inactive") for r in recs]), 3),
                }
            )
    return rows


def _best_table(arms, max_increase: float) -> list[dict[str, Any]]:
    return [
        {
            "model": model,
            "rule": rule,
            "granularity": granularity,
            f"highest target within {max_increase:.0%}": format_summary(
                summarize([_value(r["best_target"]) for r in recs]), 3
            ),
            "inactive there": format_summary(summarize([_value(r["best_inactive"]) for r in recs]), 3),
            "FFN-layer speedup": format_summary(summarize([_value(r.get("layer_speedup")) for r in recs]), 2),
            "decode speedup": format_summary(summarize([_value(r.get("decode_speedup")) for r in recs]), 2),
        }
        for (model, rule, granularity), recs in arms.items()
    ]


def _language_table(arms, target: float) -> list[dict[str, Any]]:
    rows = []
    for (model, rule, granularity), recs in arms.items():
        row = {"model": model, "rule": rule, "granularity": granularity}
        for language in recs[0]["eval_tokens_per_language"]:
            values = [
                next(
                    (c["increase"] for c in r["curve"] if c["target"] == target and c["language"] == language), math.nan
                )
                for r in recs
            ]
            row[language] = _pct(summarize(values))
        rows.append(row)
    return rows


def _layer_table(arms) -> list[dict[str, Any]]:
    """Inactive fraction per FFN and language at the statistics target (mean over seeds), layer thresholds."""
    rows = []
    for (model, rule, granularity), recs in arms.items():
        if granularity != "layer":
            continue
        by_ffn: dict[str, dict[str, list[float]]] = {}
        for record in recs:
            totals: dict[tuple[str, str], list[float]] = {}
            for stat in record["statistics"]:
                entry = totals.setdefault((stat["ffn"], stat["language"]), [0.0, 0.0])
                entry[0] += stat["assignments"]
                entry[1] += stat["inactive"] * stat["assignments"]
            for (ffn, language), (n, inactive) in totals.items():
                by_ffn.setdefault(ffn, {}).setdefault(language, []).append(inactive / max(n, 1))
        for ffn, languages in by_ffn.items():
            rows.append(
                {"model": model, "rule": rule, "target": f"{recs[0]['statistics_target']:g}", "ffn": ffn}
                | {lang: f"{summarize(v).mean:.3f}" for lang, v in languages.items()}
            )
    return rows


def _expert_table(arms, top: int = 3) -> list[dict[str, Any]]:
    """The sparsest and densest routed experts of each MoE model (first seed; expert ids do not
    match across seeds), with the language where each is sparsest."""
    rows = []
    for (model, rule, granularity), recs in arms.items():
        if granularity != "layer":
            continue
        record = recs[0]
        experts: dict[tuple[str, int], dict[str, float]] = {}
        for stat in record["statistics"]:
            if stat["ffn"].endswith("experts") and not stat["ffn"].endswith("shared_experts") and stat["assignments"]:
                experts.setdefault((stat["ffn"], stat["expert"]), {})[stat["language"]] = stat["inactive"]
        ranked = sorted(experts.items(), key=lambda kv: -sum(kv[1].values()) / len(kv[1]))
        for label, chosen in (("sparsest", ranked[:top]), ("densest", ranked[::-1][:top])):
            for (ffn, expert), by_language in chosen:
                rows.append(
                    {
                        "model": model,
                        "rule": rule,
                        "seed": record["seed"],
                        "rank": label,
                        "ffn": ffn,
                        "expert": expert,
                        "inactive (mean over languages)": f"{sum(by_language.values()) / len(by_language):.3f}",
                        "sparsest for": max(by_language, key=by_language.get),
                        "densest for": min(by_language, key=by_language.get),
                    }
                )
    return rows


def _paired_by_seed(a: list[dict[str, Any]], b: list[dict[str, Any]], fn) -> tuple[list[float], list[float]]:
    a_by, b_by = {r["seed"]: fn(r) for r in a}, {r["seed"]: fn(r) for r in b}
    seeds = sorted(set(a_by) & set(b_by))
    return [a_by[s] for s in seeds], [b_by[s] for s in seeds]


def _suite_table(arms) -> list[dict[str, Any]]:
    """Per arm with suite scores: dense and sparse accuracy and their paired difference."""
    rows = []
    for (model, rule, granularity), recs in arms.items():
        measured = [r for r in recs if "suite" in r]
        if not measured:
            continue
        dense = [r["suite"]["dense"]["mean_acc"] for r in measured]
        sparse = [r["suite"]["sparse"]["mean_acc"] for r in measured]
        rows.append(
            {
                "model": model,
                "rule": rule,
                "granularity": granularity,
                "items per task": measured[0]["suite"]["dense"]["limit"],
                "dense acc": format_summary(summarize(dense)),
                "sparse acc": format_summary(summarize(sparse)),
                "sparse - dense (paired by seed)": format_comparison(compare_paired(sparse, dense))
                if len(measured) > 1
                else f"{sparse[0] - dense[0]:+.4f} (1 seed)",
            }
        )
    return rows


def _claim_findings(arms, max_increase: float) -> list[str]:
    findings = []
    for (model, rule, granularity), recs in arms.items():
        if CLAIM_TARGET not in _targets({0: recs}):
            continue
        increase = summarize([increase_at(r, CLAIM_TARGET) for r in recs])
        test = compare_paired(
            [overall_at(r, CLAIM_TARGET) for r in recs], [overall_at(r, CLAIM_TARGET, "dense_loss") for r in recs]
        )
        best = summarize([_value(r["best_target"]) for r in recs])
        layer = summarize([_value(r.get("layer_speedup")) for r in recs])
        decode = summarize([_value(r.get("decode_speedup")) for r in recs])
        within = increase.n > 0 and increase.mean <= max_increase
        findings.append(
            f"- **{model}, {rule}/{granularity}: {CLAIM_TARGET:.0%} of the neurons skipped** (paper: up to 90% "
            f"inactive without significant loss): loss increase {_pct(increase)}, sparse vs dense "
            f"{format_comparison(test)}; highest target within {max_increase:.0%} in every language "
            f"{format_summary(best, 3)}; **{'reproduced' if within else 'not reproduced'}** "
            f"(budget {max_increase:.0%})."
        )
        if layer.n:
            findings.append(
                f"- **{model}, {rule}/{granularity}: speedup at that target** (paper: {CLAIM_LAYER_SPEEDUP}x MoE "
                f"layer, {CLAIM_DECODE_SPEEDUP}x end-to-end, GPU on top of vLLM): FFN layer "
                f"{format_summary(layer, 2)}x, "
                f"decode {format_summary(decode, 2)}x (CPU, under the study's load); layer "
                f"**{'reproduced' if layer.mean >= CLAIM_LAYER_SPEEDUP else 'not reproduced'}**, end-to-end "
                f"**{'reproduced' if decode.mean >= CLAIM_DECODE_SPEEDUP else 'not reproduced'}**."
            )
    for model in dict.fromkeys(m for m, _, _ in arms):
        for rule in dict.fromkeys(r for m, r, _ in arms if m == model):
            layer, expert = arms.get((model, rule, "layer")), arms.get((model, rule, "expert"))
            if layer and expert:
                test = compare_paired(*_paired_by_seed(expert, layer, lambda r: increase_at(r, CLAIM_TARGET)))
                findings.append(
                    f"- **{model}, {rule}: per-expert vs per-layer thresholds at {CLAIM_TARGET:.0%}** (loss increase, "
                    f"expert - layer): {format_comparison(test)}."
                )
        gate, gate_up = arms.get((model, "gate", "layer")), arms.get((model, "gate_up", "layer"))
        if gate and gate_up:
            test = compare_paired(*_paired_by_seed(gate_up, gate, lambda r: increase_at(r, CLAIM_TARGET)))
            findings.append(
                f"- **{model}: gate_up vs gate rule at {CLAIM_TARGET:.0%}** (loss increase, gate_up - gate, layer "
                f"thresholds): {format_comparison(test)}."
            )
    return findings


def analyse(plan: dict[str, Any], records: list[dict[str, Any]], plots_dir: Path) -> Analysis:
    arms = _measured(records)
    if not arms:
        return Analysis()
    first = next(iter(arms.values()))[0]
    max_increase = plan.get("spec", {}).get("max_increase", 0.01) if isinstance(plan.get("spec"), dict) else 0.01
    target = first["statistics_target"]
    experts = _expert_table(arms)
    tables = {
        "Val loss vs target sparsity (token-weighted over languages; mean ± std over seeds)": _curve_table(arms),
        "Highest target within the loss budget in every language, and the speedup measured there": _best_table(
            arms, max_increase
        ),
        f"Loss increase per language at target {target:g}": _language_table(arms, target),
        f"Inactive fraction per FFN and language at target {target:g} (layer thresholds, seed mean)": (
            _layer_table(arms)
        ),
    }
    suite = _suite_table(arms)
    if suite:
        tables[f"Local-suite accuracy, dense vs sparse at target {target:g} (mean ± std over seeds)"] = suite
    if experts:  # none when every model is dense: no routed experts to rank
        tables[f"Sparsest and densest routed experts at target {target:g} (layer thresholds)"] = experts
    return Analysis(
        findings=_claim_findings(arms, max_increase),
        tables=tables,
        plots=[plot_curves(arms, max_increase, Path(plots_dir) / "loss_vs_sparsity.png")],
    )


def plot_curves(arms, max_increase: float, path: Path) -> Path:
    """Loss increase (%) vs target sparsity, one panel per model, one line per rule/granularity,
    ± std over seeds; symlog y so that 0 and the budget line stay readable next to large increases."""
    from moe_lit.studies.report import pyplot, save_figure

    plt = pyplot()
    models = list(dict.fromkeys(m for m, _, _ in arms))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        top = 100 * max_increase
        for (name, rule, granularity), recs in arms.items():
            if name != model:
                continue
            targets = _targets({0: recs})
            stats = [summarize([100 * increase_at(r, t) for r in recs]) for t in targets]
            top = max([top, *(s.mean + (s.std if s.n > 1 else 0.0) for s in stats if s.n)])
            ax.errorbar(
                targets,
                [s.mean for s in stats],
                yerr=[s.std if s.n > 1 else 0.0 for s in stats],
                marker="o",
                capsize=3,
                label=f"{rule}/{granularity}",
            )
        ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.axhline(100 * max_increase, color="red", linewidth=0.8, linestyle="--", label=f"{max_increase:.0%} budget")
        ax.set_yscale("symlog", linthresh=1.0)
        ticks = [t for t in (0, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500) if t <= 1.5 * top]
        ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
        ax.set_xlabel("target sparsity (fraction of neurons skipped)")
        ax.set_title(model)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("val loss increase over dense (%)")
    return save_figure(fig, path)


__all__ = [
    "SparsitySpec",
    "analyse",
    "expand",
    "increase_at",
    "language_tokens",
    "measure_sparsity",
    "model_tokenizer",
    "overall_at",
    "parse",
    "plot_curves",
]
