import json

import pytest

from moe_lit.errors import MoeLitError
from moe_lit.studies.engine import record_path
from moe_lit.studies.study import parse_study, run_study
from tests.studies import fakes
from tests.studies.test_dense_vs_sparse import small_spec


@pytest.fixture
def spec():
    return parse_study(small_spec())


def expand(study):
    return study.points


def _run(spec, out, train_fn, **kwargs):
    return run_study(spec, out, train_fn=train_fn, prepare_data=False, log=lambda _: None, **kwargs)


def test_every_point_is_recorded_with_params_losses_and_throughput(spec, tmp_path):
    records = _run(spec, tmp_path, fakes.fake_train)
    points = expand(spec)
    assert [r["hash"] for r in records] == [p.hash for p in points]
    assert len(fakes.read_calls(tmp_path)) == len(points)
    rec = json.loads(record_path(tmp_path, points[1]).read_text())  # S/E4k2
    assert rec["status"] == "ok" and rec["error"] is None
    assert rec["name"] == "S/E4k2" and rec["num_experts"] == 4 and rec["top_k"] == 2
    assert rec["val_loss"] == fakes.fake_loss(points[1].model, 0)
    assert rec["val_loss_per_language"] == {"en": rec["val_loss"] - 0.1, "de": rec["val_loss"] + 0.1}
    assert rec["total_params"] > rec["active_params"] > 0 and rec["flops_per_token"] > 0
    assert rec["tokens"] == 4096 and rec["tokens_per_s"] == 1000.0 and rec["load_imbalance"] == 1.5
    assert (tmp_path / "study.json").is_file()


def test_a_killed_sweep_resumes_without_rerunning_finished_points(spec, tmp_path):
    calls = []

    def killed_at_third(model_cfg, *args, **kwargs):
        calls.append(model_cfg)
        if len(calls) == 3:
            raise KeyboardInterrupt  # the sweep is killed while the third point trains
        return fakes.fake_train(model_cfg, *args, **kwargs)

    with pytest.raises(KeyboardInterrupt):
        _run(spec, tmp_path, killed_at_third)
    points = expand(spec)
    assert [record_path(tmp_path, p).is_file() for p in points[:4]] == [True, True, False, False]
    (tmp_path / "runs" / points[2].hash / "partial.ckpt").write_text("half")  # leftovers of the killed point

    (tmp_path / fakes.CALLS_FILE).unlink()
    records = _run(spec, tmp_path, fakes.fake_train)
    rerun = [c["out_dir"] for c in fakes.read_calls(tmp_path)]
    assert rerun == [p.hash for p in points[2:]]  # the two finished points did not train again
    assert len(records) == len(points) and all(r["status"] == "ok" for r in records)
    assert not (tmp_path / "runs" / points[2].hash / "partial.ckpt").exists()  # restarted from scratch


def test_a_failing_point_is_recorded_and_the_sweep_goes_on(tmp_path):
    spec16 = parse_study(small_spec(grid={"num_experts": ["dense", 4, 16]}, ablations=None))
    records = _run(spec16, tmp_path / "b", fakes.fail_on_16_experts)
    by_name = {r["name"]: r for r in records}
    assert by_name["S/E16k2"]["status"] == by_name["M/E16k2"]["status"] == "failed"
    assert by_name["M/E16k2"]["error"] == "RuntimeError: out of memory (fake)"
    assert "fail_on_16_experts" in by_name["M/E16k2"]["traceback"]
    assert by_name["M/E16k2"]["total_params"] > 0  # analytic columns are kept for failed points
    assert [r["status"] for r in records].count("ok") == 4

    calls_before = len(fakes.read_calls(tmp_path / "b"))
    _run(spec16, tmp_path / "b", fakes.fail_on_16_experts)  # failed points are finished: skipped
    assert len(fakes.read_calls(tmp_path / "b")) == calls_before
    records = _run(spec16, tmp_path / "b", fakes.fake_train, retry_failed=True)  # only they run again
    assert len(fakes.read_calls(tmp_path / "b")) == calls_before + 2
    assert all(r["status"] == "ok" for r in records)


def test_parallel_workers_record_results_and_a_crashed_worker_is_a_failed_point(tmp_path):
    spec = parse_study(small_spec(grid={"num_experts": [4, 16]}, ablations=None, budgets=[{"name": "S"}]))
    records = _run(spec, tmp_path, fakes.crash_on_16_experts, parallel=2)
    by_name = {r["name"]: r for r in records}
    assert set(by_name) == {"S/E4k2", "S/E16k2"}
    assert by_name["S/E4k2"]["status"] == "ok"
    assert by_name["S/E4k2"]["val_loss"] == fakes.fake_loss(expand(spec)[0].model, 0)
    assert len(fakes.read_calls(tmp_path)) == 1  # the worker that trained logged its call
    assert by_name["S/E16k2"]["status"] == "failed"
    assert by_name["S/E16k2"]["error"].startswith("worker process died with exit code 3")


def test_an_interrupted_worker_stops_the_sweep_and_leaves_no_record(tmp_path):
    spec = parse_study(small_spec(grid={"num_experts": [4]}, ablations=None, budgets=[{"name": "S"}]))
    with pytest.raises(KeyboardInterrupt):
        _run(spec, tmp_path, fakes.interrupt, parallel=2)
    assert not record_path(tmp_path, expand(spec)[0]).exists()  # it runs again on resume


def test_bad_parallel_and_mismatched_data_are_one_line_errors(spec, tmp_path):
    with pytest.raises(MoeLitError, match="--parallel: must be an integer >= 1, got 0"):
        _run(spec, tmp_path, fakes.fake_train, parallel=0)
    data = tmp_path / "data"
    data.mkdir()
    (data / "meta.json").write_text(json.dumps({"format": 1, "vocab_size": 8192}))
    with pytest.raises(MoeLitError, match=r"vocab_size: the study's models have \[97\] but data_dir .* has a tokenizer of 8192"):
        run_study(parse_study(small_spec(), str(data)), tmp_path / "out", train_fn=fakes.fake_train, log=lambda _: None)
    with pytest.raises(MoeLitError, match="holds no prepared data"):
        study = parse_study(small_spec(), str(tmp_path / "none"))
        run_study(study, tmp_path / "out", train_fn=fakes.fake_train, log=lambda _: None)
