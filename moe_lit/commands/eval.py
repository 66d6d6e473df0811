"""``moe-lit eval``: lm-eval tasks on a checkpoint; ``results.json`` + ``results.md`` in ``--out``.

``--out`` is the results directory itself (default ``runs/eval/<checkpoint name>-<path hash>``,
untracked); an existing non-empty one is refused unless ``--force``.

Task names: the local multilingual suite (``moe_lit_suite``, ``moe_lit_ppl``, ``moe_lit_next``,
``moe_lit_pairs`` or ``moe_lit_<kind>_<lang>``; built from ``--data``'s parallel test split) and any
lm-eval task, group or tag (``xcopa``, ``belebele``, ...) whose dataset is reachable. Offline, a
built-in task reads a local JSONL in its own schema with ``--task-data TASK=FILE`` (same prompt).
"""

from __future__ import annotations

import argparse
import json
import shlex
import tempfile
from pathlib import Path

from moe_lit.errors import MoeLitError

SUITE_COLUMNS = {
    ("ppl", "bits_per_byte"): "bits/byte",
    ("ppl", "byte_perplexity"): "byte ppl",
    ("next", "acc"): "next-paragraph acc",
    ("pairs", "acc"): "minimal-pairs acc",
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, type=Path, help="Lightning .ckpt or exported directory")
    parser.add_argument("--tasks", nargs="+", default=["moe_lit_suite"], help="task names (space or comma separated)")
    parser.add_argument("--limit", type=float, help="at most N documents per task (a fraction when < 1)")
    parser.add_argument("--data", type=Path, help="prepared data dir for the local suite (default: the checkpoint's)")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer.json (default: the one stored with the checkpoint)")
    parser.add_argument(
        "--task-data",
        action="append",
        default=[],
        metavar="TASK=FILE",
        help="run built-in TASK on a local JSONL in its schema (repeatable); it runs as TASK_local",
    )
    parser.add_argument("--batch-size", type=int, default=8, help="requests scored per forward")
    parser.add_argument("--device", default="auto", help="torch device; auto: CUDA when available, else CPU")
    parser.add_argument("--num-fewshot", type=int, help="few-shot examples (default: each task's own)")
    parser.add_argument("--bootstrap-iters", type=int, default=1000, help="bootstrap resamples for stderr (0: none)")
    parser.add_argument("--out", type=Path, help="results directory (default: runs/eval/<checkpoint name>-<hash>)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out")
    from moe_lit.commands.generate import add_precision_argument, add_sparsity_arguments

    add_precision_argument(parser)
    add_sparsity_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from moe_lit.evaluation.harness import default_out, result_rows
    from moe_lit.io import check_output

    if not args.checkpoint.exists():
        raise MoeLitError(f"--checkpoint: no such file or directory {args.checkpoint}")
    out = check_output(args.out or default_out(args.checkpoint, "eval"), {"--checkpoint": args.checkpoint}, args.force)
    results, suite = _evaluate(args)
    rows, languages = result_rows(results), task_languages(results)
    markdown = results_markdown(out.name, _command(args), rows, languages, suite, results["moe_lit_precision"])
    out = _write(out, results, suite, markdown)
    print(markdown)
    print(f"wrote {out}/results.json and results.md")
    return 0


def _evaluate(args: argparse.Namespace) -> tuple[dict, dict | None]:
    """Render the tasks into a temporary dir and run the harness: ``(results, suite manifest)``."""
    from moe_lit.convert.model_input import load_any_model
    from moe_lit.data.tokenizer import find_tokenizer, model_tokenizer
    from moe_lit.evaluation.harness import MoeLitLM, evaluate
    from moe_lit.evaluation.tasks import SUITE_MANIFEST, SUITE_PREFIX, resolve_data_dir, resolve_tasks

    tasks = [name for item in args.tasks for name in item.split(",") if name]
    task_data = dict(_task_data_pair(item) for item in args.task_data)
    needs_data = any(task.startswith(SUITE_PREFIX) for task in tasks)
    with tempfile.TemporaryDirectory(prefix="moe_lit_tasks_") as work:
        data_dir = resolve_data_dir(args.checkpoint, args.data) if needs_data else None
        names, manager = resolve_tasks(tasks, Path(work), data_dir=data_dir, task_data=task_data)
        # NOTE: the command loads the model (a transformers directory too), the harness takes it in memory.
        lm = MoeLitLM(
            model=load_any_model(args.checkpoint, map_location=args.device),
            tokenizer=args.tokenizer or find_tokenizer(args.checkpoint) or model_tokenizer(args.checkpoint),
            batch_size=args.batch_size,
            device=args.device,
            sparsity=args.sparsity,
            sparsity_rule=args.sparsity_rule,
            sparsity_granularity=args.sparsity_granularity,
            calibration=args.calibration,
            precision=args.precision,
        )
        results = evaluate(
            lm,
            names,
            manager,
            limit=_limit(args.limit),
            num_fewshot=args.num_fewshot,
            bootstrap_iters=args.bootstrap_iters,
        )
        results["moe_lit_precision"] = lm.precision_choice.line()
        manifest = Path(work) / SUITE_MANIFEST
        return results, json.loads(manifest.read_text()) if manifest.is_file() else None


def _write(out: Path, results: dict, suite: dict | None, markdown: str) -> Path:
    """``results.json`` (the harness's dict), ``results.md`` and ``suite.json``, atomically."""
    from lm_eval.utils import handle_non_serializable

    from moe_lit.evaluation.tasks import SUITE_MANIFEST
    from moe_lit.io import atomic_directory

    with atomic_directory(out) as tmp:
        text = json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)
        (tmp / "results.json").write_text(text + "\n")
        if suite is not None:
            (tmp / SUITE_MANIFEST).write_text(json.dumps(suite, indent=2) + "\n")
        (tmp / "results.md").write_text(markdown)
    return out


def results_markdown(
    name: str,
    command: str,
    rows: list[dict],
    languages: dict[str, str],
    suite: dict | None = None,
    precision: str | None = None,
) -> str:
    """The local suite by language (when it ran; with chance accuracy), then every metric; under
    the command, the ``precision`` line of the run."""
    from moe_lit.accounting import markdown_table

    lines = [f"# Evaluation: {name}", "", f"`{command}`", "", *([precision, ""] if precision else [])]
    table = suite_by_language(rows, languages)
    if table:
        chance = (suite or {}).get("chance_acc", {})
        table.append(
            {
                "language": "chance",
                **dict.fromkeys(SUITE_COLUMNS.values(), "-"),
                "next-paragraph acc": chance.get("next", "-"),
                "minimal-pairs acc": chance.get("pairs", "-"),
            }
        )
        items = scored_items(rows, languages, (suite or {}).get("items", {}))
        lines += ["## Local multilingual suite (same items in every language)", ""]
        lines += [f"Items per language: {items}.", ""] if items else []
        lines += [markdown_table(table), ""]
    lines += ["## All metrics", "", markdown_table(rows) if rows else "(no results)", ""]
    return "\n".join(lines)


def scored_items(rows: list[dict], languages: dict[str, str], built: dict[str, int]) -> str:
    """Items each suite kind scored per language (lm-eval's effective sample count, so ``--limit``
    shows), with the number the suite holds where fewer were scored: ``ppl 5 of 569, pairs 733``."""
    scored: dict[str, set[int]] = {}
    for row in rows:
        if row["task"] in languages and row["n"] != "":
            scored.setdefault(_suite_kind(row["task"]), set()).add(int(row["n"]))
    parts = []
    for kind in [*(k for k in built if k in scored), *(k for k in scored if k not in built)]:
        low, high = min(scored[kind]), max(scored[kind])
        text = f"{kind} {low}" if low == high else f"{kind} {low}-{high}"
        parts.append(f"{text} of {built[kind]}" if kind in built and high < built[kind] else text)
    return ", ".join(parts)


def _suite_kind(task: str) -> str:
    """``ppl`` of ``moe_lit_ppl_de``."""
    return task[len("moe_lit_") :].partition("_")[0]


def task_languages(results: dict) -> dict[str, str]:
    """Task name -> language of the local suite's tasks (their YAML metadata)."""
    configs = results.get("configs", {})
    return {task: cfg["metadata"]["language"] for task, cfg in configs.items() if "language" in cfg.get("metadata", {})}


def suite_by_language(rows: list[dict], languages: dict[str, str]) -> list[dict]:
    """Pivot ``moe_lit_<kind>_<lang>`` rows into one row per language."""
    table: dict[str, dict] = {}
    for row in rows:
        if row["task"] not in languages:
            continue
        kind = _suite_kind(row["task"])
        lang = languages[row["task"]]
        column = SUITE_COLUMNS.get((kind, row["metric"]))
        if column:
            empty = {"language": lang, **dict.fromkeys(SUITE_COLUMNS.values(), "-")}
            table.setdefault(lang, empty)[column] = row["value"]
    return list(table.values())


def _task_data_pair(item: str) -> tuple[str, Path]:
    task, sep, file = item.partition("=")
    if not sep or not task or not file:
        raise MoeLitError(f"--task-data: expected TASK=FILE, got {item!r}")
    return task, Path(file)


def _limit(limit):
    if limit is None:
        return None
    if limit <= 0:
        raise MoeLitError(f"--limit: must be > 0, got {limit}")
    return int(limit) if limit >= 1 else limit


def _command(args: argparse.Namespace) -> str:
    parts = ["moe-lit", "eval", "--checkpoint", str(args.checkpoint), "--tasks", *args.tasks]
    sparsity = (
        ("--sparsity", args.sparsity),
        ("--sparsity-rule", args.sparsity_rule if args.sparsity is not None else None),
        ("--sparsity-granularity", args.sparsity_granularity if args.sparsity is not None else None),
        ("--calibration", args.calibration),
    )
    options = (("--limit", _limit(args.limit)), ("--data", args.data), ("--out", args.out))
    options += (("--precision", args.precision if args.precision != "auto" else None),)
    for flag, value in (*options, *sparsity):
        if value is not None:
            parts += [flag, str(value)]
    for item in args.task_data:
        parts += ["--task-data", item]
    return shlex.join(parts)
