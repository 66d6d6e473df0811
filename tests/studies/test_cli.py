import json
from pathlib import Path

import yaml

from moe_lit.console_script import main
from moe_lit.studies import study as study_module
from moe_lit.studies.study import parse_study, run_study
from tests.helpers.paths import STUDIES
from tests.helpers.studies import small_spec
from tests.studies import fakes


def test_dry_run_lists_every_point_with_its_status(tmp_path, capsys):
    spec = STUDIES / "dense_vs_sparse.yaml"
    assert main(["study", "run", str(spec), "--dry-run", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| point")]
    assert len(rows) == 15 * 4 and all(row.endswith("| pending |") for row in rows)  # 15 configs (1 dropless child) x 4
    assert rows[0].startswith("| S/dense/s0 | ")
    assert "60 points, " in out and f" training FLOPs in all -> {tmp_path}" in out


def test_report_action_rebuilds_the_report(tmp_path, capsys):
    spec = parse_study(small_spec(ablations=None))
    run_study(spec, tmp_path, train_fn=fakes.fake_train, prepare_data=False, log=lambda _: None)
    assert main(["study", "report", "--out", str(tmp_path)]) == 0
    assert "6 points: 6 ok, 0 failed, 0 pending" in capsys.readouterr().out
    assert (tmp_path / "runs.csv").is_file() and (tmp_path / "plots" / "loss_vs_total_params.png").is_file()


def test_bad_study_file_is_a_one_line_error(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: x\nkind: dense_vs_sparse\nbase: {d_model: 32, n_heads: 4}\n"
        "budgets: [{name: S}]\ngrid: {match: [params]}\n"
    )
    assert main(["study", "run", str(bad), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err == "moe-lit study run: error: grid.match: got 'params', allowed values: active, total\n"
    assert main(["study", "run", str(tmp_path / "missing.yaml")]) == 2
    assert "study: no such file" in capsys.readouterr().err


def test_a_slice_run_keeps_the_command_of_the_run_it_slices(tmp_path, monkeypatch, capsys):
    def with_fake_training(*args, **kwargs):
        return run_study(*args, **kwargs, train_fn=fakes.fake_train, prepare_data=False, log=lambda _: None)

    monkeypatch.setattr(study_module, "run_study", with_fake_training)
    monkeypatch.chdir(tmp_path)
    Path("t.yaml").write_text(yaml.safe_dump(small_spec(ablations=None)))

    def recorded_after(*flags: str) -> str:
        assert main(["study", *flags]) == 0
        capsys.readouterr()
        return json.loads(Path("results/t/study.json").read_text())["command"]

    whole = "moe-lit study run t.yaml --parallel 1"
    assert recorded_after("run", "t.yaml", "--parallel", "1", "--only", "S/*") == whole
    assert recorded_after("run", "t.yaml", "--only", "M/*") == whole
    assert recorded_after("report", "t.yaml") == whole
    assert recorded_after("run", "t.yaml") == "moe-lit study run t.yaml"
