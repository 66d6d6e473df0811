"""Declarative dense-vs-sparse sweeps: YAML -> validated dataclasses -> a deduplicated list of points.

A study file names a dense base model, the active-parameter budgets (each budget is a dense model:
the base with a few fields changed), the main grid (budgets x num_experts x top_k x matching mode,
the dense model included), ablations at one budget (granularity, shared expert, heterogeneous expert
sizes, balancing, capacity factor vs dropless, matching mode), the training settings and the seeds.
:func:`expand` turns it into :class:`StudyPoint` s: every MoE model is built by
:func:`moe_lit.accounting.matched_moe_config`, so an active-matched point has the active parameters
of its budget's dense model. Points are identified by a hash of what determines the run (model
config, training settings, seed); two axes that describe the same run collapse into one point that
belongs to both groups.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from moe_lit.accounting import matched_moe_config
from moe_lit.config import ConfigError, ModelConfig, MoEConfig
from moe_lit.lit.optim import OptimConfig

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
    def from_yaml_entry(cls, entry: Any, index: int) -> "BudgetSpec":
        """``{name: S, d_ff: 256}``: the name plus the changed model fields, flat."""
        if not isinstance(entry, dict) or "name" not in entry:
            _fail(f"budgets[{index}]", f"must be a mapping with a 'name' and model fields, got {entry!r}")
        overrides = {k: v for k, v in entry.items() if k != "name"}
        return cls(name=entry["name"], overrides=overrides)


@dataclass
class GridSpec:
    """The main grid, run at every budget: num_experts x top_k x matching mode."""

    num_experts: list[Union[int, str]] = field(default_factory=lambda: [DENSE, 4, 8, 16, 32])
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
class TrainingSpec:
    """Settings shared by every run of the study (passed to ``train_run``)."""

    max_tokens: int = 2_000_000
    """Training tokens per run (the token budget; the same for every point)."""
    seq_len: int = 128
    """Training sequence length (also the models' seq_len)."""
    batch_size: int = 16
    """Sequences per optimizer step."""
    val_batches: int = 20
    """Validation batches per language in each validation."""
    evaluations: int = 1
    """Validations per run, evenly spaced, the last at the end (1 = only the final loss; more give
    a validation curve in each run's metrics.csv at the cost of time)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW and schedule (moe_lit.lit.optim.OptimConfig fields: lr, warmup_steps, schedule, ...)."""
    trainer: dict[str, Any] = field(default_factory=dict)
    """Extra Lightning Trainer arguments for every run (e.g. precision, gradient_clip_val)."""

    def __post_init__(self) -> None:
        for name in ("max_tokens", "seq_len", "batch_size", "val_batches", "evaluations"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                _fail(f"training.{name}", f"must be a positive integer, got {value!r}")
        if self.steps < self.evaluations:
            _fail(
                "training.max_tokens",
                f"must cover at least evaluations={self.evaluations} batches of seq_len*batch_size="
                f"{self.seq_len * self.batch_size} tokens, got {self.max_tokens}",
            )
        self.optim = _build(OptimConfig, self.optim, "training.optim")
        if not isinstance(self.trainer, dict):
            _fail("training.trainer", f"must be a mapping of Trainer arguments, got {self.trainer!r}")

    @property
    def steps(self) -> int:
        """Optimizer steps of each run."""
        return self.max_tokens // (self.seq_len * self.batch_size)

    @property
    def eval_every(self) -> int:
        """Optimizer steps between validations."""
        return max(1, self.steps // self.evaluations)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["optim"]["betas"] = list(data["optim"]["betas"])
        return data


@dataclass
class StudySpec:
    """A whole dense-vs-sparse study, as written in ``configs/studies/<name>.yaml``."""

    name: str
    """Study name: results go to results/<name>/ unless --out says otherwise."""
    base: ModelConfig
    """Dense base model (moe must be null; seq_len comes from training.seq_len)."""
    budgets: list[BudgetSpec]
    """Active-parameter budgets, each a dense model derived from the base."""
    grid: GridSpec = field(default_factory=GridSpec)
    """Main grid run at every budget."""
    ablations: Optional[AblationSpec] = None
    """Ablations at one budget; null = none."""
    training: TrainingSpec = field(default_factory=TrainingSpec)
    """Training settings of every run."""
    seeds: list[int] = field(default_factory=lambda: [0])
    """Seeds: every point runs once per seed."""
    data_dir: Optional[str] = None
    """Prepared data directory (moe-lit data prepare); relative paths are relative to the working
    directory; null = the data pipeline's default (data_cache/default). --data overrides it."""
    data: Optional[dict[str, Any]] = None
    """How to prepare data_dir before the first run when it is missing or prepared otherwise:
    moe-lit data prepare settings (source, languages, vocab_size, max_paragraphs, ...); a directory
    already prepared with the same settings is reused. null = use data_dir as it is."""
    description: str = ""
    """Free text shown at the top of the summary."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            _fail("name", f"must be a non-empty string without '/', got {self.name!r}")
        if self.base.moe is not None:
            _fail("base.moe", "the base model must be dense (moe: null); experts come from the grid")
        self.budgets = _require_list(self.budgets, "budgets")
        if not self.budgets:
            _fail("budgets", "needs at least one budget")
        names = [b.name for b in self.budgets]
        if len(set(names)) != len(names):
            _fail("budgets", f"names must be unique, got {names}")
        self.seeds = _require_list(self.seeds, "seeds")
        if not self.seeds or not all(_is_int(s) for s in self.seeds) or len(set(self.seeds)) != len(self.seeds):
            _fail("seeds", f"must be a non-empty list of distinct integers, got {self.seeds!r}")
        for budget in self.budgets:
            self.dense_model(budget.name)  # validates every budget's model now
        if self.ablations is not None and self.ablations.budget not in names:
            _fail("ablations.budget", f"got {self.ablations.budget!r}, allowed values: {', '.join(names)}")
        if self.data is not None:
            self.prepare_config(self.data_dir)  # validates the data settings now
            vocab = self.data.get("vocab_size")
            if vocab is not None and vocab != self.base.vocab_size:
                _fail("base.vocab_size", f"must equal data.vocab_size={vocab}, got {self.base.vocab_size}")

    def prepare_config(self, data_dir: Optional[str]):
        """The :class:`~moe_lit.data.prepare.PrepareConfig` building ``data_dir`` from ``data``."""
        from moe_lit.data.prepare import PrepareConfig

        if not isinstance(self.data, dict):
            _fail("data", f"expected a mapping of data prepare settings, got {self.data!r}")
        allowed = [f.name for f in dataclasses.fields(PrepareConfig) if f.name not in ("out", "force", "progress")]
        unknown = sorted(set(self.data) - set(allowed))
        if unknown:
            _fail("data", f"unknown key(s) {unknown}, allowed keys: {allowed}")
        try:
            return PrepareConfig(out=data_dir, **self.data)
        except ConfigError as exc:
            raise ConfigError(f"data.{exc}") from None

    def dense_model(self, budget: str) -> ModelConfig:
        """The dense model of one budget (the base with its overrides, seq_len from training)."""
        spec = next((b for b in self.budgets if b.name == budget), None)
        if spec is None:
            _fail("budget", f"got {budget!r}, allowed values: {', '.join(b.name for b in self.budgets)}")
        try:
            return self.base.replace(**spec.overrides, seq_len=self.training.seq_len)
        except ConfigError as exc:
            raise ConfigError(f"budgets[{budget}]: {exc}") from None

    @classmethod
    def from_dict(cls, data: Any) -> "StudySpec":
        if not isinstance(data, dict):
            _fail("study", f"expected a mapping, got {type(data).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            _fail("study", f"unknown key(s) {unknown}, allowed keys: {known}")
        for required in ("name", "base", "budgets"):
            if required not in data:
                _fail(required, "is required")
        base = data["base"]
        if not isinstance(base, dict):
            _fail("base", f"expected a mapping of model fields, got {base!r}")
        if "seq_len" in base:
            _fail("base.seq_len", "set the sequence length in training.seq_len")
        fields = dict(data)
        fields["base"] = ModelConfig.from_dict(dict(base))
        fields["budgets"] = [
            BudgetSpec.from_yaml_entry(entry, i) for i, entry in enumerate(_require_list(data["budgets"], "budgets"))
        ]
        fields["grid"] = _build(GridSpec, data.get("grid") or {}, "grid")
        if data.get("ablations") is not None:
            fields["ablations"] = _build(AblationSpec, data["ablations"], "ablations")
        fields["training"] = _build(TrainingSpec, data.get("training") or {}, "training")
        return cls(**fields)

    @classmethod
    def from_yaml(cls, path: Union[str, Path]) -> "StudySpec":
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"study: no such file {path}")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"study: {path} is not valid YAML ({str(exc).splitlines()[0]})") from None
        return cls.from_dict(data)


@dataclass(frozen=True)
class StudyPoint:
    """One training run of the study."""

    name: str
    """Readable label, unique within the study (e.g. M/E8k2/cf=1.25, with /s<seed> for extra seeds)."""
    config_name: str
    """The name without the seed: equal for the runs of one configuration with different seeds."""
    budget: str
    """Budget the point belongs to."""
    model: ModelConfig
    """The model to train."""
    seed: int
    """Training seed."""
    groups: dict[str, str]
    """Where the point appears (grid, granularity, shared, heterogeneous, balancing, capacity,
    matching) -> its label there (e.g. capacity -> dropless, balancing -> bias=0.001)."""
    match: str = "active"
    """Matching mode the MoE was built with (dense points: active)."""
    hash: str = ""
    """Hash of model config + training settings + seed (see :func:`config_hash`)."""

    @property
    def num_experts(self) -> int:
        """Routed experts; 1 for the dense model (a single always-on FFN)."""
        return self.model.moe.num_experts if self.model.moe else 1

    @property
    def top_k(self) -> int:
        return self.model.moe.top_k if self.model.moe else 1

    @property
    def expert_size(self) -> float:
        """Mean routed expert hidden size (d_ff for the dense model)."""
        moe = self.model.moe
        return moe.total_expert_size / moe.num_experts if moe else float(self.model.d_ff)


def config_hash(model: ModelConfig, training: TrainingSpec, seed: int) -> str:
    """12 hex digits identifying a run: equal configs, training settings and seed give equal hashes."""
    payload = {"model": model.to_dict(), "training": training.to_dict(), "seed": seed}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:12]


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


def _grid_runs(spec: StudySpec) -> list[_Run]:
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


def _ablation_runs(spec: StudySpec, abl: AblationSpec) -> list[_Run]:
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


def expand(spec: StudySpec) -> list[StudyPoint]:
    """Every run of the study, in a stable order (grid first), deduplicated by config hash."""
    runs = _grid_runs(spec) + (_ablation_runs(spec, spec.ablations) if spec.ablations else [])
    points: dict[str, dict[str, Any]] = {}
    names: dict[str, str] = {}
    for seed in spec.seeds:
        for run in runs:
            digest = config_hash(run.model, spec.training, seed)
            config_name = f"{run.budget}/{run.name}"
            name = config_name + (f"/s{seed}" if len(spec.seeds) > 1 else "")
            point = points.setdefault(
                digest,
                dict(
                    name=name,
                    config_name=config_name,
                    budget=run.budget,
                    model=run.model,
                    seed=seed,
                    groups={},
                    match=run.match,
                    hash=digest,
                ),
            )
            point["groups"].setdefault(run.group, run.label)
            if names.setdefault(point["name"], digest) != digest:
                _fail("study", f"two different runs are both named {point['name']!r}; rename a size profile or budget")
    return [StudyPoint(**point) for point in points.values()]


__all__ = [
    "AblationSpec",
    "BudgetSpec",
    "GridSpec",
    "StudyPoint",
    "StudySpec",
    "TrainingSpec",
    "config_hash",
    "expand",
]
