"""Local-suite accuracy of an in-memory model: the measure every study kind calls for task scores.

``suite_scores(model, tokenizer, data_dir)`` renders the local multilingual suite from
``data_dir`` (:mod:`moe_lit.evaluation.tasks`) and runs lm-eval on it through :class:`MoeLitLM`:
the same tasks, items and metrics as ``moe-lit eval --tasks moe_lit_next,moe_lit_pairs``. It
returns plain JSON-able numbers so that a study record can hold them: accuracy per task, the
chance accuracy of each task, the mean per language, and the mean accuracy above chance.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from moe_lit.errors import MoeLitError
from moe_lit.evaluation.tasks import SUITE_PREFIX

ACCURACY_TASKS = ("moe_lit_next", "moe_lit_pairs")
"""The local suite's multiple-choice tags (perplexity is measured by validation loss instead)."""


def suite_scores(
    model: torch.nn.Module,
    tokenizer: Any,
    data_dir: str | Path,
    *,
    limit: int | None = None,
    batch_size: int = 32,
    device: str = "cpu",
    languages: Sequence[str] | None = None,
    tasks: Sequence[str] = ACCURACY_TASKS,
    outcomes: bool = False,
) -> dict[str, Any]:
    """Accuracy of ``model`` on the local suite built from ``data_dir``'s test split.

    Args:
        model: a moe_lit Transformer (left in eval mode; its weights are not changed).
        tokenizer: ``tokenizer.json`` path or a loaded ``tokenizers.Tokenizer``.
        data_dir: a prepared data dir (``moe-lit data prepare``) whose test split builds the suite.
        limit: items per task (lm-eval's ``limit``); None = every item.
        batch_size: requests scored per forward.
        device: torch device to score on.
        languages: languages to build; None = every language of the data dir.
        tasks: local-suite task names or tags with an ``acc`` metric.
        outcomes: also return every scored item's accuracy (0 or 1), in lm-eval's item order.

    Returns:
        ``{"tasks": {task: acc}, "chance": {task: chance acc}, "items": {task: items scored},
        "stderr": {task: item-level standard error of acc}, "languages": {lang: mean acc},
        "mean_acc", "mean_above_chance", "limit"}`` (with ``outcomes``: ``"outcomes": {task:
        [0 | 1, ...]}``); above chance = ``acc - chance`` averaged over tasks.
    """
    from moe_lit.evaluation.harness import MoeLitLM, evaluate
    from moe_lit.evaluation.tasks import SuiteConfig, resolve_tasks

    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise MoeLitError(f"suite limit: must be a positive integer or null, got {limit!r}")
    suite = SuiteConfig(languages=list(languages) if languages else None)
    with tempfile.TemporaryDirectory(prefix="moe_lit_suite_") as work:
        names, manager = resolve_tasks(list(tasks), Path(work), data_dir=Path(data_dir), suite=suite)
        lm = MoeLitLM(model=model, tokenizer=tokenizer, batch_size=batch_size, device=device)
        results = evaluate(lm, names, manager, limit=limit, bootstrap_iters=0, log_samples=outcomes)
        return _scores(results, Path(work) / "data", limit)


def _scores(results: dict[str, Any], items_dir: Path, limit: int | None) -> dict[str, Any]:
    """The numbers of :func:`suite_scores` from an lm-eval results dict of local-suite tasks whose
    items :func:`~moe_lit.evaluation.tasks.render_suite` wrote into ``items_dir``."""
    accuracy, chance, items, stderr, outcomes = {}, {}, {}, {}, {}
    by_language: dict[str, list[float]] = {}
    for task, metrics in sorted(results["results"].items()):
        if "acc,none" not in metrics:
            continue  # a group's aggregate row, or a task without accuracy
        config = results["configs"][task]
        metadata = config.get("metadata", {})
        accuracy[task] = float(metrics["acc,none"])
        chance[task] = _chance(items_dir / f"{task.removeprefix(SUITE_PREFIX)}.jsonl", limit)
        items[task] = int(results["n-samples"][task]["effective"])
        stderr[task] = item_stderr(accuracy[task], items[task])
        if task in results.get("samples", {}):
            outcomes[task] = [int(sample["acc"]) for sample in sorted(results["samples"][task], key=_doc_id)]
        by_language.setdefault(metadata.get("language", "?"), []).append(accuracy[task])
    if not accuracy:
        raise MoeLitError("suite: lm-eval returned no accuracy (no multiple-choice items in the test split?)")
    return {
        **({"outcomes": outcomes} if outcomes else {}),
        "tasks": accuracy,
        "chance": chance,
        "items": items,
        "stderr": stderr,
        "languages": {lang: statistics.fmean(values) for lang, values in sorted(by_language.items())},
        "mean_acc": statistics.fmean(accuracy.values()),
        "mean_above_chance": statistics.fmean(accuracy[t] - chance[t] for t in accuracy),
        "limit": limit,
    }


def item_stderr(acc: float, items: int) -> float:
    """Standard error of an accuracy over ``items`` items scored 0 or 1 (the sample standard
    deviation over the square root of n, as lm-eval's ``mean_stderr``; nan for fewer than 2 items)."""
    return math.sqrt(acc * (1 - acc) / (items - 1)) if items > 1 else math.nan


def _doc_id(sample: dict[str, Any]) -> int:
    return int(sample["doc_id"])


def _chance(items_file: Path, limit: int | None) -> float:
    """Expected accuracy of a uniform guess over the choices of the items lm-eval scored (the first
    ``limit`` of the task's file, as lm-eval takes them)."""
    items = [json.loads(line) for line in items_file.read_text().splitlines()[:limit]]
    # NOTE: a minimal pair is a two-way choice (good vs bad) without a "choices" field.
    return statistics.fmean(1 / len(item.get("choices", ("good", "bad"))) for item in items)


__all__ = ["ACCURACY_TASKS", "item_stderr", "suite_scores"]
