"""Study kind ``dense_vs_sparse``: dense and MoE models matched on active (or total) parameters.

The kind's fields name a dense base model, the active-parameter budgets (each budget is a dense
model: the base with a few fields changed), the main grid (budgets x num_experts x top_k x matching
mode, the dense model included) and ablations at one budget (granularity, shared expert,
heterogeneous expert sizes, balancing, capacity factor vs dropless, matching mode). Every MoE model
is built by :func:`moe_lit.accounting.matched_moe_config`, so an active-matched point has the active
parameters of its budget's dense model; two axes that describe the same run collapse into one point
that belongs to both groups. seq_len comes from ``run.data.seq_len``.

Plots (``plots/``; error bars: ± std over seeds, a single-seed study says "1 seed, no error bar"):
``loss_vs_total_params.png`` (final val loss vs total parameters, log x, one line per budget and
top-k), ``loss_vs_expert_size.png`` (val loss vs mean expert size at fixed active parameters, x
ticks naming top-k, a panel per budget with a granularity sweep), ``ablation_<group>.png`` (each
variant's loss minus its reference's, paired by seed, around a zero line with the reference's seed
std as the noise band; the ticks give active / total params and the title what was matched).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_lit.accounting import matched_moe_config
from moe_lit.config import ConfigError, ModelConfig, MoEConfig
from moe_lit.plotting import pyplot, save_figure, seed_errorbar, spread_note, zero_line
from moe_lit.studies.engine import Point
from moe_lit.studies.kinds import Analysis
from moe_lit.studies.report import LANG_PREFIX, LOSS, aggregate
from moe_lit.studies.stats import Summary, compare, format_comparison, summarize

ABLATION_GROUPS = ("granularity", "shared", "heterogeneous", "balancing", "capacity", "matching")
ABLATION_AXES = {
    "granularity": "top-k and number of experts",
    "shared": "shared expert size (fraction of the dense d_ff)",
    "heterogeneous": "expert size profile",
    "balancing": "load balancing",
    "capacity": "capacity factor (tokens beyond it are dropped)",
    "matching": "model",
}
"""x-axis label of each ablation plot."""


DENSE = "dense"
MATCH_MODES = ("active", "total")
BALANCING_FIELDS = ("balancing", "aux_loss_coef", "bias_update_rate")
# NOTE: these groups hold the points whose MoE settings are the reference ones (no shared expert,
# equal experts, reference balancing, dropless, active-matched): only they may be compared along the
# total-parameter and expert-size axes.
REFERENCE_GROUPS = ("grid", "granularity")


def _fail(field_name: str, message: str) -> None:
    raise ConfigError(f"{field_name}: {message}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require_list(value: Any, field_name: str) -> list:
    if not isinstance(value, (list, tuple)):
        _fail(field_name, f"must be a list, got {value!r}")
    return list(value)


def _build(cls, data: Any, field_name: str):
    """``cls(**data)`` with unknown keys and non-mappings reported under ``field_name``."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        _fail(field_name, f"expected a mapping, got {type(data).__name__}")
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(known))
    if unknown:
        _fail(field_name, f"unknown key(s) {unknown}, allowed keys: {known}")
    return cls(**data)


def _check_model_fields(overrides: dict[str, Any], field_name: str) -> None:
    known = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in ("moe", "seq_len")]
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        _fail(field_name, f"unknown model field(s) {unknown}, allowed: {known}")


@dataclass
class BudgetSpec:
    """One active-parameter budget: the dense base model with a few fields changed."""

    name: str
    """Short label of the budget used in point names and plots (e.g. S, M)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """ModelConfig fields that differ from the base model (e.g. d_ff: 512, d_model: 128)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            _fail("budgets.name", f"must be a non-empty string without '/', got {self.name!r}")
        if not isinstance(self.overrides, dict):
            _fail(f"budgets[{self.name}].overrides", f"must be a mapping, got {self.overrides!r}")
        _check_model_fields(self.overrides, f"budgets[{self.name}].overrides")

    @classmethod
    def from_yaml_entry(cls, entry: Any, index: int) -> BudgetSpec:
        """``{name: S, d_ff: 256}``: the name plus the changed model fields, flat."""
        if not isinstance(entry, dict) or "name" not in entry:
            _fail(f"budgets[{index}]", f"must be a mapping with a 'name' and model fields, got {entry!r}")
        overrides = {k: v for k, v in entry.items() if k != "name"}
        return cls(name=entry["name"], overrides=overrides)


@dataclass
class GridSpec:
    """The main grid, run at every budget: num_experts x top_k x matching mode."""

    num_experts: list[int | str] = field(default_factory=lambda: [DENSE, 4, 8, 16, 32])
    """Total routed experts E per MoE layer; the word ``dense`` adds the budget's dense model itself."""
    top_k: list[int] = field(default_factory=lambda: [2])
    """Experts per token. With active matching the expert size is about d_ff / top_k, so this is
    the granularity axis; values >= num_experts are skipped (every expert active: no sparsity)."""
    match: list[str] = field(default_factory=lambda: ["active"])
    """Matching modes: active (MoE active params = dense params) | total (MoE total = dense total)."""
    moe: dict[str, Any] = field(default_factory=dict)
    """MoEConfig fields shared by every MoE point (e.g. balancing, aux_loss_coef, backend)."""

    def __post_init__(self) -> None:
        self.num_experts = _require_list(self.num_experts, "grid.num_experts")
        for value in self.num_experts:
            if value != DENSE and not (_is_int(value) and value >= 2):
                _fail("grid.num_experts", f"entries must be 'dense' or integers >= 2, got {value!r}")
        self.top_k = _require_list(self.top_k, "grid.top_k")
        if not self.top_k or not all(_is_int(k) and k >= 1 for k in self.top_k):
            _fail("grid.top_k", f"must be a non-empty list of integers >= 1, got {self.top_k!r}")
        self.match = _require_list(self.match, "grid.match")
        for mode in self.match:
            if mode not in MATCH_MODES:
                _fail("grid.match", f"got {mode!r}, allowed values: {', '.join(MATCH_MODES)}")
        if not isinstance(self.moe, dict):
            _fail("grid.moe", f"must be a mapping of MoEConfig fields, got {self.moe!r}")
        solved = {"num_experts", "expert_size", "top_k", "shared_expert_size"}
        allowed = [f.name for f in dataclasses.fields(MoEConfig) if f.name not in solved]
        unknown = sorted(set(self.moe) - set(allowed))
        if unknown:
            _fail("grid.moe", f"unknown or solved field(s) {unknown}, allowed: {allowed}")

    @property
    def moe_experts(self) -> list[int]:
        return [e for e in self.num_experts if e != DENSE]


@dataclass
class AblationSpec:
    """One-axis-at-a-time changes of a reference MoE point at a single budget."""

    budget: str
    """Name of the budget the ablations run at."""
    num_experts: int = 8
    """Experts of the reference MoE point."""
    top_k: int = 2
    """Top-k of the reference MoE point."""
    granularity: list[int] = field(default_factory=list)
    """Extra top_k values run at this budget for every grid num_experts > top_k (active match:
    expert size about d_ff / top_k), for the loss-vs-expert-size plot; empty = none."""
    shared_fraction: list[float] = field(default_factory=list)
    """Fractions of the dense d_ff turned into an always-on shared expert (each in (0, 1))."""
    size_profiles: dict[str, list[float]] = field(default_factory=dict)
    """Heterogeneous experts: name -> num_experts relative sizes (same mean size as the reference)."""
    balancing: list[dict[str, Any]] = field(default_factory=list)
    """Balancing variants, each a mapping of balancing (aux_loss | bias | none), aux_loss_coef,
    bias_update_rate."""
    capacity_factor: list[float] = field(default_factory=list)
    """Token-dropping capacity factors compared with the dropless reference (e.g. 1.0, 1.25, 2.0)."""
    match: list[str] = field(default_factory=list)
    """Other matching modes for the reference point (e.g. [total])."""

    def __post_init__(self) -> None:
        if not _is_int(self.num_experts) or self.num_experts < 2:
            _fail("ablations.num_experts", f"must be an integer >= 2, got {self.num_experts!r}")
        if not _is_int(self.top_k) or not 1 <= self.top_k < self.num_experts:
            _fail("ablations.top_k", f"must be an integer in [1, num_experts={self.num_experts}), got {self.top_k!r}")
        self.granularity = _require_list(self.granularity, "ablations.granularity")
        if not all(_is_int(k) and k >= 1 for k in self.granularity):
            _fail("ablations.granularity", f"must be integers >= 1, got {self.granularity!r}")
        self.shared_fraction = _require_list(self.shared_fraction, "ablations.shared_fraction")
        for value in self.shared_fraction:
            if not isinstance(value, (int, float)) or not 0 < value < 1:
                _fail("ablations.shared_fraction", f"entries must be in (0, 1), got {value!r}")
        if not isinstance(self.size_profiles, dict):
            _fail("ablations.size_profiles", f"must be a mapping name -> relative sizes, got {self.size_profiles!r}")
        for name, profile in self.size_profiles.items():
            sizes = _require_list(profile, f"ablations.size_profiles.{name}")
            if len(sizes) != self.num_experts or not all(isinstance(s, (int, float)) and s > 0 for s in sizes):
                _fail(
                    f"ablations.size_profiles.{name}",
                    f"needs num_experts={self.num_experts} positive numbers, got {sizes!r}",
                )
        self.balancing = _require_list(self.balancing, "ablations.balancing")
        for i, variant in enumerate(self.balancing):
            if not isinstance(variant, dict) or not set(variant) <= set(BALANCING_FIELDS) or not variant:
                _fail(f"ablations.balancing[{i}]", f"must be a mapping of {list(BALANCING_FIELDS)}, got {variant!r}")
        self.capacity_factor = _require_list(self.capacity_factor, "ablations.capacity_factor")
        for value in self.capacity_factor:
            if not isinstance(value, (int, float)) or value <= 0:
                _fail("ablations.capacity_factor", f"entries must be numbers > 0, got {value!r}")
        self.match = _require_list(self.match, "ablations.match")
        for mode in self.match:
            if mode not in MATCH_MODES:
                _fail("ablations.match", f"got {mode!r}, allowed values: {', '.join(MATCH_MODES)}")


@dataclass
class DenseVsSparseSpec:
    """The kind's own fields of a dense-vs-sparse study file."""

    base: ModelConfig
    """Dense base model (moe must be null; seq_len comes from run.data.seq_len)."""
    budgets: list[BudgetSpec]
    """Active-parameter budgets, each a dense model derived from the base."""
    seq_len: int = 128
    """Training sequence length (run.data.seq_len)."""
    grid: GridSpec = field(default_factory=GridSpec)
    """Main grid run at every budget."""
    ablations: AblationSpec | None = None
    """Ablations at one budget; null = none."""

    def __post_init__(self) -> None:
        if self.base.moe is not None:
            _fail("base.moe", "the base model must be dense (moe: null); experts come from the grid")
        self.budgets = _require_list(self.budgets, "budgets")
        if not self.budgets:
            _fail("budgets", "needs at least one budget")
        names = [b.name for b in self.budgets]
        if len(set(names)) != len(names):
            _fail("budgets", f"names must be unique, got {names}")
        for budget in self.budgets:
            self.dense_model(budget.name)  # validates every budget's model now
        if self.ablations is not None and self.ablations.budget not in names:
            _fail("ablations.budget", f"got {self.ablations.budget!r}, allowed values: {', '.join(names)}")

    def dense_model(self, budget: str) -> ModelConfig:
        """The dense model of one budget (the base with its overrides, seq_len from the run)."""
        spec = next((b for b in self.budgets if b.name == budget), None)
        if spec is None:
            _fail("budget", f"got {budget!r}, allowed values: {', '.join(b.name for b in self.budgets)}")
        try:
            return self.base.replace(**spec.overrides, seq_len=self.seq_len)
        except ConfigError as exc:
            raise ConfigError(f"budgets[{budget}]: {exc}") from None


def default_run() -> dict[str, Any]:
    return {"train": {"max_tokens": 2_000_000}}


def parse(fields: dict[str, Any], header) -> DenseVsSparseSpec:
    known = [f.name for f in dataclasses.fields(DenseVsSparseSpec) if f.name != "seq_len"]
    unknown = sorted(set(fields) - set(known))
    if unknown:
        _fail("study", f"unknown key(s) {unknown}, allowed keys: {known} (and the header's)")
    for required in ("base", "budgets"):
        if required not in fields:
            _fail(required, "is required")
    base = fields["base"]
    if not isinstance(base, dict):
        _fail("base", f"expected a mapping of model fields, got {base!r}")
    if "seq_len" in base:
        _fail("base.seq_len", "set the sequence length in run.data.seq_len")
    return DenseVsSparseSpec(
        base=ModelConfig.from_dict(dict(base)),
        budgets=[BudgetSpec.from_yaml_entry(e, i) for i, e in enumerate(_require_list(fields["budgets"], "budgets"))],
        seq_len=header.run.data.seq_len,
        grid=_build(GridSpec, fields.get("grid") or {}, "grid"),
        ablations=_build(AblationSpec, fields["ablations"], "ablations") if fields.get("ablations") else None,
    )


def _info(run: _Run) -> dict[str, Any]:
    moe = run.model.moe
    return {
        "budget": run.budget,
        "groups": {run.group: run.label},
        "match": run.match,
        "shared_expert_size": moe.shared_expert_size if moe else 0,
        "heterogeneous": bool(moe and not moe.uniform),
        "balancing": moe.balancing if moe else "",
        "capacity_factor": moe.capacity_factor if moe else None,
    }


def expand(spec: DenseVsSparseSpec, header) -> list[Point]:
    """Every run of the study, in a stable order (grid first), deduplicated by identity."""
    from moe_lit.studies.engine import finalize

    runs = _grid_runs(spec) + (_ablation_runs(spec, spec.ablations) if spec.ablations else [])
    points: dict[str, Point] = {}
    for seed in header.seeds:
        for run in runs:
            config_name = f"{run.budget}/{run.name}"
            (point,) = finalize(
                [
                    Point(
                        name=header.point_name(config_name, seed),
                        config_name=config_name,
                        seed=seed,
                        model=run.model,
                        run=header.seeded_run(seed),
                        info=_info(run),
                    )
                ]
            )
            known = points.setdefault(point.hash, point)
            if known is not point:
                known.info["groups"].setdefault(run.group, run.label)
    return [dataclasses.replace(p, hash="") for p in points.values()]


def analyse(plan: dict[str, Any], records: list[dict[str, Any]], plots_dir: Path) -> Analysis:
    rows = aggregate(records)
    plots = write_plots(rows, plots_dir, plan["spec"].get("ablations"))
    return Analysis(findings=findings(rows), tables={"Runs": summary_rows(rows)}, plots=plots)


@dataclass(frozen=True)
class _Run:
    """A point before hashing: its group, label in the group, and the model."""

    group: str
    budget: str
    name: str
    label: str
    model: ModelConfig
    match: str = "active"


def _moe_name(num_experts: int, top_k: int) -> str:
    return f"E{num_experts}k{top_k}"


def _balancing_label(variant: dict[str, Any], defaults: dict[str, Any]) -> str:
    settings = {**{k: defaults.get(k, getattr(MoEConfig, k)) for k in BALANCING_FIELDS}, **variant}
    kind = settings["balancing"]
    if kind == "aux_loss":
        return f"aux_loss={settings['aux_loss_coef']:g}"
    if kind == "bias":
        return f"bias={settings['bias_update_rate']:g}"
    return str(kind)


def _grid_runs(spec: DenseVsSparseSpec) -> list[_Run]:
    """Every budget x num_experts x top_k x match, the dense model included."""
    runs = []
    for budget in spec.budgets:
        dense = spec.dense_model(budget.name)
        if DENSE in spec.grid.num_experts:
            runs.append(_Run("grid", budget.name, DENSE, DENSE, dense))
        for match in spec.grid.match:
            for num_experts in spec.grid.moe_experts:
                for top_k in (k for k in spec.grid.top_k if k < num_experts):
                    model = matched_moe_config(dense, num_experts, top_k, match, **spec.grid.moe)
                    name = _moe_name(num_experts, top_k) + ("" if match == "active" else f"/{match}")
                    runs.append(_Run("grid", budget.name, name, name, model, match))
    return runs


def _ablation_runs(spec: DenseVsSparseSpec, abl: AblationSpec) -> list[_Run]:
    """Granularity at every grid num_experts, then one-axis changes of the reference MoE point."""
    dense = spec.dense_model(abl.budget)
    moe_fields = spec.grid.moe
    runs = [
        _Run(
            "granularity",
            abl.budget,
            _moe_name(e, k),
            f"k={k}",
            matched_moe_config(dense, e, k, "active", **moe_fields),
        )
        for k in abl.granularity
        for e in spec.grid.moe_experts
        if k < e
    ]
    ref = _moe_name(abl.num_experts, abl.top_k)

    def build(match: str = "active", **changes: Any) -> ModelConfig:
        return matched_moe_config(dense, abl.num_experts, abl.top_k, match, **{**moe_fields, **changes})

    reference = build()
    # group -> (label of the reference point in the group, [(name suffix, label, model, match)])
    axes: dict[str, tuple[str, list[tuple[str, str, ModelConfig, str]]]] = {
        "shared": (
            "none",
            [(f"shared={f:g}", f"{f:g}", build(shared_fraction=f), "active") for f in abl.shared_fraction],
        ),
        "heterogeneous": (
            "equal",
            [(f"profile={n}", n, build(size_profile=p), "active") for n, p in abl.size_profiles.items()],
        ),
        "balancing": (
            _balancing_label({}, moe_fields),
            [(_balancing_label(v, moe_fields),) * 2 + (build(**v), "active") for v in abl.balancing],
        ),
        "capacity": (
            "dropless",
            [(f"cf={c:g}",) * 2 + (build(capacity_factor=c), "active") for c in abl.capacity_factor],
        ),
        "matching": ("active-matched", [(m, f"{m}-matched", build(match=m), m) for m in abl.match]),
    }
    for group, (reference_label, variants) in axes.items():
        if not variants:
            continue
        runs.append(_Run(group, abl.budget, ref, reference_label, reference))
        if group == "matching":
            runs.append(_Run(group, abl.budget, DENSE, DENSE, dense))
        runs += [
            _Run(group, abl.budget, f"{ref}/{suffix}", label, model, match) for suffix, label, model, match in variants
        ]
    return runs


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
    """budget -> num_experts -> reference points sorted by expert size, for the budgets where some
    E was run at two or more top-k (elsewhere expert sizes differ only by the matching's rounding)."""
    out: dict[str, dict[int, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in reference_rows(rows):
        if r["num_experts"] > 1:
            out[r["budget"]][r["num_experts"]].append(r)
    return {
        budget: {e: sorted(pts, key=lambda r: r["expert_size"]) for e, pts in sorted(by_e.items())}
        for budget, by_e in out.items()
        if any(len(pts) > 1 for pts in by_e.values())
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
        falls = sum(b < a for a, b in zip(losses, losses[1:], strict=False))
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
            f"params, best minus {_name(pts[0])} {min(losses) - losses[0]:+.4f}: **{verdict}**; seed noise: "
            f"{_noise(min(pts, key=lambda r: r[LOSS]), pts[0])}."
        )
    return lines


def _noise(a: dict[str, Any], b: dict[str, Any]) -> str:
    """Welch's test of two configurations' losses over their seeds (one line)."""
    return format_comparison(compare(a["_losses"], b["_losses"]))


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


def _ablation_claims(bars, expert_effect: float | None) -> list[str]:
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
            dropless = next(r for label, r in bars[group] if label == "dropless")
            line += "; seed noise: " + ", ".join(
                f"{label} {_noise(r, dropless)}" for label, r in bars[group] if label != "dropless"
            )
        lines.append(line + ".")
    return lines


def _expert_count_effect(rows, bars) -> float | None:
    """Dense loss minus the best grid MoE loss at the ablation budget (the size of the main effect)."""
    budgets = {r["budget"] for group in bars.values() for _, r in group}
    for (budget, _), pts in total_params_lines(rows).items():
        if budget in budgets and pts and pts[0]["num_experts"] == 1:
            return pts[0][LOSS] - min(r[LOSS] for r in pts)
    return None


# ----------------------------------------------------------------------------- plots
def _loss(row: dict[str, Any]) -> Summary:
    """The configuration's val loss over its seeds."""
    return summarize(row["_losses"])


def total_params_figure(rows):
    """Val loss vs total params (log x), one line per budget and top-k, ± seed std; None without lines."""
    lines = total_params_lines(rows)
    if not lines:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    counts = []
    for line, ((budget, top_k), pts) in enumerate(lines.items()):
        stats = [_loss(r) for r in pts]
        counts += [s.n for s in stats]
        label = f"{budget}: active {_short(pts[-1]['active_params'])}, top-{top_k}"
        seed_errorbar(ax, [r["total_params"] for r in pts], stats, label=label)
        for r in pts:
            # NOTE: labels of alternate lines go above / below their points, so equal sizes do not overprint.
            offset = (3, 4) if line % 2 == 0 else (3, -10)
            ax.annotate(_name(r), (r["total_params"], r[LOSS]), textcoords="offset points", xytext=offset, fontsize=7)
    ax.set_xscale("log")
    ax.set(
        xlabel="total parameters",
        ylabel="final validation loss",
        title=f"Val loss vs total params at fixed active\n({spread_note(counts)})",
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def _size_ticks(ax, pts: list[dict[str, Any]]) -> None:
    """One labelled x tick per top-k at its mean expert size (at fixed active, F is about d_ff / k)."""
    by_k: dict[int, list[float]] = defaultdict(list)
    for r in pts:
        by_k[r["top_k"]].append(r["expert_size"])
    sizes = dict(sorted(((k, sum(v) / len(v)) for k, v in by_k.items()), key=lambda item: item[1]))
    ax.set_xticks(list(sizes.values()), [f"{size:.0f}\ntop-{k}" for k, size in sizes.items()])
    ax.minorticks_off()


def expert_size_figure(rows):
    """Val loss vs mean expert size at fixed active, one panel per budget with a granularity
    sweep, one line per E, x ticks naming top-k; None without such a budget."""
    panels = expert_size_lines(rows)
    if not panels:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    for ax, (budget, by_e) in zip(axes[0], panels.items(), strict=True):
        counts = []
        for num_experts, pts in by_e.items():
            stats = [_loss(r) for r in pts]
            counts += [s.n for s in stats]
            label = f"E={num_experts} (top-k {', '.join(str(r['top_k']) for r in pts)})"
            seed_errorbar(ax, [r["expert_size"] for r in pts], stats, label=label)
        ax.set_xscale("log", base=2)
        _size_ticks(ax, [r for pts in by_e.values() for r in pts])
        active = _short(next(iter(by_e.values()))[0]["active_params"])
        ax.set(
            xlabel="mean expert size F (top-k)",
            ylabel="final validation loss",
            title=f"{budget}: val loss vs expert size at {active} active\n({spread_note(counts)})",
        )
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return fig


def _reference(group: str, row: dict[str, Any], by_name: dict[str, dict[str, Any]], ablation: dict[str, Any]):
    """The row a member of an ablation group is compared with: the ablations' reference MoE point,
    or for granularity the same E at the reference top-k."""
    experts = row["num_experts"] if group == "granularity" else ablation["num_experts"]
    return by_name.get(f"{ablation['budget']}/{_moe_name(experts, ablation['top_k'])}")


def _paired_difference(row: dict[str, Any], reference: dict[str, Any]) -> Summary:
    """Loss minus the reference's, seed by seed (a seed's runs share the data order)."""
    ref = dict(zip(reference["_seeds"], reference["_losses"], strict=True))
    return summarize([loss - ref[s] for s, loss in zip(row["_seeds"], row["_losses"], strict=True) if s in ref])


def _matched_note(group: str, reference: dict[str, Any]) -> str:
    if group == "matching":
        return "active-matched: the dense model's active params;\ntotal-matched: its total params (so fewer active)"
    active = _short(reference["active_params"])
    return f"every point active-matched to the {reference['budget']} dense model ({active} active params)"


def _ablation_ticks(group: str, points) -> list[str]:
    """Each variant's label with its active / total params (what the matching kept equal)."""
    return [
        (f"{label} E{r['num_experts']}" if group == "granularity" else label)
        + f"\n{_short(r['active_params'])} act / {_short(r['total_params'])} tot"
        for label, r, _ in points
    ]


def _versus(group: str, reference: dict[str, Any], ablation: dict[str, Any]) -> str:
    if group == "granularity":
        return f"the same E at top-{ablation['top_k']}"
    return f"{reference['_groups'][group]} ({reference['config_name']}: {reference[LOSS]:.4f})"


def ablation_figure(
    group: str,
    members: list[tuple[str, dict[str, Any]]],
    rows,
    ablation: dict[str, Any],
    effect: float | None = None,
):
    """Each member's val loss minus its reference's (paired by seed; the reference is the zero line,
    its seed std the grey band), labelled with active / total params; ``effect`` (dense minus the
    best grid MoE) is drawn as a scale reference. None without a reference."""
    by_name = {r["config_name"]: r for r in rows}
    points = [
        (label, r, ref)
        for label, r in members
        if (ref := _reference(group, r, by_name, ablation)) is not None and ref is not r
    ]
    if not points:
        return None
    plt = pyplot()
    stats = [_paired_difference(r, ref) for _, r, ref in points]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(points) + 2.0), 4.2))
    seed_errorbar(ax, range(len(points)), stats, linestyle="none", color="tab:blue")
    noises = [_loss(ref).std for _, _, ref in points if _loss(ref).n > 1]
    zero_line(ax, sum(noises) / len(noises) if noises else None, "seed std of the reference")
    if effect:
        # NOTE: a single-seed study has no noise band; the main effect of the study gives the scale.
        ax.axhline(
            -effect,
            color="tab:green",
            linestyle="--",
            linewidth=1,
            label=f"scale: best grid MoE minus dense, {-effect:+.4f}",
        )
    for i, s in enumerate(stats):
        ax.annotate(f"{s.mean:+.4f}", (i, s.mean), textcoords="offset points", xytext=(6, 0), fontsize=7, va="center")
    ax.set_xticks(range(len(points)), _ablation_ticks(group, points), fontsize=7)
    ax.set_xlim(-0.6, len(points) - 0.4)
    reference = points[0][2]
    ax.set_xlabel(ABLATION_AXES[group], fontsize=9)
    ax.set_ylabel(f"val loss minus {_versus(group, reference, ablation)}\n(< 0: better than the reference)", fontsize=9)
    title = f"ablation: {group} ({reference['budget']}); {spread_note(s.n for s in stats)}"
    ax.set_title(f"{title}\n{_matched_note(group, reference)}", fontsize=8)
    if noises or effect:
        ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    return fig


def write_plots(rows: list[dict[str, Any]], plots_dir: Path, ablation: dict[str, Any] | None = None) -> list[Path]:
    """The kind's PNGs under ``plots_dir``; ``ablation`` is the spec's ablations (the references)."""
    figures = {
        "loss_vs_total_params": total_params_figure(rows),
        "loss_vs_expert_size": expert_size_figure(rows),
    }
    if ablation:
        bars = ablation_bars(rows)
        effect = _expert_count_effect(rows, bars)
        for group, members in bars.items():
            figures[f"ablation_{group}"] = ablation_figure(group, members, rows, ablation, effect)
    return [save_figure(fig, plots_dir / f"{name}.png") for name, fig in figures.items() if fig is not None]
