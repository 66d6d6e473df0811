"""Study kind ``partition``: how much of a pretrained dense model survives its cut into an MoE?

Per seed: a dense model pretrains (the study's ``run`` budget); from its final weights, one child
per conversion (a fresh run of the ``recovery`` budget, identical for every child):

* every ``methods`` entry (random | kmeans | coactivation with a router centroid | trained |
  random, and dot_moe, which learns its routers) at every ``settings`` entry (E experts, top-k) —
  the conversion of :func:`moe_lit.commands.convert_partition.partition_dense`;
* ``pruning``: structured pruning (:func:`moe_lit.convert.prune_dense.prune_dense_ffn`) to the same
  active FFN width d_ff * k / E, once per width;
* ``dense/recovered``: the dense model itself, trained the same recovery budget (the reference).

Every conversion reads its calibration / DOT-MoE training tokens from the start of the training
stream of ``run.data``; its token count (``conversion_tokens``, whole batches are read) is a
column of the table. The measurement (:func:`measure_converted`) validates the converted model
before recovery. Analysis: loss gap = converted - dense/recovered val loss of the same seed;
retention = (ln V - L_converted) / (ln V - L_dense), the share of the dense model's loss
reduction below the uniform prediction (ln V) that is kept; the paper's orderings (DOT-MoE >
clustering > random, DOT-MoE > pruning) are tested per setting on the gaps by Welch's t-test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_lit.config import ConfigError, ModelConfig
from moe_lit.convert.partition import ASSIGNMENTS, ROUTERS, partitioned_config
from moe_lit.lit.run_config import _build
from moe_lit.studies.engine import TRANSFORMED_START, Call, Point, Start
from moe_lit.studies.kinds import Analysis, check_fields
from moe_lit.studies.measures import SuiteSpec, measure_child
from moe_lit.studies.stats import compare, format_comparison, format_summary, summarize

DOT_MOE, PRUNING, DENSE = "dot_moe", "pruning", "dense"
METHODS = (*ASSIGNMENTS, DOT_MOE)
CLUSTERING = ("kmeans", "coactivation")
MODULE = "moe_lit.studies.kinds.partition"


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
        if self.method not in METHODS:
            raise ConfigError(f"method: got {self.method!r}, allowed values: {', '.join(METHODS)}")
        if self.method == DOT_MOE and self.router is not None:
            raise ConfigError("router: dot_moe learns its routers; leave router out")
        if self.method != DOT_MOE:
            self.router = self.router or "centroid"
            if self.router not in ROUTERS:
                raise ConfigError(f"router: got {self.router!r}, allowed values: {', '.join(ROUTERS)}")

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
        for name in ("calibration_tokens", "router_steps", "train_tokens", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}: must be an integer >= 1, got {value!r}")
        if not self.lr > 0:
            raise ConfigError(f"lr: must be > 0, got {self.lr!r}")


@dataclass
class RecoverySpec:
    """The training every converted model (and the dense reference) gets after the conversion."""

    steps: int = 200
    """Optimizer steps of the recovery run (batch and sequence: run.data)."""
    lr: float = 1e-3
    """Peak learning rate of its fresh schedule (run.optim otherwise)."""
    warmup: int = 20
    """Warmup steps of its fresh schedule."""

    def __post_init__(self) -> None:
        if not isinstance(self.steps, int) or isinstance(self.steps, bool) or self.steps < 1:
            raise ConfigError(f"steps: must be an integer >= 1, got {self.steps!r}")
        if not isinstance(self.warmup, int) or isinstance(self.warmup, bool) or not 0 <= self.warmup < self.steps:
            raise ConfigError(f"warmup: must be an integer in [0, steps), got {self.warmup!r}")
        if not self.lr > 0:
            raise ConfigError(f"lr: must be > 0, got {self.lr!r}")


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
    recovery: RecoverySpec = field(default_factory=RecoverySpec)
    """The same recovery run for every child."""
    suite: SuiteSpec | None = None
    """Local-suite accuracy of every recovered model (dense reference included), each measured by
    a 0-step child point (``<config>/suite``); null: loss only."""

    def __post_init__(self) -> None:
        if self.dense.moe is not None:
            raise ConfigError("dense.moe: the dense model must be dense (moe: null)")
        if not self.settings or not self.methods:
            raise ConfigError("settings / methods: need at least one entry each")
        for i, setting in enumerate(self.settings):
            try:
                partitioned_config(self.dense, setting.experts, setting.top_k, balancing=self.balancing)
            except ConfigError as exc:
                raise ConfigError(f"settings[{i}].{exc}") from None
        for what, names in (("settings", [s.name for s in self.settings]), ("methods", [m.name for m in self.methods])):
            if len(set(names)) != len(names):
                raise ConfigError(f"{what}: an entry is repeated ({names})")


def _list(cls, value: Any, name: str) -> list:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{name}: must be a non-empty list of mappings, got {value!r}")
    return [_build(cls, item, f"{name}[{i}]") for i, item in enumerate(value)]


def default_run() -> dict[str, Any]:
    return {"data": {"seq_len": 64, "batch_size": 16, "val_batches": 4}, "train": {"max_steps": 1500}}


def parse(fields: dict[str, Any], header) -> PartitionSpec:
    check_fields(PartitionSpec, fields, ("dense", "settings", "methods"))
    dense = ModelConfig.from_dict(dict(fields["dense"])).replace(seq_len=header.run.data.seq_len)
    return PartitionSpec(
        **{
            **fields,
            "dense": dense,
            "settings": _list(SettingSpec, fields["settings"], "settings"),
            "methods": _list(MethodSpec, fields["methods"], "methods"),
            "conversion": _build(ConversionSpec, fields.get("conversion"), "conversion"),
            "recovery": _build(RecoverySpec, fields.get("recovery"), "recovery"),
            "suite": _build(SuiteSpec, fields["suite"], "suite") if fields.get("suite") is not None else None,
        }
    )


# ----------------------------------------------------------------------------- points
def _whole_batches(tokens: int, batch_tokens: int) -> int:
    """Tokens read when whole batches are taken until ``tokens`` are covered."""
    return math.ceil(tokens / batch_tokens) * batch_tokens


def conversion_kwargs(
    spec: PartitionSpec, method: str, router: str | None, setting: SettingSpec, data_dir: str, seed: int
) -> dict[str, Any]:
    """The transform's arguments: only those its method reads (a setting of another method changes
    no hash of this one)."""
    conv = spec.conversion
    kwargs: dict[str, Any] = {
        "method": method,
        "experts": setting.experts,
        "top_k": setting.top_k,
        "data_dir": data_dir,
        "batch_size": conv.batch_size,
        "seed": seed,
    }
    if method == PRUNING:
        return kwargs | {"calibration_tokens": conv.calibration_tokens}
    kwargs["balancing"] = spec.balancing
    if method == DOT_MOE:
        return kwargs | {"train_tokens": conv.train_tokens, "lr": conv.lr, "train_dense": conv.train_dense}
    kwargs["router"] = router
    if method == "coactivation" or router == "trained":
        kwargs |= {"calibration_tokens": conv.calibration_tokens}
    if router == "trained":
        kwargs |= {"router_steps": conv.router_steps}
    return kwargs


def _conversion_tokens(kwargs: dict[str, Any], seq_len: int) -> int:
    tokens = kwargs.get("train_tokens", kwargs.get("calibration_tokens", 0))
    return _whole_batches(tokens, kwargs["batch_size"] * seq_len) if tokens else 0


def _pruning_settings(spec: PartitionSpec) -> list[SettingSpec]:
    """One setting per distinct active FFN width (the first setting that has it)."""
    widths: dict[float, SettingSpec] = {}
    for setting in spec.settings:
        widths.setdefault(setting.active_ffn, setting)
    return list(widths.values())


def expand(spec: PartitionSpec, header) -> list[Point]:
    data_dir = header.run.data.resolved_dir()
    seq_len = header.run.data.seq_len
    rec = spec.recovery
    measure = Call(f"{MODULE}:measure_converted")
    arms: list[tuple[str, str, str | None, str, SettingSpec | None]] = [("dense/recovered", DENSE, None, DENSE, None)]
    for setting in spec.settings:
        arms += [(f"{setting.name}/{m.name}", m.method, m.router, m.family, setting) for m in spec.methods]
    if spec.pruning:
        arms += [(f"pruning/ffn{s.active_ffn:g}", PRUNING, None, PRUNING, s) for s in _pruning_settings(spec)]
    points = []
    for seed in header.seeds:
        pretrain = header.seeded_run(seed)
        recovery = pretrain.replace(
            train={"max_steps": rec.steps, "val_every": rec.steps},
            optim={"lr": rec.lr, "warmup_steps": rec.warmup},
        )
        parent = header.point_name("dense/pretrain", seed)
        points.append(
            Point(
                parent,
                "dense/pretrain",
                seed,
                spec.dense,
                pretrain,
                info={"phase": "pretrain", "method": DENSE, "family": DENSE},
            )
        )
        for config_name, method, router, family, setting in arms:
            info = {
                "phase": "recovered",
                "method": method,
                "router": router,
                "family": family,
                "setting": setting.name if family not in (DENSE, PRUNING) else None,
                "active_ffn": setting.active_ffn if setting else 1.0,
                "conversion_tokens": 0,
            }
            model, transform = spec.dense, None
            if method == PRUNING:
                model = spec.dense.replace(d_ff=spec.dense.d_ff * setting.top_k // setting.experts)
            elif method != DENSE:
                model = partitioned_config(spec.dense, setting.experts, setting.top_k, balancing=spec.balancing)
            if method != DENSE:
                kwargs = conversion_kwargs(spec, method, router, setting, data_dir, seed)
                transform = Call(f"{MODULE}:convert", kwargs)
                info["conversion_tokens"] = _conversion_tokens(kwargs, seq_len)
            recovered = Point(
                header.point_name(config_name, seed),
                config_name,
                seed,
                model,
                recovery,
                info=info,
                start=Start(parent=parent, mode="init"),
                transform=transform,
                measure=measure if transform else None,
            )
            points.append(recovered)
            if spec.suite is not None:
                points.append(measure_child(recovered, spec.suite.measure()))
    return points


# ----------------------------------------------------------------------------- transform and measurement
def convert(model, method: str, experts: int, top_k: int, data_dir: str, batch_size: int, seed: int, **options: Any):
    """The study's transform: ``model`` (dense) converted by ``method`` (a partition method of
    :func:`~moe_lit.commands.convert_partition.partition_dense`, or ``pruning`` to the active
    width d_ff * top_k / experts), reading calibration / training tokens from ``data_dir``."""
    from moe_lit.commands.convert_partition import calibration_batches, partition_dense

    batches = calibration_batches(data_dir, model.config, batch_size, seed)
    converted, _ = partition_dense(model, method, experts, top_k, batches, seed=seed, **options)
    return converted


def measure_converted(point: Point, result: Any, run_dir: Path) -> dict[str, Any]:
    """Validation loss (overall and per language) of the converted model before its recovery: the
    start weights the engine wrote under ``run_dir/TRANSFORMED_START``, validated by a 0-step
    :func:`~moe_lit.lit.runner.train_run` on the run's validation batches."""
    from moe_lit.lit.runner import train_run

    start = Path(run_dir) / TRANSFORMED_START
    converted = train_run(
        point.model, point.run.replace(train={"max_steps": 0}), Path(run_dir) / "converted", init_from=start
    )
    return {
        "val_loss_converted": converted.val_loss,
        "val_loss_converted_per_language": converted.val_loss_per_language,
    }


# ----------------------------------------------------------------------------- analysis
def retention(loss: float, dense_loss: float, vocab_size: int) -> float:
    """Share of the dense model's loss reduction below the uniform prediction (ln V) that is kept."""
    chance = math.log(vocab_size)
    return (chance - loss) / (chance - dense_loss)


def _fmt(values: list[float]) -> str:
    return format_summary(summarize(values)) if values else ""


def _per_config(plan: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """config_name -> its info and the per-seed values (gap, retention, ...) against the same seed's
    dense/recovered and dense/pretrain records."""
    vocab = plan["spec"]["dense"]["vocab_size"]
    ok = [r for r in records if r["status"] == "ok"]
    dense = {r["seed"]: r for r in ok if r.get("method") == DENSE and r.get("phase") == "recovered"}
    pretrain = {r["seed"]: r for r in ok if r.get("phase") == "pretrain"}
    suite = {r["parent"]: r["suite"] for r in ok if r.get("phase") == "suite" and "suite" in r}
    out: dict[str, dict[str, Any]] = {}
    for record in ok:
        if record.get("phase") != "recovered" or record["seed"] not in dense:
            continue
        ref = dense[record["seed"]]
        entry = out.setdefault(
            record["config_name"],
            {
                "record": record,
                "loss": [],
                "gap": [],
                "retention": [],
                "gap_before": [],
                "per_language": {},
                "acc": [],
                "acc_retention": [],
            },
        )
        entry["loss"].append(record["val_loss"])
        entry["gap"].append(record["val_loss"] - ref["val_loss"])
        entry["retention"].append(retention(record["val_loss"], ref["val_loss"], vocab))
        before = record.get("val_loss_converted")
        if before is None and record["method"] == DENSE and record["seed"] in pretrain:
            before = pretrain[record["seed"]]["val_loss"]
        if before is not None and record["seed"] in pretrain:
            entry["gap_before"].append(before - pretrain[record["seed"]]["val_loss"])
        for lang, loss in (record.get("val_loss_per_language") or {}).items():
            entry["per_language"].setdefault(lang, []).append(loss)
        scores, ref_scores = suite.get(record["name"]), suite.get(ref["name"])
        if scores and ref_scores:
            entry["acc"].append(scores["mean_acc"])
            if ref_scores["mean_above_chance"] > 0:  # a reference at chance has nothing to retain
                entry["acc_retention"].append(scores["mean_above_chance"] / ref_scores["mean_above_chance"])
    return out


def _method_label(record: dict[str, Any]) -> str:
    if record["method"] in (DENSE, PRUNING, DOT_MOE):
        return record["method"]
    return f"{record['method']} + {record['router']} router"


def _main_rows(configs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for entry in configs.values():
        r = entry["record"]
        rows.append(
            {
                "point": r["config_name"],
                "method": _method_label(r),
                "experts / top-k": f"{r['num_experts']} / {r['top_k']}" if r["num_experts"] > 1 else "dense",
                "active FFN": f"{r['active_ffn']:.0%}",
                "active / total params": f"{r['active_params']:,} / {r['total_params']:,}",
                "conversion tokens": r.get("conversion_tokens", 0),
                "val loss": _fmt(entry["loss"]),
                "loss gap to dense": _fmt(entry["gap"]),
                "retention": _fmt(entry["retention"]),
                "gap before recovery": _fmt(entry["gap_before"]),
                "task acc": _fmt(entry["acc"]),
                "task retention (above chance)": _fmt(entry["acc_retention"]),
            }
        )
    return rows


def _language_rows(configs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for name, entry in configs.items():
        row: dict[str, Any] = {"point": name}
        for lang, values in entry["per_language"].items():
            row[lang] = f"{summarize(values).mean:.4f}"
        rows.append(row)
    return rows


Group = tuple[str, list[float]] | None
"""(config_name, per-seed loss gaps) of one configuration, or None."""


def _best(configs: dict[str, dict[str, Any]], keep) -> Group:
    """(config_name, gaps) of the configuration with the lowest mean gap among those ``keep`` accepts."""
    candidates = [(summarize(e["gap"]).mean, name, e["gap"]) for name, e in configs.items() if keep(e["record"])]
    if not candidates:
        return None
    _, name, gaps = min(candidates, key=lambda c: c[0])
    return name, gaps


def _ordering(claim: str, better: Group, worse: Group) -> str | None:
    """A finding line: is ``better``'s gap significantly lower than ``worse``'s? None if one is missing."""
    if better is None or worse is None:
        return None
    verdict = compare(better[1], worse[1])
    reproduced = verdict.significant and verdict.diff < 0
    return (
        f"- **{claim}**: {better[0]} vs {worse[0]}, loss gap {format_comparison(verdict)}; "
        f"**{'reproduced' if reproduced else 'not reproduced'}**."
    )


def _findings(configs: dict[str, dict[str, Any]]) -> list[str]:
    findings = []
    settings = list(dict.fromkeys(e["record"]["setting"] for e in configs.values() if e["record"].get("setting")))
    for setting in settings:
        here = {n: e for n, e in configs.items() if e["record"].get("setting") == setting}
        width = next(iter(here.values()))["record"]["active_ffn"]
        dot = _best(here, lambda r: r["family"] == DOT_MOE)
        clustering = _best(here, lambda r: r["family"] == "clustering")
        rand = _best(here, lambda r: r["family"] == "random")
        pruning = _best(configs, lambda r, w=width: r["family"] == PRUNING and r["active_ffn"] == w)
        for claim, better, worse in (
            (f"{setting}: DOT-MoE > clustering", dot, clustering),
            (f"{setting}: clustering > random", clustering, rand),
            (f"{setting}: DOT-MoE > pruning", dot, pruning),
        ):
            line = _ordering(claim, better, worse)
            if line:
                findings.append(line)
    if findings:
        findings.append(
            "- Each family is represented by its best configuration at the setting (lowest mean "
            "loss gap); the gap is to the dense model trained the same recovery budget, per seed."
        )
    return findings


def _plot(configs: dict[str, dict[str, Any]], plots_dir: Path) -> Path | None:
    from moe_lit.plotting import pyplot, save_figure, spread_note

    entries = [(n, e) for n, e in configs.items() if e["record"]["method"] != DENSE and e["gap"]]
    if not entries:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(entries)), 4.5))
    colours = {DOT_MOE: "tab:red", "clustering": "tab:blue", "random": "tab:grey", PRUNING: "tab:green"}
    stats = [summarize(e["gap"]) for _, e in entries]
    ax.bar(
        range(len(entries)),
        [s.mean for s in stats],
        yerr=[s.std if s.n > 1 else 0.0 for s in stats],
        color=[colours[e["record"]["family"]] for _, e in entries],
        capsize=3,
    )
    ax.set_xticks(range(len(entries)), [n for n, _ in entries], rotation=70, ha="right", fontsize=7)
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_ylabel("val loss gap to dense (after recovery)")
    ax.set_title(f"Loss gap per conversion (mean; {spread_note(s.n for s in stats)})")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    ax.legend(handles, list(colours), fontsize=8)
    return save_figure(fig, Path(plots_dir) / "loss_gap.png")


def analyse(plan: dict[str, Any], records: list[dict[str, Any]], plots_dir: Path) -> Analysis:
    configs = _per_config(plan, records)
    plot = _plot(configs, plots_dir)
    return Analysis(
        findings=_findings(configs),
        tables={
            "Conversions after the same recovery budget (mean ± std over seeds)": _main_rows(configs),
            "Val loss per language after recovery (mean over seeds)": _language_rows(configs),
        },
        plots=[plot] if plot else [],
    )


__all__ = [
    "ConversionSpec",
    "MethodSpec",
    "PartitionSpec",
    "RecoverySpec",
    "SettingSpec",
    "analyse",
    "conversion_kwargs",
    "convert",
    "expand",
    "measure_converted",
    "parse",
    "retention",
]
