"""``moe-lit eval``: lm-eval tasks on a checkpoint; results JSON + markdown under ``results/eval/<name>/``.

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
    parser.add_argument("--name", help="results/eval/<name> (default: the checkpoint's name)")
    parser.add_argument("--data", type=Path, help="prepared data dir for the local suite (default: the checkpoint's)")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer.json (default: the one stored with the checkpoint)")
    parser.add_argument(
        "--task-data", action="append", default=[], metavar="TASK=FILE",
        help="run built-in TASK on a local JSONL in its schema (repeatable); it runs as TASK_local",
    )
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-fewshot", type=int, help="few-shot examples (default: each task's own)")
    parser.add_argument("--bootstrap-iters", type=int, default=1000, help="bootstrap resamples for stderr (0: none)")
    parser.add_argument("--out-dir", type=Path, default=Path("results/eval"))


def run(args: argparse.Namespace) -> int:
    from moe_lit.evaluation.harness import MoeLitLM, checkpoint_name, evaluate, result_rows
    from moe_lit.evaluation.tasks import SUITE_PREFIX, resolve_data_dir, resolve_tasks
    from moe_lit.io import atomic_directory

    if not args.checkpoint.exists():
        raise MoeLitError(f"--checkpoint: no such file or directory {args.checkpoint}")
    tasks = [name for item in args.tasks for name in item.split(",") if name]
    task_data = dict(_task_data_pair(item) for item in args.task_data)
    name = args.name or checkpoint_name(args.checkpoint)
    with tempfile.TemporaryDirectory(prefix="moe_lit_tasks_") as work:
        data_dir = resolve_data_dir(args.checkpoint, args.data) if _needs_suite(tasks, SUITE_PREFIX) else None
        names, manager = resolve_tasks(tasks, Path(work), data_dir=data_dir, task_data=task_data)
        lm = MoeLitLM(
            checkpoint=args.checkpoint, tokenizer=args.tokenizer, batch_size=args.batch_size, device=args.device
        )
        results = evaluate(
            lm, names, manager, limit=_limit(args.limit), num_fewshot=args.num_fewshot,
            bootstrap_iters=args.bootstrap_iters,
        )
    rows = result_rows(results)
    command = _command(args)
    out = args.out_dir / name
    with atomic_directory(out) as tmp:
        from lm_eval.utils import handle_non_serializable

        text = json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)
        (tmp / "results.json").write_text(text + "\n")
        markdown = results_markdown(name, command, rows, task_languages(results))
        (tmp / "results.md").write_text(markdown)
    print(markdown)
    print(f"wrote {out}/results.json and results.md")
    return 0


def results_markdown(name: str, command: str, rows: list[dict], languages: dict[str, str]) -> str:
    """The local suite by language (when it ran), then every metric."""
    from moe_lit.accounting import markdown_table

    lines = [f"# Evaluation: {name}", "", f"`{command}`", ""]
    suite = suite_by_language(rows, languages)
    if suite:
        lines += ["## Local multilingual suite (same items in every language)", "", markdown_table(suite), ""]
    lines += ["## All metrics", "", markdown_table(rows) if rows else "(no results)", ""]
    return "\n".join(lines)


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
        kind = row["task"][len("moe_lit_") :].partition("_")[0]
        lang = languages[row["task"]]
        column = SUITE_COLUMNS.get((kind, row["metric"]))
        if column:
            empty = {"language": lang, **dict.fromkeys(SUITE_COLUMNS.values(), "-")}
            table.setdefault(lang, empty)[column] = row["value"]
    return list(table.values())


def _needs_suite(tasks: list[str], prefix: str) -> bool:
    return any(task.startswith(prefix) for task in tasks)


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
    for flag, value in (("--limit", _limit(args.limit)), ("--data", args.data), ("--name", args.name)):
        if value is not None:
            parts += [flag, str(value)]
    for item in args.task_data:
        parts += ["--task-data", item]
    return shlex.join(parts)
