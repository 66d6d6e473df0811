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
settings over it (:meth:`~moe_lit.configbase.ConfigBase.check_settings`,
:meth:`~moe_lit.configbase.ConfigBase.with_overrides`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from moe_lit.configbase import ConfigBase, ConfigError, is_int, load_yaml, require, require_positive_int
from moe_lit.lit.optim import EXTEND_SCHEDULE, OptimConfig
from moe_lit.lit.precision import PRECISIONS

DEFAULT_EVALUATIONS = 8
"""Validations per run when ``train.val_every`` is not set."""


BUDGETS = ("max_tokens", "max_steps")
"""TrainConfig's budget fields: a run sets exactly one."""


def _positive(value: Any, name: str, allow_none: bool = False) -> None:
    """An integer >= 1 (or null when ``allow_none``)."""
    if value is not None or not allow_none:
        require_positive_int(value, name)


@dataclass
class DataConfig(ConfigBase):
    """Which prepared tokens a run reads, and how (the ``MoEDataModule`` arguments)."""

    section: ClassVar[str] = "data"

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
        workers = self.num_workers
        require(is_int(workers) and workers >= 0, "num_workers", f"must be an integer >= 0, got {workers!r}")
        languages = self.languages
        require(
            languages is None
            or (isinstance(languages, list) and bool(languages) and all(isinstance(lang, str) for lang in languages)),
            "languages",
            f"must be a non-empty list of language codes, got {languages!r}",
        )
        weights = self.language_weights
        require(
            weights is None or isinstance(weights, dict),
            "language_weights",
            f"must be a mapping language -> weight, got {weights!r}",
        )

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
class TrainConfig(ConfigBase):
    """How long a run trains, how often it validates and checkpoints, and its seed."""

    section: ClassVar[str] = "train"

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
    deterministic: bool = False
    """torch's deterministic algorithms (Lightning's ``deterministic``): a CUDA run repeats its
    bits for the same seed, or stops with torch's error at an op without a deterministic kernel;
    false: torch's default kernels."""

    def __post_init__(self) -> None:
        if (self.max_tokens is None) == (self.max_steps is None):
            raise ConfigError(
                f"max_tokens: set exactly one of max_tokens and max_steps, got max_tokens={self.max_tokens!r}, "
                f"max_steps={self.max_steps!r}"
            )
        _positive(self.max_tokens, "max_tokens", allow_none=True)
        if self.max_steps is not None and (not is_int(self.max_steps) or self.max_steps < 0):
            raise ConfigError(f"max_steps: must be an integer >= 0 (0 = validate only), got {self.max_steps!r}")
        _positive(self.val_every, "val_every", allow_none=True)
        _positive(self.checkpoint_every, "checkpoint_every", allow_none=True)
        if not is_int(self.seed):
            raise ConfigError(f"seed: must be an integer, got {self.seed!r}")
        if not isinstance(self.compile, bool):
            raise ConfigError(f"compile: must be true or false, got {self.compile!r}")
        if not isinstance(self.deterministic, bool):
            raise ConfigError(f"deterministic: must be true or false, got {self.deterministic!r}")
        if self.extend_schedule not in EXTEND_SCHEDULE:
            raise ConfigError(
                f"extend_schedule: got {self.extend_schedule!r}, allowed values: {', '.join(EXTEND_SCHEDULE)}"
            )
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ConfigError(f"precision: got {self.precision!r}, allowed values: {', '.join(PRECISIONS)}, null")

    @classmethod
    def overridden(cls, data: dict[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
        """A new budget (max_tokens or max_steps) replaces the old one."""
        return {**data, **dict.fromkeys(BUDGETS)} if set(BUDGETS) & set(changes) else data

    def steps(self, tokens_per_step: int) -> int:
        """Optimizer steps of the run."""
        return self.max_steps if self.max_steps is not None else self.max_tokens // tokens_per_step

    def eval_every(self, tokens_per_step: int) -> int:
        return self.val_every or max(1, self.steps(tokens_per_step) // DEFAULT_EVALUATIONS)


@dataclass
class RunConfig(ConfigBase):
    """One training run's settings besides the model (see the module docstring)."""

    section: ClassVar[str] = "run"

    data: DataConfig = field(default_factory=DataConfig)
    """The data module's settings."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW and the learning-rate schedule (the schedule spans the whole run)."""
    train: TrainConfig = field(default_factory=lambda: TrainConfig(max_steps=100))
    """Budget, validation and checkpoint cadence, seed."""
    trainer: dict[str, Any] = field(default_factory=dict)
    """Extra Lightning Trainer arguments (replace train_run's defaults; callbacks are not allowed here)."""

    def __post_init__(self) -> None:
        self.data = DataConfig.from_dict(self.data, "data")
        self.optim = OptimConfig.from_dict(self.optim, "optim")
        self.train = TrainConfig.from_dict(self.train, "train")
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

    @classmethod
    def from_experiment(cls, path: str | Path) -> tuple[Any, RunConfig]:
        """(ModelConfig, RunConfig) of a LightningCLI experiment YAML (``moe-lit fit --config``):
        its ``data``, ``model.optim``, ``train`` and ``trainer`` sections, ``seed_everything`` as
        train.seed, the trainer's max_steps and integer val_check_interval and the checkpoint's
        every_n_train_steps as train's fields where train leaves them unset; ``model.model``
        (inline or a path relative to the YAML) is the model. The sections' translation is
        :func:`moe_lit.lit.trainer.experiment_run`, the one ``moe-lit fit`` uses."""
        from moe_lit.config import ModelConfig
        from moe_lit.lit.trainer import experiment_run

        path = Path(path)
        config = read_yaml(path, "experiment")
        module = _section_file(config.get("model") or {}, path, "model")
        model = _section_file(module.get("model") or {}, path, "model.model")
        sections = {
            **config,
            "model": module,
            "data": _section_file(config.get("data") or {}, path, "data"),
            "trainer": _section_file(config.get("trainer") or {}, path, "trainer"),
        }
        return ModelConfig.from_dict(model), experiment_run(sections)


def read_yaml(path: str | Path, what: str) -> dict[str, Any]:
    """The mapping in a YAML file; a missing file, bad YAML or a non-mapping is a one-line ConfigError."""
    return load_yaml(Path(path), what)


def _section_file(value: Any, owner: Path, name: str) -> dict[str, Any]:
    """A YAML section given inline or as a path relative to the file that names it."""
    if isinstance(value, str):
        return read_yaml(owner.parent / value, name)
    if not isinstance(value, dict):
        raise ConfigError(f"{name}: expected a mapping or a YAML path, got {type(value).__name__}")
    return value


__all__ = ["BUDGETS", "DataConfig", "RunConfig", "TrainConfig", "read_yaml"]
