"""Study kind ``partition``: how much of a pretrained dense model survives its cut into an MoE?

Per seed a dense model pretrains; from its weights one child per conversion, each trained the same
``recovery`` budget: every ``methods`` entry (random | kmeans | coactivation with a centroid |
trained | random router; dot_moe learns its routers) at every ``settings`` entry (E, top-k)
(:func:`moe_lit.convert.recipes.partition_dense`), structured ``pruning`` to the same active FFN
width d_ff * k / E, and ``dense/recovered`` (the reference). Loss gap = converted - dense/recovered
val loss of the same seed; retention = (ln V - L) / (ln V - L_dense). Claims per setting, on the
gaps, paired by seed: DOT-MoE > clustering > random, DOT-MoE > pruning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_lit.config import ConfigError, ModelConfig
from moe_lit.convert.partition import ASSIGNMENTS, ROUTERS, partitioned_config
from moe_lit.convert.recipes import PRUNING
from moe_lit.plotting import seed_errorbar, spread_note, zero_line
from moe_lit.stats import summarize
from moe_lit.studies import plots
from moe_lit.studies import spec as check
from moe_lit.studies.identity import Call, Point
from moe_lit.studies.kinds import Analysis
from moe_lit.studies.measures import SuiteSpec, measure_child, partition_on_stream, start_validation
from moe_lit.studies.records import best, cells, collect, language_means, select
from moe_lit.studies.verdicts import CONVERTED_MOE, LOWER, Claim, Subject, about

DOT_MOE, DENSE = "dot_moe", "dense"
METHODS = (*ASSIGNMENTS, DOT_MOE)
COLOURS = {DOT_MOE: "tab:red", "clustering": "tab:blue", "random": "tab:grey", PRUNING: "tab:green"}
FAMILIES = (DOT_MOE, "clustering", "random")
ORDERINGS = (("DOT-MoE", DOT_MOE, "clustering"), ("clustering", "clustering", "random"), ("DOT-MoE", DOT_MOE, PRUNING))
"""(who is claimed better, its family, the family it beats)."""


@dataclass
class SettingSpec:
    """One target MoE: E experts of d_ff/E neurons, k active per token."""

    experts: int
    """E (must divide dense.d_ff)."""
    top_k: int
    """k; the active FFN width is d_ff * k / E."""

    @property
    def name(self) -> str:
        return f"E{self.experts}k{self.top_k}"

    @property
    def active_ffn(self) -> float:
        return self.top_k / self.experts


@dataclass
class MethodSpec:
    """One conversion: a neuron assignment and, for the heuristic ones, a router."""

    method: str
    """random | kmeans | coactivation | dot_moe."""
    router: str | None = None
    """centroid | trained | random for the heuristic methods (null: centroid); dot_moe learns its
    routers and takes none."""

    def __post_init__(self) -> None:
        check.choice(self.method, "method", METHODS)
        if self.method == DOT_MOE and self.router is not None:
            raise ConfigError("router: dot_moe learns its routers; leave router out")
        if self.method != DOT_MOE:
            self.router = self.router or "centroid"
            check.choice(self.router, "router", ROUTERS)

    @property
    def name(self) -> str:
        return self.method if self.method == DOT_MOE else f"{self.method}+{self.router}"

    @property
    def family(self) -> str:
        return self.method if self.method in (DOT_MOE, "random") else "clustering"


@dataclass
class ConversionSpec:
    """Token budgets and settings of the conversions (the options of ``moe-lit convert partition``)."""

    calibration_tokens: int = 16_384
    """Calibration tokens of coactivation, the trained router and the pruning ranking."""
    router_steps: int = 100
    """Full-batch Adam steps of a trained router."""
    train_tokens: int = 65_536
    """dot_moe: training tokens of the assignment and routers (dense model as teacher)."""
    lr: float = 1e-2
    """dot_moe: constant AdamW learning rate."""
    train_dense: bool = False
    """dot_moe: train every weight too, not only the affinities and routers."""
    batch_size: int = 16
    """Sequences per calibration / dot_moe training batch (seq_len: run.data.seq_len)."""

    def __post_init__(self) -> None:
        check.positive_fields(self, "calibration_tokens", "router_steps", "train_tokens", "batch_size")
        check.number(self.lr, "lr", 0)


@dataclass
class PartitionSpec:
    """The kind's own fields."""

    dense: ModelConfig
    """The dense model that pretrains and is converted (seq_len from run.data.seq_len)."""
    settings: list[SettingSpec]
    """Target MoEs (experts, top_k); default: E=8,k=4 and E=16,k=8 (50 % of the FFN active), E=8,k=2 (25 %)."""
    methods: list[MethodSpec]
    """Conversions run at every setting."""
    pruning: bool = True
    """Add the structured-pruning baseline at every active FFN width of the settings."""
    balancing: str = "aux_loss"
    """moe.balancing of the converted MoEs (aux_loss | bias | none)."""
    conversion: ConversionSpec = field(default_factory=ConversionSpec)
    """Token budgets of the conversions."""
    recovery: check.FineTune = field(default_factory=check.FineTune)
    """The same recovery run (steps, lr, warmup) for every child and the dense reference."""
    suite: SuiteSpec | None = None
    """Local-suite accuracy of every recovered model (dense reference included), each measured by
    a 0-step child point (``<config>/suite``); null: loss only."""

    def __post_init__(self) -> None:
        if self.dense.moe is not None:
            raise ConfigError("dense.moe: the dense model must be dense (moe: null)")
        for i, setting in enumerate(self.settings):
            with check.errors_under(f"settings[{i}]."):
                partitioned_config(self.dense, setting.experts, setting.top_k, balancing=self.balancing)
        check.distinct([s.name for s in self.settings], "settings", what="settings")
        check.distinct([m.name for m in self.methods], "methods", what="methods")


DEFAULT_RUN = {"data": {"seq_len": 64, "batch_size": 16, "val_batches": 4}, "train": {"max_steps": 1500}}
PAPER, HERE = (
    Subject(CONVERTED_MOE, "DOT-MoE / MoEfication: pretrained dense LMs cut into experts"),
    "scale and budget in the description above",
)
"""What the paper tested its claims on, and the study's scale (its object: :func:`analyse`)."""
parse = check.parser(PartitionSpec, ("dense", "settings", "methods"))


# ----------------------------------------------------------------------------- points
def conversion_kwargs(
    spec: PartitionSpec, method: str, router: str | None, setting: SettingSpec, data_dir: str, seed: int
) -> dict[str, Any]:
    """The transform's arguments: only those its method reads (a setting of another method changes
    no hash of this one)."""
    conv = spec.conversion
    kwargs: dict[str, Any] = {"method": method, "experts": setting.experts, "top_k": setting.top_k}
    kwargs |= {"data_dir": data_dir, "batch_size": conv.batch_size, "seed": seed}
    if method == PRUNING:
        return kwargs | {"calibration_tokens": conv.calibration_tokens}
    kwargs["balancing"] = spec.balancing
    if method == DOT_MOE:
        return kwargs | {"train_tokens": conv.train_tokens, "lr": conv.lr, "train_dense": conv.train_dense}
    kwargs["router"] = router
    if method == "coactivation" or router == "trained":
        kwargs["calibration_tokens"] = conv.calibration_tokens
    if router == "trained":
        kwargs["router_steps"] = conv.router_steps
    return kwargs


def _conversion_tokens(kwargs: dict[str, Any], seq_len: int) -> int:
    """Tokens read when whole batches are taken until the budget is covered."""
    tokens, batch = kwargs.get("train_tokens", kwargs.get("calibration_tokens", 0)), kwargs["batch_size"] * seq_len
    return math.ceil(tokens / batch) * batch if tokens else 0


def _arms(spec: PartitionSpec) -> list[tuple[str, str, str | None, str, SettingSpec | None]]:
    """(config name, method, router, family, setting): the dense reference, every method at every
    setting, and pruning once per distinct active FFN width (the first setting that has it)."""
    arms: list[tuple[str, str, str | None, str, SettingSpec | None]] = [("dense/recovered", DENSE, None, DENSE, None)]
    for setting in spec.settings:
        arms += [(f"{setting.name}/{m.name}", m.method, m.router, m.family, setting) for m in spec.methods]
    widths: dict[float, SettingSpec] = {}
    for setting in spec.settings:
        widths.setdefault(setting.active_ffn, setting)
    if spec.pruning:
        arms += [(f"pruning/ffn{s.active_ffn:g}", PRUNING, None, PRUNING, s) for s in widths.values()]
    return arms


def expand(spec: PartitionSpec, header) -> list[Point]:
    data_dir, seq_len, points = header.run.data.resolved_dir(), header.run.data.seq_len, []
    for seed in header.seeds:
        pretrain = header.seeded_run(seed)
        recovery, start = spec.recovery.run(pretrain), header.start("dense/pretrain", seed)
        info = {"phase": "pretrain", "method": DENSE, "family": DENSE}
        points.append(header.point("dense/pretrain", seed, spec.dense, pretrain, info))
        for config_name, method, router, family, setting in _arms(spec):
            active = setting.active_ffn if setting else 1.0
            info = {"phase": "recovered", "method": method, "router": router, "family": family}
            info |= {"setting": setting.name if family not in (DENSE, PRUNING) else None, "active_ffn": active}
            info["conversion_tokens"], model, transform = 0, spec.dense, None
            if method == PRUNING:
                model = spec.dense.replace(d_ff=spec.dense.d_ff * setting.top_k // setting.experts)
            elif method != DENSE:
                model = partitioned_config(spec.dense, setting.experts, setting.top_k, balancing=spec.balancing)
            if method != DENSE:
                kwargs = conversion_kwargs(spec, method, router, setting, data_dir, seed)
                transform = Call.of(partition_on_stream, **kwargs)
                info["conversion_tokens"] = _conversion_tokens(kwargs, seq_len)
            measure = Call.of(measure_converted) if transform else None
            points.append(header.point(config_name, seed, model, recovery, info, start, transform, measure=measure))
            if spec.suite is not None:
                points.append(measure_child(points[-1], spec.suite.measure()))
    return points


def measure_converted(point: Point, result: Any, run_dir: Path) -> dict[str, Any]:
    """Validation loss of the converted model before its recovery (:func:`.measures.start_validation`)."""
    return start_validation(point, run_dir)


# ----------------------------------------------------------------------------- analysis
def chance_retention(loss: float, dense_loss: float, vocab_size: int) -> float:
    """Share of the dense model's loss reduction below the uniform prediction (ln V) that is kept."""
    chance = math.log(vocab_size)
    return (chance - loss) / (chance - dense_loss)


def _per_config(plan: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """config_name -> seed -> its ``record`` and values (loss, gap, retention, gap_before, acc,
    acc_retention, per_language) against the same seed's dense/recovered and dense/pretrain records."""
    vocab = plan["spec"]["dense"]["vocab_size"]
    dense = {r["seed"]: r for r in select(records, method=DENSE, phase="recovered")}
    pretrain = {r["seed"]: r for r in select(records, phase="pretrain")}
    suite = {r["parent"]: r["suite"] for r in select(records, phase="suite") if "suite" in r}
    items = []
    for record in (r for r in select(records, phase="recovered") if r["seed"] in dense):
        seed, ref, loss = record["seed"], dense[record["seed"]], record["val_loss"]
        values = {"record": record, "loss": loss, "gap": loss - ref["val_loss"]}
        values |= {"retention": chance_retention(loss, ref["val_loss"], vocab)}
        before = record.get("val_loss_converted")
        if before is None and record["method"] == DENSE and seed in pretrain:
            before = pretrain[seed]["val_loss"]
        if before is not None and seed in pretrain:
            values["gap_before"] = before - pretrain[seed]["val_loss"]
        values["per_language"] = record.get("val_loss_per_language") or {}
        scores, ref_scores = suite.get(record["name"]), suite.get(ref["name"])
        if scores and ref_scores:
            values["acc"] = scores["mean_acc"]
            if ref_scores["mean_above_chance"] > 0:  # a reference at chance has nothing to retain
                values["acc_retention"] = scores["mean_above_chance"] / ref_scores["mean_above_chance"]
        items.append((record["config_name"], seed, values))
    return collect(items)


def _first(entry: dict[str, Any]) -> dict[str, Any]:
    return next(iter(entry["record"].values()))


def _method_label(r: dict[str, Any]) -> str:
    return r["method"] if r["method"] in (DENSE, PRUNING, DOT_MOE) else f"{r['method']} + {r['router']} router"


COLUMNS = {"val loss": "loss", "loss gap to dense": "gap", "retention": "retention"}
COLUMNS |= {"gap before recovery": "gap_before", "task acc": "acc", "task retention (above chance)": "acc_retention"}


def _main_row(name: str, entry: dict[str, Any]) -> dict[str, Any]:
    r = _first(entry)
    shape = f"{r['num_experts']} / {r['top_k']}" if r["num_experts"] > 1 else "dense"
    row = {"point": name, "method": _method_label(r), "experts / top-k": shape, "active FFN": f"{r['active_ffn']:.0%}"}
    row["active / total params"] = f"{r['active_params']:,} / {r['total_params']:,}"
    return row | {"conversion tokens": r.get("conversion_tokens", 0)} | cells(entry, COLUMNS)


def _ordering_claims(configs: dict[str, dict[str, Any]]) -> list:
    claims = []
    settings = dict.fromkeys(_first(e)["setting"] for e in configs.values() if _first(e).get("setting"))
    for setting in settings:
        here = {n: e for n, e in configs.items() if _first(e).get("setting") == setting}
        width = _first(next(iter(here.values())))["active_ffn"]
        best_of = {f: best({n: e["gap"] for n, e in here.items() if _first(e)["family"] == f}) for f in FAMILIES}
        prunings = {
            n: e["gap"]
            for n, e in configs.items()
            if (_first(e)["family"], _first(e)["active_ffn"]) == (PRUNING, width)
        }
        best_of[PRUNING] = best(prunings)
        for who, better, worse in ORDERINGS:
            if (a := best_of[better]) is not None and (b := best_of[worse]) is not None:
                claim = Claim(f"{setting}: {who} beats {worse}", "loss gap to dense", (a, b), LOWER)
                claims.append(claim.on(configs[a]["gap"], configs[b]["gap"]))
    return claims


def _plot(configs: dict[str, dict[str, Any]], plots_dir: Path) -> Path | None:
    """Each conversion's loss gap to dense (± std over seeds) around the zero line, one colour per family."""
    entries = {n: e for n, e in configs.items() if _first(e)["method"] != DENSE and e["gap"]}
    if not entries:
        return None
    fig, (ax,) = plots.panels(1, 0.45 * len(entries), 4.5)
    names, counts = list(entries), []
    for family, colour in COLOURS.items():
        xs = [i for i, name in enumerate(names) if _first(entries[name])["family"] == family]
        stats = [summarize(list(entries[names[i]]["gap"].values())) for i in xs]
        if xs:
            seed_errorbar(ax, xs, stats, linestyle="none", color=colour, label=family)
        counts += [s.n for s in stats]
    zero_line(ax)
    ax.set_xticks(range(len(names)), names, rotation=70, ha="right", fontsize=7)
    ax.set(ylabel="val loss gap to dense (after recovery)", title=f"Loss gap per conversion ({spread_note(counts)})")
    ax.legend(fontsize=8)
    return plots.save(fig, plots_dir, "loss_gap")


MAIN = "Conversions after the same recovery budget (mean ± std over seeds)"
LANGUAGES = "Val loss per language after recovery (mean over seeds)"
NOTE = "- Each family stands for its best configuration at the setting (lowest mean loss gap, picked after the runs)."


def analyse(plan: dict[str, Any], records: list[dict[str, Any]], plots_dir: Path) -> Analysis:
    configs = _per_config(plan, records)
    languages = [{"point": n} | language_means(e["per_language"]) for n, e in configs.items()]
    claims, plot = about(_ordering_claims(configs), PAPER, Subject(CONVERTED_MOE, HERE)), _plot(configs, plots_dir)
    tables = {MAIN: [_main_row(n, e) for n, e in configs.items()], LANGUAGES: languages}
    return Analysis(claims=claims, findings=[NOTE] * bool(claims), tables=tables, plots=[plot] if plot else [])


__all__ = ["PartitionSpec", "analyse", "chance_retention", "expand", "measure_converted", "parse"]
