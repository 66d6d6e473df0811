"""Study kind ``sparsity``: how much of each expert can be skipped, and what does skipping buy?

After the intra-expert activation sparsity paper (up to 90% of the neurons inside an expert
inactive without significant loss; up to 2.5x MoE-layer and 1.2x end-to-end speedup on GPU). Per
seed and per model of ``models``: the model is pretrained by the study (a model config) or taken
from disk (``{path: <exported model dir>}``, e.g. an imported HF model; its own ``tokenizer.json``).
One measurement point per (model, rule, granularity) -- a dense model is one expert per layer, so
it has the ``layer`` granularity only -- starts from those weights with ``train.max_steps: 0`` and
runs :func:`measure_sparsity`:

* calibration: ``calibration_tokens`` of the ``calibration_split`` text, the same share of every
  language, whole documents in a seeded order (the seed picks the calibration text);
* the loss curve (:func:`~moe_lit.inference.sparsity.sparsity_loss_curve`): per target, the val
  loss per language on ``eval_tokens`` tokens of the ``eval_split`` text (the model's own
  tokenizer) against the dense model on the same tokens, and the inactive fraction reached;
* the highest target whose loss increase is at most ``max_increase`` in every language, and there
  the FFN-layer (one middle block, ``timing_tokens`` tokens per step) and end-to-end greedy decode
  speedups, dense and sparse timed interleaved in one process (:mod:`moe_lit.timing`);
* the inactive fraction per (language, layer, expert) at ``statistics_target``.

Claims: at 90% skipped the loss increase lies within ``max_increase`` (TOST over the seeds: the
study's stated margin); the speedups are the GPU's (untestable here: CPU timings under the study's
own load); per-expert thresholds and the gate_up rule lose less (paired by seed).
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
from moe_lit.stats import Summary, format_difference, format_summary, format_values, paired_difference, summarize
from moe_lit.studies import plots
from moe_lit.studies import spec as check
from moe_lit.studies.engine import Call, Point, Start
from moe_lit.studies.kinds import Analysis
from moe_lit.studies.measures import SuiteSpec, model_tokenizer
from moe_lit.studies.records import select
from moe_lit.studies.verdicts import EQUIVALENT, HIGHER, LOWER, Claim

CLAIM_TARGET = 0.9
"""The paper's 'up to 90% of the neurons inactive without significant loss'."""
CLAIM_LAYER_SPEEDUP, CLAIM_DECODE_SPEEDUP = 2.5, 1.2
"""The paper's MoE-layer and end-to-end speedups (on top of vLLM, GPU)."""
EVAL_BATCH = 8
"""Evaluation windows per forward."""
GPU_SPEEDUP = "the paper's speedups are GPU kernels on top of vLLM; this study times CPU forward passes ({})"


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
    """Largest relative loss increase (in every language) that counts as no loss (0.01 = 1%); the
    equivalence margin of the 90% claim."""
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
            check.label(name, "models")
            if not isinstance(value, (dict, ModelConfig, str)):
                raise ConfigError(f"models.{name}: must be a model config or {{path: dir}}, got {value!r}")
            if isinstance(value, dict) and "path" in value and (set(value) != {"path"} or not value["path"]):
                raise ConfigError(f"models.{name}: a model on disk is {{path: <dir>}} alone, got {value!r}")
        check.distinct(
            self.targets, "targets", each=lambda t: isinstance(t, (int, float)) and 0 <= t < 1, must="in [0, 1)"
        )
        check.distinct(self.rules, "rules", each=lambda r: r in RULES, must=f"one of {', '.join(RULES)}")
        check.distinct(
            self.granularities,
            "granularities",
            each=lambda g: g in GRANULARITIES,
            must=f"one of {', '.join(GRANULARITIES)}",
        )
        check.languages(self.languages, "languages")
        for name in ("calibration_split", "eval_split"):
            check.choice(getattr(self, name), name, check.SPLITS)
        for name in ("calibration_tokens", "eval_tokens", "timing_tokens", "timing_rounds", "decode_tokens"):
            check.positive_int(getattr(self, name), name)
        check.number(self.max_increase, "max_increase", 0, closed="low")
        if self.statistics_target not in self.targets:
            raise ConfigError(
                f"statistics_target: must be one of targets {self.targets}, got {self.statistics_target!r}"
            )
        check.choice(self.clock, "clock", CLOCKS)


def default_run() -> dict[str, Any]:
    return {"data": {"seq_len": 64, "batch_size": 16, "val_batches": 4}, "train": {"max_steps": 600}}


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
        try:
            models[name] = ModelConfig.from_dict(dict(value)).replace(seq_len=header.run.data.seq_len)
        except ConfigError as exc:
            raise ConfigError(f"models.{name}.{exc}") from None
    spec.models = models
    return spec


def expand(spec: SparsitySpec, header) -> list[Point]:
    points = []
    for seed in header.seeds:
        measure_run = header.seeded_run(seed).replace(train={"max_steps": 0})
        for name, model in spec.models.items():
            if isinstance(model, str):
                start, model_cfg = Start(path=model, mode="init"), model_on_disk(model)
            else:
                parent = header.point_name(f"{name}/pretrain", seed)
                info = {"arm": "pretrain", "model_name": name}
                points.append(Point(parent, f"{name}/pretrain", seed, model, header.seeded_run(seed), info))
                start, model_cfg = Start(parent=parent, mode="init"), model
            for rule in spec.rules:
                for granularity in list(spec.granularities) if model_cfg.moe is not None else ["layer"]:
                    config_name, measure = (
                        f"{name}/{rule}/{granularity}",
                        _measure(spec, header, rule, granularity, seed),
                    )
                    info = {"arm": "sparsity", "model_name": name, "rule": rule, "granularity": granularity}
                    points.append(
                        Point(
                            header.point_name(config_name, seed),
                            config_name,
                            seed,
                            model_cfg,
                            measure_run,
                            info,
                            start,
                            measure=measure,
                        )
                    )
    return points


KWARGS = (
    "targets",
    "languages",
    "calibration_split",
    "calibration_tokens",
    "eval_split",
    "eval_tokens",
    "max_increase",
)
KWARGS += ("statistics_target", "timing_tokens", "timing_rounds", "decode_tokens", "clock")


def _measure(spec: SparsitySpec, header, rule: str, granularity: str, seed: int) -> Call:
    kwargs = {"data_dir": str(header.run.data.resolved_dir()), "rule": rule, "granularity": granularity, "seed": seed}
    kwargs |= {name: getattr(spec, name) for name in KWARGS}
    # NOTE: only when set, so that the points of a study without it keep their hashes.
    suite = {"suite_limit": spec.suite.limit, "suite_batch_size": spec.suite.batch_size} if spec.suite else {}
    return Call.of(measure_sparsity, **kwargs, **suite)


# ----------------------------------------------------------------------------- the measurement
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
    model, tokenizer = load_model(checkpoint).eval(), model_tokenizer(checkpoint, data_dir)
    evaluation = language_tokens(data_dir, eval_split, languages, tokenizer, eval_tokens)
    calibration = language_tokens(
        data_dir, calibration_split, languages, tokenizer, max(1, calibration_tokens // len(evaluation)), seed
    )
    window = model.config.seq_len
    calibration_batches = [b for ids in calibration.values() for b in token_batches(ids, window, EVAL_BATCH)]
    eval_batches = {lang: token_batches(ids, window + 1, EVAL_BATCH) for lang, ids in evaluation.items()}
    sample = collect_scores(model, calibration_batches, rule, calibration_tokens, seed=seed)
    curve, statistics = sample_loss_curve(model, sample, eval_batches, targets, granularity)
    best = highest_target_within(curve, max_increase)
    weights = {lang: sum(b[:, 1:].numel() for b in batches) for lang, batches in eval_batches.items()}
    suite = {}
    if suite_batch_size is not None:
        options = {"limit": suite_limit, "batch_size": suite_batch_size, "languages": languages}
        suite = {"suite": _suite_at(model, sample, statistics_target, granularity, tokenizer, data_dir, options)}
    timings = _timings(
        model, sample, best, granularity, eval_batches, timing_tokens, timing_rounds, decode_tokens, clock
    )
    return {
        **suite,
        "curve": [{k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()} for row in curve],
        "eval_tokens_per_language": weights,
        "calibration_tokens_used": sum(b.numel() for b in calibration_batches),
        "dense_loss": _overall(curve, targets[0], weights, "dense_loss"),
        "best_target": best,
        "best_inactive": None if best is None else _overall(curve, best, weights, "inactive"),
        **timings,
        "statistics_target": statistics_target,
        "statistics": [{**r, "inactive": round(r["inactive"], 5)} for r in statistics[statistics_target]],
    }


def _suite_at(model, sample, target, granularity, tokenizer, data_dir, options) -> dict[str, Any]:
    """Local-suite scores of ``model`` dense and sparsified at ``target`` (thresholds from ``sample``)."""
    from moe_lit.inference.sparsity import sparsify, thresholds_at
    from moe_lit.studies.measures import suite

    sparse = sparsify(model, thresholds_at(sample, target, granularity))
    dense, sparse_scores = (suite(m, data_dir, tokenizer, **options) for m in (model, sparse))
    return {"target": target, "dense": dense, "sparse": sparse_scores}


def _overall(curve: list[dict[str, Any]], target: float, weights: dict[str, int], key: str) -> float:
    rows = [r for r in curve if r["target"] == target]
    return sum(r[key] * weights[r["language"]] for r in rows) / sum(weights[r["language"]] for r in rows)


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
    first, block, captured = next(iter(eval_batches.values()))[0][:1], len(model.blocks) // 2, {}
    handle = model.blocks[block].ffn.register_forward_pre_hook(lambda _module, args: captured.update(x=args[0]))
    with torch.inference_mode():
        model(first[:, :timing_tokens])
    handle.remove()

    def call(layer):
        def run():
            with torch.inference_mode():
                layer(captured["x"])

        return run

    layers = {"dense": call(model.blocks[block].ffn), "sparse": call(sparse.blocks[block].ffn)}
    layer_times = interleaved_times(layers, rounds, 3, clock)
    prompt = first[0, :16].tolist()
    cases = {k: (lambda m=m: generate(m, [prompt], decode_tokens)) for k, m in (("dense", model), ("sparse", sparse))}
    decode_times = interleaved_times(cases, max(2, rounds // 10), 1, clock)
    speedups = {
        "layer_speedup": paired_ratio(layer_times, "dense", "sparse"),
        "decode_speedup": paired_ratio(decode_times, "dense", "sparse"),
    }
    return speedups | {"timing_block": block, "timing_clock": clock}


# ----------------------------------------------------------------------------- analysis
Arm = tuple[str, str, str]
"""(model name, rule, granularity)."""


def _measured(records: list[dict[str, Any]]) -> dict[Arm, list[dict[str, Any]]]:
    """Arm -> its ok measurement records (seed order)."""
    arms: dict[Arm, list[dict[str, Any]]] = {}
    for record in (r for r in select(records, arm="sparsity") if "curve" in r):
        arms.setdefault((record["model_name"], record["rule"], record["granularity"]), []).append(record)
    return {arm: sorted(rs, key=lambda r: r["seed"]) for arm, rs in arms.items()}


def overall_at(record: dict[str, Any], target: float, key: str = "loss") -> float:
    """Token-weighted mean of ``key`` over the languages at ``target`` (NaN when not measured)."""
    rows = [r for r in record["curve"] if r["target"] == target]
    return _overall(rows, target, record["eval_tokens_per_language"], key) if rows else math.nan


def increase_at(record: dict[str, Any], target: float) -> float:
    """Relative increase of the overall loss at ``target`` over the dense loss (0.01 = 1%)."""
    return overall_at(record, target) / overall_at(record, target, "dense_loss") - 1.0


def _pct(values: list[float]) -> str:
    s = summarize(values)
    if s.n == 0:
        return "n/a"
    return format_summary(Summary(s.mean * 100, s.std * 100, s.n, s.sem * 100, s.n_nan), 2).replace(" (", " % (", 1)


def _value(x: Any) -> float:
    return math.nan if x is None else float(x)


def _targets(recs: list[dict[str, Any]]) -> list[float]:
    return sorted({r["target"] for rec in recs for r in rec["curve"]})


def _tables(arms, max_increase: float, target: float) -> dict[str, list[dict[str, Any]]]:
    curve, best, languages, layers, experts, suite = [], [], [], [], [], []
    for (model, rule, granularity), recs in arms.items():
        arm = {"model": model, "rule": rule, "granularity": granularity}
        for t in _targets(recs):
            worst = [max((r["increase"] for r in rec["curve"] if r["target"] == t), default=math.nan) for rec in recs]
            row = {"target": f"{t:g}", "val loss": format_values([overall_at(r, t) for r in recs])}
            row |= {"increase": _pct([increase_at(r, t) for r in recs]), "worst language": _pct(worst)}
            curve.append(
                arm | row | {"inactive reached": format_values([overall_at(r, t, "inactive") for r in recs], 3)}
            )
        row = {f"highest target within {max_increase:.0%}": format_values([_value(r["best_target"]) for r in recs], 3)}
        row["inactive there"] = format_values([_value(r["best_inactive"]) for r in recs], 3)
        row["FFN-layer speedup"] = format_values([_value(r.get("layer_speedup")) for r in recs], 2)
        best.append(arm | row | {"decode speedup": format_values([_value(r.get("decode_speedup")) for r in recs], 2)})
        increases = {
            lang: [
                next((c["increase"] for c in r["curve"] if (c["target"], c["language"]) == (target, lang)), math.nan)
                for r in recs
            ]
            for lang in recs[0]["eval_tokens_per_language"]
        }
        languages.append(arm | {lang: _pct(v) for lang, v in increases.items()})
        if granularity == "layer":
            layers += _layer_rows(model, rule, recs)
            experts += _expert_rows(model, rule, recs[0])
        measured = [r for r in recs if "suite" in r]
        if measured:
            dense, sparse = ([r["suite"][k]["mean_acc"] for r in measured] for k in ("dense", "sparse"))
            row = {
                "items per task": measured[0]["suite"]["dense"]["limit"],
                "dense acc": format_values(dense),
                "sparse acc": format_values(sparse),
            }
            diff = (
                format_difference(paired_difference(sparse, dense))
                if len(measured) > 1
                else f"{sparse[0] - dense[0]:+.4f} (1 seed)"
            )
            suite.append(arm | row | {"sparse - dense (paired by seed)": diff})
    tables = {
        "Val loss vs target sparsity (token-weighted over languages; mean ± std over seeds)": curve,
        "Highest target within the loss budget in every language, and the speedup measured there": best,
        f"Loss increase per language at target {target:g}": languages,
        f"Inactive fraction per FFN and language at target {target:g} (layer thresholds, seed mean)": layers,
    }
    if suite:
        tables[f"Local-suite accuracy, dense vs sparse at target {target:g} (mean ± std over seeds)"] = suite
    if experts:  # none when every model is dense: no routed experts to rank
        tables[f"Sparsest and densest routed experts at target {target:g} (layer thresholds)"] = experts
    return tables


def _layer_rows(model: str, rule: str, recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Inactive fraction per FFN and language at the statistics target (mean over seeds)."""
    by_ffn: dict[str, dict[str, list[float]]] = {}
    for record in recs:
        totals: dict[tuple[str, str], list[float]] = {}
        for stat in record["statistics"]:
            entry = totals.setdefault((stat["ffn"], stat["language"]), [0.0, 0.0])
            entry[0], entry[1] = entry[0] + stat["assignments"], entry[1] + stat["inactive"] * stat["assignments"]
        for (ffn, language), (n, inactive) in totals.items():
            by_ffn.setdefault(ffn, {}).setdefault(language, []).append(inactive / max(n, 1))
    head = {"model": model, "rule": rule, "target": f"{recs[0]['statistics_target']:g}"}
    return [
        head | {"ffn": ffn} | {lang: f"{summarize(v).mean:.3f}" for lang, v in langs.items()}
        for ffn, langs in by_ffn.items()
    ]


def _expert_rows(model: str, rule: str, record: dict[str, Any], top: int = 3) -> list[dict[str, Any]]:
    """The sparsest and densest routed experts of an MoE model (first seed; expert ids do not
    match across seeds), with the language where each is sparsest."""
    experts: dict[tuple[str, int], dict[str, float]] = {}
    for stat in record["statistics"]:
        if stat["ffn"].endswith("experts") and not stat["ffn"].endswith("shared_experts") and stat["assignments"]:
            experts.setdefault((stat["ffn"], stat["expert"]), {})[stat["language"]] = stat["inactive"]
    ranked = sorted(experts.items(), key=lambda kv: -sum(kv[1].values()) / len(kv[1]))
    rows = []
    for label, chosen in (("sparsest", ranked[:top]), ("densest", ranked[::-1][:top])):
        for (ffn, expert), by_language in chosen:
            row = {"model": model, "rule": rule, "seed": record["seed"], "rank": label, "ffn": ffn, "expert": expert}
            row["inactive (mean over languages)"] = f"{sum(by_language.values()) / len(by_language):.3f}"
            rows.append(
                row
                | {
                    "sparsest for": max(by_language, key=by_language.get),
                    "densest for": min(by_language, key=by_language.get),
                }
            )
    return rows


def _claims(arms, max_increase: float) -> list:
    claims = []
    for (model, rule, granularity), recs in arms.items():
        if CLAIM_TARGET not in _targets(recs):
            continue
        increase = {r["seed"]: increase_at(r, CLAIM_TARGET) for r in recs}
        text = f"{model}, {rule}/{granularity}: {CLAIM_TARGET:.0%} of the neurons skipped without loss"
        claims.append(
            Claim(text, "relative loss increase", ("sparse", "dense"), EQUIVALENT, max_increase, paper=0.0).on(
                increase, 0.0
            )
        )
        speedups = [summarize([_value(r.get(k)) for r in recs]).mean for k in ("layer_speedup", "decode_speedup")]
        measured = f"measured: FFN layer {speedups[0]:.2f}x, decode {speedups[1]:.2f}x"
        text = (
            f"{model}, {rule}/{granularity}: {CLAIM_LAYER_SPEEDUP}x layer, {CLAIM_DECODE_SPEEDUP}x end-to-end speedup"
        )
        claims.append(Claim(text, "speedup", ("sparse", "dense"), HIGHER).missing(GPU_SPEEDUP.format(measured)))
    for model in dict.fromkeys(m for m, _, _ in arms):
        for rule in dict.fromkeys(r for m, r, _ in arms if m == model):
            layer, expert = arms.get((model, rule, "layer")), arms.get((model, rule, "expert"))
            if layer and expert:
                text = f"{model}, {rule}: per-expert thresholds lose less than per-layer at {CLAIM_TARGET:.0%}"
                claims.append(
                    Claim(text, "loss increase", ("expert", "layer"), LOWER).on(
                        *(_increase(r) for r in (expert, layer))
                    )
                )
        gate, gate_up = arms.get((model, "gate", "layer")), arms.get((model, "gate_up", "layer"))
        if gate and gate_up:
            text = f"{model}: the gate_up rule loses less than gate at {CLAIM_TARGET:.0%} (layer thresholds)"
            claims.append(
                Claim(text, "loss increase", ("gate_up", "gate"), LOWER).on(_increase(gate_up), _increase(gate))
            )
    return claims


def _increase(recs: list[dict[str, Any]]) -> dict[int, float]:
    return {r["seed"]: increase_at(r, CLAIM_TARGET) for r in recs}


def analyse(plan: dict[str, Any], records: list[dict[str, Any]], plots_dir: Path) -> Analysis:
    arms = _measured(records)
    if not arms:
        return Analysis()
    spec = plan.get("spec") if isinstance(plan.get("spec"), dict) else {}
    max_increase = spec.get("max_increase", 0.01)
    target = next(iter(arms.values()))[0]["statistics_target"]
    return Analysis(
        claims=_claims(arms, max_increase),
        tables=_tables(arms, max_increase, target),
        plots=[plot_curves(arms, max_increase, plots_dir)],
    )


def plot_curves(arms, max_increase: float, plots_dir: Path) -> Path:
    """Loss increase (%) vs target sparsity, one panel per model, one line per rule/granularity,
    ± std over seeds; symlog y so that 0 and the budget line stay readable next to large increases."""
    from moe_lit.plotting import seed_errorbar

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


__all__ = [
    "SparsitySpec",
    "analyse",
    "expand",
    "increase_at",
    "language_tokens",
    "measure_sparsity",
    "overall_at",
    "parse",
    "plot_curves",
]
