"""``RunConfig``: every setting of one training run except the model, in four sections.

* ``data``: the :class:`~moe_lit.lit.datamodule.MoEDataModule` arguments (same names);
* ``optim``: :class:`~moe_lit.lit.optim.OptimConfig` (AdamW + LR schedule);
* ``train``: the budget (tokens or steps), validation and checkpoint cadence, seed, compile;
* ``trainer``: extra Lightning ``Trainer`` arguments (precision, accelerator, gradient_clip_val, ...).

The LightningCLI experiment YAMLs use the same sections and names (``data:``, ``train:``,
``trainer:``; ``optim`` sits at ``model.optim`` there because it is an argument of the module), so
one YAML feeds ``moe-lit fit`` and :func:`moe_lit.lit.run.train_run`
(:meth:`RunConfig.from_experiment`). The demo and every study kind build a ``RunConfig``; ``moe-lit
demo`` and ``moe-lit distill`` read one from a run YAML (``configs/runs/``) with ``--SECTION.FIELD``
settings over it (:func:`check_settings`, :func:`merge_sections`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from moe_lit.config import ConfigError, refuse_unknown_keys
from moe_lit.io import yaml_problem
from moe_lit.lit.optim import EXTEND_SCHEDULE, OptimConfig
from moe_lit.lit.precision import PRECISIONS

DEFAULT_EVALUATIONS = 8
"""Validations per run when ``train.val_every`` is not set."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(value: Any, name: str, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not _is_int(value) or value < 1:
        raise ConfigError(f"{name}: must be a positive integer, got {value!r}")


def build_section(cls, data: Any, section: str):
    """``cls(**data)`` with unknown keys and non-mappings reported under ``section``."""
    if isinstance(data, cls):
        return data
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise ConfigError(f"{section}: expected a mapping, got {type(data).__name__}")
    refuse_unknown_keys(data, cls, section)
    try:
        return cls(**data)
    except ConfigError as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith(f"{section}.") else f"{section}.{message}") from None


@dataclass
class DataConfig:
    """Which prepared tokens a run reads, and how (the ``MoEDataModule`` arguments)."""

    data_dir: str | None = None
    """Directory written by ``moe-lit data prepare``; relative paths are relative to the working
    directory; null = the data pipeline's default (``$MOE_LIT_DATA`` or data_cache/default)."""
    seq_len: int = 256
    """Tokens per training sequence (also the model's seq_len)."""
    batch_size: int = 8
    """Sequences per optimizer step (per device)."""
    val_batches: int | None = None
    """Validation batches per language in each validation (null = the whole split)."""
    languages: list[str] | None = None
    """Languages to train and validate on, a subset of the prepared ones (null = all)."""
    language_weights: dict[str, float] | None = None
    """Relative sampling weight of each language in training (null = proportional to its tokens;
    a language left out gets weight 0: validated on, not trained on)."""
    num_workers: int = 0
    """Worker processes of each validation loader (the training stream is read in the main process)."""

    def __post_init__(self) -> None:
        _positive(self.seq_len, "seq_len")
        _positive(self.batch_size, "batch_size")
        _positive(self.val_batches, "val_batches", allow_none=True)
        if not _is_int(self.num_workers) or self.num_workers < 0:
            raise ConfigError(f"num_workers: must be an integer >= 0, got {self.num_workers!r}")
        if self.languages is not None:
            if (
                not isinstance(self.languages, list)
                or not self.languages
                or not all(isinstance(lang, str) for lang in self.languages)
            ):
                raise ConfigError(f"languages: must be a non-empty list of language codes, got {self.languages!r}")
        if self.language_weights is not None and not isinstance(self.language_weights, dict):
            raise ConfigError(f"language_weights: must be a mapping language -> weight, got {self.language_weights!r}")

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.batch_size

    def resolved_dir(self) -> str:
        """``data_dir``, else the data pipeline's default directory."""
        if self.data_dir:
            return str(self.data_dir)
        from moe_lit.data.layout import default_data_dir

        return str(default_data_dir())


@dataclass
class TrainConfig:
    """How long a run trains, how often it validates and checkpoints, and its seed."""

    max_tokens: int | None = None
    """Token budget (rounded down to whole optimizer steps of seq_len x batch_size tokens); set
    exactly one of max_tokens and max_steps."""
    max_steps: int | None = None
    """Step budget (optimizer steps); set exactly one of max_tokens and max_steps. 0 = no training:
    the run only validates its initial weights (e.g. a transformed model evaluated as it is)."""
    val_every: int | None = None
    """Optimizer steps between validations (and a validation at the end); null = 8 per run."""
    checkpoint_every: int | None = None
    """Optimizer steps between rewrites of checkpoints/last.ckpt (null = val_every)."""
    seed: int = 0
    """Seed of the model initialisation, the data order and the language sampling."""
    compile: bool = False
    """torch.compile each transformer block (inductor; the routed experts stay eager): same losses
    and checkpoints as eager, compile time on the first step (moe_lit.callbacks.compile)."""
    precision: str | None = None
    """auto (bf16-mixed on a CPU with native bf16 where a GEMM probe measures it faster, else
    fp32; moe_lit.lit.precision) | 32-true | bf16-mixed (forced) | null: the trainer's precision
    as configured."""
    extend_schedule: str = "keep"
    """A resume with another step budget than the run's (e.g. a finished run extended): keep (the
    learning-rate schedule of the run's budget; past its end the lr stays at its end value) |
    replan (the schedule stretched over the new budget: the lr rises again). One line says which."""

    def __post_init__(self) -> None:
        if (self.max_tokens is None) == (self.max_steps is None):
            raise ConfigError(
                f"max_tokens: set exactly one of max_tokens and max_steps, got max_tokens={self.max_tokens!r}, "
                f"max_steps={self.max_steps!r}"
            )
        _positive(self.max_tokens, "max_tokens", allow_none=True)
        if self.max_steps is not None and (not _is_int(self.max_steps) or self.max_steps < 0):
            raise ConfigError(f"max_steps: must be an integer >= 0 (0 = validate only), got {self.max_steps!r}")
        _positive(self.val_every, "val_every", allow_none=True)
        _positive(self.checkpoint_every, "checkpoint_every", allow_none=True)
        if not _is_int(self.seed):
            raise ConfigError(f"seed: must be an integer, got {self.seed!r}")
        if not isinstance(self.compile, bool):
            raise ConfigError(f"compile: must be true or false, got {self.compile!r}")
        if self.extend_schedule not in EXTEND_SCHEDULE:
            raise ConfigError(
                f"extend_schedule: got {self.extend_schedule!r}, allowed values: {', '.join(EXTEND_SCHEDULE)}"
            )
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ConfigError(f"precision: got {self.precision!r}, allowed values: {', '.join(PRECISIONS)}, null")

    def steps(self, tokens_per_step: int) -> int:
        """Optimizer steps of the run."""
        return self.max_steps if self.max_steps is not None else self.max_tokens // tokens_per_step

    def eval_every(self, tokens_per_step: int) -> int:
        return self.val_every or max(1, self.steps(tokens_per_step) // DEFAULT_EVALUATIONS)


@dataclass
class RunConfig:
    """One training run's settings besides the model (see the module docstring)."""

    data: DataConfig = field(default_factory=DataConfig)
    """The data module's settings."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW and the learning-rate schedule (the schedule spans the whole run)."""
    train: TrainConfig = field(default_factory=lambda: TrainConfig(max_steps=100))
    """Budget, validation and checkpoint cadence, seed."""
    trainer: dict[str, Any] = field(default_factory=dict)
    """Extra Lightning Trainer arguments (replace train_run's defaults; callbacks are not allowed here)."""

    def __post_init__(self) -> None:
        self.data = build_section(DataConfig, self.data, "data")
        self.optim = build_section(OptimConfig, self.optim, "optim")
        self.train = build_section(TrainConfig, self.train, "train")
        if not isinstance(self.trainer, dict):
            raise ConfigError(f"trainer: must be a mapping of Trainer arguments, got {self.trainer!r}")
        if "callbacks" in self.trainer:
            raise ConfigError("trainer.callbacks: pass callbacks to train_run(callbacks=...), not in the run config")
        if self.train.max_tokens is not None and self.steps < 1:
            raise ConfigError(
                f"train.max_tokens: {self.train.max_tokens} is less than one batch "
                f"(seq_len*batch_size={self.data.tokens_per_step})"
            )

    @property
    def steps(self) -> int:
        """Optimizer steps of the run."""
        return self.train.steps(self.data.tokens_per_step)

    @property
    def eval_every(self) -> int:
        """Optimizer steps between validations."""
        return self.train.eval_every(self.data.tokens_per_step)

    @property
    def tokens(self) -> int:
        """Training tokens of the run (whole steps)."""
        return self.steps * self.data.tokens_per_step

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["optim"]["betas"] = list(data["optim"]["betas"])
        return data

    @classmethod
    def from_dict(cls, data: Any) -> RunConfig:
        if isinstance(data, cls):
            return data
        if not isinstance(data, dict):
            raise ConfigError(f"run: expected a mapping with data, optim, train, trainer; got {type(data).__name__}")
        refuse_unknown_keys(data, cls, "run")
        return cls(**data)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, path: str | Path) -> RunConfig:
        return cls.from_dict(read_yaml(path, "run"))

    def replace(self, **sections: Any) -> RunConfig:
        """A copy with fields of whole sections changed: ``replace(train={"seed": 1})`` changes
        train.seed only; a new budget (max_tokens or max_steps) replaces the old one."""
        data = self.to_dict()
        for name, changes in sections.items():
            if name not in data or not isinstance(changes, dict):
                raise ConfigError(f"run: replace takes mappings of the sections {list(data)}, got {name}={changes!r}")
        return RunConfig.from_dict(merge_sections(data, sections))

    @classmethod
    def from_experiment(cls, path: str | Path) -> tuple[Any, RunConfig]:
        """(ModelConfig, RunConfig) of a LightningCLI experiment YAML (``moe-lit fit --config``):
        its ``data``, ``model.optim``, ``train`` and ``trainer`` sections, ``seed_everything`` as
        train.seed, the trainer's max_steps and integer val_check_interval and the checkpoint's
        every_n_train_steps as train's fields where train leaves them unset; ``model.model``
        (inline or a path relative to the YAML) is the model. The two give equal Trainer arguments
        (tests/lit/test_trainer_arguments.py)."""
        from moe_lit.config import ModelConfig

        path = Path(path)
        config = read_yaml(path, "experiment")
        module = _section_file(config.get("model") or {}, path, "model")
        model = _section_file(module.get("model") or {}, path, "model.model")
        data = {k: v for k, v in (_section_file(config.get("data") or {}, path, "data")).items() if k != "seed"}
        trainer = _section_file(config.get("trainer") or {}, path, "trainer")
        train = dict(config.get("train") or {})
        if "seed_everything" in config:
            train.setdefault("seed", config["seed_everything"])
        if "max_steps" in trainer and "max_tokens" not in train:
            train.setdefault("max_steps", trainer["max_steps"])
        if isinstance(trainer.get("val_check_interval"), int):  # NOTE: a float is a fraction of an epoch
            train.setdefault("val_every", trainer["val_check_interval"])
        every = (config.get("checkpoint") or {}).get("every_n_train_steps")
        if every is not None:
            train.setdefault("checkpoint_every", every)
        trainer = {k: v for k, v in trainer.items() if k not in ("max_steps", "callbacks", "logger")}
        run = cls(data=data, optim=module.get("optim") or {}, train=train, trainer=trainer)
        return ModelConfig.from_dict(model), run


SECTIONS: dict[str, Any] = {"data": DataConfig, "optim": OptimConfig, "train": TrainConfig, "trainer": None}
"""A run's sections and the dataclass of each (``trainer``: any Lightning Trainer argument)."""


def check_settings(settings: dict[str, dict[str, Any]], extra: dict[str, Any] | None = None) -> None:
    """``--SECTION.FIELD`` settings name the run's sections and their fields (and those of ``extra``,
    a command's own sections); anything else is a one-line ConfigError. Values are checked when the
    run is built."""
    sections = {**SECTIONS, **(extra or {})}
    refuse_unknown_keys(settings, sections, "settings", what="section(s)", label="allowed sections")
    for name, fields in settings.items():
        if sections[name] is not None:
            refuse_unknown_keys(fields, sections[name], name)


def merge_sections(data: dict[str, Any], sections: dict[str, Any]) -> dict[str, Any]:
    """``data`` (a run mapping, e.g. a run YAML's) with fields of its sections changed:
    ``{"train": {"seed": 1}}`` changes train.seed only; a new budget (max_tokens or max_steps)
    replaces the old one."""
    merged = dict(data)
    for name, changes in sections.items():
        section = merged.get(name) or {}
        if not isinstance(changes, dict) or not isinstance(section, dict):
            raise ConfigError(f"{name}: expected a mapping of fields, got {changes!r} over {section!r}")
        section = dict(section)
        if name == "train" and {"max_tokens", "max_steps"} & set(changes):
            section.update(max_tokens=None, max_steps=None)
        merged[name] = {**section, **changes}
    return merged


def read_yaml(path: str | Path, what: str) -> dict[str, Any]:
    """The mapping in a YAML file; a missing file, bad YAML or a non-mapping is a one-line ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what}: no such file {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what}: {path} is not valid YAML ({yaml_problem(exc)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: {path} must hold a mapping, got {type(data).__name__}")
    return data


def _section_file(value: Any, owner: Path, name: str) -> dict[str, Any]:
    """A YAML section given inline or as a path relative to the file that names it."""
    if isinstance(value, str):
        return read_yaml(owner.parent / value, name)
    if not isinstance(value, dict):
        raise ConfigError(f"{name}: expected a mapping or a YAML path, got {type(value).__name__}")
    return value


__all__ = [
    "SECTIONS",
    "DataConfig",
    "RunConfig",
    "TrainConfig",
    "build_section",
    "check_settings",
    "merge_sections",
    "read_yaml",
]
