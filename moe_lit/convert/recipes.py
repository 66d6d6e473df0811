"""Conversion recipes shared by the commands and the study kinds: calibrate -> plan -> transform.

Each recipe reads its calibration text from a prepared data directory, plans on it and applies a
pure transform of :mod:`moe_lit.convert` (the source model is left untouched):

* :func:`partition_dense`: the dense -> MoE conversion of ``moe-lit convert partition`` and of the
  ``partition`` kind: a neuron assignment (random | kmeans | coactivation) with a router (centroid |
  trained | random), DOT-MoE (the split and the routers learned with the dense model as teacher),
  or the structured-pruning baseline at the same active width (``pruning``: a dense model keeping
  each FFN's d_ff * k / E most active neurons), on the batches of a training stream
  (:func:`moe_lit.lit.datamodule.calibration_batches`); DOT-MoE's training is passed in (``fit``:
  :func:`moe_lit.lit.distill.fit_dot_moe`), so this layer builds no Lightning object;
* :func:`prune_by_importance`: an MoE with a fraction of every layer's experts removed, ranked by
  an importance method on routed calibration text (the ``pruning`` kind);
* :func:`moe_to_dense_on_text` and :func:`prune_dense_to_width`: an MoE turned into a dense FFN of
  width W, and its dense baseline cut to W (the ``moe_to_dense`` kind).

The calibration text of the last three is the parallel text of one split (:func:`calibration_text`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from moe_lit.data.layout import tokenizer_file
from moe_lit.data.tokenizer import load_tokenizer, resolve_eot_id
from moe_lit.errors import MoeLitError

PRUNING = "pruning"
"""The structured-pruning baseline: a dense model cut to the active width d_ff * k / E (no experts)."""
FitDotMoE = Callable[[Any, Any, list[torch.Tensor], Any, float], Any]
"""``fit(dense, student, batches, DotMoEConfig, lr)``: trains a DOT-MoE student in place, one optimizer
step a batch, the dense model its teacher (:func:`moe_lit.lit.distill.fit_dot_moe`)."""


def partition_dense(
    dense,
    method: str,
    num_experts: int,
    top_k: int,
    batches: Iterator[torch.Tensor] | None = None,
    *,
    router: str | None = None,
    calibration_tokens: int = 16_384,
    router_steps: int = 100,
    train_tokens: int = 65_536,
    lr: float = 1e-2,
    train_dense: bool = False,
    balancing: str = "aux_loss",
    seed: int = 0,
    fit: FitDotMoE | None = None,
) -> tuple[Any, dict[str, Any]]:
    """(the MoE, what was done) for a dense model: the conversion of ``moe-lit convert partition``
    (its options, without the files), also the transform of the ``partition`` study kind.
    ``batches``: the calibration / DOT-MoE training stream; ``fit``: DOT-MoE's training."""
    if method == "dot_moe":
        return _dot_moe(dense, num_experts, top_k, batches, train_tokens, lr, train_dense, balancing, seed, fit)
    if method == PRUNING:
        return _pruning(dense, num_experts, top_k, batches, calibration_tokens)
    return _heuristic(
        dense,
        method,
        num_experts,
        top_k,
        batches,
        router or "centroid",
        calibration_tokens,
        router_steps,
        balancing,
        seed,
    )


def _take(batches: Iterator[torch.Tensor], tokens: int) -> list[torch.Tensor]:
    """Whole batches from ``batches`` until ``tokens`` predicted tokens are covered."""
    out, seen = [], 0
    for batch_BL1 in batches:
        out.append(batch_BL1)
        seen += batch_BL1[:, 1:].numel()
        if seen >= tokens:
            return out
    raise MoeLitError(f"--calibration: the training stream has only {seen} tokens, fewer than the {tokens} asked")


def _heuristic(dense, method, num_experts, top_k, batches, router, calibration_tokens, router_steps, balancing, seed):
    from moe_lit.convert.calibration import ffn_inputs
    from moe_lit.convert.partition import assign_neurons, build_routers, partition_ffn, partitioned_config

    cfg = partitioned_config(dense.config, num_experts, top_k, balancing=balancing)
    calibration, tokens = None, 0
    if batches is not None and (method == "coactivation" or router == "trained"):
        taken = _take(batches, calibration_tokens)
        tokens = sum(b[:, 1:].numel() for b in taken)
        calibration = ffn_inputs(dense, taken, calibration_tokens)
    assignment = assign_neurons(dense, method, num_experts, calibration, seed, cfg.moe_layer_ids)
    routers = build_routers(dense, assignment, router, num_experts, calibration, seed, router_steps)
    model = partition_ffn(dense, assignment, num_experts, top_k, routers, seed, balancing=balancing)
    return model, {"router": router, "calibration_tokens": tokens, "train_tokens": 0}


def _pruning(dense, num_experts, top_k, batches, calibration_tokens):
    from moe_lit.convert.calibration import ffn_inputs
    from moe_lit.convert.prune_dense import prune_dense_ffn

    if num_experts < 1 or top_k < 1 or (dense.config.d_ff * top_k) % num_experts:
        raise MoeLitError(
            f"--top-k/--experts: pruning keeps d_ff * k / E neurons, which must be a whole number; "
            f"got d_ff={dense.config.d_ff}, k={top_k}, E={num_experts}"
        )
    keep = dense.config.d_ff * top_k // num_experts
    calibration = ffn_inputs(dense, batches, calibration_tokens)
    tokens = min(len(x_TD) for x_TD in calibration.values())
    return prune_dense_ffn(dense, calibration, keep), {
        "router": None,
        "calibration_tokens": tokens,
        "train_tokens": 0,
        "kept_neurons": keep,
    }


def _dot_moe(dense, num_experts, top_k, batches, train_tokens, lr, train_dense, balancing, seed, fit):
    from moe_lit.convert.dot_moe import DotMoEConfig, dot_moe_student, export_dot_moe

    if batches is None:
        raise MoeLitError("calibration: method dot_moe needs training batches (calibration_batches of a prepared dir)")
    if fit is None:
        raise MoeLitError("fit: method dot_moe needs its training function (moe_lit.lit.distill.fit_dot_moe)")
    cfg = DotMoEConfig(train_dense=train_dense)
    student = dot_moe_student(dense, num_experts, top_k, cfg, seed, balancing=balancing)
    taken = _take(batches, train_tokens)
    fit(dense, student, taken, cfg, lr)
    tokens = sum(b[:, 1:].numel() for b in taken)
    record = {
        "router": "learned",
        "calibration_tokens": 0,
        "train_tokens": tokens,
        "steps": len(taken),
        "train_dense": train_dense,
        "lr": lr,
    }
    return export_dot_moe(student), record


def calibration_text(model, data_dir, tokens: int, languages=None, split: str = "test", record_inputs: bool = False):
    """The routing trace of ``tokens`` tokens per language of the parallel ``split`` text
    (:func:`~moe_lit.convert.importance.calibration_trace`, the data's tokenizer, no gradients)."""
    from moe_lit.convert.importance import calibration_trace

    with torch.no_grad():
        tokenizer = load_tokenizer(tokenizer_file(data_dir))
        return calibration_trace(model, data_dir, tokenizer, languages, split, tokens, record_inputs=record_inputs)


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
    global_budget: bool = False,
):
    """``model`` without ``fraction`` of every MoE layer's experts (``global_budget``: of all its
    experts, ranked across layers; never below top-k in a layer): the calibration text routed
    through it, the experts ranked by ``method`` (:func:`~moe_lit.convert.importance.plan_keep`),
    the rest removed (:func:`~moe_lit.convert.prune.prune_experts`, pure)."""
    from moe_lit.convert.importance import MaestroConfig, plan_keep
    from moe_lit.convert.prune import prune_experts

    trace = calibration_text(model, data_dir, calibration_tokens, languages, split, method in ("reap", "naee"))
    with torch.no_grad():
        maestro = MaestroConfig(damping=damping)
        keep, _ = plan_keep(
            method,
            model,
            trace,
            fraction=fraction,
            global_budget=global_budget,
            seed=seed,
            maestro=maestro,
            naee_cap=naee_cap,
        )
        return prune_experts(model, keep)


def moe_to_dense_on_text(model, data_dir: str, calibration_tokens: int, languages=None, split="test", **config: Any):
    """``model`` (an MoE) as a dense model (:func:`~moe_lit.convert.moe_to_dense.moe_to_dense`) scored,
    grouped and scaled on the calibration text; ``config``: the :class:`MoeToDenseConfig` fields."""
    from moe_lit.convert.moe_to_dense import MoeToDenseConfig, moe_to_dense

    trace = calibration_text(model, data_dir, calibration_tokens, languages, split, record_inputs=True)
    return moe_to_dense(model, trace, MoeToDenseConfig(**config))[0]


def prune_dense_to_width(model, width: int, data_dir: str, calibration_tokens: int, languages=None, split="test"):
    """``model``'s FFNs cut to their ``width`` most active neurons (mean |activation|) on the
    calibration text (every document window of the parallel ``split``)."""
    from moe_lit.analysis.routing import document_windows, tokenize_documents
    from moe_lit.convert.calibration import ffn_inputs
    from moe_lit.convert.prune_dense import prune_dense_ffn
    from moe_lit.evaluation.tasks import read_parallel

    tokenizer = load_tokenizer(tokenizer_file(data_dir))
    text = read_parallel(Path(data_dir), split, languages)
    docs = tokenize_documents(text, tokenizer, resolve_eot_id(tokenizer), calibration_tokens)
    windows = [
        torch.tensor(window)[None]
        for by_doc in docs.values()
        for tokens in by_doc.values()
        for window in document_windows(tokens, model.config.seq_len)
        if len(window) > 1
    ]
    return prune_dense_ffn(model, ffn_inputs(model, windows, sum(w.numel() for w in windows)), width)


__all__ = [
    "PRUNING",
    "FitDotMoE",
    "calibration_text",
    "moe_to_dense_on_text",
    "partition_dense",
    "prune_by_importance",
    "prune_dense_to_width",
]
