"""``moe-lit demo``: the README's main job, a dense and an active-matched MoE model side by side.

1. prepare the default corpus (``moe-lit data prepare`` with its defaults; reused once built),
2. train ``configs/model/tiny-dense.yaml`` and ``configs/model/tiny-moe.yaml`` (the MoE matched to
   the dense model on active parameters) with :func:`train_run`, both the run of ``--config``
   (``configs/runs/demo.yaml``; ``--SECTION.FIELD VALUE`` settings over it, e.g.
   ``--train.max_tokens 200000``) under each model YAML's optimizer,
3. write ``results/demo/`` at once (a temporary directory renamed into place): ``results.json``,
   ``results.md`` (params total/active, tokens, final validation loss overall and per language,
   tokens/s of the training run, and training-step tokens/s eager vs compiled: each trained model's
   step on one training batch, an eager and a ``torch.compile``'d copy timed interleaved,
   :func:`moe_lit.lit.throughput.eager_vs_compiled`), ``val_loss.png`` (validation loss vs training
   tokens of both models) and the trained models exported to ``models/<name>/`` (config,
   safetensors, tokenizer: what ``make eval`` reads; git-ignored, being large).

Checkpoints and CSV logs stay in ``--work-dir`` (``runs/demo``). A non-empty ``--out`` or
``--work-dir`` is refused unless ``--force`` (``make demo`` passes it: it rebuilds the tracked results).

A SIGTERM, SIGINT or SIGUSR1 while a model trains saves its checkpoint at the next step, prints one
line with the command that resumes (the same one with ``--resume``) and exits with 128 + signal.
``--resume`` continues the demo of ``--work-dir`` with the same settings: a model already trained
is not trained again (``<work-dir>/<name>/result.json``), an interrupted one continues from its
``checkpoints/last.ckpt``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from moe_lit.accounting import markdown_table
from moe_lit.checkpoint import export_model, load_model
from moe_lit.config import ModelConfig, refuse_unknown_keys
from moe_lit.data.layout import tokenizer_file
from moe_lit.errors import MoeLitError
from moe_lit.io import atomic_directory, atomic_write_json, atomic_write_text, check_output
from moe_lit.lit.optim import OptimConfig
from moe_lit.lit.run_config import RunConfig, check_settings, merge_sections, read_yaml
from moe_lit.resources import CONFIGS_DIR

if TYPE_CHECKING:
    from moe_lit.callbacks.preemption import Preemption
    from moe_lit.lit.run import RunResult

MODELS = {"dense": CONFIGS_DIR / "model/tiny-dense.yaml", "moe": CONFIGS_DIR / "model/tiny-moe.yaml"}
RUN = CONFIGS_DIR / "runs/demo.yaml"
"""The default ``--config``: the run of each model."""
SETTINGS_CHECK = check_settings
"""``--SECTION.FIELD VALUE`` words over ``--config`` (moe_lit.console_script): the run's sections."""
RESULTS_JSON, RESULTS_MD, PLOT = "results.json", "results.md", "val_loss.png"
MODELS_DIR = "models"
COMMAND = "make demo"
WORK_DIR_SETTINGS, RESULT_FILE = "demo.json", "result.json"
"""In ``--work-dir``: the settings of the demo it holds; in each model's folder: its RunResult."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "Run settings: --SECTION.FIELD VALUE over the --config YAML (sections data, optim, train, trainer; "
        "moe_lit.lit.run_config.RunConfig), e.g. --train.max_tokens 200000 --data.data_dir DIR --optim.lr 1e-3."
    )
    parser.add_argument(
        "--config", type=Path, default=RUN, help="run YAML of each model (default: configs/runs/demo.yaml)"
    )
    parser.add_argument("--out", type=Path, default=Path("results/demo"), help="results directory")
    parser.add_argument("--work-dir", type=Path, default=Path("runs/demo"), help="checkpoints and CSV logs")
    parser.add_argument(
        "--step-rounds",
        type=int,
        default=8,
        help="interleaved steps timing each trained model's step eager vs compiled (0 = skip)",
    )
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out and --work-dir")
    parser.add_argument(
        "--resume", action="store_true", help="continue the interrupted demo of --work-dir (same settings)"
    )


def run(args: argparse.Namespace) -> int:
    from moe_lit.callbacks.preemption import Preemption

    if args.step_rounds < 0:
        raise MoeLitError(f"--step-rounds: must be >= 0 (0 skips the step timing), got {args.step_rounds}")
    run_doc = merge_sections(read_yaml(args.config, "--config"), args.settings)
    base = RunConfig.from_dict(run_doc)  # every setting checked before anything is written
    inputs = {"data.data_dir": base.data.data_dir}
    check_output(args.out, inputs, args.force)
    settings = {
        f"{section}.{key}": value for section, fields in run_doc.items() for key, value in (fields or {}).items()
    }
    settings["step_rounds"] = args.step_rounds
    check_work_dir(args, settings, inputs)
    data_dir = prepare_default_data(base.data.data_dir)
    run_doc = merge_sections(run_doc, {"data": {"data_dir": str(data_dir)}})
    preemption = Preemption(resume=resume_command(), label="moe-lit demo")
    results, runs = {}, {}
    for name, path in MODELS.items():
        model_cfg, optim = load_module_config(path)
        runs[name] = RunConfig.from_dict(
            merge_sections({**run_doc, "optim": optim}, {"optim": run_doc.get("optim") or {}})
        )
        results[name] = train_model(name, path, model_cfg, runs[name], args, preemption)
    steps_timed = step_throughput(results, runs["moe"], args.step_rounds) if args.step_rounds else {}
    write_results(results, settings, tokenizer_file(data_dir), args.out, steps_timed)
    print((args.out / RESULTS_MD).read_text())
    return 0


def check_work_dir(args: argparse.Namespace, settings: dict[str, object], inputs: dict[str, object]) -> None:
    """``--resume`` needs the work dir of a demo with the same settings; otherwise it must be
    empty, or ``--force`` (the demo's own ``demo.json`` is written there); never one of ``inputs``."""
    marker = args.work_dir / WORK_DIR_SETTINGS
    earlier = _read_settings(marker)
    if args.resume:
        if earlier is None:
            raise MoeLitError(f"--resume: {args.work_dir} holds no demo to continue; run without --resume")
        if earlier != settings:
            changed = sorted(k for k in {*earlier, *settings} if earlier.get(k) != settings.get(k))
            raise MoeLitError(
                f"--resume: the demo in {args.work_dir} ran with other settings ({', '.join(changed)}); "
                "run with those, or with --force instead of --resume to start over"
            )
        check_output(args.work_dir, inputs, True, "--work-dir")
        return
    if not args.force and earlier is not None:
        raise MoeLitError(
            f"--work-dir: {args.work_dir} holds an earlier demo; pass --resume to continue it (an interrupted "
            "demo: probably what you want) or --force to start over"
        )
    check_output(args.work_dir, inputs, args.force, "--work-dir")
    atomic_write_json(marker, settings)


def _read_settings(marker: Path) -> dict[str, object] | None:
    if not marker.is_file():
        return None
    try:
        return json.loads(marker.read_text())
    except ValueError as exc:
        raise MoeLitError(f"{marker}: not readable JSON; pass --force to start the demo over") from exc


def resume_command() -> str:
    """This command with ``--resume``: what continues it."""
    from moe_lit.callbacks.preemption import command_line

    command = command_line()
    return command if "--resume" in command.split() else f"{command} --resume"


def train_model(
    name: str,
    config: Path,
    model_cfg: ModelConfig,
    run_cfg: RunConfig,
    args: argparse.Namespace,
    preemption: Preemption,
) -> RunResult:
    """One model's run in ``<work-dir>/<name>``: reused with ``--resume`` when it finished, continued
    when it was interrupted, else trained afresh; its result saved beside it."""
    from moe_lit.lit.run import CHECKPOINT_DIR, LAST_CHECKPOINT, RunResult, train_run

    run_dir = args.work_dir / name
    result_file, last = run_dir / RESULT_FILE, run_dir / CHECKPOINT_DIR / LAST_CHECKPOINT
    if args.resume and result_file.is_file():
        print(f"demo: {name} was trained ({result_file})", flush=True)
        return RunResult(**json.loads(result_file.read_text()))
    resume_from = last if args.resume and last.is_file() else None
    if resume_from is None:
        shutil.rmtree(run_dir, ignore_errors=True)  # a previous demo's logs and checkpoints
    what = f"continuing from {resume_from}" if resume_from else f"for {run_cfg.tokens:,} tokens"
    print(f"demo: training {name} ({config.name}) {what}", flush=True)
    result = train_run(model_cfg, run_cfg, run_dir, callbacks=[preemption], resume_from=resume_from)
    atomic_write_json(result_file, dataclasses.asdict(result))
    return result


def prepare_default_data(data_dir: str | None) -> Path:
    """``moe-lit data prepare`` with its defaults (reused when already prepared); the directory."""
    from moe_lit.data.prepare import PrepareConfig, prepare

    cfg = PrepareConfig(out=data_dir)
    prepare(cfg)
    return Path(cfg.out)


def step_throughput(results: dict[str, RunResult], run: RunConfig, rounds: int) -> dict[str, dict]:
    """Each trained model's training step on the first training batch of ``run``, eager vs compiled."""
    from moe_lit.lit.datamodule import MoEDataModule
    from moe_lit.lit.throughput import eager_vs_compiled

    print(f"demo: timing each model's training step, eager vs compiled ({rounds} rounds)", flush=True)
    loader = MoEDataModule.from_config(run.data, run.train.seed)
    batch_BL1 = next(iter(loader.train_dataloader()))
    models = {name: load_model(result.checkpoint) for name, result in results.items()}
    return eager_vs_compiled(models, batch_BL1, rounds=rounds)


def load_module_config(path: Path) -> tuple[ModelConfig, dict[str, object]]:
    """The ``model`` and ``optim`` sections of a ``configs/model/*.yaml`` file (the optim fields checked)."""
    doc = yaml.safe_load(path.read_text())
    optim = doc.get("optim") or {}
    refuse_unknown_keys(optim, OptimConfig, f"{path}: optim")
    return ModelConfig.from_yaml(path), optim


def results_rows(results: dict[str, RunResult], steps_timed: dict[str, dict] | None = None) -> list[dict[str, object]]:
    """One table row per model: params, tokens, final validation loss (overall, per language), tok/s
    of the run and, when timed, of its step eager and compiled."""
    rows = []
    for name, result in results.items():
        row: dict[str, object] = {
            "model": name,
            "total params": result.total_params,
            "active params": result.active_params,
            "tokens": result.tokens,
            "val loss": result.val_loss,
        }
        row.update(result.val_loss_per_language)
        row["tokens/s"] = round(result.tokens_per_s)
        if steps_timed and name in steps_timed:
            timed = steps_timed[name]
            row["step tok/s eager"] = round(timed["eager_tokens_per_s"])
            row["step tok/s compiled"] = round(timed["compiled_tokens_per_s"])
            row["compiled speedup"] = round(timed["compiled_speedup"], 3)
            row["compile s"] = round(timed["compile_s"], 1)
        rows.append(row)
    return rows


def val_curve(result: RunResult) -> tuple[list[int], list[float]]:
    """(training tokens, validation loss) at each validation."""
    tokens_per_step = result.tokens // max(1, result.steps)
    return [p["step"] * tokens_per_step for p in result.curve], [p["val_loss"] for p in result.curve]


def plot_val_loss(results: dict[str, RunResult], path: Path) -> None:
    from moe_lit.plotting import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    for name, result in results.items():
        tokens, losses = val_curve(result)
        label = f"{name} ({result.total_params / 1e6:.1f}M total, {result.active_params / 1e6:.1f}M active)"
        ax.plot(tokens, losses, marker="o", label=label)
    ax.set_xlabel("training tokens")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title("moe-lit demo: dense vs active-matched MoE")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_results(
    results: dict[str, RunResult],
    settings: dict[str, object],
    tokenizer: Path,
    out: Path,
    steps_timed: dict[str, dict] | None = None,
) -> None:
    """``results.json``, ``results.md``, ``val_loss.png`` and ``models/`` in ``out``, all or nothing."""
    with atomic_directory(out) as tmp:
        runs = {name: dataclasses.asdict(result) for name, result in results.items()}
        doc = {"command": COMMAND, "settings": settings, "runs": runs, "step_throughput": steps_timed or {}}
        atomic_write_json(tmp / RESULTS_JSON, doc)
        table = markdown_table(results_rows(results, steps_timed))
        atomic_write_text(tmp / RESULTS_MD, f"Made by `{COMMAND}`.\n\n{table}\n")
        plot_val_loss(results, tmp / PLOT)
        for name, result in results.items():
            export_model(load_model(result.checkpoint), tmp / MODELS_DIR / name, tokenizer)
