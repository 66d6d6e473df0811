"""``moe-lit distill``: train a student on a frozen teacher's logits and the data (MoE -> dense, recovery).

The student (``--student``, a ``.ckpt`` or exported dir, e.g. the output of ``convert
moe-to-dense``) starts from its weights with a fresh optimizer; the teacher (``--teacher``) stays
frozen. Training is :func:`~moe_lit.lit.run.train_run` with a
:class:`~moe_lit.lit.distill.DistillModule` (forward KL at ``distill.temperature`` mixed with the
LM loss), so logs, checkpoints and validation are those of every other run. Its settings are the
run YAML ``--config`` (``configs/runs/distill.yaml``: data, optim, train, trainer and distill
sections) with ``--SECTION.FIELD VALUE`` words over it (``--train.max_tokens 65536``). ``--out`` receives
``metrics.csv``, ``checkpoints/``, ``model/`` (the distilled student, exported with the student's
tokenizer) and ``distill.json`` (the run's result and settings).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from moe_lit.config import ModelConfig
from moe_lit.configbase import dotted, load_yaml
from moe_lit.errors import MoeLitError
from moe_lit.lit.distill import DistillConfig
from moe_lit.lit.optim import OptimConfig
from moe_lit.lit.run_config import RunConfig
from moe_lit.resources import CONFIGS_DIR

MODEL_DIR, REPORT = "model", "distill.json"
RUN = CONFIGS_DIR / "runs/distill.yaml"
"""The default ``--config``."""


@dataclass
class DistillSettings(RunConfig):
    """A distillation's ``--config``: the run's sections, and the distillation loss's."""

    distill: DistillConfig = field(default_factory=DistillConfig)
    """The weights of the distillation loss (temperature, KL and CE weights)."""

    def run(self) -> RunConfig:
        """The run's sections alone (what train_run takes)."""
        return RunConfig(self.data, self.optim, self.train, self.trainer)


SETTINGS_CHECK = DistillSettings.check_settings
"""``--SECTION.FIELD VALUE`` words over ``--config`` (moe_lit.console_script): the run's sections and distill."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "Run settings: --SECTION.FIELD VALUE over the --config YAML (sections data, optim, train, trainer, distill), "
        "e.g. --train.max_tokens 65536 --data.data_dir DIR --optim.lr 1e-4 --distill.temperature 2."
    )
    parser.add_argument("--teacher", required=True, type=Path, help="frozen teacher: .ckpt or exported dir")
    parser.add_argument("--student", required=True, type=Path, help="student to train: .ckpt or exported dir")
    parser.add_argument("--config", type=Path, default=RUN, help="run YAML (default: configs/runs/distill.yaml)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out")
    parser.add_argument("--out", required=True, type=Path, help="run directory to write")


def teacher_student_module(cfg: ModelConfig, optim: OptimConfig, teacher, distill: DistillConfig):
    """A DistillModule over a fresh student of ``cfg`` and ``teacher`` (train_run's module factory)."""
    from moe_lit.lit.distill import DistillModule

    module = DistillModule(cfg, optim, distill)
    module.set_teacher(teacher)
    return module


def run(args: argparse.Namespace) -> int:
    from moe_lit.checkpoint import export_model, load_model
    from moe_lit.convert.model_input import load_any_model
    from moe_lit.data.tokenizer import find_tokenizer
    from moe_lit.io import atomic_write_json, check_output
    from moe_lit.lit.run import train_run

    config = DistillSettings.from_dict(DistillSettings.merge(load_yaml(args.config, "--config"), dotted(args.settings)))
    run_cfg, distill = config.run(), config.distill
    check_output(args.out, {"--teacher": args.teacher, "--student": args.student}, args.force)
    if args.force and args.out.exists():
        # NOTE: a run directory is appended to (metrics, checkpoints): replacing one means removing it.
        shutil.rmtree(args.out) if args.out.is_dir() else args.out.unlink()
    teacher = load_any_model(args.teacher)
    if run_cfg.data.seq_len > teacher.config.seq_len:
        seq_len = run_cfg.data.seq_len
        raise MoeLitError(f"data.seq_len: {seq_len} exceeds the teacher's seq_len {teacher.config.seq_len}")
    factory = partial(teacher_student_module, teacher=teacher, distill=distill)
    student = load_any_model(args.student)
    result = train_run(student.config, run_cfg, args.out, init_from=args.student, module_factory=factory)
    trained = load_model(Path(result.checkpoint))
    export_model(trained, args.out / MODEL_DIR, find_tokenizer(args.student))
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "settings"}
    settings |= {"run": run_cfg.to_dict(), "distill": dataclasses.asdict(distill)}
    atomic_write_json(args.out / REPORT, {"settings": settings, "result": dataclasses.asdict(result)})
    print(
        f"wrote {args.out / MODEL_DIR} (distilled {result.tokens:,} tokens in {result.steps} steps from "
        f"{args.teacher}; val loss {result.val_loss:.4f})"
    )
    return 0
