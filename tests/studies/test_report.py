import csv

import pytest

from moe_lit.errors import MoeLitError
from moe_lit.studies.kinds.dense_vs_sparse import DROPPING_AT_VALIDATION, claims, findings
from moe_lit.studies.report import aggregate, read_results, write_report
from moe_lit.studies.study import parse_study, run_study
from moe_lit.studies.verdicts import NO_MARGIN, judge
from tests.helpers.studies import small_spec
from tests.studies import fakes


def capacity_hurts(model_cfg, run, out_dir, **kwargs):
    """fake_train, with dropping costing 0.02/cf nats and the 8-expert S model failing."""
    moe = model_cfg.moe
    if moe and moe.num_experts == 8 and model_cfg.d_ff == 64:
        raise ValueError("diverged (fake)")
    result = fakes.fake_train(model_cfg, run, out_dir, **kwargs)
    if moe and moe.capacity_factor:
        result["val_loss"] = round(result["val_loss"] + 0.02 / moe.capacity_factor, 6)
    return result


@pytest.fixture(scope="module")
def study_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    run_study(
        parse_study(small_spec()),
        out,
        train_fn=capacity_hurts,
        prepare_data=False,
        command="moe-lit study run t.yaml",
        log=lambda _: None,
    )
    return out


def test_runs_csv_has_one_row_per_run_with_language_columns(study_dir):
    paths = write_report(study_dir)
    rows = list(csv.DictReader(paths["runs_csv"].open()))
    assert len(rows) == 17  # 15 points + the 2 capacity points' dropless-validation children
    header = list(rows[0])
    assert header[:3] == ["name", "config_name", "hash"]
    assert (
        header.index("val_loss")
        < header.index("val_loss_de")
        < header.index("val_loss_en")
        < header.index("tokens_per_s")
    )
    failed = next(r for r in rows if r["name"] == "S/E8k2")
    assert (
        failed["status"] == "failed" and failed["error"] == "ValueError: diverged (fake)" and failed["val_loss"] == ""
    )
    ok = next(r for r in rows if r["name"] == "M/E4k2/cf=2")
    assert float(ok["val_loss_en"]) == pytest.approx(float(ok["val_loss"]) - 0.02 / 2 - 0.1, abs=1e-6)


def test_summary_and_plots(study_dir):
    paths = write_report(study_dir)
    text = paths["summary"].read_text()
    assert "Command: `moe-lit study run t.yaml`" in text
    assert "17 points: 14 ok, 3 failed, 0 pending; seeds [0]" in text
    assert "| S/E8k2 | " in text and "ValueError: diverged (fake)" in text  # the failed-runs table
    assert {p.name for p in (study_dir / "plots").iterdir()} == {"loss_vs_total_params.png"}  # one plot of its own
    assert paths["loss_vs_total_params"].read_bytes()[:4] == b"\x89PNG"
    assert "![loss_vs_total_params](plots/loss_vs_total_params.png)" in text


def test_claims_and_findings_of_the_seed_with_numbers(study_dir):
    plan, records = read_results(study_dir)
    rows = aggregate(records)
    lines = findings(rows)

    def line(prefix):
        return next(text for text in lines if text.startswith(prefix))

    total_m = line("- **Loss vs total params at fixed active** (M")
    assert total_m.endswith("dense 4.9425 → E4 4.8945 → E8 4.8388.")
    total_s = line("- **Loss vs total params at fixed active** (S")
    assert "E8" not in total_s  # the failed point is left out
    assert "E4: F=126 (k=1, " in line("- **Best expert size at fixed active** (M)")
    assert line("- **capacity**") == "- **capacity**: dropless 4.8945, cf=1 4.9145, cf=2 4.9045."  # 0.02 / cf
    verdicts = judge(claims(rows, plan["spec"]["ablations"], margin=0.01))
    texts = [v.evidence.claim.text for v in verdicts]
    assert texts[:3] == [
        "S, top-2: at fixed active params the most total params beat dense",  # S/E8k2 failed: no smallest MoE
        "M, top-2: at fixed active params the most total params beat dense",
        "M, top-2: at fixed active params the most total params beat the smallest MoE",
    ]
    assert "dropless beats token dropping (cf=1)" in texts and "shared: 0.5 matters little" in texts
    # one seed: every claim is untestable here, for want of a noise estimate
    assert {v.word for v in verdicts} == {"untestable here"}
    reasons = {v.evidence.claim.text: v.evidence.reason for v in verdicts}
    dropless = {reasons.pop(text) for text in list(reasons) if text.startswith("dropless")}
    assert set(reasons.values()) == {"no noise estimate: 1 seed"}
    assert dropless == {f"no noise estimate: 1 seed; {DROPPING_AT_VALIDATION}"}  # validated with its capacity too
    unstated = judge(claims(rows, plan["spec"]["ablations"]))  # no margin stated: the no-effect claims say so
    assert {v.evidence.reason for v in unstated if v.evidence.claim.direction == "equivalent"} == {NO_MARGIN}


def test_readme_block_is_filled_and_the_rest_kept(study_dir, tmp_path):
    readme = tmp_path / "docs" / "README.md"
    readme.parent.mkdir()
    readme.write_text("# Top\n\n## Study: t\n\nIntro.\n\n<!-- study:t -->\nold\n<!-- /study:t -->\n\n## Next\n")
    write_report(study_dir, readme=readme)
    text = readme.read_text()
    assert text.startswith("# Top\n\n## Study: t\n\nIntro.\n\n<!-- study:t -->\n### Study: t (kind dense_vs_sparse)\n")
    assert text.endswith("<!-- /study:t -->\n\n## Next\n") and "old" not in text
    assert "#### Findings (computed from the runs below)" in text and "Command: `moe-lit study run t.yaml`" in text
    rel = f"../../{study_dir.name}/plots/loss_vs_total_params.png"
    assert f"![loss_vs_total_params]({rel})" in text and (readme.parent / rel).is_file()
    first = text
    write_report(study_dir, readme=readme)  # idempotent
    assert readme.read_text() == first
    readme.write_text("no block\n")
    with pytest.raises(MoeLitError, match="--readme: .* has no '<!-- study:t -->' ... '<!-- /study:t -->' block"):
        write_report(study_dir, readme=readme)


def test_report_without_a_study_is_a_clear_error(tmp_path):
    with pytest.raises(MoeLitError, match="holds no study.json; run `moe-lit study run` first"):
        write_report(tmp_path)


def test_a_report_from_fewer_finished_points_is_refused_without_force(study_dir, tmp_path):
    import shutil

    write_report(study_dir)
    clone = tmp_path / "clone"
    shutil.copytree(study_dir, clone)
    for record in sorted((clone / "runs").glob("*.json"))[:3]:  # a fresh clone that lacks some records
        record.unlink()
    summary = (clone / "summary.md").read_text()
    with pytest.raises(MoeLitError, match="has a report of 14 finished points but only 1[12] records are here"):
        write_report(clone)
    assert (clone / "summary.md").read_text() == summary  # nothing was replaced
    (clone / "report.json").unlink()  # a report shipped before report.json existed: runs.csv counts
    with pytest.raises(MoeLitError, match="has a report of 14 finished points"):
        write_report(clone)
    assert "pending" in write_report(clone, force=True)["summary"].read_text()
