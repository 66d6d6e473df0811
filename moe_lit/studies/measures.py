"""Measurements the study kinds share: validation batches, the parallel text of a split
per language, the start weights' validation, local-suite accuracy, a child point that measures a
finished one, the final model of a point's result, the dense -> MoE partition on the training
stream (a transform two kinds call); and the measurements of models a kind's points name (sparsity profile, training
step times, routing divergence, the MoE -> dense screen), each a plain function of a checkpoint.
The point plug-ins among them are registered by name in :mod:`moe_lit.studies.plugins`.

A point's measurement (``Point.measure = Call.of(fn, **kwargs)``) is called after its run as
``fn(point, result, run_dir, **kwargs)`` and returns fields for the point's record. To measure
an already finished point without running it again, give it a child point
(:func:`measure_child`: ``Start(parent=..., mode="init")``, ``train.max_steps: 0`` and the
measurement); the parent's record and hash stay as they were.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_lit.config import ModelConfig
from moe_lit.convert import recipes
from moe_lit.data.tokenizer import model_tokenizer
from moe_lit.studies import spec as check
from moe_lit.studies.identity import TRANSFORMED_START, Call, Point, Start


@dataclass
class SuiteSpec:
    """A kind's ``suite:`` field: local-suite accuracy of its final models (null: not measured)."""

    limit: int | None = 50
    """Items per task (the first ones of each task; null: every item)."""
    batch_size: int = 32
    """Requests scored per forward."""

    def __post_init__(self) -> None:
        check.positive_int(self.limit, "suite.limit", optional=True)
        check.positive_int(self.batch_size, "suite.batch_size")

    def measure(self) -> Call:
        """The :func:`local_suite` call with these settings."""
        return Call.of(local_suite, limit=self.limit, batch_size=self.batch_size)


def suite(model, data_dir: str | Path, tokenizer=None, **options: Any) -> dict[str, Any]:
    """Local-suite accuracy (:func:`moe_lit.evaluation.suite.suite_scores`) of ``model`` on the test
    split of ``data_dir``, with the data's tokenizer unless given; ``options``: limit, batch_size, languages."""
    from moe_lit.data.layout import tokenizer_file
    from moe_lit.evaluation.suite import suite_scores

    return suite_scores(model, tokenizer or tokenizer_file(data_dir), data_dir, **options)


def suite_fields(model, data_dir: str | Path, limit: int | None) -> dict[str, Any]:
    """A record's suite fields: the whole result under ``suite`` and its two means flat (CSV columns)."""
    scores = suite(model, data_dir, limit=limit)
    return {
        "suite": scores,
        "suite_mean_acc": scores["mean_acc"],
        "suite_mean_above_chance": scores["mean_above_chance"],
    }


def final_checkpoint(result: Any) -> str | Path:
    """The final checkpoint of a point's run (a measure-only point's result is a dict)."""
    return result["checkpoint"] if isinstance(result, dict) else result.checkpoint


def final_model(result: Any):
    """The model of :func:`final_checkpoint`."""
    from moe_lit.checkpoint import load_model

    return load_model(final_checkpoint(result))


def local_suite(point: Point, result: Any, run_dir: Path, limit: int | None = None, batch_size: int = 32) -> dict:
    """Local-suite accuracy of the run's final weights on the test split of the point's data dir:
    ``{"suite": scores}``."""
    data_dir = Path(point.run.data.resolved_dir())
    return {"suite": suite(final_model(result), data_dir, limit=limit, batch_size=batch_size)}


def partition_on_stream(model, method: str, experts: int, top_k: int, data_dir, batch_size: int, seed: int, **options):
    """The dense ``model`` partitioned (or pruned) by ``method``
    (:func:`~moe_lit.convert.recipes.partition_dense`; DOT-MoE trained by
    :func:`~moe_lit.lit.distill.fit_dot_moe`) on batches of ``batch_size`` of the training stream of
    ``data_dir``: the transform of the kinds that cut a dense model into an MoE."""
    from moe_lit.lit.datamodule import calibration_batches
    from moe_lit.lit.distill import fit_dot_moe

    batches = calibration_batches(data_dir, model.config, batch_size, seed)
    return recipes.partition_dense(model, method, experts, top_k, batches, seed=seed, fit=fit_dot_moe, **options)[0]


def validation_batches(run) -> dict[str, list]:
    """``{language: [(B, L+1) batches]}``: the validation batches train_run validates ``run`` on."""
    from moe_lit.lit.datamodule import MoEDataModule

    datamodule = MoEDataModule.from_config(run.data, run.train.seed)
    return {lang: list(loader) for lang, loader in zip(datamodule.languages, datamodule.val_dataloader(), strict=True)}


def start_validation(point: Point, run_dir: Path) -> dict[str, Any]:
    """Validation loss (overall and per language) of a transformed point's start weights (the model
    the engine wrote under ``run_dir/TRANSFORMED_START``) before training, by a 0-step
    :func:`~moe_lit.lit.run.train_run` on the run's validation batches."""
    from moe_lit.lit.run import train_run

    start = Path(run_dir) / TRANSFORMED_START
    converted = train_run(
        point.model, point.run.replace(train={"max_steps": 0}), Path(run_dir) / "converted", init_from=start
    )
    return {
        "val_loss_converted": converted.val_loss,
        "val_loss_converted_per_language": converted.val_loss_per_language,
    }


def measure_child(parent: Point, measure: Call, suffix: str = "suite") -> Point:
    """A point that validates ``parent``'s final weights (0 steps) and runs ``measure`` on them.

    Named ``<parent config>/<suffix>`` (seeded like the parent); ``info`` is the parent's with
    ``phase: suffix``; the record's ``parent`` field names the measured point, to join the two.
    """
    config_name = f"{parent.config_name}/{suffix}"
    name = parent.name.replace(parent.config_name, config_name, 1)
    return Point(
        name,
        config_name,
        parent.seed,
        parent.model,
        parent.run.replace(train={"max_steps": 0}),
        info={**parent.info, "phase": suffix},
        start=Start(parent=parent.name, mode="init"),
        measure=measure,
    )


# ----------------------------------------------------------------------------- measurements of models
SPARSITY_BATCH = 8
"""Evaluation windows per forward of the sparsity measurement."""


def language_tokens(
    data_dir, split: str, languages: list[str] | None, tokenizer, tokens: int, seed: int | None = None
) -> dict[str, list[int]]:
    """Per language, the first ``tokens`` tokens of the parallel ``split`` text (whole documents,
    paragraphs each followed by EOS); ``seed`` shuffles the document order (the same in every language)."""
    from moe_lit.analysis.routing import tokenize_documents
    from moe_lit.data.tokenizer import resolve_eot_id
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


def bits_per_byte(model, tokenizer, data_dir, split: str, languages: list[str] | None, tokens: int) -> dict:
    """Bits per UTF-8 byte per language: the first ``tokens`` tokens of the parallel ``split`` text
    (:func:`language_tokens`, the same documents for every model with this tokenizer) cut into
    windows of the model's seq_len + 1; the summed next-token loss in bits over the bytes that the
    scored tokens (each window's all but first) decode to."""
    import torch

    from moe_lit.inference.sparsity import mean_loss, token_batches

    out = {}
    for lang, ids in language_tokens(data_dir, split, languages, tokenizer, tokens).items():
        batches = token_batches(ids, model.config.seq_len + 1, SPARSITY_BATCH)
        with torch.no_grad():
            nats = mean_loss(model, batches) * sum(b[:, 1:].numel() for b in batches)
        scored = [row[1:].tolist() for b in batches for row in b]
        size = sum(len(tokenizer.decode(row, skip_special_tokens=True).encode("utf-8")) for row in scored)
        out[lang] = nats / math.log(2) / size
    return out


def model_quality(
    checkpoint, data_dir, languages, bpb_split: str, bpb_tokens: int, suite_languages=None, **suite_options: Any
) -> dict:
    """One model's :func:`bits_per_byte` per language of ``languages`` (and their mean), local-suite
    scores in ``suite_languages`` with every item's outcome (``suite_options``: tasks, limit,
    batch_size), the accuracy over all those items with its item-level standard error, the model's
    parameter count and the seconds each measure took."""
    import time

    from moe_lit.checkpoint import load_model
    from moe_lit.evaluation.suite import item_stderr

    model, tokenizer = load_model(checkpoint).eval(), model_tokenizer(checkpoint, data_dir=data_dir)
    start = time.perf_counter()
    bpb = bits_per_byte(model, tokenizer, data_dir, bpb_split, languages, bpb_tokens)
    middle = time.perf_counter()
    scores = suite(model, data_dir, tokenizer, languages=suite_languages, outcomes=True, **suite_options)
    items = [o for task in sorted(scores["outcomes"]) for o in scores["outcomes"][task]]
    acc = sum(items) / len(items)
    return {"bpb": bpb, "bpb_mean": sum(bpb.values()) / len(bpb), "suite": scores, "task_acc": acc} | {
        "task_acc_se": item_stderr(acc, len(items)),
        "task_items": len(items),
        "params": sum(p.numel() for p in model.parameters()),
        "bpb_wall_s": round(middle - start, 1),
        "suite_wall_s": round(time.perf_counter() - middle, 1),
    }


def sparsity_profile(
    checkpoint: str | Path,
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
    """Intra-expert activation sparsity of the model at ``checkpoint`` (the ``sparsity`` kind's
    measurement): thresholds calibrated on ``calibration_tokens`` of the ``calibration_split`` text
    (every language's share, documents in a ``seed``-ed order), the val loss per language and
    target on ``eval_tokens`` of ``eval_split`` against the dense model
    (:func:`~moe_lit.inference.sparsity.sample_loss_curve`), the highest target within
    ``max_increase`` and there the FFN-layer and decode speedups (dense and sparse timed
    interleaved), the inactive fraction per (language, layer, expert) at ``statistics_target``;
    with ``suite_batch_size``, the local-suite accuracy of the dense and the sparse model there."""
    import torch

    from moe_lit.checkpoint import load_model
    from moe_lit.inference.sparsity import collect_scores, highest_target_within, sample_loss_curve, token_batches

    torch.manual_seed(seed)
    model, tokenizer = load_model(checkpoint).eval(), model_tokenizer(checkpoint, data_dir=data_dir)
    evaluation = language_tokens(data_dir, eval_split, languages, tokenizer, eval_tokens)
    calibration = language_tokens(
        data_dir, calibration_split, languages, tokenizer, max(1, calibration_tokens // len(evaluation)), seed
    )
    window = model.config.seq_len
    calibration_batches = [b for ids in calibration.values() for b in token_batches(ids, window, SPARSITY_BATCH)]
    eval_batches = {lang: token_batches(ids, window + 1, SPARSITY_BATCH) for lang, ids in evaluation.items()}
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
        "dense_loss": token_weighted(curve, targets[0], weights, "dense_loss"),
        "best_target": best,
        "best_inactive": None if best is None else token_weighted(curve, best, weights, "inactive"),
        **timings,
        "statistics_target": statistics_target,
        "statistics": [{**r, "inactive": round(r["inactive"], 5)} for r in statistics[statistics_target]],
    }


def measure_sparsity(point: Point, result: Any, run_dir: Path, **kwargs: Any) -> dict[str, Any]:
    """:func:`sparsity_profile` of the point's final weights (its start weights after a 0-step run)."""
    return sparsity_profile(final_checkpoint(result), **kwargs)


def _suite_at(model, sample, target, granularity, tokenizer, data_dir, options) -> dict[str, Any]:
    """Local-suite scores of ``model`` dense and sparsified at ``target`` (thresholds from ``sample``)."""
    from moe_lit.inference.sparsity import sparsify, thresholds_at

    sparse = sparsify(model, thresholds_at(sample, target, granularity))
    dense, sparse_scores = (suite(m, data_dir, tokenizer, **options) for m in (model, sparse))
    return {"target": target, "dense": dense, "sparse": sparse_scores}


def token_weighted(curve: list[dict[str, Any]], target: float, weights: dict[str, int], key: str) -> float:
    """The mean of ``key`` over the languages of a sparsity curve at ``target``, weighted by tokens."""
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


def step_times(source: ModelConfig, grown: ModelConfig, batch_size: int, lr: float, seed: int, rounds: int) -> dict:
    """Median seconds of one training step (forward, backward, AdamW, bias update) of two models
    (``E``: ``source``, ``mE``: ``grown``), interleaved in this process on the same batch."""
    import torch

    from moe_lit.convert.common import next_token_loss
    from moe_lit.model import Transformer
    from moe_lit.timing import interleaved_times, median

    torch.manual_seed(seed)
    batch_BL1 = torch.randint(0, grown.vocab_size, (batch_size, grown.seq_len + 1))
    cases = {}
    for key, cfg in (("E", source), ("mE", grown)):
        model = Transformer(cfg).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

        def step(model=model, optimizer=optimizer) -> None:
            next_token_loss(model, batch_BL1).backward()
            optimizer.step()
            optimizer.zero_grad()
            model.update_router_biases()

        cases[key] = step
    times = interleaved_times(cases, rounds=rounds, warmup=2)
    return {"step_times": {key: median(values) for key, values in times.items()}}


def routing_divergence(checkpoint: str | Path, run, new_languages: list[str]) -> dict[str, Any]:
    """On the run's validation batches: the JS divergence (bits, mean over MoE layers) of each new
    language's expert usage from the mean usage of the other languages, and for every pair of
    languages ("a|b") the JS divergence of their expert usage and of their token-unigram
    distributions (the part of any sharing that shared subwords and scripts explain)."""
    import torch

    from moe_lit.analysis.routing import js_divergence, language_js, usage_by_language
    from moe_lit.checkpoint import load_model
    from moe_lit.evaluation.routing_trace import routing_trace

    model = load_model(checkpoint).eval()
    batches = validation_batches(run)
    languages = list(batches)
    with torch.no_grad(), routing_trace(model) as recorder:
        for lang, loader in batches.items():
            for batch_BL1 in loader:
                recorder.set_labels(language=lang)
                model(batch_BL1[:, :-1])
    usage_GME = usage_by_language(recorder.trace(), languages)
    base_ME = usage_GME[[i for i, lang in enumerate(languages) if lang not in new_languages]].mean(dim=0)
    js = {lang: float(js_divergence(usage_GME[languages.index(lang)], base_ME).mean()) for lang in new_languages}
    routing_GG = language_js(usage_GME).mean(dim=0)
    counts_GV = [
        torch.bincount(torch.cat([b[:, :-1].flatten() for b in batches[lang]]), minlength=model.config.vocab_size)
        for lang in languages
    ]
    unigram_GV = torch.stack(counts_GV).double()
    unigram_GV /= unigram_GV.sum(dim=-1, keepdim=True)
    unigram_GG = js_divergence(unigram_GV[:, None], unigram_GV[None]).clamp(0.0, 1.0)
    pairs = [(i, j) for i in range(len(languages)) for j in range(i + 1, len(languages))]
    return {
        "routing_js_new_vs_base": js,
        "routing_js_pairs": {f"{languages[i]}|{languages[j]}": float(routing_GG[i, j]) for i, j in pairs},
        "unigram_js_pairs": {f"{languages[i]}|{languages[j]}": float(unigram_GG[i, j]) for i, j in pairs},
    }


def conversion_screen(
    checkpoint: str | Path,
    run,
    configs: list,
    data_dir: str,
    calibration_tokens: int,
    languages=None,
    split: str = "test",
) -> dict[str, Any]:
    """The MoE at ``checkpoint`` converted to a dense model by every :class:`MoeToDenseConfig` of
    ``configs`` (:func:`moe_lit.convert.moe_to_dense.screen`, scores shared), each one's validation
    loss (overall and per language) on the run's validation batches before any training."""
    import time

    from moe_lit.checkpoint import load_model
    from moe_lit.convert.moe_to_dense import screen

    start = time.perf_counter()
    model = load_model(checkpoint).eval()
    trace = recipes.calibration_text(model, data_dir, calibration_tokens, languages, split, record_inputs=True)
    rows = screen(model, trace, configs, validation_batches(run))
    keys = {"grouping": "grouping", "scaling": "scaling", "params": "params", "loss": "val_loss"}
    keys["loss_per_label"] = "val_loss_per_language"
    screened = [{new: row[old] for old, new in keys.items()} for row in rows]
    return {"screen": screened, "screen_wall_s": round(time.perf_counter() - start, 3)}


__all__ = [
    "SPARSITY_BATCH",
    "SuiteSpec",
    "bits_per_byte",
    "conversion_screen",
    "final_checkpoint",
    "final_model",
    "language_tokens",
    "routing_divergence",
    "sparsity_profile",
    "step_times",
    "token_weighted",
    "local_suite",
    "model_quality",
    "partition_on_stream",
    "measure_child",
    "measure_sparsity",
    "start_validation",
    "suite",
    "suite_fields",
    "validation_batches",
]
