"""Executors: submitit's local executor runs point jobs; SLURM settings reach the sbatch script."""

import dataclasses
import os
from pathlib import Path

import pytest
import submitit
import yaml

from moe_lit.config import ConfigError
from moe_lit.studies.executors import ExecutorConfig, make_executor, submit_points, wait_all


def write_and_double(item: dict) -> dict:
    """A job: writes a file (proof it ran) and returns a dict."""
    Path(item["path"]).write_text(str(item["x"]))
    return {"double": 2 * item["x"], "pid": os.getpid()}


def fail_on_odd(item: dict) -> dict:
    if item["x"] % 2:
        raise ValueError(f"odd item {item['x']}")
    return {"x": item["x"]}


def test_local_jobs_run_and_results_collected(tmp_path):
    cfg = ExecutorConfig(kind="submitit_local", timeout_min=2)
    items = [{"path": str(tmp_path / f"out{x}.txt"), "x": x} for x in (3, 5)]
    jobs = submit_points(cfg, write_and_double, items, cfg.resolve_folder(tmp_path))
    seen = []
    outcomes = wait_all(jobs, on_done=lambda o: seen.append(o.index), poll_s=0.2)
    assert [o.index for o in outcomes] == [0, 1] and sorted(seen) == [0, 1]
    assert all(o.ok and o.error is None for o in outcomes)
    assert [o.result["double"] for o in outcomes] == [6, 10]
    assert {o.result["pid"] for o in outcomes}.isdisjoint({os.getpid()})  # ran in other processes
    assert [(tmp_path / f"out{x}.txt").read_text() for x in (3, 5)] == ["3", "5"]
    assert (tmp_path / "submitit").is_dir()


def test_failing_job_is_an_outcome_not_a_crash(tmp_path):
    cfg = ExecutorConfig(kind="submitit_local", timeout_min=2, folder=str(tmp_path / "logs"))
    jobs = submit_points(cfg, fail_on_odd, [{"x": 2}, {"x": 1}], cfg.resolve_folder(tmp_path))
    good, bad = wait_all(jobs, poll_s=0.2)
    assert good.ok and good.result == {"x": 2}
    assert not bad.ok and bad.result is None
    assert bad.error == "ValueError: odd item 1" and "fail_on_odd" in bad.traceback
    assert bad.log.startswith(str(tmp_path / "logs"))


def die(item: dict) -> dict:
    os._exit(3)  # as if killed: no result, no exception


def test_dead_job_is_a_failed_outcome(tmp_path, monkeypatch):
    monkeypatch.setattr(submitit.Job, "_results_timeout_s", 0)  # do not wait for a result that never comes
    cfg = ExecutorConfig(kind="submitit_local", timeout_min=2)
    (outcome,) = wait_all(submit_points(cfg, die, [{}], tmp_path), poll_s=0.2)
    assert not outcome.ok and outcome.result is None
    assert outcome.error.startswith(f"job {outcome.job_id} ended without a result (state ")
    assert outcome.error.endswith(f"see {outcome.log}")


def test_no_items_no_jobs(tmp_path):
    assert submit_points(ExecutorConfig(kind="submitit_local"), fail_on_odd, [], tmp_path) == []
    assert wait_all([]) == []


def test_slurm_settings_reach_sbatch(tmp_path, monkeypatch):
    # NOTE: no cluster here: pretend srun exists so that submitit builds (but never submits) the script.
    monkeypatch.setattr(submitit.SlurmExecutor, "affinity", classmethod(lambda cls: 2))
    cfg = ExecutorConfig(
        kind="slurm",
        partition="gpu",
        gpus_per_node=2,
        cpus_per_task=8,
        mem_gb=64,
        timeout_min=90,
        array_parallelism=4,
        account="proj",
        qos="high",
        setup=["module load cuda"],
        additional={"constraint": "a100"},
    )
    executor = make_executor(cfg, tmp_path, name="dense_vs_sparse")
    script = executor._executor._make_submission_file_text("python -m x", "uid")
    for line in (
        "--partition=gpu", "--gpus-per-node=2", "--cpus-per-task=8", "--mem=64GB", "--time=90",
        "--account=proj", "--qos=high", "--constraint=a100", "--job-name=dense_vs_sparse",
    ):  # fmt: skip
        assert f"#SBATCH {line}\n" in script
    assert "module load cuda" in script
    assert executor._executor.parameters["array_parallelism"] == 4


def test_local_kind_is_not_a_submitit_executor(tmp_path):
    with pytest.raises(ConfigError, match="executor.kind"):
        make_executor(ExecutorConfig(kind="local"), tmp_path)


@pytest.mark.parametrize(
    "field, value",
    [
        ("kind", "kubernetes"),
        ("parallel", 0),
        ("gpus_per_node", -1),
        ("cpus_per_task", 0),
        ("mem_gb", "lots"),
        ("timeout_min", 1.5),
        ("array_parallelism", True),
        ("partition", ""),
        ("setup", "module load cuda"),
        ("additional", ["constraint"]),
    ],
)
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ConfigError, match=rf"^executor\.{field}: "):
        ExecutorConfig(**{field: value})


def test_yaml_section_round_trip():
    text = """
    kind: slurm
    partition: gpu
    gpus_per_node: 1
    mem_gb: 64
    additional: {constraint: a100}
    """
    cfg = ExecutorConfig(**yaml.safe_load(text))
    assert ExecutorConfig(**yaml.safe_load(yaml.safe_dump(dataclasses.asdict(cfg)))) == cfg
    assert cfg.submitit_parameters() == {
        "timeout_min": 240,
        "gpus_per_node": 1,
        "mem_gb": 64,
        "slurm_partition": "gpu",
        "slurm_array_parallelism": 256,
        "slurm_additional_parameters": {"constraint": "a100"},
    }
