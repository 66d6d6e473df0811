"""``moe-lit demo``: the README's main job, the card end to end on the bundled data.

1. prepare the data of the dense_vs_sparse study (``moe-lit data prepare --vocab-size 2048`` into
   ``data_cache/v2048``, as ``configs/studies/dense_vs_sparse.yaml`` says; reused once built),
2. train ``configs/model/demo-dense.yaml`` and ``configs/model/demo-moe.yaml`` (the study's best
   arm, E32 top-2, matched to the dense model on active parameters by
   :func:`moe_lit.accounting.matched_moe_config`) with :func:`train_run`, each the run of
   ``--config`` (``configs/runs/demo.yaml``; ``--SECTION.FIELD VALUE`` settings over it) under its
   model YAML's optimizer; with ``--seeds N`` both models for N seeds (``train.seed`` + 0..N-1),
3. train the dense model again with :class:`~moe_lit.callbacks.dense_upcycling.DenseToMoEUpcycling`:
   half way through the run it becomes an MoE of the MoE's layout and trains on (``upcycled``),
4. the card's steps on the three models of the first seed (``moe_lit.commands.demo_card``): the
   local multilingual suite through lm-eval (``moe-lit eval``), the per-language routing analysis of
   the two MoEs (``moe-lit analyze routing``), and the better MoE exported to transformers
   (``moe-lit export --format mixtral``), loaded with ``AutoModelForCausalLM`` and asked for a line,
5. write ``results/demo/`` at once (a temporary directory renamed into place): ``README.md`` (the
   page), ``results.json``, the three plots, the suite and routing reports, and the models in
   ``models/`` (git-ignored, being large: ``models/<name>/`` what ``make eval`` reads,
   ``models/hf-<name>/`` the transformers export).

Checkpoints, CSV logs and each step's own output stay in ``--work-dir`` (``runs/demo``). A non-empty
``--out`` or ``--work-dir`` is refused unless ``--force`` (``make demo`` passes it: it rebuilds the
tracked results).

A SIGTERM, SIGINT or SIGUSR1 while a model trains saves its checkpoint at the next step, prints one
line with the command that resumes (the same one with ``--resume``) and exits with 128 + signal.
``--resume`` continues the demo of ``--work-dir`` with the same settings (``--seeds`` may grow: the
new seeds are trained, the rest reused). Nothing finished is done again (a trained model's
``<work-dir>/<name>/result.json``, each step's output directory); an interrupted training
continues from its ``checkpoints/last.ckpt``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from moe_lit.config import ModelConfig
from moe_lit.configbase import dotted, load_yaml, refuse_unknown_keys
from moe_lit.data.layout import tokenizer_file
from moe_lit.errors import MoeLitError
from moe_lit.io import atomic_write_json, check_output
from moe_lit.lit.optim import OptimConfig
from moe_lit.lit.run_config import RunConfig
from moe_lit.resources import CONFIGS_DIR

if TYPE_CHECKING:
    from lightning.pytorch.callbacks import Callback

    from moe_lit.callbacks.dense_upcycling import DenseToMoEUpcycling
    from moe_lit.lit.run import RunResult

MODELS = {"dense": CONFIGS_DIR / "model/demo-dense.yaml", "moe": CONFIGS_DIR / "model/demo-moe.yaml"}
"""The two models trained from scratch: the study's budget-M dense model and its E32 top-2 MoE."""
UPCYCLED = "upcycled"
"""The third model: the dense run grown into the MoE's layout half way (:func:`upcycling`)."""
STUDY = CONFIGS_DIR / "studies/dense_vs_sparse.yaml"
"""The study whose best arm the demo trains; its ``data`` section prepares the demo's data."""
RUN = CONFIGS_DIR / "runs/demo.yaml"
"""The default ``--config``: the run of each model."""
SETTINGS_CHECK = RunConfig.check_settings
"""``--SECTION.FIELD VALUE`` words over ``--config`` (moe_lit.console_script): the run's sections."""
WORK_DIR_SETTINGS, RESULT_FILE = "demo.json", "result.json"
"""In ``--work-dir``: the settings of the demo it holds; in each model's folder: its RunResult."""
EVAL_LIMIT = 10
"""Default ``--eval-limit``: items per suite task, so the suite fits the demo's time."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "Run settings: --SECTION.FIELD VALUE over the --config YAML (sections data, optim, train, trainer; "
        "moe_lit.lit.run_config.RunConfig), e.g. --train.max_tokens 200000 --data.data_dir DIR --optim.lr 1e-3."
    )
    parser.add_argument(
        "--config", type=Path, default=RUN, help="run YAML of each model (default: configs/runs/demo.yaml)"
    )
    parser.add_argument("--out", type=Path, default=Path("results/demo"), help="results directory")
    parser.add_argument("--work-dir", type=Path, default=Path("runs/demo"), help="checkpoints, logs, step outputs")
    parser.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="seeds of the dense model and the MoE (train.seed + 0..N-1): the MoE - dense difference as mean ± sd",
    )
    parser.add_argument(
        "--eval-limit", type=int, default=EVAL_LIMIT, help="items per task of the multilingual suite (lm-eval --limit)"
    )
    parser.add_argument(
        "--step-rounds",
        type=int,
        default=0,
        help="interleaved steps timing each trained model's step eager vs compiled (0 = skip)",
    )
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out and --work-dir")
    parser.add_argument(
        "--resume", action="store_true", help="continue the interrupted demo of --work-dir (same settings)"
    )


def run(args: argparse.Namespace) -> int:
    from moe_lit.callbacks.preemption import Preemption
    from moe_lit.commands import demo_card

    check_counts(args)
    run_doc = RunConfig.merge(load_yaml(args.config, "--config"), dotted(args.settings))
    base = RunConfig.from_dict(run_doc)  # every setting checked before anything is written
    inputs = {"data.data_dir": base.data.data_dir}
    check_output(args.out, inputs, args.force)
    settings = {
        f"{section}.{key}": value for section, fields in run_doc.items() for key, value in (fields or {}).items()
    }
    settings |= {"eval_limit": args.eval_limit, "step_rounds": args.step_rounds}
    check_work_dir(args, settings, inputs)  # not --seeds: a resumed demo may add seeds
    data_dir = prepare_default_data(base.data.data_dir)
    run_doc = RunConfig.merge(run_doc, {"data.data_dir": str(data_dir)})
    preemption = Preemption(resume=resume_command(), label="moe-lit demo")
    models = {name: load_module_config(path) for name, path in MODELS.items()}
    runs = model_runs(run_doc, models)
    trained: dict[str, RunResult] = {}
    grow = upcycling(models["dense"][0], models["moe"][0], runs["dense"].steps, base.train.seed)
    for index in range(args.seeds):
        for name, (model_cfg, _) in models.items():
            run_cfg = runs[name].replace(train={"seed": base.train.seed + index})
            trained[seed_name(name, index)] = train_model(
                seed_name(name, index), MODELS[name], model_cfg, run_cfg, args, [preemption]
            )
        if index == 0:  # the third model of the card, before more seeds
            dense = models["dense"][0]
            trained[UPCYCLED] = train_model(UPCYCLED, MODELS["dense"], dense, runs["dense"], args, [preemption, grow])
    steps = demo_card.card_steps(trained, data_dir, args)
    card = {name: trained[name] for name in demo_card.CARD_MODELS}
    steps_timed = step_throughput(card, runs["moe"], args.step_rounds) if args.step_rounds else {}
    settings["seeds"] = args.seeds
    demo_card.write_results(trained, settings, tokenizer_file(data_dir), args.out, steps_timed, steps, grow.at_steps[0])
    print((args.out / demo_card.PAGE).read_text())
    return 0


def check_counts(args: argparse.Namespace) -> None:
    """The integer options: one line naming the option and what it allows."""
    if args.seeds < 1:
        raise MoeLitError(f"--seeds: must be >= 1, got {args.seeds}")
    if args.eval_limit < 1:
        raise MoeLitError(f"--eval-limit: must be >= 1 (items per suite task), got {args.eval_limit}")
    if args.step_rounds < 0:
        raise MoeLitError(f"--step-rounds: must be >= 0 (0 skips the step timing), got {args.step_rounds}")


def seed_name(name: str, index: int) -> str:
    """``dense`` for the first seed, ``dense-seed2`` for the third: a run's folder in ``--work-dir``."""
    return name if index == 0 else f"{name}-seed{index}"


def upcycling(dense: ModelConfig, moe: ModelConfig, steps: int, seed: int) -> DenseToMoEUpcycling:
    """The dense run's FFNs become MoE layers after half its ``steps``: granular (virtual-group)
    upcycling into ``moe``'s experts and top-k with granularity top-k, so each expert holds
    d_ff / top_k of the dense neurons, the upcycled model computes the dense function exactly at
    the swap and stays active-matched (as :func:`matched_moe_config`'s granularity); ``moe``'s
    balancing, without an expert output bias (so it exports)."""
    from moe_lit.callbacks.dense_upcycling import DenseToMoEUpcycling
    from moe_lit.convert.dense_to_moe import UpcyclingConfig

    if moe.moe is None or dense.moe is not None:
        raise MoeLitError(f"demo: upcycling grows a dense model into an MoE; got {MODELS['dense']}, {MODELS['moe']}")
    m = moe.moe
    fields = {"expert_output_bias": False, "balancing": m.balancing, "aux_loss_coef": m.aux_loss_coef}
    plan = UpcyclingConfig(
        recipe="granular",
        num_experts=m.num_experts,
        top_k=m.top_k,
        granularity=m.top_k,
        seed=seed,
        moe=fields | {"backend": m.backend},
    )
    return DenseToMoEUpcycling(at_step=max(1, steps // 2), upcycling=plan)


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


def model_runs(
    run_doc: dict[str, Any], models: dict[str, tuple[ModelConfig, dict[str, object]]]
) -> dict[str, RunConfig]:
    """Per demo model, its run: the ``run_doc`` sections under the model YAML's optimizer, the run's own
    optim fields over it."""
    return {
        name: RunConfig.from_dict(RunConfig.merge({**run_doc, "optim": optim}, {"optim": run_doc.get("optim") or {}}))
        for name, (_, optim) in models.items()
    }


def train_model(
    name: str,
    config: Path,
    model_cfg: ModelConfig,
    run_cfg: RunConfig,
    args: argparse.Namespace,
    callbacks: list[Callback],
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
    print(f"demo: training {name} ({config.name}, seed {run_cfg.train.seed}) {what}", flush=True)
    result = train_run(model_cfg, run_cfg, run_dir, callbacks=callbacks, resume_from=resume_from)
    atomic_write_json(result_file, dataclasses.asdict(result))
    return result


def prepare_default_data(data_dir: str | None) -> Path:
    """The demo's data directory: ``data_dir`` as it is when given (a prepared directory), else the
    dense_vs_sparse study's (``moe-lit data prepare`` with its ``data`` section; reused once built)."""
    from moe_lit.data.prepare import prepare
    from moe_lit.studies.study import load_study

    if data_dir is not None:
        return Path(data_dir)
    cfg = load_study(STUDY).header.prepare_config()
    prepare(cfg)
    return Path(cfg.out)


def step_throughput(results: dict[str, RunResult], run: RunConfig, rounds: int) -> dict[str, dict]:
    """Each trained model's training step on the first training batch of ``run``, eager vs compiled."""
    from moe_lit.checkpoint import load_model
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
