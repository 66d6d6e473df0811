"""Study kind ``dense_vs_sparse``: dense and MoE models matched on active (or total) parameters.

Budgets x the grid (num_experts x top_k x matching mode, dense included), and one-axis ablations at one budget,
every MoE by :func:`moe_lit.accounting.matched_moe_config`. Claims, paired by seed: at fixed active params the most
total params beat dense and the smallest MoE; the best expert size does not move with E; shared experts,
heterogeneous sizes and balancing matter little (TOST within ``margin``); dropless beats token dropping, tested on
each capacity-limited point's final weights validated dropless (a 0-step child), so that only training dropped tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import product
from operator import itemgetter
from pathlib import Path
from typing import Any

from moe_lit.accounting import matched_moe_config
from moe_lit.config import ConfigError, ModelConfig, MoEConfig
from moe_lit.convert.common import dropless
from moe_lit.stats import summarize
from moe_lit.studies import plots
from moe_lit.studies import spec as check
from moe_lit.studies.identity import Call, Point, Start, finalize
from moe_lit.studies.kinds import Analysis
from moe_lit.studies.records import group as grouped
from moe_lit.studies.records import minus
from moe_lit.studies.report import LANG_PREFIX, LOSS, aggregate
from moe_lit.studies.verdicts import EQUIVALENT, LOWER, SCRATCH, Claim, Evidence, Subject, about

DROPLESS_VALIDATION = "dropless-val"
"""Name suffix (and record ``validation`` field) of the 0-step child validating a capacity-limited point dropless."""
DROPPING_AT_VALIDATION = (
    "the capacity-limited arm is validated with its capacity factor too (model/moe.py drops tokens outside "
    "training), so its val loss mixes dropping in training with dropping at evaluation, and its dropless "
    f"validation ({DROPLESS_VALIDATION}) has not finished"
)
ABLATIONS = ("shared", "heterogeneous", "balancing", "capacity", "matching")
"""The ablations compared with the reference MoE point, in report order (granularity: the expert-size claims)."""
DENSE, MATCH_MODES, SMALL = "dense", ("active", "total"), ("shared", "heterogeneous", "balancing")
BALANCING_FIELDS = ("balancing", "aux_loss_coef", "bias_update_rate")
Row = dict[str, Any]
Run = tuple[str, ModelConfig, dict[str, Any]]


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
        each, must = (lambda e: e == DENSE or check.is_int(e) and e >= 2), "'dense' or an integer >= 2"
        check.distinct(self.num_experts, "num_experts", each=each, what="experts", must=must)
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
    """Extra top_k values run for every grid num_experts > top_k (the expert-size claims)."""
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
        check.require(self.base.moe is None, "base.moe", "must be dense (moe: null); experts come from the grid")
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
PAPER, HERE = (
    Subject(SCRATCH, "the papers' MoE and dense LMs trained from scratch at their scale"),
    "scale and budget in the description above",
)
"""What the paper tested its claims on, and the study's scale (its object: :func:`analyse`)."""
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


def _run(group: str, budget: str, name: str, label: str, model: ModelConfig, match: str = "active") -> Run:
    """(config name, model, info) of a run; info: its budget, its label in its group, the matching, the MoE settings."""
    moe, info = model.moe, {"budget": budget, "groups": {group: label}, "match": match}
    shared, mixed = (moe.shared_expert_size, not moe.uniform) if moe else (0, False)
    info |= {"shared_expert_size": shared, "heterogeneous": mixed, "balancing": moe.balancing if moe else ""}
    return f"{budget}/{name}", model, info | {"capacity_factor": moe.capacity_factor if moe else None}


def expand(spec: DenseVsSparseSpec, header) -> list[Point]:
    """Every run of the study, in a stable order (grid first), deduplicated by identity (their groups merged)."""
    points: dict[str, Point] = {}
    for seed, (name, model, info) in product(header.seeds, _runs(spec)):
        point = header.point(name, seed, model, header.seeded_run(seed), {**info, "groups": dict(info["groups"])})
        if (known := points.setdefault(finalize([point])[0].hash, point)) is not point:
            known.info["groups"] |= {g: label for g, label in info["groups"].items() if g not in known.info["groups"]}
    return [*points.values(), *(_dropless_validation(p) for p in points.values() if _drops_tokens(p))]


def _drops_tokens(point: Point) -> bool:
    return point.model.moe is not None and point.model.moe.capacity_factor is not None


def _dropless_validation(parent: Point) -> Point:
    """A 0-step child validating ``parent``'s final weights dropless; its info is the parent's (the capacity
    factor it trained with) in no group, with ``validation: dropless``."""
    config_name = f"{parent.config_name}/{DROPLESS_VALIDATION}"
    return Point(
        parent.name.replace(parent.config_name, config_name, 1),
        config_name,
        parent.seed,
        parent.model.replace(moe={"capacity_factor": None}),
        parent.run.replace(train={"max_steps": 0}),
        info={**parent.info, "groups": {}, "validation": "dropless"},
        start=Start(parent=parent.name, mode="init"),
        transform=Call.of(dropless),
    )


def _moe_name(num_experts: int, top_k: int) -> str:
    return f"E{num_experts}k{top_k}"


def _balancing_label(variant: dict[str, Any], defaults: dict[str, Any]) -> str:
    settings = {**{k: defaults.get(k, getattr(MoEConfig, k)) for k in BALANCING_FIELDS}, **variant}
    strength = {"aux_loss": "aux_loss_coef", "bias": "bias_update_rate"}.get(kind := settings["balancing"])
    return f"{kind}={settings[strength]:g}" if strength else str(kind)


def _runs(spec: DenseVsSparseSpec) -> list[Run]:
    """Every budget x num_experts x top_k x match (the dense model included), then the ablations: granularity
    at every grid num_experts and one-axis changes of the reference MoE point."""
    runs, experts, moe = [], [e for e in spec.grid.num_experts if e != DENSE], spec.grid.moe
    for budget, dense in ((b.name, spec.dense_model(b.name)) for b in spec.budgets):
        runs += [_run("grid", budget, DENSE, DENSE, dense)] if DENSE in spec.grid.num_experts else []
        for match, e, k in ((m, e, k) for m in spec.grid.match for e in experts for k in spec.grid.top_k if k < e):
            name = _moe_name(e, k) + ("" if match == "active" else f"/{match}")
            runs.append(_run("grid", budget, name, name, matched_moe_config(dense, e, k, match, **moe), match))
    if (abl := spec.ablations) is None:
        return runs
    dense = spec.dense_model(abl.budget)

    def variant(group: str, name: str, label: str, e=abl.num_experts, k=abl.top_k, match="active", **changes) -> Run:
        return _run(group, abl.budget, name, label, matched_moe_config(dense, e, k, match, **{**moe, **changes}), match)

    runs += [variant("granularity", _moe_name(e, k), f"k={k}", e, k) for k in abl.granularity for e in experts if k < e]
    ref = _moe_name(abl.num_experts, abl.top_k)
    axes = {  # group -> (the reference's label in the group, [(name suffix, label, changes)])
        "shared": ("none", [(f"shared={f:g}", f"{f:g}", {"shared_fraction": f}) for f in abl.shared_fraction]),
        "heterogeneous": ("equal", [(f"profile={n}", n, {"size_profile": v}) for n, v in abl.size_profiles.items()]),
        "balancing": (_balancing_label({}, moe), [(_balancing_label(v, moe),) * 2 + (v,) for v in abl.balancing]),
        "capacity": ("dropless", [(f"cf={c:g}",) * 2 + ({"capacity_factor": c},) for c in abl.capacity_factor]),
        "matching": ("active-matched", [(m, f"{m}-matched", {"match": m}) for m in abl.match]),
    }
    for group, (reference_label, variants) in ((g, v) for g, v in axes.items() if v[1]):
        runs.append(variant(group, ref, reference_label))
        runs += [_run(group, abl.budget, DENSE, DENSE, dense)] if group == "matching" else []
        runs += [variant(group, f"{ref}/{suffix}", label, **changes) for suffix, label, changes in variants]
    return runs


def _short(n: float) -> str:
    scale = next(((unit, s) for unit, s in (("M", 1e6), ("k", 1e3)) if abs(n) >= s), ("", 1.0))
    return f"{n / scale[1]:.3g}{scale[0]}"


def _loss_cell(r: Row) -> float | str:
    return r[LOSS] if r["seeds"] == 1 else f"{r[LOSS]:.4f} ± {r['loss_std']:.4f}"


def dropless_validations(rows: list[Row]) -> dict[str, Row]:
    """Capacity-limited configuration -> its weights validated dropless (the 0-step children's row)."""
    suffix = f"/{DROPLESS_VALIDATION}"
    return {r["config_name"].removesuffix(suffix): r for r in rows if r.get("validation") == "dropless"}


def summary_rows(rows: list[Row]) -> list[Row]:
    """The markdown table: one row per trained configuration; where some were capacity-limited, a column of
    their losses validated dropless (``val loss`` is validated as trained)."""
    langs, nan = sorted({k for r in rows for k in r if k.startswith(LANG_PREFIX)}), float("nan")
    validated, out = dropless_validations(rows), []
    for r in (r for r in rows if r.get("validation") != "dropless"):
        item = {"point": r["config_name"], "groups": r["groups"], "E": r["num_experts"], "k": r["top_k"]}
        item |= {"expert F": round(r["expert_size"], 1), "total": _short(r["total_params"])}
        item |= {"active": _short(r["active_params"]), "active non-emb": _short(r["active_non_embedding"])}
        item |= {"fwd FLOPs/tok": _short(r["flops_per_token"]), "tokens": _short(r.get("tokens", nan))}
        item["val loss"] = _loss_cell(r)
        if validated:  # NOTE: a study without capacity-limited points has no such column
            child = validated.get(r["config_name"])
            item["val loss, dropless"] = _loss_cell(child) if child else ""
        item |= {lang.removeprefix(LANG_PREFIX): r.get(lang, nan) for lang in langs}
        item |= {"tok/s": round(r.get("tokens_per_s", nan)), "imbalance": r.get("load_imbalance", nan)}
        out.append(item | {"dropped": r.get("dropped_fraction", nan)})
    return out


# ----------------------------------------------------------------------------- the seed's claims
def total_params_lines(rows: list[Row]) -> dict[tuple[str, int], list[Row]]:
    """(budget, top_k) -> active-matched grid points by total params, each line starting with the dense model."""
    grid = [r for r in rows if r["match"] == "active" and "grid" in r["_groups"]]
    dense = {r["budget"]: [r] for r in grid if r["num_experts"] == 1}
    lines = grouped(grid, lambda r: (r["budget"], r["top_k"]) if r["num_experts"] > 1 else None)
    return {k: dense.get(k[0], []) + sorted(v, key=itemgetter("total_params")) for k, v in lines.items()}


def expert_size_sweeps(rows: list[Row]) -> dict[str, dict[int, dict[int, Row]]]:
    """budget -> num_experts (ascending) -> top_k -> its point, for the budgets where some E ran at two or
    more top-k (elsewhere expert sizes differ only by the matching's rounding)."""
    out: dict[str, dict[int, dict[int, Row]]] = {}
    for r in (r for r in rows if r["match"] == "active" and r["num_experts"] > 1):
        if {"grid", "granularity"} & set(r["_groups"]):  # NOTE: the points with the reference MoE settings only
            out.setdefault(r["budget"], {}).setdefault(r["num_experts"], {})[r["top_k"]] = r
    return {b: dict(sorted(by_e.items())) for b, by_e in out.items() if any(len(v) > 1 for v in by_e.values())}


def ablation_groups(rows: list[Row]) -> dict[str, list[tuple[str, Row]]]:
    """group -> [(label, row)] for every ablation group present (the reference MoE point in each)."""
    return {g: m for g in ABLATIONS if (m := [(r["_groups"][g], r) for r in rows if g in r["_groups"]])}


def _losses(r: Row) -> dict[int, float]:
    return dict(zip(r["_seeds"], r["_losses"], strict=True))


def _name(r: Row) -> str:
    return "dense" if r["num_experts"] == 1 else f"E{r['num_experts']}"


def claims(rows: list[Row], ablation: dict[str, Any] | None = None, margin: float | None = None) -> list:
    """The seed's claims tested on the configurations' losses (paired by seed)."""
    tests = []  # (claim, direction, margin, a, b)
    for (budget, top_k), pts in total_params_lines(rows).items():
        moes, where = [r for r in pts if r["num_experts"] > 1], f"{budget}, top-{top_k}: at fixed active params"
        pairs = [(moes[-1], pts[0], "dense")] if moes and pts[0]["num_experts"] == 1 else []
        for a, b, what in pairs + ([(moes[-1], moes[0], "the smallest MoE")] if len(moes) > 1 else []):
            tests.append((f"{where} the most total params beat {what}", LOWER, None, a, b))
    granularity = [c for budget, by_e in expert_size_sweeps(rows).items() for c in _size_effects(budget, by_e, margin)]
    name = f"{ablation['budget']}/{_moe_name(ablation['num_experts'], ablation['top_k'])}" if ablation else None
    ref = next((r for r in rows if r["config_name"] == name), None)  # the reference MoE point of the ablations
    validated, dropping = dropless_validations(rows), []
    for group, members in ablation_groups(rows).items() if ref else ():
        for label, r in (m for m in members if m[1] is not ref):
            if group in SMALL:
                tests.append((f"{group}: {label} matters little", EQUIVALENT, margin, r, ref))
            elif group == "capacity":
                # NOTE: on the weights validated dropless, so that the arms differ only in training.
                dropping += [] if r["config_name"] in validated else [r["config_name"]]
                r = validated.get(r["config_name"], r)
                tests.append((f"dropless beats token dropping ({label})", LOWER, None, ref, r))
    made = [
        Claim(text, "val loss", (a["config_name"], b["config_name"]), direction, m).on(_losses(a), _losses(b))
        for text, direction, m, a, b in tests
    ]
    return [e.untestable(DROPPING_AT_VALIDATION) if e.claim.arms[1] in dropping else e for e in made] + granularity


def _size_effects(budget: str, by_k: dict[int, dict[int, Row]], margin: float | None) -> Iterator[Evidence]:
    """ "The best expert size does not move with E" as a paired interaction: per seed, the loss at
    the smallest minus the largest top-k both E ran (a smaller minus a larger expert size) is the
    same at each E as at the smallest E, within the margin."""
    first, *others = by_k
    for e in (e for e in others if len(set(by_k[first]) & set(by_k[e])) > 1):
        lo, *_, hi = sorted(set(by_k[first]) & set(by_k[e]))  # the smallest and the largest top-k both ran
        text = f"{budget}: E{e}'s top-{lo} vs top-{hi} effect is E{first}'s (the best expert size does not move with E)"
        names = (f"(E{e}: k{lo} - k{hi})", f"(E{first}: k{lo} - k{hi})")
        effect = {x: minus(_losses(by_k[x][lo]), _losses(by_k[x][hi])) for x in (e, first)}
        yield Claim(text, "val loss", names, EQUIVALENT, margin).on(effect[e], effect[first])


def findings(rows: list[Row]) -> list[str]:
    """What the runs show beside the claims: each line's losses, the best expert size per E, the ablations."""
    lines = []
    for (budget, top_k), pts in total_params_lines(rows).items():
        path = " → ".join(f"{_name(r)} {r[LOSS]:.4f}" for r in pts)
        where = f"{budget}, top-{top_k}, active {_short(pts[0]['active_params'])}"
        lines.append(f"- **Loss vs total params at fixed active** ({where}): {path}.")
    for budget, by_e in expert_size_sweeps(rows).items():
        best = ((e, min(pts.values(), key=itemgetter(LOSS))) for e, pts in by_e.items() if len(pts) > 1)
        detail = ", ".join(f"E{e}: F={r['expert_size']:.0f} (k={r['top_k']}, {r[LOSS]:.4f})" for e, r in best)
        lines.append(f"- **Best expert size at fixed active** ({budget}): {detail}.")
    validated = dropless_validations(rows)
    for group, members in ((g, m) for g, m in ablation_groups(rows).items() if len(m) > 1):
        losses = (f"{label} {r[LOSS]:.4f}{_validated_dropless(validated, r)}" for label, r in members)
        lines.append(f"- **{group}**: " + ", ".join(losses) + ".")
    return lines


def _validated_dropless(validated: dict[str, Row], r: Row) -> str:
    child = validated.get(r["config_name"])
    return f" (validated dropless {child[LOSS]:.4f})" if child else ""


def analyse(plan: dict[str, Any], records: list[dict[str, Any]], plots_dir: Path) -> Analysis:
    rows, spec = aggregate(records), plan["spec"]
    figure = total_params_figure(rows)
    written = [plots.save(figure, plots_dir, "loss_vs_total_params")] if figure is not None else []
    tested = about(claims(rows, spec.get("ablations"), spec.get("margin")), PAPER, Subject(SCRATCH, HERE))
    return Analysis(claims=tested, findings=findings(rows), tables={"Runs": summary_rows(rows)}, plots=written)


def total_params_figure(rows: list[Row]):
    """Val loss vs total params (log x), one line per budget and top-k, ± seed std; None without lines."""
    if not (lines := total_params_lines(rows)):
        return None
    fig, (ax,) = plots.panels(1, 6.4, 4.2)
    series = {f"{b}: active {_short(v[-1]['active_params'])}, top-{k}": v for (b, k), v in lines.items()}
    data = {s: ([r["total_params"] for r in v], [summarize(r["_losses"]) for r in v]) for s, v in series.items()}
    plots.lines(ax, data, "total parameters", "final validation loss", "Val loss vs total params at fixed active")
    for i, pts in enumerate(series.values()):  # NOTE: alternate lines label above / below: equal sizes do not overprint
        for r in pts:
            xy, offset = (r["total_params"], r[LOSS]), (3, 4) if i % 2 == 0 else (3, -10)
            ax.annotate(_name(r), xy, textcoords="offset points", xytext=offset, fontsize=7)
    ax.set_xscale("log")
    return fig


__all__ = ["DenseVsSparseSpec", "analyse", "claims", "expand", "findings", "parse", "total_params_figure"]
