"""Study kind ``dense_vs_sparse``: dense and MoE models matched on active (or total) parameters.

Budgets (the dense base with a few fields changed) x the grid (num_experts x top_k x matching mode, dense
included), and one-axis ablations at one budget (granularity, shared expert, heterogeneous sizes, balancing,
capacity factor, matching); every MoE is :func:`moe_lit.accounting.matched_moe_config`, and two axes describing
one run are one point. Claims, paired by seed: at fixed active params the most total params beat dense and the
smallest MoE; the best expert size does not move with E; shared experts, heterogeneous sizes and balancing matter
little (TOST within ``margin``); dropless beats token dropping. Plots: loss vs total params and vs expert size
(:func:`moe_lit.studies.plots.lines`), and per ablation each variant minus its reference around zero.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path
from typing import Any, NamedTuple

from moe_lit.accounting import matched_moe_config
from moe_lit.config import ConfigError, ModelConfig, MoEConfig
from moe_lit.plotting import spread_note
from moe_lit.stats import summarize
from moe_lit.studies import plots
from moe_lit.studies import spec as check
from moe_lit.studies.engine import Point, finalize
from moe_lit.studies.kinds import Analysis
from moe_lit.studies.records import group as grouped
from moe_lit.studies.records import minus
from moe_lit.studies.report import LANG_PREFIX, LOSS, aggregate
from moe_lit.studies.verdicts import EQUIVALENT, LOWER, Claim

AXES = {"granularity": "top-k and number of experts", "shared": "shared expert size (fraction of the dense d_ff)"}
AXES |= {"heterogeneous": "expert size profile", "balancing": "load balancing"}
AXES |= {"capacity": "capacity factor (tokens beyond it are dropped)", "matching": "model"}
"""Ablation group -> x-axis label of its plot (in plot order)."""
DENSE, MATCH_MODES, SMALL = "dense", ("active", "total"), ("shared", "heterogeneous", "balancing")
BALANCING_FIELDS = ("balancing", "aux_loss_coef", "bias_update_rate")
# NOTE: only points with the reference MoE settings (grid, granularity) are compared along total params.
REFERENCE_GROUPS = ("grid", "granularity")
Row = dict[str, Any]


@dataclass
class BudgetSpec:
    """One active-parameter budget: the dense base model with a few fields changed."""

    name: str
    """Short label of the budget used in point names and plots (e.g. S, M)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """ModelConfig fields that differ from the base model (e.g. d_ff: 512, d_model: 128)."""

    def __post_init__(self) -> None:
        check.label(self.name, "budgets.name")
        allowed = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in ("moe", "seq_len")]
        check.known_keys(self.overrides, f"budgets[{self.name}].overrides", allowed, "model field(s)", "allowed")


@dataclass
class GridSpec:
    """The main grid, run at every budget: num_experts x top_k x matching mode."""

    num_experts: list[int | str] = field(default_factory=lambda: [DENSE, 4, 8, 16, 32])
    """Total routed experts E per MoE layer; the word ``dense`` adds the budget's dense model itself."""
    top_k: list[int] = field(default_factory=lambda: [2])
    """Experts per token (expert size about d_ff / top_k with active matching); top_k >= num_experts is skipped."""
    match: list[str] = field(default_factory=lambda: ["active"])
    """Matching modes: active (MoE active params = dense params) | total (MoE total = dense total)."""
    moe: dict[str, Any] = field(default_factory=dict)
    """MoEConfig fields shared by every MoE point (e.g. balancing, aux_loss_coef, backend)."""

    def __post_init__(self) -> None:
        why = f"entries must be 'dense' or integers >= 2, got {self.num_experts!r}"
        check.require(all(e == DENSE or check.is_int(e) and e >= 2 for e in list(self.num_experts)), "num_experts", why)
        check.ints(self.top_k, "top_k", 1)
        check.choices(self.match, "match", MATCH_MODES)
        solved = {"num_experts", "expert_size", "top_k", "shared_expert_size"}
        allowed = [f.name for f in dataclasses.fields(MoEConfig) if f.name not in solved]
        check.known_keys(self.moe, "moe", allowed, "or solved field(s)", "allowed")


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
    """Extra top_k values run for every grid num_experts > top_k (the loss-vs-expert-size plot)."""
    shared_fraction: list[float] = field(default_factory=list)
    """Fractions of the dense d_ff turned into an always-on shared expert (each in (0, 1))."""
    size_profiles: dict[str, list[float]] = field(default_factory=dict)
    """Heterogeneous experts: name -> num_experts relative sizes (same mean size as the reference)."""
    balancing: list[dict[str, Any]] = field(default_factory=list)
    """Balancing variants, each a mapping of balancing (aux_loss | bias | none), aux_loss_coef, bias_update_rate."""
    capacity_factor: list[float] = field(default_factory=list)
    """Token-dropping capacity factors compared with the dropless reference (e.g. 1.0, 1.25, 2.0)."""
    match: list[str] = field(default_factory=list)
    """Other matching modes for the reference point (e.g. [total])."""

    def __post_init__(self) -> None:
        check.integer(self.num_experts, "num_experts", 2)
        check.int_in(self.top_k, "top_k", 1, self.num_experts, f"num_experts={self.num_experts}")
        check.ints(self.granularity, "granularity", 1, empty=True)
        check.fractions(self.shared_fraction, "shared_fraction", empty=True)
        for name, sizes in self.size_profiles.items():
            why = f"needs num_experts={self.num_experts} positive numbers, got {sizes}"
            check.require(len(list(sizes)) == self.num_experts, f"size_profiles.{name}", why)
            check.positives(list(set(sizes)), f"size_profiles.{name}")
        for i, variant in enumerate(self.balancing):
            ok = isinstance(variant, dict) and bool(variant) and set(variant) <= set(BALANCING_FIELDS)
            check.require(ok, f"balancing[{i}]", f"must be a mapping of {list(BALANCING_FIELDS)}, got {variant!r}")
        check.positives(self.capacity_factor, "capacity_factor", empty=True)
        check.choices(self.match, "match", MATCH_MODES)


@dataclass
class DenseVsSparseSpec:
    """The kind's own fields of a dense-vs-sparse study file."""

    base: ModelConfig
    """Dense base model (moe must be null; seq_len comes from run.data.seq_len)."""
    budgets: list[BudgetSpec]
    """Active-parameter budgets, each a dense model derived from the base: ``{name: S, d_ff: 256}``."""
    grid: GridSpec = field(default_factory=GridSpec)
    """Main grid run at every budget."""
    ablations: AblationSpec | None = None
    """Ablations at one budget; null = none."""
    margin: float | None = None
    """Largest val-loss difference that counts as no effect (the TOST margin), stated before it runs; null: none."""

    def __post_init__(self) -> None:
        why = "the base model must be dense (moe: null); experts come from the grid"
        check.require(self.base.moe is None, "base.moe", why)
        check.distinct([b.name for b in self.budgets], "budgets", what="budget names")
        for budget in self.budgets:
            self.dense_model(budget.name)  # validates every budget's model now
        if self.ablations is not None:
            check.choice(self.ablations.budget, "ablations.budget", [b.name for b in self.budgets])
        check.number(self.margin, "margin", 0, optional=True)

    def dense_model(self, budget: str) -> ModelConfig:
        """The dense model of one budget (the base with its overrides)."""
        with check.errors_under(f"budgets[{budget}]: "):
            return self.base.replace(**next(b for b in self.budgets if b.name == budget).overrides)


DEFAULT_RUN = {"train": {"max_tokens": 2_000_000}}
_parse = check.parser(DenseVsSparseSpec, ("base", "budgets"))


def parse(fields: dict[str, Any], header) -> DenseVsSparseSpec:
    if isinstance(fields.get("base"), dict) and "seq_len" in fields["base"]:
        raise ConfigError("base.seq_len: set the sequence length in run.data.seq_len")
    budgets = []
    for i, entry in enumerate(fields.get("budgets") or []):
        if not isinstance(entry, dict) or "name" not in entry:
            raise ConfigError(f"budgets[{i}]: must be a mapping with a 'name' and model fields, got {entry!r}")
        budgets.append(BudgetSpec(entry["name"], {k: v for k, v in entry.items() if k != "name"}))
    return _parse(fields | ({"budgets": budgets} if budgets else {}), header)


class _Run(NamedTuple):
    """A point before hashing: its group, label in the group, and the model."""

    group: str
    budget: str
    name: str
    label: str
    model: ModelConfig
    match: str = "active"


def _info(run: _Run) -> dict[str, Any]:
    moe, out = run.model.moe, {"budget": run.budget, "groups": {run.group: run.label}, "match": run.match}
    shared, mixed = (moe.shared_expert_size, not moe.uniform) if moe else (0, False)
    out |= {"shared_expert_size": shared, "heterogeneous": mixed, "balancing": moe.balancing if moe else ""}
    return out | {"capacity_factor": moe.capacity_factor if moe else None}


def expand(spec: DenseVsSparseSpec, header) -> list[Point]:
    """Every run of the study, in a stable order (grid first), deduplicated by identity."""
    runs = _grid_runs(spec) + (_ablation_runs(spec, spec.ablations) if spec.ablations else [])
    points: dict[str, Point] = {}
    for seed, run in ((seed, run) for seed in header.seeds for run in runs):
        point = header.point(f"{run.budget}/{run.name}", seed, run.model, header.seeded_run(seed), _info(run))
        if (known := points.setdefault(finalize([point])[0].hash, point)) is not point:
            known.info["groups"].setdefault(run.group, run.label)
    return list(points.values())


def _moe_name(num_experts: int, top_k: int) -> str:
    return f"E{num_experts}k{top_k}"


def _balancing_label(variant: dict[str, Any], defaults: dict[str, Any]) -> str:
    settings = {**{k: defaults.get(k, getattr(MoEConfig, k)) for k in BALANCING_FIELDS}, **variant}
    kind = settings["balancing"]
    if kind in ("aux_loss", "bias"):
        return f"{kind}={settings['aux_loss_coef' if kind == 'aux_loss' else 'bias_update_rate']:g}"
    return str(kind)


def _grid_runs(spec: DenseVsSparseSpec) -> list[_Run]:
    """Every budget x num_experts x top_k x match, the dense model included."""
    runs, experts, moe = [], [e for e in spec.grid.num_experts if e != DENSE], spec.grid.moe
    for budget, dense in ((b.name, spec.dense_model(b.name)) for b in spec.budgets):
        runs += [_Run("grid", budget, DENSE, DENSE, dense)] if DENSE in spec.grid.num_experts else []
        for match, e, k in ((m, e, k) for m in spec.grid.match for e in experts for k in spec.grid.top_k if k < e):
            name = _moe_name(e, k) + ("" if match == "active" else f"/{match}")
            runs.append(_Run("grid", budget, name, name, matched_moe_config(dense, e, k, match, **moe), match))
    return runs


def _ablation_runs(spec: DenseVsSparseSpec, abl: AblationSpec) -> list[_Run]:
    """Granularity at every grid num_experts, then one-axis changes of the reference MoE point."""
    dense, moe, experts = spec.dense_model(abl.budget), spec.grid.moe, [e for e in spec.grid.num_experts if e != DENSE]

    def build(e: int = abl.num_experts, k: int = abl.top_k, match: str = "active", **changes: Any) -> ModelConfig:
        return matched_moe_config(dense, e, k, match, **{**moe, **changes})

    sweep = [(e, k) for k in abl.granularity for e in experts if k < e]
    runs = [_Run("granularity", abl.budget, _moe_name(e, k), f"k={k}", build(e, k)) for e, k in sweep]
    ref, reference = _moe_name(abl.num_experts, abl.top_k), build()
    axes = {  # group -> (the reference's label in the group, [(name suffix, label, changes)])
        "shared": ("none", [(f"shared={f:g}", f"{f:g}", {"shared_fraction": f}) for f in abl.shared_fraction]),
        "heterogeneous": ("equal", [(f"profile={n}", n, {"size_profile": v}) for n, v in abl.size_profiles.items()]),
        "balancing": (_balancing_label({}, moe), [(_balancing_label(v, moe),) * 2 + (v,) for v in abl.balancing]),
        "capacity": ("dropless", [(f"cf={c:g}",) * 2 + ({"capacity_factor": c},) for c in abl.capacity_factor]),
        "matching": ("active-matched", [(m, f"{m}-matched", {"match": m}) for m in abl.match]),
    }
    for group, (reference_label, variants) in ((g, v) for g, v in axes.items() if v[1]):
        runs.append(_Run(group, abl.budget, ref, reference_label, reference))
        runs += [_Run(group, abl.budget, DENSE, DENSE, dense)] if group == "matching" else []
        for suffix, label, changes in variants:
            match = changes.get("match", "active")
            runs.append(_Run(group, abl.budget, f"{ref}/{suffix}", label, build(**changes), match))
    return runs


def _short(n: float) -> str:
    scale = next(((unit, s) for unit, s in (("M", 1e6), ("k", 1e3)) if abs(n) >= s), ("", 1.0))
    return f"{n / scale[1]:.3g}{scale[0]}"


def summary_rows(rows: list[Row]) -> list[Row]:
    """The markdown table: one row per configuration."""
    langs, nan = sorted({k for r in rows for k in r if k.startswith(LANG_PREFIX)}), float("nan")
    out = []
    for r in rows:
        item = {"point": r["config_name"], "groups": r["groups"], "E": r["num_experts"], "k": r["top_k"]}
        item |= {"expert F": round(r["expert_size"], 1), "total": _short(r["total_params"])}
        item |= {"active": _short(r["active_params"]), "active non-emb": _short(r["active_non_embedding"])}
        item |= {"fwd FLOPs/tok": _short(r["flops_per_token"]), "tokens": _short(r.get("tokens", nan))}
        item["val loss"] = r[LOSS] if r["seeds"] == 1 else f"{r[LOSS]:.4f} ± {r['loss_std']:.4f}"
        item |= {lang.removeprefix(LANG_PREFIX): r.get(lang, nan) for lang in langs}
        item |= {"tok/s": round(r.get("tokens_per_s", nan)), "imbalance": r.get("load_imbalance", nan)}
        out.append(item | {"dropped": r.get("dropped_fraction", nan)})
    return out


# ----------------------------------------------------------------------------- the seed's claims
def total_params_lines(rows: list[Row]) -> dict[tuple[str, int], list[Row]]:
    """(budget, top_k) -> active-matched grid points by total params, each line starting with the dense model."""
    grid = [r for r in rows if r["match"] == "active" and "grid" in r["_groups"]]
    dense = {r["budget"]: r for r in grid if r["num_experts"] == 1}
    lines = grouped(grid, lambda r: (r["budget"], r["top_k"]) if r["num_experts"] > 1 else None)
    by_total = {k: sorted(v, key=itemgetter("total_params")) for k, v in lines.items()}
    return {k: ([dense[k[0]]] if k[0] in dense else []) + v for k, v in by_total.items()}


def expert_size_lines(rows: list[Row]) -> dict[str, dict[int, list[Row]]]:
    """budget -> num_experts -> reference points by expert size, for the budgets where some E ran at
    two or more top-k (elsewhere expert sizes differ only by the matching's rounding)."""
    refs = [r for r in rows if r["match"] == "active" and set(r["_groups"]) & set(REFERENCE_GROUPS)]
    refs = [r for r in refs if r["num_experts"] > 1]
    out = {b: grouped(rs, itemgetter("num_experts")) for b, rs in grouped(refs, itemgetter("budget")).items()}
    sweeps = {b: by_e for b, by_e in out.items() if any(len(v) > 1 for v in by_e.values())}
    by_size = itemgetter("expert_size")
    return {b: {e: sorted(v, key=by_size) for e, v in sorted(by_e.items())} for b, by_e in sweeps.items()}


def ablation_bars(rows: list[Row]) -> dict[str, list[tuple[str, Row]]]:
    """group -> [(label, row)] for every ablation group present."""
    bars = {g: [(r["_groups"][g], r) for r in rows if g in r["_groups"]] for g in AXES}
    return {group: members for group, members in bars.items() if members}


def _losses(r: Row) -> dict[int, float]:
    return dict(zip(r["_seeds"], r["_losses"], strict=True))


def _name(r: Row) -> str:
    return "dense" if r["num_experts"] == 1 else f"E{r['num_experts']}"


def _compared(group: str, members: list[tuple[str, Row]], rows: list[Row], ablation: dict[str, Any]):
    """(label, member, its reference) of an ablation group: the reference MoE point (granularity:
    the same E at the reference top-k); members that are their own reference left out."""
    by_name, out = {r["config_name"]: r for r in rows}, []
    for label, r in members:
        experts = r["num_experts"] if group == "granularity" else ablation["num_experts"]
        ref = by_name.get(f"{ablation['budget']}/{_moe_name(experts, ablation['top_k'])}")
        out += [(label, r, ref)] if ref not in (None, r) else []
    return out


def claims(rows: list[Row], ablation: dict[str, Any] | None = None, margin: float | None = None) -> list:
    """The seed's claims tested on the configurations' losses (paired by seed)."""
    tests = []  # (claim, direction, margin, a, b)
    for (budget, top_k), pts in total_params_lines(rows).items():
        moes, where = [r for r in pts if r["num_experts"] > 1], f"{budget}, top-{top_k}: at fixed active params"
        pairs = [(moes[-1], pts[0], "dense")] if moes and pts[0]["num_experts"] == 1 else []
        for a, b, what in pairs + ([(moes[-1], moes[0], "the smallest MoE")] if len(moes) > 1 else []):
            tests.append((f"{where} the most total params beat {what}", LOWER, None, a, b))
    granularity = [
        claim for budget, by_e in expert_size_lines(rows).items() for claim in _size_effects(budget, by_e, margin)
    ]
    for group, members in ablation_bars(rows).items() if ablation else ():
        for label, r, ref in _compared(group, members, rows, ablation):
            if group in SMALL:
                tests.append((f"{group}: {label} matters little", EQUIVALENT, margin, r, ref))
            elif group == "capacity":
                tests.append((f"dropless beats token dropping ({label})", LOWER, None, ref, r))
    return [
        Claim(text, "val loss", (a["config_name"], b["config_name"]), direction, m).on(_losses(a), _losses(b))
        for text, direction, m, a, b in tests
    ] + granularity


def _size_effects(budget: str, by_e: dict[int, list[Row]], margin: float | None) -> list:
    """ "The best expert size does not move with E" as a paired interaction: per seed, the loss at
    the smallest minus the largest top-k both E ran (a smaller minus a larger expert size) is the
    same at each E as at the smallest E, within the margin."""
    by_k = {e: {r["top_k"]: r for r in pts} for e, pts in by_e.items()}
    first, *others = by_k
    claims = []
    for e in others:
        if len(shared := sorted(set(by_k[first]) & set(by_k[e]))) < 2:
            continue
        lo, hi = shared[0], shared[-1]
        text = f"{budget}: E{e}'s top-{lo} vs top-{hi} effect is E{first}'s (the best expert size does not move with E)"
        names = (f"(E{e}: k{lo} - k{hi})", f"(E{first}: k{lo} - k{hi})")
        effect = {x: minus(_losses(by_k[x][lo]), _losses(by_k[x][hi])) for x in (e, first)}
        claims.append(Claim(text, "val loss", names, EQUIVALENT, margin).on(effect[e], effect[first]))
    return claims


def findings(rows: list[Row]) -> list[str]:
    """What the runs show beside the claims: each line's losses, the best expert size per E, the ablations."""
    lines = []
    for (budget, top_k), pts in total_params_lines(rows).items():
        path = " → ".join(f"{_name(r)} {r[LOSS]:.4f}" for r in pts)
        where = f"{budget}, top-{top_k}, active {_short(pts[0]['active_params'])}"
        lines.append(f"- **Loss vs total params at fixed active** ({where}): {path}.")
    for budget, by_e in expert_size_lines(rows).items():
        best = ((e, min(pts, key=itemgetter(LOSS))) for e, pts in by_e.items() if len(pts) > 1)  # E -> its best size
        detail = ", ".join(f"E{e}: F={r['expert_size']:.0f} (k={r['top_k']}, {r[LOSS]:.4f})" for e, r in best)
        lines.append(f"- **Best expert size at fixed active** ({budget}): {detail}.")
    for group, members in ((g, m) for g, m in ablation_bars(rows).items() if g != "granularity" and len(m) > 1):
        lines.append(f"- **{group}**: " + ", ".join(f"{label} {r[LOSS]:.4f}" for label, r in members) + ".")
    return lines


def analyse(plan: dict[str, Any], records: list[dict[str, Any]], plots_dir: Path) -> Analysis:
    rows, spec = aggregate(records), plan["spec"]
    written = write_plots(rows, plots_dir, spec.get("ablations"))
    tested = claims(rows, spec.get("ablations"), spec.get("margin"))
    return Analysis(claims=tested, findings=findings(rows), tables={"Runs": summary_rows(rows)}, plots=written)


# ----------------------------------------------------------------------------- plots
def _line(points: list[Row], x: str) -> tuple[list[float], list]:
    return [r[x] for r in points], [summarize(r["_losses"]) for r in points]


def total_params_figure(rows: list[Row]):
    """Val loss vs total params (log x), one line per budget and top-k, ± seed std; None without lines."""
    if not (lines := total_params_lines(rows)):
        return None
    fig, (ax,) = plots.panels(1, 6.4, 4.2)
    series = {f"{b}: active {_short(v[-1]['active_params'])}, top-{k}": v for (b, k), v in lines.items()}
    data = {label: _line(v, "total_params") for label, v in series.items()}
    plots.lines(ax, data, "total parameters", "final validation loss", "Val loss vs total params at fixed active")
    for i, pts in enumerate(series.values()):  # NOTE: alternate lines label above / below: equal sizes do not overprint
        for r in pts:
            xy, offset = (r["total_params"], r[LOSS]), (3, 4) if i % 2 == 0 else (3, -10)
            ax.annotate(_name(r), xy, textcoords="offset points", xytext=offset, fontsize=7)
    ax.set_xscale("log")
    return fig


def expert_size_figure(rows: list[Row]):
    """Val loss vs mean expert size at fixed active, one panel per budget with a granularity sweep,
    one line per E, x ticks naming top-k; None without such a budget."""
    if not (panels := expert_size_lines(rows)):
        return None
    fig, axes = plots.panels(len(panels), 5.2, 4.2)
    for ax, (budget, by_e) in zip(axes, panels.items(), strict=True):
        data = {f"E={e} (top-k {', '.join(str(r['top_k']) for r in v)})": v for e, v in by_e.items()}
        title = f"{budget}: val loss vs expert size at {_short(next(iter(by_e.values()))[0]['active_params'])} active"
        lines = {label: _line(v, "expert_size") for label, v in data.items()}
        plots.lines(ax, lines, "mean expert size F (top-k)", "final validation loss", title)
        ax.set_xscale("log", base=2)
        by_k: dict[int, list[float]] = defaultdict(list)
        for r in (r for v in by_e.values() for r in v):
            by_k[r["top_k"]].append(r["expert_size"])
        sizes = sorted(((sum(v) / len(v), k) for k, v in by_k.items()))
        ax.set_xticks([size for size, _ in sizes], [f"{size:.0f}\ntop-{k}" for size, k in sizes])
        ax.minorticks_off()
    return fig


def ablation_figure(group: str, members: list[tuple[str, Row]], rows: list[Row], ablation: dict[str, Any], effect=None):
    """Each member's val loss minus its reference's (paired by seed; the reference is the zero line,
    its seed std the grey band), labelled with active / total params; ``effect`` (dense minus the
    best grid MoE) is drawn as a scale. None without a reference."""
    if not (points := _compared(group, members, rows, ablation)):
        return None
    stats = [summarize(list(minus(_losses(r), _losses(ref)).values())) for _, r, ref in points]
    noises = [s.std for s in (summarize(ref["_losses"]) for _, _, ref in points) if s.n > 1]
    labels = []
    for lb, r, _ in points:
        name = f"{lb} E{r['num_experts']}" if group == "granularity" else lb
        labels.append(f"{name}\n{_short(r['active_params'])} act / {_short(r['total_params'])} tot")
    fig, (ax,) = plots.panels(1, 1.1 * len(points) + 2.0, 4.2)
    scale = (-effect, f"scale: best grid MoE minus dense, {-effect:+.4f}") if effect else None
    plots.differences(ax, labels, stats, sum(noises) / len(noises) if noises else None, scale)
    ref, versus = points[0][2], f"the same E at top-{ablation['top_k']}"
    versus = versus if group == "granularity" else f"{ref['_groups'][group]} ({ref['config_name']}: {ref[LOSS]:.4f})"
    ax.set_xlabel(AXES[group], fontsize=9)
    ax.set_ylabel(f"val loss minus {versus}\n(< 0: better than the reference)", fontsize=9)
    dense = f"the {ref['budget']} dense model ({_short(ref['active_params'])} active params)"
    matched = f"every point active-matched to {dense}"
    if group == "matching":
        matched = "active-matched: the dense model's active params;\ntotal-matched: its total params (so fewer active)"
    ax.set_title(f"ablation: {group} ({ref['budget']}); {spread_note(s.n for s in stats)}\n{matched}", fontsize=8)
    return fig


def write_plots(rows: list[Row], plots_dir: Path, ablation: dict[str, Any] | None = None) -> list[Path]:
    """The kind's PNGs under ``plots_dir``; ``ablation`` is the spec's ablations (the references)."""
    figures = {"loss_vs_total_params": total_params_figure(rows), "loss_vs_expert_size": expert_size_figure(rows)}
    if ablation:
        here = [v for (b, _), v in total_params_lines(rows).items() if b == ablation["budget"]]
        line = next((v for v in here if v[0]["num_experts"] == 1), None)
        effect = line[0][LOSS] - min(r[LOSS] for r in line) if line else None
        for group, members in ablation_bars(rows).items():
            figures[f"ablation_{group}"] = ablation_figure(group, members, rows, ablation, effect)
    return [plots.save(fig, plots_dir, name) for name, fig in figures.items() if fig is not None]


__all__ = ["DenseVsSparseSpec", "ablation_bars", "ablation_figure", "analyse", "claims", "expand", "findings", "parse"]
