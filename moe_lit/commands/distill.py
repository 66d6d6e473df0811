"""``moe-lit distill``: train a student on a frozen teacher's logits and the data (MoE -> dense, recovery).

The student (``--student``, a ``.ckpt`` or exported dir, e.g. the output of ``convert
moe-to-dense``) starts from its weights with a fresh optimizer; the teacher (``--teacher``) stays
frozen. Training is :func:`~moe_lit.lit.run.train_run` with a
:class:`~moe_lit.lit.distill.DistillModule` (forward KL at ``--temperature`` mixed with the LM
loss), so logs, checkpoints and validation are those of every other run. ``--out`` receives
``metrics.csv``, ``checkpoints/``, ``model/`` (the distilled student, exported with the student's
tokenizer) and ``distill.json`` (the run's result and settings).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from functools import partial
from pathlib import Path

from moe_lit.config import ModelConfig
from moe_lit.errors import MoeLitError
from moe_lit.lit.distill import DistillConfig
from moe_lit.lit.optim import OptimConfig

MODEL_DIR, REPORT = "model", "distill.json"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--teacher", required=True, type=Path, help="frozen teacher: .ckpt or exported dir")
    parser.add_argument("--student", required=True, type=Path, help="student to train: .ckpt or exported dir")
    parser.add_argument("--data", type=Path, help="prepared data directory (default: moe-lit data prepare's)")
    parser.add_argument("--tokens", type=int, default=262_144, help="distillation tokens")
    parser.add_argument("--seq-len", type=int, default=128, help="training sequence length")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per optimizer step")
    parser.add_argument("--val-batches", type=int, default=4, help="validation batches per language")
    parser.add_argument("--evals", type=int, default=4, help="validations during the run")
    parser.add_argument("--lr", type=float, default=3e-4, help="peak AdamW learning rate")
    parser.add_argument("--warmup-steps", type=int, default=10, help="optimizer steps of linear learning-rate warmup")
    parser.add_argument("--temperature", type=float, default=1.0, help="softmax temperature of the KL term")
    parser.add_argument("--kl-weight", type=float, default=1.0, help="weight of the forward KL (times tau^2)")
    parser.add_argument("--ce-weight", type=float, default=1.0, help="weight of the LM cross-entropy")
    parser.add_argument("--seed", type=int, default=0, help="seed of the run")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out")
    parser.add_argument("--out", required=True, type=Path, help="run directory to write")


def distill_module(cfg: ModelConfig, optim: OptimConfig, teacher, distill: DistillConfig):
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
    from moe_lit.lit.run_config import DataConfig, RunConfig, TrainConfig

    for name in ("tokens", "seq_len", "batch_size", "val_batches", "evals"):
        if getattr(args, name) < 1:
            raise MoeLitError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    distill = DistillConfig(temperature=args.temperature, kl_weight=args.kl_weight, ce_weight=args.ce_weight)
    check_output(args.out, {"--teacher": args.teacher, "--student": args.student}, args.force)
    if args.force and args.out.exists():
        # NOTE: a run directory is appended to (metrics, checkpoints): replacing one means removing it.
        shutil.rmtree(args.out) if args.out.is_dir() else args.out.unlink()
    teacher = load_any_model(args.teacher)
    if args.seq_len > teacher.config.seq_len:
        raise MoeLitError(f"--seq-len: {args.seq_len} exceeds the teacher's seq_len {teacher.config.seq_len}")
    steps = max(1, args.tokens // (args.seq_len * args.batch_size))
    run_cfg = RunConfig(
        data=DataConfig(
            data_dir=None if args.data is None else str(args.data),
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            val_batches=args.val_batches,
        ),
        optim=OptimConfig(lr=args.lr, warmup_steps=args.warmup_steps),
        train=TrainConfig(max_tokens=args.tokens, val_every=max(1, steps // args.evals), seed=args.seed),
    )
    factory = partial(distill_module, teacher=teacher, distill=distill)
    student = load_any_model(args.student)
    result = train_run(student.config, run_cfg, args.out, init_from=args.student, module_factory=factory)
    trained = load_model(Path(result.checkpoint))
    export_model(trained, args.out / MODEL_DIR, find_tokenizer(args.student))
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    atomic_write_json(args.out / REPORT, {"settings": settings, "result": dataclasses.asdict(result)})
    print(
        f"wrote {args.out / MODEL_DIR} (distilled {result.tokens:,} tokens in {result.steps} steps from "
        f"{args.teacher}; val loss {result.val_loss:.4f})"
    )
    return 0
