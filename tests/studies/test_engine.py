import json

import pytest

from moe_lit.errors import MoeLitError
from moe_lit.studies.identity import record_path
from moe_lit.studies.study import parse_study, run_study
from tests.helpers.studies import small_spec
from tests.studies import fakes


@pytest.fixture
def spec():
    # NOTE: without the capacity ablation, whose dropless children transform their parent's real weights.
    ablations = {k: v for k, v in small_spec()["ablations"].items() if k != "capacity_factor"}
    return parse_study(small_spec(ablations=ablations))


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


@pytest.mark.slow
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


@pytest.mark.slow
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
    with pytest.raises(
        MoeLitError, match=r"vocab_size: the study's models have \[97\] but data_dir .* has a tokenizer of 8192"
    ):
        run_study(parse_study(small_spec(), str(data)), tmp_path / "out", train_fn=fakes.fake_train, log=lambda _: None)
    with pytest.raises(MoeLitError, match="holds no prepared data"):
        study = parse_study(small_spec(), str(tmp_path / "none"))
        run_study(study, tmp_path / "out", train_fn=fakes.fake_train, log=lambda _: None)


def _family(seed_points=1):
    """A parent and two children forking from its step-2 checkpoint, hashed."""
    from moe_lit.lit.run_config import RunConfig
    from moe_lit.studies.identity import Point, Start, finalize
    from tests.helpers.models import tiny

    run = RunConfig(data={"seq_len": 16, "batch_size": 4}, train={"max_steps": 6, "val_every": 2})
    parent = Point("parent", "parent", 0, tiny(), run)
    kids = [Point(f"kid{i}", f"kid{i}", 0, tiny(), run, start=Start("parent", step=2 * i)) for i in (1, 2)]
    return finalize([*kids, parent])  # any order: parents are scheduled first


def test_children_start_from_their_parents_checkpoint_which_trains_once(tmp_path):
    from moe_lit.studies.identity import fork_checkpoint
    from moe_lit.studies.schedule import run_points

    points = _family()
    by_name = {p.name: p for p in points}
    records = run_points(points, tmp_path, train_fn=fakes.fake_train, log=lambda _: None)
    assert [r["status"] for r in records] == ["ok"] * 3
    calls = fakes.read_calls(tmp_path)
    assert [c["out_dir"] for c in calls] == [by_name[n].hash for n in ("parent", "kid1", "kid2")]
    assert calls[1]["start"] == str(fork_checkpoint(tmp_path, by_name["parent"], 2))
    assert calls[2]["start"] == str(fork_checkpoint(tmp_path, by_name["parent"], 4))
    # a kid's record lost: it runs again from the parent's kept checkpoint, the parent does not
    record_path(tmp_path, by_name["kid2"]).unlink()
    run_points(points, tmp_path, train_fn=fakes.fake_train, log=lambda _: None)
    assert [c["out_dir"] for c in fakes.read_calls(tmp_path)[3:]] == [by_name["kid2"].hash]


def test_a_failed_parent_fails_its_children_without_running_them(tmp_path):
    from moe_lit.studies.schedule import run_points

    def parent_fails(model_cfg, run, out_dir, **kwargs):
        if kwargs.get("resume_from") is None:
            raise RuntimeError("diverged (fake)")
        return fakes.fake_train(model_cfg, run, out_dir, **kwargs)

    records = {r["name"]: r for r in run_points(_family(), tmp_path, train_fn=parent_fails, log=lambda _: None)}
    assert records["parent"]["error"] == "RuntimeError: diverged (fake)"
    assert records["kid1"]["status"] == records["kid2"]["status"] == "failed"
    assert records["kid1"]["error"] == "parent point 'parent' failed"


def test_a_point_leased_by_another_runner_is_left_to_it(tmp_path):
    from moe_lit.studies.leases import try_lease
    from moe_lit.studies.schedule import run_points

    points = _family()
    parent = next(p for p in points if p.name == "parent")
    held = try_lease(tmp_path, parent.hash, ttl_s=600)
    log = []
    records = run_points(points, tmp_path, train_fn=fakes.fake_train, log=log.append)
    assert records == [] and fakes.read_calls(tmp_path) == []  # the children wait for the parent
    assert any(line.startswith("parent (") and "leased by another runner" in line for line in log)
    held.release()
    assert len(run_points(points, tmp_path, train_fn=fakes.fake_train, log=lambda _: None)) == 3


def test_a_point_another_runner_failed_is_left_failed_unless_retry_failed(tmp_path):
    # NOTE: a runner's schedule is made at its start; a point failed since by another runner has a
    # record then, and --retry-failed alone runs it again (not every runner that reaches it).
    from moe_lit.studies.run import run_leased, run_point

    parent = next(p for p in _family() if p.name == "parent")
    assert run_point(parent, tmp_path, {}, train_fn=_broken)["status"] == "failed"  # the other runner
    assert run_leased(parent, tmp_path, {}, train_fn=fakes.fake_train) is None
    assert fakes.read_calls(tmp_path) == [] and json.loads(record_path(tmp_path, parent).read_text())["error"]
    assert run_leased(parent, tmp_path, {}, train_fn=fakes.fake_train, retry_failed=True)["status"] == "ok"
    assert len(fakes.read_calls(tmp_path)) == 1


def _broken(*args, **kwargs):
    raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")


@pytest.mark.slow
def test_submitit_local_executor_runs_the_waves(tmp_path):
    from moe_lit.studies.executors import ExecutorConfig
    from moe_lit.studies.schedule import run_points

    executor = ExecutorConfig(kind="submitit_local", timeout_min=5)
    records = run_points(_family(), tmp_path, train_fn=fakes.fake_train, executor=executor, log=lambda _: None)
    assert sorted(r["name"] for r in records if r["status"] == "ok") == ["kid1", "kid2", "parent"]
    assert (tmp_path / "submitit").is_dir()


def test_identity_ignores_fields_left_at_their_defaults():
    import dataclasses

    from moe_lit.studies.identity import digest, stable_dict

    @dataclasses.dataclass
    class Before:
        d_model: int = 64

    @dataclasses.dataclass
    class After:  # the same config after gaining a field with a default
        d_model: int = 64
        loss_chunk_tokens: int = 4096

    assert digest(stable_dict(Before(d_model=32))) == digest(stable_dict(After(d_model=32)))
    assert digest(stable_dict(After(d_model=32, loss_chunk_tokens=1))) != digest(stable_dict(Before(d_model=32)))
    assert stable_dict(After()) == {}


def _module_points(module):
    from moe_lit.config import ModelConfig
    from moe_lit.lit.run_config import RunConfig
    from moe_lit.studies.identity import Point, Start, finalize

    model = ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, d_ff=32)
    run = RunConfig.from_dict({"data": {"data_dir": "x", "seq_len": 8}, "train": {"max_steps": 2}})
    parent = Point("parent", "parent", 0, model, run)
    child = Point("child", "child", 0, model, run, start=Start(parent="parent", mode="init"), module=module)
    return finalize([parent, child])


def test_a_point_with_a_module_trains_with_it_built_over_its_parents_checkpoint(tmp_path):
    from moe_lit.studies.identity import Call, fork_checkpoint
    from moe_lit.studies.schedule import run_points

    parent, child = _module_points(Call.of(fakes.module_probe, tag="kd"))
    records = run_points([parent, child], tmp_path, train_fn=fakes.train_with_module, log=lambda _: None)
    assert "module" not in records[0]  # no module: train_fn gets no module_factory (the plain LM module)
    assert records[1]["module"] == {
        "d_ff": 32,
        "lr": child.run.optim.lr,
        "parent": str(fork_checkpoint(tmp_path, parent, None)),
        "tag": "kd",
    }


def test_a_plug_in_is_hashed_by_its_registered_name_and_version_not_its_import_path(monkeypatch):
    from moe_lit.registry import Entry
    from moe_lit.studies.identity import Call
    from moe_lit.studies.plugins import MODULES

    parent, plain = _module_points(None)
    _, with_module = _module_points(Call.of(fakes.module_probe))
    _, other_kwargs = _module_points(Call.of(fakes.module_probe, tag="x"))
    assert plain.identity(parent.hash)["module"] is None
    assert with_module.identity(parent.hash)["module"] == {"name": fakes.MODULE_PROBE, "version": 1, "kwargs": {}}
    assert len({plain.hash, with_module.hash, other_kwargs.hash}) == 3
    # the same name on a function defined elsewhere: the same point; a new version: a new point
    moved = Entry(fakes.MODULE_PROBE, 1, fakes.train_with_module)
    monkeypatch.setitem(MODULES._entries, fakes.MODULE_PROBE, moved)
    assert _module_points(Call(fakes.MODULE_PROBE))[1].hash == with_module.hash
    monkeypatch.setitem(MODULES._entries, fakes.MODULE_PROBE, Entry(fakes.MODULE_PROBE, 2, fakes.module_probe))
    assert _module_points(Call(fakes.MODULE_PROBE))[1].hash != with_module.hash


def test_a_call_names_a_registered_plug_in_only():
    from moe_lit.registry import UnknownName
    from moe_lit.studies.identity import Call

    with pytest.raises(ValueError, match="is not a registered study plug-in"):
        Call.of(fakes.fake_train)
    with pytest.raises(UnknownName, match="study plug-in: unknown name 'nope', registered: expand_experts, "):
        Call("nope").to_dict()
