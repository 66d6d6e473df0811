"""``moe-lit fit|validate|test``: LightningCLI over MoELitModule and MoEDataModule.

Configs compose from YAML files in ``configs/`` (``--config configs/experiments/tiny-moe.yaml``,
or ``--model configs/model/tiny-moe.yaml --trainer configs/trainer/cpu.yaml``). The vocabulary
size comes from the prepared data (``data.vocab_size`` after the datamodule is built) and the
sequence length from ``data.seq_len``; neither is set in a model YAML.

Every run gets, besides the configured ones, a ``checkpoint`` (ModelCheckpoint: ``last.ckpt``,
rewritten every 100 steps; ``--checkpoint.*`` changes it), a ``routing`` monitor
(RoutingMonitor), a ``divergence`` guard (DivergenceGuard: a non-finite loss stops the run with one
line and exit 2; ``--divergence.policy skip`` skips such steps instead), a ThroughputMonitor
(tokens/s, FLOPs/s and, on devices with a known peak, MFU), a RichProgressBar (unless
``trainer.enable_progress_bar`` is false) and a CSV logger under ``runs/``
(``--trainer.logger lightning.pytorch.loggers.TensorBoardLogger`` for TensorBoard).
``--trainer.default_root_dir DIR`` puts the run's logs, ``config.yaml`` and checkpoints under DIR
instead of ``runs/``. ``--ckpt_path`` checkpoints load with ``weights_only=True``.
Resume a run with ``moe-lit fit --config ... --ckpt_path .../last.ckpt``; with ``--ckpt_path`` the
model section comes from the checkpoint's hyper-parameters.

A config mistake (unknown key, wrong type, invalid value) prints one line naming the key and exits
with status 2, like every other ``moe-lit`` error.
"""

from __future__ import annotations

import argparse
import re
import warnings
from collections.abc import Sequence
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override

from moe_lit.callbacks import DivergenceGuard, RoutingMonitor
from moe_lit.callbacks.compile import CompileBlocks
from moe_lit.checkpoint import read_lightning_checkpoint
from moe_lit.config import ModelConfig
from moe_lit.errors import MoeLitError
from moe_lit.lit.module import MoELitModule
from moe_lit.lit.optim import OptimConfig
from moe_lit.lit.runner import throughput_monitor

LIGHTNING_CKPT_NAMES = ("last", "best", "hpc")
"""``--ckpt_path`` values Lightning resolves itself (``last``: the newest checkpoint of the run's
ModelCheckpoint, or a fresh start when there is none); it loads them with weights_only=True too."""
DEFAULT_LOG_DIR = "runs"
"""Where a run's logs and checkpoints go unless ``--trainer.default_root_dir`` says otherwise."""
CHECKPOINT_DEFAULTS = {"checkpoint.save_last": True, "checkpoint.every_n_train_steps": 100, "checkpoint.save_top_k": 0}


class MoELightningCLI(LightningCLI):
    """LightningCLI with our links, default callbacks and one-line config errors."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.seq_len", "model.model.seq_len", apply_on="parse")
        parser.link_arguments("data.vocab_size", "model.model.vocab_size", apply_on="instantiate")
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults(CHECKPOINT_DEFAULTS)
        parser.add_lightning_class_args(RoutingMonitor, "routing")
        parser.add_lightning_class_args(DivergenceGuard, "divergence")
        for name, help_text in TRAIN_FIELDS.items():
            parser.add_argument(f"--train.{name}", type=int | None, default=None, help=help_text)
        parser.add_argument("--train.compile", type=bool | None, default=None, help=TRAIN_COMPILE_HELP)

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        try:
            super().parse_arguments(parser, args)
        except argparse.ArgumentError as exc:
            raise MoeLitError(config_error_line(str(exc))) from exc
        validate_module_config(self._section()["model"])
        apply_train_section(self._section())

    @override
    def _parse_ckpt_path(self) -> None:
        # NOTE: `--ckpt_path` is read first by our loader (weights_only=True, one line naming the file
        # when it is missing, corrupt or holds code), then Lightning parses its hyper-parameters.
        section = self._section()
        if section.get("weights_only") is False:
            raise MoeLitError(
                "weights_only: false is refused; checkpoints load with weights_only=True (never run code)"
            )
        if "weights_only" in section:
            section["weights_only"] = True
        ckpt_path = section.get("ckpt_path")
        if ckpt_path and str(ckpt_path) not in LIGHTNING_CKPT_NAMES and not str(ckpt_path).startswith("registry"):
            read_lightning_checkpoint(ckpt_path)
        super()._parse_ckpt_path()

    def _section(self) -> Any:
        """The parsed config of the running subcommand."""
        return self.config[self.config["subcommand"]] if "subcommand" in self.config else self.config

    @override
    def before_instantiate_classes(self) -> None:
        # NOTE: the default RichProgressBar goes when the config turns the progress bar off
        # (Lightning refuses a progress-bar callback with enable_progress_bar=False).
        trainer = self._section()["trainer"]
        if trainer.get("enable_progress_bar") is False:
            callbacks = self.trainer_defaults.get("callbacks", [])
            self.trainer_defaults["callbacks"] = [c for c in callbacks if not isinstance(c, RichProgressBar)]
        follow_root_dir(trainer)
        if (self._section().get("train") or {}).get("compile"):
            # NOTE: trainer_defaults' callbacks come after the configured ones (upcycling swaps included).
            self.trainer_defaults["callbacks"] = [*self.trainer_defaults.get("callbacks", []), CompileBlocks()]

    @override
    def instantiate_classes(self) -> None:
        # NOTE: only building the objects is wrapped: an error while training is never a config error.
        try:
            super().instantiate_classes()
        except MoeLitError:
            raise
        except (argparse.ArgumentError, ValueError, TypeError) as exc:
            raise MoeLitError(config_error_line(str(exc))) from exc


TRAIN_FIELDS = {
    "max_tokens": "token budget: trainer.max_steps = max_tokens // (data.seq_len * data.batch_size)",
    "max_steps": "step budget (trainer.max_steps)",
    "val_every": "optimizer steps between validations (trainer.val_check_interval, across epochs)",
    "checkpoint_every": "optimizer steps between checkpoints (checkpoint.every_n_train_steps)",
    "seed": "seed of the run (seed_everything)",
}
"""The ``train`` section: moe_lit.lit.run_config.TrainConfig, the same section train_run reads."""
TRAIN_COMPILE_HELP = "torch.compile each transformer block (moe_lit.callbacks.compile.CompileBlocks)"


def apply_train_section(section: Any) -> None:
    """Turn a ``train`` section (RunConfig's names, shared with train_run and the studies) into the
    Trainer, checkpoint and seed settings it means; fields left unset change nothing."""
    from moe_lit.lit.run_config import TrainConfig

    train = {k: v for k, v in (section.get("train") or {}).items() if v is not None}
    if not train:
        return
    budget = {k: train[k] for k in ("max_tokens", "max_steps") if k in train}
    try:
        cfg = TrainConfig(**({"max_steps": section["trainer"].get("max_steps") or 1} if not budget else {}), **train)
    except MoeLitError as exc:
        raise MoeLitError(f"train.{exc}") from None
    if budget:
        section["trainer"]["max_steps"] = cfg.steps(section["data"]["seq_len"] * section["data"]["batch_size"])
    if cfg.val_every is not None:
        section["trainer"]["val_check_interval"] = cfg.val_every
        section["trainer"]["check_val_every_n_epoch"] = None
    if cfg.checkpoint_every is not None:
        section["checkpoint"]["every_n_train_steps"] = cfg.checkpoint_every
    if "seed" in train:
        section["seed_everything"] = cfg.seed


def validate_module_config(model_section: Any) -> None:
    """Build the model and optim dataclasses once, right after parsing, so that their ConfigError
    (one line naming the field) comes before any run output; the linked vocab size is checked later."""
    ModelConfig.from_dict(model_section["model"].as_dict())
    OptimConfig(**model_section["optim"].as_dict())


def follow_root_dir(trainer: Any) -> None:
    """``trainer.default_root_dir`` decides where the run's logs, config and checkpoints go.

    NOTE: the logger's ``save_dir`` defaults to ``runs`` (so a run without either option lands in
    ``runs/``); Lightning puts checkpoints under the logger's directory, so that default would win
    over ``default_root_dir``. A ``save_dir`` the user set to anything else still wins."""
    root, logger = trainer.get("default_root_dir"), trainer.get("logger")
    init_args = getattr(logger, "init_args", None)
    if root is not None and init_args is not None and getattr(init_args, "save_dir", None) == DEFAULT_LOG_DIR:
        init_args.save_dir = str(root)


def _trainer_defaults() -> dict[str, Any]:
    return {
        "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": DEFAULT_LOG_DIR}},
        "callbacks": [RichProgressBar(), throughput_monitor()],
    }


_KEY = re.compile(r'Parser key "([^"]+)":\s*(.*)')
_UNKNOWN = (
    re.compile(r"Option '([^']+)' is not accepted"),
    re.compile(r"does not accept option '([^']+)'"),
    re.compile(r"unrecognized arguments: --?(\S+)"),
)
_NOISE = ("Does not validate against", "Subtypes:", "Errors:", "Problem with given class_path", "Given value")


def config_error_line(message: str) -> str:
    """One line ``<key>: <problem>`` from a (nested, multi-line) jsonargparse error message."""
    keys, details = [], []
    for raw in str(message).splitlines():
        line = raw.strip().removeprefix("- ").strip()
        if not line or line.startswith("usage:") or line.startswith(_NOISE) or "<class 'NoneType'>" in line:
            continue
        match = _KEY.match(line)
        if match:
            keys.append(match.group(1))
            line = match.group(2)
        for pattern in _UNKNOWN:
            unknown = pattern.search(line)
            if unknown:
                keys.append(unknown.group(1))
                line = "unknown key"
        if line:
            details.append(re.sub(r"<class '([\w.]+)'>", r"\1", line).replace("Expected a ", "expected "))
    detail = details[0] if details else "invalid value"
    return f"{'.'.join(keys)}: {detail}" if keys else detail


def run_lightning_cli(argv: Sequence[str]) -> int:
    """Run ``fit|validate|test`` with ``argv`` (subcommand first); config errors raise MoeLitError."""
    from jsonargparse import set_parsing_settings

    # NOTE: attribute docstrings (the line under each dataclass field) become --help text.
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    try:
        with warnings.catch_warnings():
            # NOTE: argv is sys.argv's tail when run as `moe-lit`; Lightning warns about getting both.
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
            _run_cli(argv)
    except SystemExit as exc:  # --help and --print_config exit 0
        return exc.code if isinstance(exc.code, int) else 2
    return 0


def _run_cli(argv: Sequence[str]) -> None:
    from moe_lit.lit.datamodule import MoEDataModule

    MoELightningCLI(
        MoELitModule,
        MoEDataModule,
        trainer_defaults=_trainer_defaults(),
        parser_kwargs={"exit_on_error": False},
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
        args=list(argv),
    )


__all__ = ["MoELightningCLI", "config_error_line", "run_lightning_cli"]
