"""scripts/gpu_check.sh against the GPU machine's image (requirements/gpu-image.txt): what it carries
(requirements/gpu-carry.txt, the lock's versions, nothing the image has), its CPU commands run in a
Python that can import only the image plus the carried wheels (scripts/image_guard), one result line
per step within a 360 s budget, and the benchmark's rows written as each case ends."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_throughput
from scripts.gpu_check_results import main as results_main
from scripts.image_guard.sitecustomize import normalize, read_names

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
IMAGE = ROOT / "requirements" / "gpu-image.txt"
CARRY = ROOT / "requirements" / "gpu-carry.txt"
LOCK = ROOT / "requirements" / "lock.txt"
CARRIED = [ROOT / ".gpu-wheels", ROOT / ".gpu-sdists"]
BUDGET_S = 360
TREE_LIMIT = 64 * 2**20
TRAINERS = ("ddp", "fsdp2", "fsdp")
SDISTS = {"megablocks-0.10.0.tar.gz", "stanford_stk-0.7.1.tar.gz", "grouped_gemm-0.3.0.tar.gz"}


def pins(path: Path) -> dict[str, str]:
    """``name -> version`` of the ``name==version`` lines of a requirements file."""
    found = re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", path.read_text(), flags=re.MULTILINE)
    return {normalize(name): version for name, version in found}


def guarded(carried: Path | None, log: Path | None = None) -> dict[str, str]:
    """The environment of a Python that can import only the image's packages and ``carried``'s."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "scripts" / "image_guard"), "MOE_LIT_IMAGE_ALLOW": str(IMAGE)}
    env["MOE_LIT_IMAGE_CARRY"] = str(carried or "")
    if log is not None:
        env["MOE_LIT_IMAGE_GUARD_LOG"] = str(log)
    return env


def test_the_carried_wheels_are_the_locks_versions_of_packages_the_image_lacks():
    carried, lock = pins(CARRY), pins(LOCK)
    assert carried and {name: lock.get(name) for name in carried} == carried
    assert set(carried) & read_names(IMAGE) == set()
    assert {"jsonargparse", "docstring-parser", "typeshed-client", "litdata", "boto3"} <= set(carried)


def test_the_image_guard_refuses_a_package_outside_the_lists_and_names_it(tmp_path):
    code = "import json, yaml, jsonargparse, tests.helpers; print('imported')"  # stdlib, image, carried, checkout
    refused = subprocess.run(
        [sys.executable, "-c", code], env=guarded(None, log=tmp_path / "log"), capture_output=True, text=True, cwd=ROOT
    )
    assert refused.returncode == 1
    assert "ModuleNotFoundError: GPU image guard: 'jsonargparse' comes from jsonargparse" in refused.stderr
    assert (tmp_path / "log").read_text().count("'jsonargparse'") == 1
    allowed = subprocess.run([sys.executable, "-c", code], env=guarded(CARRY), capture_output=True, text=True, cwd=ROOT)
    assert (allowed.returncode, allowed.stdout) == (0, "imported\n"), allowed.stderr
    (tmp_path / "carry.txt").write_text("boto3\n")  # a carried wheel travels without its requirements
    alone = subprocess.run(
        [sys.executable, "-c", "import boto3"], env=guarded(tmp_path / "carry.txt"), capture_output=True, text=True
    )
    assert "GPU image guard: 'botocore' comes from botocore" in alone.stderr


def script_steps() -> list[tuple[str, int]]:
    """``(name, limit)`` of every ``step`` and ``skipped`` call in the script, ``$trainer`` expanded."""
    calls = re.findall(r'^\s*(?:if .*then )?(?:step|skipped) "?([\w$-]+)"? (\d+)', SCRIPT.read_text(), re.MULTILINE)
    return [
        (name.replace("$trainer", trainer), int(limit))
        for name, limit in calls
        for trainer in (TRAINERS if "$trainer" in name else ("",))
    ]


@pytest.mark.slow
def test_the_dry_check_runs_its_cpu_commands_on_the_image_alone_and_records_every_step_within_the_budget(tmp_path):
    env = guarded(CARRY, log=tmp_path / "refused.log") | {
        "GPU_CHECK_DRY": "1",
        "OUT": str(tmp_path / "out"),
        "PYTHON": sys.executable,
    }
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "out" / "gpu_check.jsonl").read_text().splitlines()]
    names = [line["step"] for line in lines]
    expected = ["probe", "carry", "corpus", "build"]
    expected += [f"fit-{t}{resumed}" for t in TRAINERS for resumed in ("", "-resume")]
    assert names == [*expected, "resume-compare", "parity", "bench"]
    failed = {
        line["step"]: line.get("skipped") or (tmp_path / "out" / line["log"]).read_text()[-1500:]
        for line in lines
        if line["exit"]
    }
    refused = sorted(set((tmp_path / "refused.log").read_text().splitlines())) if failed else []
    assert failed == {}, "\n".join(["refused imports (optional ones are caught by their importer):", *refused, *failed])
    assert sum(line["timeout_s"] for line in lines) <= BUDGET_S
    limits = {line["step"]: line["timeout_s"] for line in lines}
    assert [(name, limits.get(name)) for name, _ in script_steps()] == script_steps()  # device branches too
    compared = next(line for line in lines if line["step"] == "resume-compare")["resumed_vs_uninterrupted"]
    assert compared["ddp"]["steps"] == 2 and compared["ddp"]["max_abs_diff_loss"] < 1e-4, compared
    ran = {line["step"] for line in lines if "skipped" not in line}
    assert ran == {"probe", "corpus", "fit-ddp", "fit-ddp-resume", "fit-fsdp2", "fit-fsdp", *names[-3:]}
    assert {p.name for p in (tmp_path / "out").glob("*.csv")} == {"fit-ddp-metrics.csv", "fit-ddp-resumed-metrics.csv"}


def test_compare_takes_the_largest_difference_over_the_steps_both_runs_logged(tmp_path, capsys):
    header = "epoch,step,train/grad_norm,train/loss,val/loss\n"
    full, resumed = tmp_path / "ddp" / "logs" / "fit", tmp_path / "ddp-resumed" / "logs" / "fit-step2"
    for folder, rows in ((full, ["0,0,1.0,5.0,", "0,1,1.0,4.0,", "0,2,0.5,3.0,", "0,3,0.5,2.0,", "0,3,,,2.5"]),
                         (resumed, ["0,2,0.5,3.0,", "0,3,0.75,2.125,"])):  # fmt: skip
        folder.mkdir(parents=True)
        (folder / "metrics.csv").write_text(header + "\n".join(rows) + "\n")
    assert results_main(["compare", "2", str(tmp_path / "ddp")]) == 0
    numbers = json.loads(capsys.readouterr().out.removeprefix("numbers: "))
    assert numbers == {
        "resumed_vs_uninterrupted": {"ddp": {"steps": 2, "max_abs_diff_loss": 0.125, "max_abs_diff_grad_norm": 0.25}}
    }
    assert results_main(["compare", "2", str(tmp_path / "missing")]) == 1


def test_a_record_keeps_the_logs_numbers_and_the_pytest_outcomes_of_a_killed_run(tmp_path):
    log = tmp_path / "parity.log"
    log.write_text(
        "tests/gpu/test_a.py::test_x[fields0] PASSED   [ 10%]\n"
        "tests/gpu/test_a.py::test_y SKIPPED (MegaBlocks unavailable)   [ 20%]\n"
        "tests/gpu/test_a.py::test_z FAILED   [ 30%]\n"
        'numbers: {"a": 1}\nnumbers: {"a": 2}\n'
    )
    results = tmp_path / "results.jsonl"
    assert results_main(["record", str(results), "parity", "124", "40", "40", str(log)]) == 0
    assert results_main(["record", str(results), "build", "0", "0", "120", str(tmp_path / "none.log"), "dry"]) == 0
    assert [json.loads(line) for line in results.read_text().splitlines()] == [
        {"step": "parity", "exit": 124, "seconds": 40, "timeout_s": 40, "timed_out": True, "log": "parity.log",
         "a": 2, "tests": {"passed": 1, "skipped": 1, "failed": 1}},
        {"step": "build", "exit": 0, "seconds": 0, "timeout_s": 120, "skipped": "dry"},
    ]  # fmt: skip


class Killed(Exception):
    """The time limit stopping the benchmark inside a case."""


def test_the_benchmark_writes_each_case_as_it_ends_so_a_killed_run_keeps_the_finished_ones(tmp_path, monkeypatch):
    cases = []

    def run_case(name, backend, warmup, steps, peak, compiled=False):
        if len(cases) == 2:
            raise Killed
        cases.append((name, backend, compiled))
        return {"model": name, "backend": backend, "compiled": compiled, "tokens_per_s": 100}

    monkeypatch.setattr(gpu_throughput.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_throughput.torch.cuda, "get_device_name", lambda: "stand-in")
    monkeypatch.setattr(gpu_throughput, "measured_matmul_flops", lambda: 5e14)
    monkeypatch.setattr(gpu_throughput, "run_case", run_case)
    out = tmp_path / "gpu.jsonl"
    with pytest.raises(Killed):
        gpu_throughput.main(["--out", str(out), "--models", "moe-180m", "--compiled", "moe-180m:grouped"])
    header, *rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert header["measured_bf16_matmul_tflops"] == 500.0 and header["environment"]["gpu"] == "stand-in"
    assert (
        [(r["model"], r["backend"], r["compiled"]) for r in rows]
        == cases
        == [
            ("moe-180m", "megablocks", False),
            ("moe-180m", "grouped", False),
        ]
    )
    cases.clear()
    gpu_throughput.main(["--out", str(out), "--models", "moe-180m", "--backends", "grouped", "--compiled", ""])
    assert json.loads(out.read_text().splitlines()[-1]) == {
        "summary": {"moe-180m": {"fastest": "grouped", "compiled_speedup": {}}}
    }


@pytest.mark.skipif(not CARRIED[0].is_dir(), reason="no .gpu-wheels here: run bash scripts/gpu_check.sh fetch")
def test_the_fetched_folders_hold_exactly_the_carry_list_and_fit_the_device_tree():
    wheels = {p.name for p in CARRIED[0].iterdir()}
    fetched = {normalize(w.split("-")[0]): w.split("-")[1] for w in wheels}
    assert fetched == pins(CARRY) and len(wheels) == len(fetched)
    assert all(w.endswith("-py3-none-any.whl") or re.search(r"-cp312-.*manylinux.*x86_64\.whl$", w) for w in wheels)
    assert {p.name for p in CARRIED[1].iterdir()} == SDISTS
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    tree = sum((ROOT / name).stat().st_size for name in tracked.split("\0") if name and (ROOT / name).is_file())
    # NOTE: .gpu-prebuilt (what make gpu-build-check compiled) travels too where it exists.
    prebuilt = ROOT / ".gpu-prebuilt"
    carried = sum(
        p.stat().st_size for folder in [*CARRIED, prebuilt] if folder.is_dir() for p in folder.rglob("*") if p.is_file()
    )
    assert tree + carried <= TREE_LIMIT, f"tracked {tree} + carried {carried} bytes > 64 MiB"
