"""Study reports from the run records: runs.csv, summary.md (tables + computed findings), plots.

Everything here reads ``results/<study>/study.json`` and ``runs/<hash>.json`` only, so a report can
be rebuilt at any time (``moe-lit study report``), also while a sweep is still running.

Plots (``plots/``):
* ``loss_vs_total_params.png``: final val loss vs total parameters (log x) of the reference
  (active-matched, grid) points, one line per active budget (and top_k);
* ``loss_vs_expert_size.png``: val loss vs mean expert size at fixed active parameters, one panel
  per budget with more than one expert size, one line per num_experts;
* ``ablation_<group>.png``: one bar plot per ablation group (shared, heterogeneous, balancing,
  capacity, matching, granularity).
"""

from __future__ import annotations

import csv
import io
import math
import os
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Optional

from moe_lit.accounting import markdown_table
from moe_lit.errors import MoeLitError
from moe_lit.io import atomic_write_text
from moe_lit.studies.runner import RUNS_DIR, STATUS_FAILED, STATUS_OK, STUDY_FILE, read_record
from moe_lit.studies.spec import REFERENCE_GROUPS

PLOTS_DIR = "plots"
LOSS = "val_loss"
LANG_PREFIX = "val_loss_"
ABLATION_GROUPS = ("granularity", "shared", "heterogeneous", "balancing", "capacity", "matching")
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


def load_study(out_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(plan, records): ``study.json`` and the records of the finished points, in plan order."""
    out_dir = Path(out_dir)
    plan = read_record(out_dir / STUDY_FILE)
    if plan is None:
        raise MoeLitError(f"--out: {out_dir} holds no {STUDY_FILE}; run `moe-lit study run` first")
    records = [read_record(out_dir / RUNS_DIR / f"{p['hash']}.json") for p in plan["points"]]
    return plan, [r for r in records if r is not None]


def flat_row(record: dict[str, Any]) -> dict[str, Any]:
    """One CSV row: scalars only; per-language losses become ``val_loss_<lang>`` columns."""
    row = {k: v for k, v in record.items() if k not in DROPPED and not isinstance(v, (dict, list))}
    row["groups"] = ",".join(record.get("groups", {}))
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
            by_config[record["config_name"]].append(flat_row(record) | {"_groups": record["groups"]})
    rows = []
    for runs in by_config.values():
        row = dict(runs[0])
        losses = [r[LOSS] for r in runs]
        for key, value in row.items():
            if isinstance(value, float) and key not in ("expert_size", "capacity_factor"):
                row[key] = statistics.fmean(r[key] for r in runs)
        row["seeds"] = len(runs)
        row["loss_std"] = statistics.stdev(losses) if len(losses) > 1 else 0.0
        rows.append(row)
    return rows


def _short(n: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


def summary_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The markdown table: one row per configuration."""
    langs = sorted({k for r in rows for k in r if k.startswith(LANG_PREFIX)})
    out = []
    for r in rows:
        item = {
            "point": r["config_name"],
            "groups": r["groups"],
            "E": r["num_experts"],
            "k": r["top_k"],
            "expert F": round(r["expert_size"], 1),
            "total": _short(r["total_params"]),
            "active": _short(r["active_params"]),
            "active non-emb": _short(r["active_non_embedding"]),
            "fwd FLOPs/tok": _short(r["flops_per_token"]),
            "tokens": _short(r.get("tokens", float("nan"))),
            "val loss": r[LOSS] if r["seeds"] == 1 else f"{r[LOSS]:.4f} ± {r['loss_std']:.4f}",
        }
        item.update({lang.removeprefix(LANG_PREFIX): r.get(lang, float("nan")) for lang in langs})
        item["tok/s"] = round(r.get("tokens_per_s", float("nan")))
        item["imbalance"] = r.get("load_imbalance", float("nan"))
        out.append(item)
    return out


# ----------------------------------------------------------------------------- the seed's findings
def reference_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Active-matched points with reference MoE settings (grid and granularity groups)."""
    return [r for r in rows if r["match"] == "active" and set(r["_groups"]) & set(REFERENCE_GROUPS)]


def total_params_lines(rows: list[dict[str, Any]]) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """(budget, top_k) -> grid points sorted by total params, each line starting with the dense model."""
    grid = [r for r in reference_rows(rows) if "grid" in r["_groups"]]
    dense = {r["budget"]: r for r in grid if r["num_experts"] == 1}
    lines: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in grid:
        if r["num_experts"] > 1:
            lines[(r["budget"], r["top_k"])].append(r)
    return {
        key: ([dense[key[0]]] if key[0] in dense else []) + sorted(pts, key=lambda r: r["total_params"])
        for key, pts in lines.items()
    }


def expert_size_lines(rows: list[dict[str, Any]]) -> dict[str, dict[int, list[dict[str, Any]]]]:
    """budget -> num_experts -> reference points sorted by expert size (budgets with >= 2 sizes)."""
    out: dict[str, dict[int, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in reference_rows(rows):
        if r["num_experts"] > 1:
            out[r["budget"]][r["num_experts"]].append(r)
    return {
        budget: {e: sorted(pts, key=lambda r: r["expert_size"]) for e, pts in sorted(by_e.items())}
        for budget, by_e in out.items()
        if len({r["expert_size"] for pts in by_e.values() for r in pts}) > 1
    }


def ablation_bars(rows: list[dict[str, Any]]) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """group -> [(label, row)] for every ablation group present."""
    bars: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for group in ABLATION_GROUPS:
        members = [(r["_groups"][group], r) for r in rows if group in r["_groups"]]
        if members:
            bars[group] = members
    return bars


def findings(rows: list[dict[str, Any]]) -> list[str]:
    """The seed's claims checked on these runs, each with its numbers and a verdict (markdown bullets)."""
    bars = ablation_bars(rows)
    return [
        *_total_params_claim(rows),
        *_expert_size_claim(rows),
        *_ablation_claims(bars, _expert_count_effect(rows, bars)),
    ]


def _name(r: dict[str, Any]) -> str:
    return "dense" if r["num_experts"] == 1 else f"E{r['num_experts']}"


def _total_params_claim(rows) -> list[str]:
    """Claim 1: at fixed active params, loss improves with total params."""
    lines = []
    for (budget, top_k), pts in total_params_lines(rows).items():
        losses = [r[LOSS] for r in pts]
        falls = sum(b < a for a, b in zip(losses, losses[1:]))
        if falls == len(losses) - 1:
            verdict = "reproduced"
        elif min(losses[1:], default=math.inf) < losses[0]:
            verdict = "partly reproduced (sparse beats the first point, but not monotonically)"
        else:
            verdict = "not reproduced"
        path = " → ".join(f"{_name(r)} {r[LOSS]:.4f}" for r in pts)
        lines.append(
            f"- **Loss vs total params at fixed active** ({budget}, top-{top_k}, active "
            f"{_short(pts[0]['active_params'])}): {path}; loss falls at {falls} of {len(pts) - 1} steps up in total "
            f"params, best minus {_name(pts[0])} {min(losses) - losses[0]:+.4f}: **{verdict}**."
        )
    return lines


def _expert_size_claim(rows) -> list[str]:
    """Claim 2: the best expert size does not depend on total params (only on active params)."""
    lines = []
    for budget, by_e in expert_size_lines(rows).items():
        best = {e: min(pts, key=lambda r: r[LOSS]) for e, pts in by_e.items() if len(pts) > 1}
        if len(best) < 2:
            continue
        sizes = {r["top_k"] for r in best.values()}
        detail = ", ".join(f"E{e}: F={r['expert_size']:.0f} (k={r['top_k']}, {r[LOSS]:.4f})" for e, r in best.items())
        verdict = (
            "reproduced: the same expert size at every E" if len(sizes) == 1 else "not reproduced: it moves with E"
        )
        lines.append(f"- **Best expert size at fixed active** ({budget}): {detail}; **{verdict}**.")
    return lines


def _ablation_claims(bars, expert_effect: Optional[float]) -> list[str]:
    """Claim 3: shared / heterogeneous / balancing matter little; claim 4: dropless beats dropping."""
    lines = []
    for group in ("shared", "heterogeneous", "balancing", "capacity", "matching"):
        if len(bars.get(group, ())) < 2:
            continue
        values = {label: r[LOSS] for label, r in bars[group]}
        spread = max(values.values()) - min(values.values())
        line = f"- **{group}**: " + ", ".join(f"{label} {loss:.4f}" for label, loss in values.items())
        line += f"; spread {spread:.4f}"
        if group in ("shared", "heterogeneous", "balancing") and expert_effect:
            small = spread < expert_effect / 2
            line += (
                f" vs the expert-count effect {expert_effect:.4f} (dense minus best grid MoE): "
                f"**{'reproduced: small' if small else 'not reproduced: not small'}**"
            )
        if group == "capacity" and "dropless" in values:
            gaps = {label: loss - values["dropless"] for label, loss in values.items() if label != "dropless"}
            verdict = "reproduced" if all(g > 0 for g in gaps.values()) else "not reproduced"
            line += "; loss minus dropless: " + ", ".join(f"{label} {g:+.4f}" for label, g in gaps.items())
            line += f" (positive = dropless better): **{verdict}**"
        lines.append(line + ".")
    return lines


def _expert_count_effect(rows, bars) -> Optional[float]:
    """Dense loss minus the best grid MoE loss at the ablation budget (the size of the main effect)."""
    budgets = {r["budget"] for group in bars.values() for _, r in group}
    for (budget, _), pts in total_params_lines(rows).items():
        if budget in budgets and pts and pts[0]["num_experts"] == 1:
            return pts[0][LOSS] - min(r[LOSS] for r in pts)
    return None


# ----------------------------------------------------------------------------- plots
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_total_params(rows, path: Path) -> Optional[Path]:
    lines = total_params_lines(rows)
    if not lines:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for (budget, top_k), pts in lines.items():
        ax.plot(
            [r["total_params"] for r in pts],
            [r[LOSS] for r in pts],
            marker="o",
            label=f"{budget} (active {_short(pts[-1]['active_params'])}, top-{top_k})",
        )
        for r in pts:
            ax.annotate(
                "dense" if r["num_experts"] == 1 else f"E{r['num_experts']}",
                (r["total_params"], r[LOSS]),
                textcoords="offset points",
                xytext=(3, 4),
                fontsize=7,
            )
    ax.set_xscale("log")
    ax.set(xlabel="total parameters", ylabel="final validation loss", title="Val loss vs total params at fixed active")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_expert_size(rows, path: Path) -> Optional[Path]:
    panels = expert_size_lines(rows)
    if not panels:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.0), squeeze=False)
    for ax, (budget, by_e) in zip(axes[0], panels.items()):
        for num_experts, pts in by_e.items():
            ax.plot([r["expert_size"] for r in pts], [r[LOSS] for r in pts], marker="o", label=f"E={num_experts}")
        ax.set_xscale("log", base=2)
        ax.set(xlabel="mean expert size F", ylabel="final validation loss", title=f"{budget}: val loss vs expert size")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_ablation(group: str, bars: list[tuple[str, dict[str, Any]]], path: Path) -> Path:
    plt = _pyplot()
    labels = [label if group != "granularity" else f"{label} E{r['num_experts']}" for label, r in bars]
    losses = [r[LOSS] for _, r in bars]
    errors = [r.get("loss_std", 0.0) for _, r in bars]
    fig, ax = plt.subplots(figsize=(max(4.0, 0.9 * len(bars) + 1.5), 3.8))
    ax.bar(range(len(bars)), losses, yerr=errors, color="tab:blue", alpha=0.8)
    ax.set_xticks(range(len(bars)), labels, rotation=30, ha="right", fontsize=8)
    low, high = min(losses), max(losses)
    pad = max(0.02, (high - low) * 0.5)
    # NOTE: the differences between variants are a few hundredths of a nat: bars from zero would
    # hide them, so the axis is zoomed and the values are written on the bars.
    ax.set_ylim(low - pad, high + pad)
    for i, loss in enumerate(losses):
        ax.text(i, loss, f"{loss:.4f}", ha="center", va="bottom", fontsize=7)
    ax.set(ylabel="final validation loss", title=f"ablation: {group} ({bars[0][1]['budget']})")
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    fig.clf()
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def write_plots(rows: list[dict[str, Any]], plots_dir: Path) -> list[Path]:
    made = [
        plot_total_params(rows, plots_dir / "loss_vs_total_params.png"),
        plot_expert_size(rows, plots_dir / "loss_vs_expert_size.png"),
    ]
    made += [
        plot_ablation(group, bars, plots_dir / f"ablation_{group}.png") for group, bars in ablation_bars(rows).items()
    ]
    return [p for p in made if p is not None]


# ----------------------------------------------------------------------------- the report
def summary_markdown(
    plan: dict[str, Any], records: list[dict[str, Any]], plots: list[Path], level: int = 1, plots_href: str = PLOTS_DIR
) -> str:
    """The study's markdown summary; ``level`` is the level of its top heading, ``plots_href`` the
    plot folder as seen from where the markdown lives."""
    rows = aggregate(records)
    failed = [r for r in records if r["status"] == STATUS_FAILED]
    pending = len(plan["points"]) - len(records)
    top, sub = "#" * level, "#" * (level + 1)
    parts = [
        f"{top} Study: {plan['name']}",
        plan.get("description", "").strip(),
        f"Command: `{plan['command']}`" if plan.get("command") else "",
        f"{len(plan['points'])} points: {len(records) - len(failed)} ok, {len(failed)} failed, {pending} pending.",
        f"{sub} Findings (computed from the runs below)",
        "\n".join(findings(rows)) or "(not enough finished runs)",
        f"{sub} Runs",
        markdown_table(summary_rows(rows)),
    ]
    if failed:
        table = markdown_table([{"point": r["name"], "hash": r["hash"], "error": r["error"]} for r in failed])
        parts += [f"{sub} Failed runs", table]
    if plots:
        parts += [f"{sub} Plots", "\n".join(f"![{p.stem}]({plots_href}/{p.name})" for p in plots)]
    return "\n\n".join(p for p in parts if p) + "\n"


def update_readme(readme: Path, out_dir: Path, plan: dict[str, Any], records, plots: list[Path]) -> Path:
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
    body = summary_markdown(plan, records, plots, level=3, plots_href=Path(href).as_posix())
    return atomic_write_text(readme, f"{head}{begin}\n{body}{end}{tail}")


def write_report(out_dir: Path, readme: Optional[Path] = None) -> dict[str, Path]:
    """Write runs.csv, summary.md and plots/ under ``out_dir`` (and fill the study's block in
    ``readme`` when given); returns the paths written."""
    out_dir = Path(out_dir)
    plan, records = load_study(out_dir)
    plots = write_plots(aggregate(records), out_dir / PLOTS_DIR)
    paths = {
        "runs_csv": atomic_write_text(out_dir / "runs.csv", runs_csv(records)),
        "summary": atomic_write_text(out_dir / "summary.md", summary_markdown(plan, records, plots)),
    }
    if readme is not None:
        paths["readme"] = update_readme(readme, out_dir, plan, records, plots)
    return paths | {p.stem: p for p in plots}


__all__ = [
    "aggregate",
    "findings",
    "flat_row",
    "load_study",
    "runs_csv",
    "summary_markdown",
    "update_readme",
    "write_report",
]
