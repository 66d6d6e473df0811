"""Every shipped trainer config through the real ``moe-lit fit``, in 2 gloo processes on CPU.

Each file keeps its own precision, gradient clipping and optimizer; only what a CPU cannot do is
overridden (accelerator cpu, 2 devices, one node). Per file: a 4-step fit exits 0 and writes a
checkpoint at step 2 and at the end; a fit resumed from step 2 logs the uninterrupted run's losses
and gradient norms; ``moe-lit validate`` and ``moe-lit eval`` (in this process) read the final checkpoint,
once per checkpoint format. Files that are one trainer once the CPU overrides apply (multinode-slurm.yaml is
fsdp2.yaml on one node) run once, named together. The GPU-only files (FSDP1 needs an accelerator,
expert parallelism needs MegaBlocks) are parsed and their strategy built.
"""

from __future__ import annotations

import csv
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from lightning.pytorch.strategies import Strategy

from moe_lit.console_script import main
from tests.helpers.cli_runs import TINY
from tests.helpers.paths import CONFIGS, EXPERIMENT

pytestmark = pytest.mark.slow

TRAINER_CONFIGS = sorted(p.name for p in (CONFIGS / "trainer").glob("*.yaml"))
GPU_ONLY = {"fsdp.yaml": "FSDP1 needs a CUDA device", "fsdp2-ep.yaml": "expert parallelism needs MegaBlocks"}
CPU_OVERRIDES = {"accelerator": "cpu", "devices": 2, "num_nodes": 1}
CPU = [arg for key, value in CPU_OVERRIDES.items() for arg in (f"--trainer.{key}", str(value))]
STEPS = 4
RESUME_STEP = 2
MOE_LIT = str(Path(sys.executable).with_name("moe-lit"))
TIMEOUT_S = 300


def on_cpu(trainer_yaml: str) -> dict:
    """The trainer a CPU run of ``trainer_yaml`` gets: the shipped file with ``CPU_OVERRIDES``."""
    return yaml.safe_load((CONFIGS / "trainer" / trainer_yaml).read_text()) | CPU_OVERRIDES


def checkpoint_format(trainer_yaml: str) -> str:
    """Who writes the checkpoint: our strategy class (FSDP2's consolidated file), else Lightning's one file.

    NOTE: a string strategy (``ddp``, ``auto``) saves rank 0's full state dict through Lightning.
    """
    strategy = on_cpu(trainer_yaml).get("strategy", "auto")
    return strategy["class_path"] if isinstance(strategy, dict) else "lightning"


def cpu_runs() -> list:
    """One param per distinct CPU trainer (its files joined by ``+``); the first of each checkpoint format
    also validates and evaluates."""
    groups: list[list[str]] = []
    for name in (n for n in TRAINER_CONFIGS if n not in GPU_ONLY):
        twin = next((group for group in groups if on_cpu(group[0]) == on_cpu(name)), None)
        if twin:
            twin.append(name)
        else:
            groups.append([name])
    formats = {checkpoint_format(group[0]): group[0] for group in reversed(groups)}
    return [pytest.param(group, group[0] in formats.values(), id="+".join(group)) for group in groups]


def moe_lit(*args: str) -> subprocess.CompletedProcess:
    """The installed ``moe-lit`` console script, as a user runs it."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run([MOE_LIT, *args], capture_output=True, text=True, timeout=TIMEOUT_S, env=env)


def fit_args(trainer_yaml: str, data: Path, out: Path) -> list[str]:
    return [
        "fit",
        "--config",
        EXPERIMENT,
        "--trainer",
        str(CONFIGS / "trainer" / trainer_yaml),
        *CPU,
        "--data.data_dir",
        str(data),
        *TINY,
        "--train.max_steps",
        str(STEPS),
        "--checkpoint.every_n_train_steps",
        str(RESUME_STEP),
        "--checkpoint.save_top_k",
        "-1",
        "--out",
        str(out),
    ]


def train_rows(metrics_csv: Path) -> dict[int, dict[str, float]]:
    """``step -> {train/loss, train/grad_norm}`` of a run's metrics.csv."""
    rows: dict[int, dict[str, float]] = {}
    with metrics_csv.open() as handle:
        for row in csv.DictReader(handle):
            if row.get("train/loss"):
                rows[int(row["step"])] = {k: float(row[k]) for k in ("train/loss", "train/grad_norm")}
    return rows


def assert_ok(done: subprocess.CompletedProcess, what: str) -> None:
    assert done.returncode == 0, f"{what} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"


@pytest.mark.parametrize("trainer_yamls,evaluates", cpu_runs())
def test_trainer_config_fits_resumes_validates_and_evaluates_in_two_processes(
    trainer_yamls, evaluates, prepared, tmp_path, capsys
):
    trainer_yaml = trainer_yamls[0]  # the others are the same trainer on a CPU
    assert on_cpu(trainer_yaml).get("gradient_clip_val", 0) > 0  # every shipped file clips; the run keeps it

    full = tmp_path / "full"
    done = moe_lit(*fit_args(trainer_yaml, prepared, full))
    assert_ok(done, "fit")
    assert "Traceback" not in done.stderr
    final = full / "checkpoints" / "last.ckpt"
    assert f"fit: checkpoint {final}" in done.stdout
    at_resume = next((full / "checkpoints").glob(f"*step={RESUME_STEP}.ckpt"))

    resumed_dir = tmp_path / "resumed"
    done = moe_lit(*fit_args(trainer_yaml, prepared, resumed_dir), "--ckpt_path", str(at_resume))
    assert_ok(done, "resumed fit")
    uninterrupted = train_rows(full / "logs" / "fit" / "metrics.csv")
    resumed = train_rows(resumed_dir / "logs" / f"fit-step{RESUME_STEP}" / "metrics.csv")
    assert sorted(resumed) == list(range(RESUME_STEP, STEPS)) and sorted(uninterrupted) == list(range(STEPS))
    for step, row in resumed.items():
        assert row == pytest.approx(uninterrupted[step], rel=1e-5), step
    assert all(row["train/grad_norm"] > 0 for row in uninterrupted.values())
    if not evaluates:
        return

    # NOTE: one process each, in this one: the commands' own code, without two more interpreter starts
    assert (
        main(["validate", "--ckpt_path", str(final), "--data.data_dir", str(prepared), "--out", str(tmp_path / "v")])
        == 0
    )
    assert "| overall |" in capsys.readouterr().out
    eval_args = ["--checkpoint", str(final), "--tasks", "moe_lit_next", "--data", str(prepared), "--limit", "2"]
    assert main(["eval", *eval_args, "--bootstrap-iters", "0", "--out", str(tmp_path / "eval")]) == 0
    assert (tmp_path / "eval" / "results.json").is_file()


@pytest.mark.parametrize("trainer_yaml", sorted(GPU_ONLY))
def test_gpu_only_trainer_config_parses_and_builds_its_strategy(trainer_yaml, prepared, capsys):
    trainer_file = CONFIGS / "trainer" / trainer_yaml
    args = ["fit", "--config", EXPERIMENT, "--trainer", str(trainer_file), "--data.data_dir", str(prepared), *TINY]
    assert main([*args, "--print_config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)["trainer"]
    shipped = yaml.safe_load(trainer_file.read_text())
    assert printed["precision"] == shipped["precision"] and printed["gradient_clip_val"] == shipped["gradient_clip_val"]
    strategy = printed["strategy"]
    module, _, name = strategy["class_path"].rpartition(".")
    built = getattr(importlib.import_module(module), name)(**strategy["init_args"])
    assert isinstance(built, Strategy) and type(built).__name__ == name
