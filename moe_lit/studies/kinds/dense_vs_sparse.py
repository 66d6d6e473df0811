"""Study kind ``dense_vs_sparse``: dense and MoE models matched on active (or total) parameters.

The kind's fields name a dense base model, the active-parameter budgets (each a dense model: the
base with a few fields changed), the main grid (budgets x num_experts x top_k x matching mode, the
dense model included) and ablations at one budget (granularity, shared expert, heterogeneous
expert sizes, balancing, capacity factor vs dropless, matching mode). Every MoE model is built by
:func:`moe_lit.accounting.matched_moe_config`, so an active-matched point has the active parameters
of its budget's dense model; two axes that describe the same run collapse into one point that
belongs to both groups. seq_len comes from ``run.data.seq_len``.

Claims (the seed's four), paired by seed: at fixed active params the largest MoE beats dense and
the smallest MoE; the best expert size does not move with E, and shared experts, heterogeneous
sizes and balancing matter little (equivalence within the study's ``margin``); dropless beats
token dropping. Plots (error bars ± std over seeds): ``loss_vs_total_params.png``,
``loss_vs_expert_size.png`` (x ticks name top-k) and ``ablation_<group>.png`` (each variant minus
its reference, paired by seed, around a zero line with the reference's seed std as the noise band).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_lit.accounting import matched_moe_config
from moe_lit.config import ConfigError, ModelConfig, MoEConfig
from moe_lit.plotting import seed_errorbar, spread_note, zero_line
from moe_lit.stats import summarize
from moe_lit.studies import plots
from moe_lit.studies import spec as check
from moe_lit.studies.engine import Point, finalize
from moe_lit.studies.kinds import Analysis
from moe_lit.studies.records import minus
from moe_lit.studies.report import LANG_PREFIX, LOSS, aggregate
from moe_lit.studies.verdicts import EQUIVALENT, LOWER, Claim

ABLATION_AXES = {
    "granularity": "top-k and number of experts",
    "shared": "shared expert size (fraction of the dense d_ff)",
    "heterogeneous": "expert size profile",
    "balancing": "load balancing",
    "capacity": "capacity factor (tokens beyond it are dropped)",
    "matching": "model",
}
"""Ablation group -> x-axis label of its plot."""
DENSE, MATCH_MODES = "dense", ("active", "total")
BALANCING_FIELDS = ("balancing", "aux_loss_coef", "bias_update_rate")
SMALL = ("shared", "heterogeneous", "balancing")
"""The groups the seed says matter little."""
# NOTE: these groups hold the points whose MoE settings are the reference ones (no shared expert,
# equal experts, reference balancing, dropless, active-matched): only they may be compared along the
# total-parameter and expert-size axes.
REFERENCE_GROUPS = ("grid", "granularity")


def _matches(values: list, name: str) -> list:
    for mode in values:
        check.choice(mode, name, MATCH_MODES)
    return values


@dataclass
class BudgetSpec:
    """One active-parameter budget: the dense base model with a few fields changed."""

    name: str
    """Short label of the budget used in point names and plots (e.g. S, M)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """ModelConfig fields that differ from the base model (e.g. d_ff: 512, d_model: 128)."""

    def __post_init__(self) -> None:
        check.label(self.name, "budgets.name")
        known = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in ("moe", "seq_len")]
        unknown = sorted(set(self.overrides) - set(known))
        if unknown:
            raise ConfigError(f"budgets[{self.name}].overrides: unknown model field(s) {unknown}, allowed: {known}")

    @classmethod
    def from_yaml_entry(cls, entry: Any, index: int) -> BudgetSpec:
        """``{name: S, d_ff: 256}``: the name plus the changed model fields, flat."""
        if not isinstance(entry, dict) or "name" not in entry:
            raise ConfigError(f"budgets[{index}]: must be a mapping with a 'name' and model fields, got {entry!r}")
        return cls(name=entry["name"], overrides={k: v for k, v in entry.items() if k != "name"})


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
        ok = isinstance(self.num_experts, list) and all(
            e == DENSE or check.is_int(e) and e >= 2 for e in self.num_experts
        )
        if not ok:
            raise ConfigError(f"num_experts: entries must be 'dense' or integers >= 2, got {self.num_experts!r}")
        check.distinct(self.top_k, "top_k", each=lambda k: check.is_int(k) and k >= 1, what="integers", must=">= 1")
        _matches(self.match, "match")
        solved = {"num_experts", "expert_size", "top_k", "shared_expert_size"}
        allowed = [f.name for f in dataclasses.fields(MoEConfig) if f.name not in solved]
        if not isinstance(self.moe, dict) or set(self.moe) - set(allowed):
            raise ConfigError(
                f"moe: unknown or solved field(s) {sorted(set(self.moe) - set(allowed))}, allowed: {allowed}"
            )

    @property
    def moe_experts(self) -> list[int]:
        return [e for e in self.num_experts if e != DENSE]  # type: ignore[misc]


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
        check.integer(self.num_experts, "num_experts", 2)
        check.int_in(self.top_k, "top_k", 1, self.num_experts, f"num_experts={self.num_experts}")
        check.distinct(
            self.granularity, "granularity", each=lambda k: check.is_int(k) and k >= 1, must=">= 1", empty=True
        )
        check.distinct(self.shared_fraction, "shared_fraction", each=lambda f: 0 < f < 1, must="in (0, 1)", empty=True)
        for name, sizes in self.size_profiles.items():
            if (
                not isinstance(sizes, list)
                or len(sizes) != self.num_experts
                or not all(check.is_number(s) and s > 0 for s in sizes)
            ):
                raise ConfigError(
                    f"size_profiles.{name}: needs num_experts={self.num_experts} positive numbers, got {sizes!r}"
                )
        for i, variant in enumerate(self.balancing):
            if not isinstance(variant, dict) or not variant or not set(variant) <= set(BALANCING_FIELDS):
                raise ConfigError(f"balancing[{i}]: must be a mapping of {list(BALANCING_FIELDS)}, got {variant!r}")
        check.distinct(
            self.capacity_factor, "capacity_factor", each=lambda c: check.is_number(c) and c > 0, must="> 0", empty=True
        )
        _matches(self.match, "match")


@dataclass
class DenseVsSparseSpec:
    """The kind's own fields of a dense-vs-sparse study file."""

    base: ModelConfig
    """Dense base model (moe must be null; seq_len comes from run.data.seq_len)."""
    budgets: list[BudgetSpec]
    """Active-parameter budgets, each a dense model derived from the base."""
    grid: GridSpec = field(default_factory=GridSpec)
    """Main grid run at every budget."""
    ablations: AblationSpec | None = None
    """Ablations at one budget; null = none."""
    margin: float | None = None
    """Largest val-loss difference that counts as no effect, stated before the study runs (analysis
    only): the equivalence margin of the claims that shared experts, heterogeneous sizes and
    balancing matter little and that the best expert size does not move; null: those are untestable."""

    def __post_init__(self) -> None:
        if self.base.moe is not None:
            raise ConfigError("base.moe: the base model must be dense (moe: null); experts come from the grid")
        names = [b.name for b in self.budgets]
        check.distinct(names, "budgets", what="budget names")
        for budget in names:
            self.dense_model(budget)  # validates every budget's model now
        if self.ablations is not None:
            check.choice(self.ablations.budget, "ablations.budget", names)
        if self.margin is not None:
            check.number(self.margin, "margin", 0)

    def dense_model(self, budget: str) -> ModelConfig:
        """The dense model of one budget (the base with its overrides)."""
        spec = next(b for b in self.budgets if b.name == budget)
        try:
            return self.base.replace(**spec.overrides)
        except ConfigError as exc:
            raise ConfigError(f"budgets[{budget}]: {exc}") from None


def default_run() -> dict[str, Any]:
    return {"train": {"max_tokens": 2_000_000}}


_parse = check.parser(DenseVsSparseSpec, ("base", "budgets"))


def parse(fields: dict[str, Any], header) -> DenseVsSparseSpec:
    if isinstance(fields.get("base"), dict) and "seq_len" in fields["base"]:
        raise ConfigError("base.seq_len: set the sequence length in run.data.seq_len")
    budgets = fields.get("budgets")
    if isinstance(budgets, list):
        fields = {**fields, "budgets": [BudgetSpec.from_yaml_entry(e, i) for i, e in enumerate(budgets)]}
    return _parse(fields, header)


@dataclass(frozen=True)
class _Run:
    """A point before hashing: its group, label in the group, and the model."""

    group: str
    budget: str
    name: str
    label: str
    model: ModelConfig
    match: str = "active"

    def info(self) -> dict[str, Any]:
        moe = self.model.moe
        out = {"budget": self.budget, "groups": {self.group: self.label}, "match": self.match}
        out |= {
            "shared_expert_size": moe.shared_expert_size if moe else 0,
            "heterogeneous": bool(moe and not moe.uniform),
        }
        return out | {
            "balancing": moe.balancing if moe else "",
            "capacity_factor": moe.capacity_factor if moe else None,
        }


def expand(spec: DenseVsSparseSpec, header) -> list[Point]:
    """Every run of the study, in a stable order (grid first), deduplicated by identity."""
    runs = _grid_runs(spec) + (_ablation_runs(spec, spec.ablations) if spec.ablations else [])
    points: dict[str, Point] = {}
    for seed in header.seeds:
        for run in runs:
            config_name = f"{run.budget}/{run.name}"
            name, seeded = header.point_name(config_name, seed), header.seeded_run(seed)
            (point,) = finalize([Point(name, config_name, seed, run.model, seeded, run.info())])
            known = points.setdefault(point.hash, point)
            if known is not point:
                known.info["groups"].setdefault(run.group, run.label)
    return [dataclasses.replace(p, hash="") for p in points.values()]


def _moe_name(num_experts: int, top_k: int) -> str:
    return f"E{num_experts}k{top_k}"


def _balancing_label(variant: dict[str, Any], defaults: dict[str, Any]) -> str:
    settings = {**{k: defaults.get(k, getattr(MoEConfig, k)) for k in BALANCING_FIELDS}, **variant}
    if settings["balancing"] == "aux_loss":
        return f"aux_loss={settings['aux_loss_coef']:g}"
    return f"bias={settings['bias_update_rate']:g}" if settings["balancing"] == "bias" else str(settings["balancing"])


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
    dense, moe = spec.dense_model(abl.budget), spec.grid.moe
    runs = [
        _Run("granularity", abl.budget, _moe_name(e, k), f"k={k}", matched_moe_config(dense, e, k, "active", **moe))
        for k in abl.granularity
        for e in spec.grid.moe_experts
        if k < e
    ]

    def build(match: str = "active", **changes: Any) -> ModelConfig:
        return matched_moe_config(dense, abl.num_experts, abl.top_k, match, **{**moe, **changes})

    ref, reference = _moe_name(abl.num_experts, abl.top_k), build()
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
            _balancing_label({}, moe),
            [(_balancing_label(v, moe),) * 2 + (build(**v), "active") for v in abl.balancing],
        ),
        "capacity": (
            "dropless",
            [(f"cf={c:g}",) * 2 + (build(capacity_factor=c), "active") for c in abl.capacity_factor],
        ),
        "matching": ("active-matched", [(m, f"{m}-matched", build(match=m), m) for m in abl.match]),
    }
    for group, (reference_label, variants) in axes.items():
        if variants:
            runs.append(_Run(group, abl.budget, ref, reference_label, reference))
            runs += [_Run(group, abl.budget, DENSE, DENSE, dense)] if group == "matching" else []
            runs += [
                _Run(group, abl.budget, f"{ref}/{suffix}", label, model, match)
                for suffix, label, model, match in variants
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
        item = {"point": r["config_name"], "groups": r["groups"], "E": r["num_experts"], "k": r["top_k"]}
        item |= {
            "expert F": round(r["expert_size"], 1),
            "total": _short(r["total_params"]),
            "active": _short(r["active_params"]),
        }
        item |= {"active non-emb": _short(r["active_non_embedding"]), "fwd FLOPs/tok": _short(r["flops_per_token"])}
        item |= {"tokens": _short(r.get("tokens", float("nan")))}
        item["val loss"] = r[LOSS] if r["seeds"] == 1 else f"{r[LOSS]:.4f} ± {r['loss_std']:.4f}"
        item |= {lang.removeprefix(LANG_PREFIX): r.get(lang, float("nan")) for lang in langs}
        out.append(
            item
            | {"tok/s": round(r.get("tokens_per_s", float("nan"))), "imbalance": r.get("load_imbalance", float("nan"))}
        )
    return out


# ----------------------------------------------------------------------------- the seed's claims
def reference_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Active-matched points with reference MoE settings (grid and granularity groups)."""
    return [r for r in rows if r["match"] == "active" and set(r["_groups"]) & set(REFERENCE_GROUPS)]


def total_params_lines(rows: list[dict[str, Any]]) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """(budget, top_k) -> grid points sorted by total params, each line starting with the dense model."""
    grid = [r for r in reference_rows(rows) if "grid" in r["_groups"]]
    dense = {r["budget"]: r for r in grid if r["num_experts"] == 1}
    lines: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in (r for r in grid if r["num_experts"] > 1):
        lines[(r["budget"], r["top_k"])].append(r)
    return {
        k: ([dense[k[0]]] if k[0] in dense else []) + sorted(v, key=lambda r: r["total_params"])
        for k, v in lines.items()
    }


def expert_size_lines(rows: list[dict[str, Any]]) -> dict[str, dict[int, list[dict[str, Any]]]]:
    """budget -> num_experts -> reference points sorted by expert size, for the budgets where some
    E was run at two or more top-k (elsewhere expert sizes differ only by the matching's rounding)."""
    out: dict[str, dict[int, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in (r for r in reference_rows(rows) if r["num_experts"] > 1):
        out[r["budget"]][r["num_experts"]].append(r)
    return {
        budget: {e: sorted(pts, key=lambda r: r["expert_size"]) for e, pts in sorted(by_e.items())}
        for budget, by_e in out.items()
        if any(len(pts) > 1 for pts in by_e.values())
    }


def ablation_bars(rows: list[dict[str, Any]]) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """group -> [(label, row)] for every ablation group present."""
    bars = {g: [(r["_groups"][g], r) for r in rows if g in r["_groups"]] for g in ABLATION_AXES}
    return {group: members for group, members in bars.items() if members}


def _losses(r: dict[str, Any]) -> dict[int, float]:
    return dict(zip(r["_seeds"], r["_losses"], strict=True))


def _name(r: dict[str, Any]) -> str:
    return "dense" if r["num_experts"] == 1 else f"E{r['num_experts']}"


def claims(rows: list[dict[str, Any]], ablation: dict[str, Any] | None = None, margin: float | None = None) -> list:
    """The seed's claims tested on the configurations' losses (paired by seed)."""
    out = []
    for (budget, top_k), pts in total_params_lines(rows).items():
        moes, where = [r for r in pts if r["num_experts"] > 1], f"{budget}, top-{top_k}"
        pairs = [(moes[-1], pts[0], "dense")] if moes and pts[0]["num_experts"] == 1 else []
        pairs += [(moes[-1], moes[0], "the smallest MoE")] if len(moes) > 1 else []
        for a, b, what in pairs:
            text = f"{where}: at fixed active params the most total params beat {what}"
            out.append(Claim(text, "val loss", (a["config_name"], b["config_name"]), LOWER).on(_losses(a), _losses(b)))
    for budget, by_e in expert_size_lines(rows).items():
        best = {e: min(pts, key=lambda r: r[LOSS]) for e, pts in by_e.items() if len(pts) > 1}
        first = next(iter(best.values()), None)
        for e, own in list(best.items())[1:]:
            same = next((r for r in by_e[e] if r["top_k"] == first["top_k"]), None)
            if same is not None and same is not own:
                text, arms = (
                    f"{budget}, E{e}: the best expert size does not move with E",
                    (same["config_name"], own["config_name"]),
                )
                out.append(Claim(text, "val loss", arms, EQUIVALENT, margin).on(_losses(same), _losses(own)))
    by_name = {r["config_name"]: r for r in rows}
    for group, members in ablation_bars(rows).items() if ablation else ():
        for label, r in members:
            ref = _reference(group, r, by_name, ablation)
            if ref is None or ref is r or group not in (*SMALL, "capacity"):
                continue
            if group == "capacity":
                claim = Claim(
                    f"dropless beats token dropping ({label})",
                    "val loss",
                    (ref["config_name"], r["config_name"]),
                    LOWER,
                )
                out.append(claim.on(_losses(ref), _losses(r)))
            else:
                claim = Claim(
                    f"{group}: {label} matters little",
                    "val loss",
                    (r["config_name"], ref["config_name"]),
                    EQUIVALENT,
                    margin,
                )
                out.append(claim.on(_losses(r), _losses(ref)))
    return out


def findings(rows: list[dict[str, Any]]) -> list[str]:
    """What the runs show beside the claims: each line's losses and the best expert size per E."""
    lines = []
    for (budget, top_k), pts in total_params_lines(rows).items():
        path = " → ".join(f"{_name(r)} {r[LOSS]:.4f}" for r in pts)
        active = _short(pts[0]["active_params"])
        lines.append(f"- **Loss vs total params at fixed active** ({budget}, top-{top_k}, active {active}): {path}.")
    for budget, by_e in expert_size_lines(rows).items():
        best = {e: min(pts, key=lambda r: r[LOSS]) for e, pts in by_e.items() if len(pts) > 1}
        detail = ", ".join(f"E{e}: F={r['expert_size']:.0f} (k={r['top_k']}, {r[LOSS]:.4f})" for e, r in best.items())
        lines.append(f"- **Best expert size at fixed active** ({budget}): {detail}.")
    for group, members in ablation_bars(rows).items():
        if group not in ("granularity",) and len(members) > 1:
            lines.append(f"- **{group}**: " + ", ".join(f"{label} {r[LOSS]:.4f}" for label, r in members) + ".")
    return lines


def analyse(plan: dict[str, Any], records: list[dict[str, Any]], plots_dir: Path) -> Analysis:
    rows, spec = aggregate(records), plan["spec"]
    written = write_plots(rows, plots_dir, spec.get("ablations"))
    tested = claims(rows, spec.get("ablations"), spec.get("margin"))
    return Analysis(claims=tested, findings=findings(rows), tables={"Runs": summary_rows(rows)}, plots=written)


# ----------------------------------------------------------------------------- plots
def _loss(row: dict[str, Any]):
    return summarize(row["_losses"])


def total_params_figure(rows):
    """Val loss vs total params (log x), one line per budget and top-k, ± seed std; None without lines."""
    lines = total_params_lines(rows)
    if not lines:
        return None
    fig, (ax,) = plots.panels(1, 6.4, 4.2)
    counts = []
    for i, ((budget, top_k), pts) in enumerate(lines.items()):
        stats = [_loss(r) for r in pts]
        counts += [s.n for s in stats]
        seed_errorbar(
            ax,
            [r["total_params"] for r in pts],
            stats,
            label=f"{budget}: active {_short(pts[-1]['active_params'])}, top-{top_k}",
        )
        for r in pts:  # NOTE: labels of alternate lines go above / below, so equal sizes do not overprint
            ax.annotate(
                _name(r),
                (r["total_params"], r[LOSS]),
                textcoords="offset points",
                xytext=(3, 4) if i % 2 == 0 else (3, -10),
                fontsize=7,
            )
    ax.set_xscale("log")
    ax.set(
        xlabel="total parameters",
        ylabel="final validation loss",
        title=f"Val loss vs total params at fixed active\n({spread_note(counts)})",
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def expert_size_figure(rows):
    """Val loss vs mean expert size at fixed active, one panel per budget with a granularity
    sweep, one line per E, x ticks naming top-k; None without such a budget."""
    panels = expert_size_lines(rows)
    if not panels:
        return None
    fig, axes = plots.panels(len(panels), 5.2, 4.2)
    for ax, (budget, by_e) in zip(axes, panels.items(), strict=True):
        counts = []
        for num_experts, pts in by_e.items():
            stats = [_loss(r) for r in pts]
            counts += [s.n for s in stats]
            seed_errorbar(
                ax,
                [r["expert_size"] for r in pts],
                stats,
                label=f"E={num_experts} (top-k {', '.join(str(r['top_k']) for r in pts)})",
            )
        ax.set_xscale("log", base=2)
        by_k: dict[int, list[float]] = defaultdict(list)
        for r in (r for pts in by_e.values() for r in pts):
            by_k[r["top_k"]].append(r["expert_size"])
        sizes = dict(sorted(((k, sum(v) / len(v)) for k, v in by_k.items()), key=lambda item: item[1]))
        ax.set_xticks(list(sizes.values()), [f"{size:.0f}\ntop-{k}" for k, size in sizes.items()])
        ax.minorticks_off()
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
    """The row an ablation member is compared with: the reference MoE point, or for granularity
    the same E at the reference top-k."""
    experts = row["num_experts"] if group == "granularity" else ablation["num_experts"]
    return by_name.get(f"{ablation['budget']}/{_moe_name(experts, ablation['top_k'])}")


def ablation_figure(
    group: str, members: list[tuple[str, dict[str, Any]]], rows, ablation: dict[str, Any], effect: float | None = None
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
    stats = [summarize(list(minus(_losses(r), _losses(ref)).values())) for _, r, ref in points]
    fig, (ax,) = plots.panels(1, max(6.0, 1.1 * len(points) + 2.0), 4.2)
    seed_errorbar(ax, range(len(points)), stats, linestyle="none", color="tab:blue")
    noises = [_loss(ref).std for _, _, ref in points if _loss(ref).n > 1]
    zero_line(ax, sum(noises) / len(noises) if noises else None, "seed std of the reference")
    if effect:  # NOTE: a single-seed study has no noise band; the study's main effect gives the scale
        ax.axhline(
            -effect,
            color="tab:green",
            linestyle="--",
            linewidth=1,
            label=f"scale: best grid MoE minus dense, {-effect:+.4f}",
        )
    for i, s in enumerate(stats):
        ax.annotate(f"{s.mean:+.4f}", (i, s.mean), textcoords="offset points", xytext=(6, 0), fontsize=7, va="center")
    ticks = [
        (f"{label} E{r['num_experts']}" if group == "granularity" else label)
        + f"\n{_short(r['active_params'])} act / {_short(r['total_params'])} tot"
        for label, r, _ in points
    ]
    ax.set_xticks(range(len(points)), ticks, fontsize=7)
    ax.set_xlim(-0.6, len(points) - 0.4)
    reference = points[0][2]
    versus = (
        f"the same E at top-{ablation['top_k']}"
        if group == "granularity"
        else f"{reference['_groups'][group]} ({reference['config_name']}: {reference[LOSS]:.4f})"
    )
    ax.set_xlabel(ABLATION_AXES[group], fontsize=9)
    ax.set_ylabel(f"val loss minus {versus}\n(< 0: better than the reference)", fontsize=9)
    matched = (
        "active-matched: the dense model's active params;\ntotal-matched: its total params (so fewer active)"
        if group == "matching"
        else f"every point active-matched to the {reference['budget']} dense model "
        f"({_short(reference['active_params'])} active params)"
    )
    ax.set_title(f"ablation: {group} ({reference['budget']}); {spread_note(s.n for s in stats)}\n{matched}", fontsize=8)
    if noises or effect:
        ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    return fig


def write_plots(rows: list[dict[str, Any]], plots_dir: Path, ablation: dict[str, Any] | None = None) -> list[Path]:
    """The kind's PNGs under ``plots_dir``; ``ablation`` is the spec's ablations (the references)."""
    figures = {"loss_vs_total_params": total_params_figure(rows), "loss_vs_expert_size": expert_size_figure(rows)}
    if ablation:
        bars, lines = ablation_bars(rows), total_params_lines(rows)
        budgets = {r["budget"] for group in bars.values() for _, r in group}
        effects = [
            pts[0][LOSS] - min(r[LOSS] for r in pts)
            for (b, _), pts in lines.items()
            if b in budgets and pts[0]["num_experts"] == 1
        ]
        for group, members in bars.items():
            figures[f"ablation_{group}"] = ablation_figure(
                group, members, rows, ablation, effects[0] if effects else None
            )
    return [plots.save(fig, plots_dir, name) for name, fig in figures.items() if fig is not None]


__all__ = [
    "DenseVsSparseSpec",
    "ablation_bars",
    "ablation_figure",
    "analyse",
    "claims",
    "expand",
    "expert_size_figure",
    "findings",
    "parse",
    "total_params_figure",
]
