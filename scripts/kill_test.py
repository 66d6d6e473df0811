"""kill -9 at random moments of a data preparation, a training run and a study, then rerun the command.

    python scripts/kill_test.py --trials 5 [--seed 0] [--work DIR]

Per trial and job, the command is started, sent SIGKILL after a random delay (uniform over the
time an uninterrupted run of it took; every other fit trial is killed that long after its first
checkpoint appeared, uniform over the reference's time from first checkpoint to end), and started
again until it exits 0 (unchanged; a fit with the flag its refusal names). The result must equal
the uninterrupted run's, byte for byte:

* ``moe-lit data prepare`` of a tiny generated corpus: every file of the prepared directory (an
  interrupted preparation leaves only a temporary sibling, which is never taken for prepared);
* ``moe-lit fit`` of a tiny MoE for a few steps with ``last.ckpt`` after every step, rerun as its
  refusal says (``--resume`` from its ``last.ckpt``, ``--force`` when the kill came before one):
  the final weights and optimizer state;
* ``moe-lit study run`` of a tiny upcycling study (fixed E, fixed mE and an arm that forks from the
  fixed-E run's checkpoint): every point's final and per-language validation loss and curve
  (a point killed mid-run has no record and runs again; its claim, held by the dead process, is
  free at once).

Prints one JSON line per trial and a summary; exits 1 on any mismatch. CPU only, a few minutes.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
LETTERS = {"en": "abcdefgh", "de": "jklmnopq", "ru": "абвгдежз"}
STEPS = 6
LAST = Path("checkpoints") / "last.ckpt"
CLOCK_FIELDS = {"meta.json": "seconds", "index.json": "updated_at"}


def write_corpus(root: Path, seed: int = 0) -> Path:
    """``root/<lang>/doc<i>.txt``, 2 files x 40 paragraphs per language, each in its own letters."""
    rng = random.Random(seed)
    for lang, letters in LETTERS.items():
        (root / lang).mkdir(parents=True, exist_ok=True)
        for i in range(2):
            pars = [" ".join("".join(rng.choices(letters, k=rng.randint(2, 6))) for _ in range(20)) for _ in range(40)]
            (root / lang / f"doc{i}.txt").write_text("\n\n".join(pars) + "\n", encoding="utf-8")
    return root


def prepare_command(corpus: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "moe_lit.console_script",
        "data",
        "prepare",
        "--source",
        str(corpus),
        "--out",
        str(out),
        "--vocab-size",
        "300",
        "--quiet",
    ]


def fit_command(data: Path, out: Path) -> list[str]:
    tiny = [
        "--model.model.d_model",
        "32",
        "--model.model.n_layers",
        "2",
        "--model.model.d_ff",
        "64",
        "--model.model.moe.num_experts",
        "4",
        "--model.model.moe.expert_size",
        "16",
        "--model.model.moe.balancing",
        "bias",
        "--data.seq_len",
        "16",
        "--data.batch_size",
        "4",
        "--data.val_batches",
        "1",
    ]
    return [
        sys.executable,
        "-m",
        "moe_lit.console_script",
        "fit",
        "--config",
        str(REPO / "configs/experiments/tiny-moe.yaml"),
        "--data.data_dir",
        str(data),
        *tiny,
        "--trainer.max_steps",
        str(STEPS),
        "--trainer.enable_progress_bar",
        "false",
        "--out",
        str(out),
        "--trainer.logger",
        "false",
        "--checkpoint.every_n_train_steps",
        "1",
    ]


def fit_rerun_flag(out: Path) -> list[str]:
    """What the refusal of a rerun into a killed fit's directory asks for: ``--resume`` from its
    ``last.ckpt``, ``--force`` when none was written (nothing to add when the kill left no directory)."""
    if (out / LAST).is_file():
        return ["--resume"]
    return ["--force"] if out.exists() else []


STUDY = {
    "name": "kill_test",
    "kind": "upcycling",
    "seeds": [0],
    "run": {
        "data": {"seq_len": 16, "batch_size": 2, "val_batches": 1},
        "optim": {"lr": 3e-3, "warmup_steps": 1},
        "train": {"max_steps": 6, "val_every": 2},
        "trainer": {"enable_progress_bar": False, "accelerator": "cpu"},
    },
    "model": {
        "vocab_size": 300,
        "d_model": 32,
        "n_layers": 1,
        "n_heads": 2,
        "d_ff": 64,
        "moe": {"num_experts": 2, "expert_size": 16, "top_k": 1, "balancing": "bias"},
    },
    "expand_at": 4,
    "utility_batches": 2,
    "separation_every": 1,
    "timing_rounds": 2,
    "arms": [{"name": "utility_copy", "selection": "utility"}],
}
STUDY_FIELDS = ("status", "val_loss", "val_loss_per_language", "curve", "steps")


def study_command(spec: Path, data: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "moe_lit.console_script",
        "study",
        "run",
        str(spec),
        "--data",
        str(data),
        "--out",
        str(out),
    ]


def study_result(out: Path) -> dict[str, dict]:
    """What each point measured (wall times and paths left out)."""
    records = (json.loads(p.read_text()) for p in (out / "runs").glob("*.json"))
    return {r["name"]: {k: r.get(k) for k in STUDY_FIELDS} for r in records}


def run(cmd: list[str], kill_after: float | None = None, after_file: Path | None = None) -> tuple[int, float]:
    """Run ``cmd`` (in the repo root); SIGKILL it ``kill_after`` seconds after its start, or after
    ``after_file`` first exists when given. Returns (rc, seconds)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while after_file is not None and proc.poll() is None and not after_file.exists():
        time.sleep(0.02)
    try:
        _, err = proc.communicate(timeout=kill_after)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate()
        return -signal.SIGKILL, time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[2:5])} failed (rc {proc.returncode}):\n{err[-2000:]}")
    return 0, time.perf_counter() - start


def first_appearance(cmd: list[str], path: Path) -> tuple[float, float]:
    """Run ``cmd`` to the end; returns (seconds until ``path`` first existed, total seconds)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen = None
    while proc.poll() is None:
        if seen is None and path.exists():
            seen = time.perf_counter() - start
        time.sleep(0.02)
    if proc.returncode != 0 or seen is None:
        raise SystemExit(f"{' '.join(cmd[2:5])} failed (rc {proc.returncode}) or never wrote {path}")
    return seen, time.perf_counter() - start


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` by relative path, without the wall-clock fields
    (``seconds`` of meta.json, litdata's ``updated_at`` in index.json)."""
    digest = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if path.name in CLOCK_FIELDS:
            fields = {k: v for k, v in json.loads(data).items() if k != CLOCK_FIELDS[path.name]}
            data = json.dumps(fields, sort_keys=True).encode()
        digest[str(path.relative_to(root))] = hashlib.sha256(data).hexdigest()
    return digest


def training_result(out: Path) -> dict[str, torch.Tensor]:
    """Final weights, Adam moments and step of a finished run."""
    ckpt = torch.load(out / LAST, map_location="cpu", weights_only=True)
    tensors = dict(ckpt["state_dict"])
    for i, state in ckpt["optimizer_states"][0]["state"].items():
        tensors.update({f"optim.{i}.{k}": v for k, v in state.items() if torch.is_tensor(v)})
    tensors["global_step"] = torch.tensor(ckpt["global_step"])
    return tensors


def same_training(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def killed_then_rerun(
    cmd: list[str], delay: float, last: Path, after_checkpoint: bool, rerun_flags=lambda: []
) -> tuple[int, int | None]:
    """Kill once ``delay`` seconds after the start (or after the first checkpoint), then rerun with
    ``rerun_flags()`` added until it exits 0. Returns the number of starts and the step of the
    checkpoint the rerun resumed from (None: none was written, a fresh start)."""
    rc, _ = run(cmd, kill_after=delay, after_file=last if after_checkpoint else None)
    resumed_from = torch.load(last, map_location="cpu", weights_only=True)["global_step"] if last.is_file() else None
    starts = 1
    while rc != 0:
        rc, _ = run([*cmd, *rerun_flags()])
        starts += 1
    return starts, resumed_from


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=5, help="kills per job")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=Path("runs/kill_test"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    work = args.work.resolve()
    shutil.rmtree(work, ignore_errors=True)
    corpus = write_corpus(work / "corpus")

    _, prepare_s = run(prepare_command(corpus, work / "data_ref"))
    data_ref = tree_digest(work / "data_ref")
    # NOTE: most of a tiny run is start-up; every other kill falls between its first checkpoint and its end.
    first_ckpt_s, fit_s = first_appearance(fit_command(work / "data_ref", work / "fit_ref"), work / "fit_ref" / LAST)
    fit_ref = training_result(work / "fit_ref")
    spec = work / "study.yaml"
    spec.write_text(json.dumps(STUDY))  # JSON is YAML
    _, study_s = run(study_command(spec, work / "data_ref", work / "study_ref"))
    study_ref = study_result(work / "study_ref")

    failures = 0
    for trial in range(args.trials):
        out = work / f"data_{trial}"
        delay = rng.uniform(0.0, prepare_s)
        rc, _ = run(prepare_command(corpus, out), kill_after=delay)
        leftovers = sorted(p.name for p in work.iterdir() if p.name.startswith(f".data_{trial}"))
        # NOTE: an output that exists after the kill is taken for complete by the rerun: it must be.
        existed = out.exists()
        complete_if_there = not existed or tree_digest(out) == data_ref
        run(prepare_command(corpus, out))
        ok = tree_digest(out) == data_ref and complete_if_there
        failures += not ok
        print(
            json.dumps(
                {
                    "job": "prepare",
                    "trial": trial,
                    "kill_after_s": round(delay, 2),
                    "killed": rc != 0,
                    "output_after_kill": existed,
                    "complete_if_there": complete_if_there,
                    "temporaries_left": leftovers,
                    "equal": ok,
                }
            )
        )

        run_dir = work / f"fit_{trial}"
        after_checkpoint = trial % 2 == 1
        delay = rng.uniform(0.0, fit_s - first_ckpt_s if after_checkpoint else fit_s)
        starts, resumed_from = killed_then_rerun(
            fit_command(work / "data_ref", run_dir),
            delay,
            run_dir / LAST,
            after_checkpoint,
            rerun_flags=functools.partial(fit_rerun_flag, run_dir),
        )
        ok = same_training(training_result(run_dir), fit_ref)
        failures += not ok
        print(
            json.dumps(
                {
                    "job": "fit",
                    "trial": trial,
                    "kill_after_s": round(delay, 2),
                    "counted_from": "first checkpoint" if after_checkpoint else "start",
                    "starts": starts,
                    "resumed_from_step": resumed_from,
                    "equal": ok,
                }
            )
        )

        out = work / f"study_{trial}"
        delay = rng.uniform(0.0, study_s)
        starts, _ = killed_then_rerun(study_command(spec, work / "data_ref", out), delay, out / "none", False)
        ok = study_result(out) == study_ref
        failures += not ok
        print(
            json.dumps({"job": "study", "trial": trial, "kill_after_s": round(delay, 2), "starts": starts, "equal": ok})
        )
    print(
        json.dumps(
            {
                "trials": args.trials,
                "jobs": ["prepare", "fit", "study"],
                "failures": failures,
                "uninterrupted_s": {
                    "prepare": round(prepare_s, 1),
                    "fit": round(fit_s, 1),
                    "fit_first_checkpoint": round(first_ckpt_s, 1),
                    "study": round(study_s, 1),
                },
            }
        )
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
