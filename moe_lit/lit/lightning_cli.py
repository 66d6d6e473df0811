"""``moe-lit fit|validate|test``: LightningCLI over MoELitModule and MoEDataModule.

Configs compose from YAML files in ``configs/`` (``--config configs/experiments/tiny-moe.yaml``,
or ``--model configs/model/tiny-moe.yaml --trainer configs/trainer/cpu.yaml``). The vocabulary
size comes from the prepared data (``data.vocab_size`` after the datamodule is built) and the
sequence length from ``data.seq_len``; neither is set in a model YAML.

The Trainer is the one builder's, as train_run's: the parsed ``data``, ``model.optim``, ``train``
(TrainConfig's fields) and ``trainer`` sections make a RunConfig (:func:`moe_lit.lit.trainer.experiment_run`;
``trainer.max_steps``, an integer ``trainer.val_check_interval`` and ``seed_everything`` stand for
train's fields left unset), and :func:`moe_lit.lit.trainer.trainer_arguments` builds the Trainer of
it. Every run gets, besides the configured callbacks, a ModelCheckpoint (``last.ckpt`` at every
validation, or every ``train.checkpoint_every`` steps; ``--checkpoint.*`` changes its other
arguments), a RoutingMonitor (every ``trainer.log_every_n_steps``), a ``divergence`` guard
(DivergenceGuard: a non-finite loss stops the run with one line and exit 2; ``--divergence.policy
skip`` skips such steps instead), a ThroughputMonitor (tokens/s, FLOPs/s and, on devices with a
known peak, MFU), a progress bar (on a terminal MoEProgressBar, one line: step / max_steps, ETA,
loss, lr, tokens/s, load imbalance, ...; else StepLines, plain lines for logs; unless
``trainer.enable_progress_bar`` is false), a ``Preemption`` handler (SIGTERM, SIGINT or SIGUSR1:
``last.ckpt`` at the next step boundary, one line with the command that resumes, exit 128 +
signal), a ``ThreadShare`` (a CPU run's threads: the cores other processes leave free), a model
summary with the analytic FLOPs per token (MoEModelSummary; unless ``trainer.enable_model_summary``
is false) and a CSV logger in the run directory (``--trainer.logger
lightning.pytorch.loggers.TensorBoardLogger`` for TensorBoard).

Every run writes into one run directory (``--out DIR``, or ``--trainer.default_root_dir DIR``, or
the ``save_dir`` of a logger configured with one; by default the run holding ``--ckpt_path``,
else ``runs/<first --config's stem>``, else ``runs/<subcommand>``), with a fixed layout::

    DIR/checkpoints/last.ckpt           the checkpoints (printed at the end of fit)
    DIR/logs/<segment>/metrics.csv      one log folder per invocation, with its config.yaml

``<segment>`` is ``fit`` for a fresh run, ``fit-step<N>`` for a resume from a checkpoint at step
N, ``validate-step<N>`` / ``test-step<N>`` for an evaluation of one: a name that follows from
the inputs, so a resume or validate never opens a new ``version_N`` and a rerun of the same
command replaces its own log. A fresh ``fit`` refuses a non-empty DIR, saying which flag probably
fits: ``--resume`` continues it from ``DIR/checkpoints/last.ckpt`` (the same command plus
``--resume``, e.g. after an interrupt), ``--force`` replaces it. A requeued SLURM job
(``SLURM_RESTART_COUNT`` > 0) continues its run from ``last.ckpt`` as if given ``--resume``.

``--ckpt_path`` takes a Lightning ``.ckpt`` (loaded with ``weights_only=True``; resume with
``moe-lit fit --config ... --ckpt_path DIR/checkpoints/last.ckpt``) or an exported directory
(fit starts from its weights, validate and test evaluate them). The model section and, unless
given, ``data.seq_len`` come from it, so ``moe-lit validate --ckpt_path CK --data.data_dir D``
needs no config. A resume continues its run as it was (``moe_lit.lit.resume``): model, optim or
``data.seq_len`` settings given with another value than the checkpoint's, or data of another
vocabulary or tokenizer, are one line and exit 2. ``--init_from PATH`` (a ``.ckpt`` or an
exported directory) starts a new run from its weights instead: its model, a fresh optimizer,
schedule and step, any data of its vocabulary size. A resume with another ``max_steps`` keeps the
run's lr schedule (``--train.extend_schedule replan`` re-plans it); one line says which.

``validate`` and ``test`` print one table, a row per language (loss and perplexity), then overall.

A config mistake (unknown key, wrong type, invalid value) prints one line naming the key and exits
with status 2, like every other ``moe-lit`` error.
"""

from __future__ import annotations

import argparse
import codecs
import dataclasses
import inspect
import os
import re
import shutil
import signal
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import ActionYesNo
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from moe_lit._compat import require_tested
from moe_lit.callbacks import DivergenceGuard
from moe_lit.callbacks.preemption import Preemption, exit_status
from moe_lit.checkpoint import checkpoint_config, read_lightning_checkpoint
from moe_lit.config import ModelConfig
from moe_lit.configbase import yaml_problem
from moe_lit.convert.model_input import load_any_config, load_any_model
from moe_lit.errors import MoeLitError
from moe_lit.io import check_output
from moe_lit.lit.console import MoEModelSummary, evaluation_table, quiet_lightning
from moe_lit.lit.datamodule import MoEDataModule
from moe_lit.lit.module import MoELitModule
from moe_lit.lit.optim import OptimConfig
from moe_lit.lit.resume import (
    WEIGHTS_HINT,
    check_resumed_data,
    check_resumed_model,
    existing_run_message,
    fit_resume_command,
    requeued_run,
    resume_checkpoint,
    resumed_precision,
)
from moe_lit.lit.run_config import RunConfig, TrainConfig
from moe_lit.lit.trainer import CHECKPOINT_ARGUMENTS, experiment_run, trainer_arguments

LIGHTNING_CKPT_NAMES = ("last", "best", "hpc")
"""``--ckpt_path`` values Lightning resolves itself (``last``: the newest checkpoint of the run's
ModelCheckpoint, or a fresh start when there is none); it loads them with weights_only=True too."""
DEFAULT_LOG_DIR = "runs"
"""The parent of the default run directories (``runs/<config stem>``)."""
CHECKPOINT_DEFAULTS = {f"checkpoint.{k}": v for k, v in CHECKPOINT_ARGUMENTS.items()}
"""The run's ModelCheckpoint arguments (the builder's), which ``--checkpoint.*`` changes."""
TRAIN_DEFAULTS = {f"train.{field.name}": None for field in dataclasses.fields(TrainConfig)}
"""Every ``train`` field unset: TrainConfig's default, or what the trainer section says (budget,
validation cadence) when left unset."""
LIGHTNING_LOG_EVERY = 50
"""Lightning's ``log_every_n_steps`` when a trainer config leaves it null: validate's and test's."""


class MoELightningCLI(LightningCLI):
    """LightningCLI with our links, the one Trainer builder and one-line config errors."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.seq_len", "model.model.seq_len", apply_on="parse")
        parser.link_arguments("data.vocab_size", "model.model.vocab_size", apply_on="instantiate")
        # NOTE: the run's checkpoint is the builder's; these are arguments over it, not a callback.
        parser.add_class_arguments(ModelCheckpoint, "checkpoint", instantiate=False)
        parser.set_defaults(CHECKPOINT_DEFAULTS)
        parser.add_lightning_class_args(DivergenceGuard, "divergence")
        # NOTE: TrainConfig's fields and docstrings are the options; RunConfig checks the values.
        parser.add_class_arguments(TrainConfig, "train", instantiate=False)
        parser.set_defaults(TRAIN_DEFAULTS)
        parser.add_argument(
            "--out",
            type=str | None,
            default=None,
            help="run directory: checkpoints/, logs/<segment>/ (default: the run of --ckpt_path, "
            "else runs/<first --config's stem>, else runs/<subcommand>); same as --trainer.default_root_dir",
        )
        parser.add_argument(
            "--force", action=ActionYesNo, default=False, help="fit: replace a non-empty --out (a fresh run)"
        )
        parser.add_argument(
            "--resume",
            action=ActionYesNo,
            default=False,
            help="fit: continue the run in --out from its checkpoints/last.ckpt (e.g. after an interrupt)",
        )
        parser.add_argument(
            "--init_from",
            type=str | None,
            default=None,
            help="fit: a new run from the weights of a .ckpt or exported model (its model, fresh optimizer, "
            "schedule and step; other data allowed): fine-tuning, not resuming",
        )

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        self.argv = list(args)
        try:
            super().parse_arguments(parser, args)
        except argparse.ArgumentError as exc:
            raise MoeLitError(broken_yaml(args) or config_error_line(str(exc))) from exc
        except UnicodeDecodeError as exc:  # e.g. a .ckpt given to --config
            raise MoeLitError(f"{binary_argument(args)}: not a YAML file; a checkpoint goes to --ckpt_path") from exc
        section = self._section()
        validate_module_config(section["model"])
        seed = section["train"]["seed"]
        if seed is not None:  # NOTE: the CLI seeds before it builds anything, as train_run does
            section["seed_everything"] = seed
        absolute_data_dir(section["data"])

    @override
    def _parse_ckpt_path(self) -> None:
        # NOTE: `--ckpt_path` is read first by our loader (weights_only=True, one line naming the file
        # when it is missing, corrupt or holds code), then Lightning parses its hyper-parameters.
        # Lightning's hook is private: a rename would skip this check silently.
        require_tested("lightning")
        section = self._section()
        if section.get("weights_only") is False:
            raise MoeLitError(
                "weights_only: false is refused; checkpoints load with weights_only=True (never run code)"
            )
        if "weights_only" in section:
            section["weights_only"] = True
        subcommand = self.config["subcommand"]
        last = last_checkpoint(section, run_dir_of(section, subcommand))
        init_from = section.get("init_from")
        if init_from and (section.get("resume") or section.get("ckpt_path")):
            raise MoeLitError("--init_from starts a new run from weights, --resume/--ckpt_path continue one: give one")
        if section.get("resume"):
            section["ckpt_path"] = str(resume_checkpoint(last, section.get("ckpt_path"), section["force"]))
        elif subcommand == "fit" and not section.get("ckpt_path") and not init_from and requeued_run(last):
            section["ckpt_path"], section["force"] = str(last), False
        ckpt_path = section.get("ckpt_path") or init_from
        self.exported: Path | None = None
        self.start_step: int | None = None
        self.resumed: dict[str, Any] | None = None
        trained: ModelConfig | None = None
        given = given_model(section, self.argv)
        if ckpt_path and str(ckpt_path) not in LIGHTNING_CKPT_NAMES and not str(ckpt_path).startswith("registry"):
            if init_from or Path(ckpt_path).is_dir():
                trained = load_any_config(ckpt_path)
                if subcommand == "fit":
                    flag = "--init_from" if init_from else "--ckpt_path"
                    weights = {"hyper_parameters": {"model": trained.to_dict()}}
                    check_resumed_model(weights, given[0], None, flag, WEIGHTS_HINT)
                # NOTE: Lightning resumes from files only; an export's config goes in the model
                # section here and its weights into the module before the run (_start_from_export).
                self.exported, section["ckpt_path"] = Path(ckpt_path), None
                model = {"model": {"model": trained.to_dict()}}
                self.config = self.parser.parse_object({subcommand: model}, self.config)
            else:
                self.resumed = read_lightning_checkpoint(ckpt_path)
                self.start_step, trained = self.resumed.get("global_step"), checkpoint_config(self.resumed, ckpt_path)
                if subcommand == "fit":
                    check_resumed_model(self.resumed, *given, "--ckpt_path")
        default_seq_len = self._section()["data"]["seq_len"] == data_default("seq_len")
        if trained is not None and not default_seq_len and subcommand == "fit" and self.resumed is not None:
            seq_len = self._section()["data"]["seq_len"]
            if seq_len != trained.seq_len:
                raise MoeLitError(
                    f"--ckpt_path: data.seq_len is {trained.seq_len} in the checkpoint but {seq_len} given; "
                    "a resume continues the run as it was; --init_from starts a new run from its weights"
                )
        super()._parse_ckpt_path()
        if trained is not None and default_seq_len:
            # NOTE: the link data.seq_len -> model.model.seq_len ran at parse time, with the default.
            self._section()["data"]["seq_len"] = self._section()["model"]["model"]["seq_len"] = trained.seq_len
        # NOTE: a train mistake is one line before any output; after the checks of what a resume resumes.
        self.run_config(self._section()["trainer"].as_dict())

    def _section(self) -> Any:
        """The parsed config of the running subcommand."""
        return self.config[self.config["subcommand"]] if "subcommand" in self.config else self.config

    def run_config(self, trainer: dict[str, Any]) -> RunConfig:
        """The RunConfig of the parsed sections with the Trainer arguments ``trainer`` (parsed, or
        built); validate and test train nothing, so their budget and ``train.precision`` go."""
        section = self._section()
        data = section["data"].as_dict()
        if data.get("data_dir") is not None:
            data["data_dir"] = os.fspath(data["data_dir"])
        train = section["train"].as_dict()
        if self.config["subcommand"] != "fit":
            # NOTE: no budget, so no cadence to derive the log's from: Lightning's.
            train.update(max_tokens=None, max_steps=0, precision=None)
            trainer = {**trainer, "log_every_n_steps": trainer.get("log_every_n_steps") or LIGHTNING_LOG_EVERY}
        sections = {
            "seed_everything": section.get("seed_everything"),
            "data": data,
            "model": {"optim": section["model"]["optim"].as_dict()},
            "train": train,
            "trainer": trainer,
            "checkpoint": section["checkpoint"].as_dict(),
        }
        return experiment_run(sections)

    @override
    def before_instantiate_classes(self) -> None:
        subcommand = self.config["subcommand"]
        section = self._section()
        self.run_dir = use_run_dir(section, subcommand, self.start_step)
        self.resume_command: str | None = None
        if subcommand == "fit":
            last = last_checkpoint(section, self.run_dir)
            steps = self.run_config(section["trainer"].as_dict()).steps
            prepare_fit_dir(self.run_dir, section.get("ckpt_path"), self.exported, section["force"], last, steps)
            self.resume_command = fit_resume_command(self.argv, self.run_dir)

    def validate(self, **kwargs: Any) -> None:
        """``trainer.validate``, its metrics printed as one table (a row per language)."""
        self._evaluate("val", self.trainer.validate, kwargs)

    def test(self, **kwargs: Any) -> None:
        """``trainer.test``, its metrics printed as one table (a row per language)."""
        self._evaluate("test", self.trainer.test, kwargs)

    def _evaluate(self, stage: str, method: Any, kwargs: dict[str, Any]) -> None:
        # NOTE: Lightning's own printout repeats the epoch-level metrics under one column per
        # dataloader (language) without naming them; the table names the languages instead.
        results = method(**{**kwargs, "verbose": False})
        if not results or not self.trainer.is_global_zero:
            return
        from moe_lit.accounting import markdown_table

        languages = self.model.language_names(len(results))
        print(markdown_table(evaluation_table(results[0], stage, languages)))

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Any:
        # NOTE: the one Trainer builder, as train_run's; here, not at parsing: the probe of
        # train.precision auto trains the built model (its vocabulary comes from the data).
        subcommand = self.config["subcommand"]
        section = self._section()
        trainer = self._get(self.config_init, "trainer").as_dict()
        self.run = self.run_config(trainer)
        callbacks = [*(trainer.get("callbacks") or []), self._get(self.config_init, "divergence")]
        callbacks.append(Preemption(resume=self.resume_command, label=f"moe-lit {subcommand}"))
        if trainer.get("enable_model_summary") is not False:
            callbacks.append(MoEModelSummary())
        checkpoint = {k: v for k, v in section["checkpoint"].as_dict().items() if k != "every_n_train_steps"}
        resumed = resumed_precision(self.resumed) if subcommand == "fit" else None
        arguments = trainer_arguments(
            self.run, self.run_dir, self.model.model, callbacks, trainer.get("logger"), checkpoint, resumed
        )
        if "precision" in arguments:  # NOTE: the saved config.yaml records the precision the run chose
            section["trainer"]["precision"] = arguments["precision"]
        return self._instantiate_trainer({**arguments, **kwargs}, [])

    @override
    def instantiate_classes(self) -> None:
        # NOTE: only building the objects is wrapped: an error while training is never a config error.
        try:
            super().instantiate_classes()
        except MoeLitError:
            raise
        except (argparse.ArgumentError, ValueError, TypeError) as exc:
            line = config_error_line(str(exc))
            if "`tensorboard`" in line:
                # NOTE: tensorboard is an extra, only Lightning's TensorBoardLogger uses it.
                line += " (TensorBoardLogger: pip install 'moe_lit[tensorboard]')"
            raise MoeLitError(line) from exc

    def before_fit(self) -> None:
        self._check_resumed_data()
        if isinstance(self.model, MoELitModule):
            self.model.extend_schedule = self.run.train.extend_schedule
        self._start_from_export()

    def before_validate(self) -> None:
        self._check_resumed_data()
        self._start_from_export()

    def before_test(self) -> None:
        self._check_resumed_data()
        self._start_from_export()

    def _check_resumed_data(self) -> None:
        """A ``--ckpt_path`` checkpoint needs the data it was trained on (its vocabulary and tokenizer)."""
        if self.resumed is not None and isinstance(self.datamodule, MoEDataModule):
            check_resumed_data(self.resumed, self.datamodule, "--ckpt_path")

    def after_fit(self) -> None:
        # NOTE: Trainer.log_dir is a broadcast (a collective): called on rank 0 only, it waits for
        # ranks that have already left. The logger's own log_dir is the same path, read locally.
        if self.trainer.is_global_zero:
            checkpoint = self.trainer.checkpoint_callback
            path = getattr(checkpoint, "last_model_path", "") or getattr(checkpoint, "best_model_path", "")
            print(f"fit: checkpoint {path or '(none written)'}; logs {local_log_dir(self.trainer)}", flush=True)

    def _start_from_export(self) -> None:
        """The weights of an exported ``--ckpt_path`` directory, into the module built from its config."""
        if self.exported is None:
            return
        try:
            self.model.model.load_state_dict(load_any_model(self.exported).state_dict())
        except RuntimeError as exc:
            raise MoeLitError(
                f"--ckpt_path: the weights of {self.exported} do not fit the configured model (is data.vocab_size "
                f"{self.model.config.vocab_size} its vocabulary?)"
            ) from exc


def local_log_dir(trainer: Any) -> str | None:
    """``Trainer.log_dir`` read on this rank alone (the property broadcasts it from rank 0)."""
    if not trainer.loggers:
        return trainer.default_root_dir
    logger = trainer.loggers[0]
    return getattr(logger, "log_dir", None) or logger.save_dir


def binary_argument(args: Any) -> str:
    """The first command-line value naming a file that is not UTF-8 text (``a config file`` if none)."""
    for value in args if isinstance(args, list | tuple) else []:
        path = Path(str(value))
        try:
            if path.is_file():
                with path.open("rb") as handle:  # a cut multi-byte character at the end is fine (final=False)
                    codecs.getincrementaldecoder("utf-8")().decode(handle.read(4096))
        except UnicodeDecodeError:
            return str(path)
        except OSError:
            continue
    return "a config file"


def broken_yaml(args: Any) -> str | None:
    """``FILE: not valid YAML (line L, column C: problem)`` for the first command-line value naming a
    YAML file that does not parse (jsonargparse's message names neither); None when none."""
    for value in args if isinstance(args, list | tuple) else []:
        path = Path(str(value).split("=", 1)[-1])  # --config=FILE too
        if path.suffix not in (".yaml", ".yml") or not path.is_file():
            continue
        try:
            yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            return f"{path}: not valid YAML ({yaml_problem(exc)})"
        except (OSError, UnicodeDecodeError):
            continue
    return None


def absolute_data_dir(data: Any) -> None:
    """``data.data_dir`` as the absolute path it resolved to (against its config file or the cwd; when
    unset, the data pipeline's default: ``$MOE_LIT_DATA``, else ``data_cache/default`` of the checkout,
    else of the cwd), so that the saved ``config.yaml`` and the checkpoint name the same directory."""
    data_dir = data.get("data_dir")
    if data_dir is None:
        from moe_lit.data.layout import default_data_dir

        data["data_dir"] = os.path.abspath(default_data_dir())
    elif isinstance(data_dir, os.PathLike):
        data["data_dir"] = type(data_dir)(os.path.normpath(os.fspath(data_dir)))


def validate_module_config(model_section: Any) -> None:
    """Build the model and optim dataclasses once, right after parsing, so that their ConfigError
    (one line naming the field) comes before any run output; the linked vocab size is checked later."""
    ModelConfig.from_dict(model_section["model"].as_dict())
    OptimConfig(**model_section["optim"].as_dict())


def given_model(section: Any, argv: Sequence[str]) -> tuple[ModelConfig | None, OptimConfig | None]:
    """The model and the optim settings of the command line where it gives them (``--model.model.*``
    / ``--model.optim.*`` arguments, a ``--model`` file, or a ``--config`` file with a ``model``
    section); None where not given (a resume or an evaluation then takes the checkpoint's)."""
    configs = [Path(str(config)) for config in section.get("config") or []]
    whole = any(arg.split("=", 1)[0] == "--model" for arg in argv) or any(_has_model(c) for c in configs)
    model = section["model"]
    has_model = whole or any(arg.startswith("--model.model") for arg in argv)
    has_optim = whole or any(arg.startswith("--model.optim") for arg in argv)
    return (
        ModelConfig.from_dict(model["model"].as_dict()) if has_model else None,
        OptimConfig(**model["optim"].as_dict()) if has_optim else None,
    )


def _has_model(config: Path) -> bool:
    try:
        doc = yaml.safe_load(config.read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return False
    return isinstance(doc, dict) and "model" in doc


def data_default(name: str) -> Any:
    """The default of a MoEDataModule argument."""
    from moe_lit.lit.datamodule import MoEDataModule

    return inspect.signature(MoEDataModule).parameters[name].default


def run_dir_of(section: Any, subcommand: str) -> Path:
    """``--out``, else ``trainer.default_root_dir``, else a ``save_dir`` given to the logger, else
    the run holding ``--ckpt_path`` (``<run>/checkpoints/x.ckpt``), else ``runs/<first --config's
    stem>``, else ``runs/<subcommand>``."""
    save_dir = getattr(getattr(section["trainer"].get("logger"), "init_args", None), "save_dir", None)
    custom_save_dir = save_dir if save_dir not in (None, DEFAULT_LOG_DIR) else None
    chosen = section.get("out") or section["trainer"].get("default_root_dir") or custom_save_dir
    if chosen:
        return Path(chosen)
    ckpt_path = section.get("ckpt_path")
    if ckpt_path and Path(ckpt_path).is_file() and Path(ckpt_path).parent.name == "checkpoints":
        return Path(ckpt_path).parent.parent
    configs = section.get("config") or []
    return Path(DEFAULT_LOG_DIR) / (Path(str(configs[0])).stem if configs else subcommand)


def use_run_dir(section: Any, subcommand: str, start_step: int | None) -> Path:
    """Point the trainer, the default logger and the checkpoint callback at the run directory.

    NOTE: the logger's name and version are fixed (``logs/<segment>``) instead of Lightning's
    counter, and the checkpoints live beside the logs, not inside one version's folder, so a resume
    finds and continues the same ``checkpoints/``. A logger the user configured keeps its own
    ``save_dir``/``name``/``version`` wherever they differ from the defaults."""
    run_dir = run_dir_of(section, subcommand)
    trainer = section["trainer"]
    trainer["default_root_dir"] = str(run_dir)
    init_args = getattr(trainer.get("logger"), "init_args", None)
    if init_args is not None and getattr(init_args, "save_dir", None) == DEFAULT_LOG_DIR:
        init_args.save_dir = str(run_dir)
        if getattr(init_args, "name", None) in ("lightning_logs", "default"):
            init_args.name = "logs"
        if getattr(init_args, "version", None) is None:
            init_args.version = subcommand if start_step is None else f"{subcommand}-step{start_step}"
    if section["checkpoint"].get("dirpath") is None:
        section["checkpoint"]["dirpath"] = str(run_dir / "checkpoints")
    return run_dir


def last_checkpoint(section: Any, run_dir: Path) -> Path:
    """The run's ``last.ckpt`` (in ``checkpoint.dirpath``, by default ``run_dir/checkpoints``)."""
    return Path(section["checkpoint"].get("dirpath") or run_dir / "checkpoints") / "last.ckpt"


def prepare_fit_dir(
    run_dir: Path, ckpt_path: Any, exported: Path | None, force: bool, last: Path, max_steps: int | None
) -> None:
    """A resume (``--ckpt_path`` inside the run, or ``--resume``) continues ``run_dir``; a fresh fit
    needs it absent or empty, or ``--force`` (which removes it first; never the working directory or
    its parents). The refusal says whether ``--resume`` (a run stopped before ``max_steps`` with a
    checkpoint ``last``) or ``--force`` probably fits."""
    resolved = run_dir.resolve()
    source = Path(ckpt_path).resolve() if ckpt_path and Path(ckpt_path).is_file() else None
    if source is not None and resolved in source.parents:
        return
    check_output(run_dir, {"--ckpt_path": exported}, force=True)  # the input checks only
    if not force and run_dir.exists() and (run_dir.is_file() or any(run_dir.iterdir())):
        raise MoeLitError(existing_run_message(run_dir, last, max_steps))
    if force and run_dir.exists():
        cwd = Path.cwd().resolve()
        if resolved == cwd or resolved in cwd.parents:
            raise MoeLitError(f"--out: {run_dir} holds the working directory; --force never removes it")
        shutil.rmtree(run_dir) if run_dir.is_dir() else run_dir.unlink()


TRAINER_DEFAULTS = {
    "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": DEFAULT_LOG_DIR}}
}
"""The CLI's logger: a CSVLogger in the run directory (``use_run_dir``); the callbacks are the builder's."""


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
        # NOTE: jsonargparse refuses the unknown key; this only rewrites its message as one line.
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

    # NOTE: attribute docstrings (the line under each dataclass field) become --help text. Reading
    # them parses the source of every class the parser covers (the Trainer's and nn.Module's
    # included), most of the parser's build time, so only a run that prints help reads them.
    set_parsing_settings(docstring_parse_attribute_docstrings=any(arg in ("-h", "--help") for arg in argv))
    try:
        with warnings.catch_warnings(), quiet_lightning():
            # NOTE: argv is sys.argv's tail when run as `moe-lit`; Lightning warns about getting both.
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
            _run_cli(argv)
        leave_process_group()
    except SIGTERMException:  # Lightning's own stop outside training (Preemption handles it inside)
        return exit_status(signal.SIGTERM)
    except SystemExit as exc:  # --help and --print_config exit 0; an interrupted fit 128 + signal
        return exc.code if isinstance(exc.code, int) else 2
    return 0


def leave_process_group() -> None:
    """After a run that finished on every rank: the ranks meet once, then close their process group."""
    import torch.distributed as dist

    # NOTE: a process group left to the interpreter's exit is torn down while the other ranks'
    # connections close under it; gloo can then abort the process (SIGABRT, "terminate called
    # without an active exception") after a fit that succeeded. The barrier keeps rank 0's store
    # alive until every rank is done with it.
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _run_cli(argv: Sequence[str]) -> None:
    from moe_lit.lit.datamodule import MoEDataModule

    MoELightningCLI(
        MoELitModule,
        MoEDataModule,
        trainer_defaults=TRAINER_DEFAULTS,
        parser_kwargs={"exit_on_error": False, "allow_abbrev": False},  # --train.max_step is no --train.max_steps
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
        args=list(argv),
    )


__all__ = ["MoELightningCLI", "config_error_line", "run_lightning_cli"]
