"""Study reports from the records, for every kind: runs.csv, summary.md, plots, a README block.

Everything here reads ``results/<study>/study.json`` and ``runs/<hash>.json`` only, so a report can
be rebuilt at any time (``moe-lit study report``), also while a study still runs. The kind's
``analyse`` supplies its claims (tested), findings, tables and plots; this module judges the
claims together (:func:`moe_lit.studies.verdicts.judge`: Holm over the study's claims, one verdict
each), names the tests used in the header, lists the measured contrast of every claim untestable here
as a labelled finding, and writes the rest. A report built from fewer finished
points than the one it would replace is refused unless ``force`` (a fresh clone without the
records must never overwrite the shipped results).
"""

from __future__ import annotations

import csv
import io
import os
import statistics
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from moe_lit.accounting import markdown_table
from moe_lit.errors import MoeLitError
from moe_lit.io import atomic_write_json, atomic_write_text
from moe_lit.studies.identity import RUNS_DIR, STATUS_FAILED, STATUS_OK, read_record
from moe_lit.studies.kinds import Analysis, kind_module
from moe_lit.studies.study import study_from_plan
from moe_lit.studies.verdicts import Verdict, claim_findings, judge, report_json, used_tests

PLOTS_DIR = "plots"
LOSS = "val_loss"
LANG_PREFIX = "val_loss_"
REPORT_FILE = "report.json"
# NOTE: columns of runs.csv in this order; per-language losses follow val_loss, unknown result
# fields (whatever else train_fn returns) go last, so nothing measured is lost.
COLUMNS = (
    "name",
    "config_name",
    "hash",
    "status",
    "budget",
    "seed",
    "groups",
    "match",
    "num_experts",
    "top_k",
    "expert_size",
    "shared_expert_size",
    "heterogeneous",
    "balancing",
    "capacity_factor",
    "total_params",
    "active_params",
    "total_non_embedding",
    "active_non_embedding",
    "flops_per_token",
    "tokens",
    "steps",
    LOSS,
)
TAIL = ("tokens_per_s", "load_imbalance", "wall_s", "study_wall_s", "error")
DROPPED = ("model", "traceback", "val_loss_per_language")


def read_results(out_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(plan, records): ``study.json`` and the records of the finished points, in plan order."""
    out_dir = Path(out_dir)
    plan = study_from_plan(out_dir)
    records = [read_record(out_dir / RUNS_DIR / f"{p['hash']}.json") for p in plan["points"]]
    return plan, [r for r in records if r is not None]


def flat_row(record: dict[str, Any]) -> dict[str, Any]:
    """One CSV row: scalars only; per-language losses become ``val_loss_<lang>`` columns."""
    row = {k: v for k, v in record.items() if k not in DROPPED and not isinstance(v, (dict, list))}
    if "groups" in record:
        row["groups"] = ",".join(record["groups"])
    for lang, loss in (record.get("val_loss_per_language") or {}).items():
        row[f"{LANG_PREFIX}{lang}"] = loss
    return row


def _ordered_columns(rows: Iterable[dict[str, Any]]) -> list[str]:
    present: dict[str, None] = {}
    for row in rows:
        present.update(dict.fromkeys(row))
    langs = sorted(k for k in present if k.startswith(LANG_PREFIX))
    head = [c for c in COLUMNS if c in present] + langs
    tail = [c for c in TAIL if c in present]
    return head + sorted(set(present) - set(head) - set(tail)) + tail


def runs_csv(records: list[dict[str, Any]]) -> str:
    rows = [flat_row(r) for r in records]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=_ordered_columns(rows), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


# ----------------------------------------------------------------------------- aggregation over seeds
def aggregate(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per configuration (seeds averaged) over the successful records, in plan order."""
    by_config: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        if record["status"] == STATUS_OK:
            by_config[record["config_name"]].append(flat_row(record) | {"_groups": record.get("groups", {})})
    rows = []
    for runs in by_config.values():
        row = dict(runs[0])
        losses = [r[LOSS] for r in runs]
        for key, value in row.items():
            if (
                isinstance(value, float)
                and key not in ("expert_size", "capacity_factor")
                and all(isinstance(r.get(key), float) for r in runs)
            ):
                row[key] = statistics.fmean(r[key] for r in runs)
        row["seeds"] = len(runs)
        row["loss_std"] = statistics.stdev(losses) if len(losses) > 1 else 0.0
        row["_losses"] = losses
        row["_seeds"] = [r["seed"] for r in runs]
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- the report
def summary_markdown(
    plan: dict[str, Any],
    records: list[dict[str, Any]],
    analysis: Analysis,
    level: int = 1,
    plots_href: str = PLOTS_DIR,
    verdicts: list[Verdict] | None = None,
) -> str:
    """The study's markdown summary; ``level`` is the level of its top heading, ``plots_href`` the
    plot folder as seen from where the markdown lives; ``verdicts``: the judged claims (default:
    :func:`~moe_lit.studies.verdicts.judge` of the analysis' claims)."""
    verdicts = judge(analysis.claims) if verdicts is None else verdicts
    failed = [r for r in records if r["status"] == STATUS_FAILED]
    pending = len(plan["points"]) - len(records)
    top, sub = "#" * level, "#" * (level + 1)
    seeds = plan.get("seeds") or [0]
    parts = [
        f"{top} Study: {plan['name']} (kind {plan.get('kind', 'dense_vs_sparse')})",
        plan.get("description", "").strip(),
        f"Command: `{plan['command']}`" if plan.get("command") else "",
        f"{len(plan['points'])} points: {len(records) - len(failed)} ok, {len(failed)} failed, {pending} pending; "
        f"seeds {seeds} (values are mean ± std over the seeds, n = seeds finished). {used_tests(verdicts)}".strip(),
        f"{sub} Claims (verdicts: reproduced, contradicted, not detected, untestable here)",
        markdown_table([v.fields for v in verdicts]) if verdicts else "(not enough finished runs)",
    ]
    notes = [*analysis.findings, *(line for v in verdicts for line in claim_findings(v.evidence))]
    if notes:
        parts += [f"{sub} Findings (computed from the runs below)", "\n".join(notes)]
    for title, rows in analysis.tables.items():
        parts += [f"{sub} {title}", markdown_table(rows) if rows else "(none finished)"]
    if failed:
        table = markdown_table([{"point": r["name"], "hash": r["hash"], "error": r["error"]} for r in failed])
        parts += [f"{sub} Failed runs", table]
    if analysis.plots:
        parts += [f"{sub} Plots", "\n".join(f"![{p.stem}]({plots_href}/{p.name})" for p in analysis.plots)]
    return "\n\n".join(p for p in parts if p) + "\n"


def update_readme(
    readme: Path, out_dir: Path, plan: dict[str, Any], records, analysis: Analysis, verdicts: list[Verdict]
) -> Path:
    """Replace the block between ``<!-- study:NAME -->`` and ``<!-- /study:NAME -->`` in ``readme``
    with the summary (headings at level 3, plot links relative to the README)."""
    readme = Path(readme)
    begin, end = f"<!-- study:{plan['name']} -->", f"<!-- /study:{plan['name']} -->"
    text = readme.read_text() if readme.is_file() else ""
    if begin not in text or end not in text.split(begin, 1)[1]:
        raise MoeLitError(f"--readme: {readme} has no '{begin}' ... '{end}' block to fill")
    head, rest = text.split(begin, 1)
    tail = rest.split(end, 1)[1]
    href = os.path.relpath(
        Path(out_dir) / PLOTS_DIR, readme.resolve().parent if readme.is_absolute() else readme.parent
    )
    body = summary_markdown(plan, records, analysis, level=3, plots_href=Path(href).as_posix(), verdicts=verdicts)
    return atomic_write_text(readme, f"{head}{begin}\n{body}{end}{tail}")


def previous_finished(out_dir: Path) -> int:
    """Finished points of the report in ``out_dir`` (report.json, else the ok rows of runs.csv)."""
    previous = read_record(out_dir / REPORT_FILE)
    if previous is not None:
        return previous.get("finished", 0)
    try:
        with open(out_dir / "runs.csv", newline="") as handle:
            return sum(row.get("status") == STATUS_OK for row in csv.DictReader(handle))
    except OSError:
        return 0


def _refuse_fewer(out_dir: Path, finished: int, force: bool) -> None:
    previous = previous_finished(out_dir)
    if not force and finished < previous:
        raise MoeLitError(
            f"study report: {out_dir} has a report of {previous} finished points but only {finished} "
            "records are here (are runs/*.json missing?); pass --force to replace it anyway"
        )


def write_report(out_dir: Path, readme: Path | None = None, force: bool = False) -> dict[str, Path]:
    """Write runs.csv, summary.md and plots/ under ``out_dir`` (and fill the study's block in
    ``readme`` when given); returns the paths written."""
    out_dir = Path(out_dir)
    plan, records = read_results(out_dir)
    finished = sum(r["status"] == STATUS_OK for r in records)
    _refuse_fewer(out_dir, finished, force)
    analysis = kind_module(plan.get("kind", "dense_vs_sparse")).analyse(plan, records, out_dir / PLOTS_DIR)
    verdicts = judge(analysis.claims)
    paths = {
        "runs_csv": atomic_write_text(out_dir / "runs.csv", runs_csv(records)),
        "summary": atomic_write_text(
            out_dir / "summary.md", summary_markdown(plan, records, analysis, verdicts=verdicts)
        ),
    }
    if readme is not None:
        paths["readme"] = update_readme(readme, out_dir, plan, records, analysis, verdicts)
    report = {"finished": finished, "points": len(plan["points"]), "claims": report_json(verdicts)}
    atomic_write_json(out_dir / REPORT_FILE, report)
    return paths | {p.stem: p for p in analysis.plots}


__all__ = [
    "aggregate",
    "flat_row",
    "read_results",
    "runs_csv",
    "summary_markdown",
    "update_readme",
    "write_report",
]
