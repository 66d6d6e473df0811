import csv

import pytest

from moe_lit.errors import MoeLitError
from moe_lit.studies.kinds.dense_vs_sparse import findings
from moe_lit.studies.report import aggregate, load_study, write_report
from moe_lit.studies.study import parse_study, run_study
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
    assert len(rows) == 15
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
    assert "15 points: 14 ok, 1 failed, 0 pending; seeds [0]" in text
    assert "| S/E8k2 | " in text and "ValueError: diverged (fake)" in text  # the failed-runs table
    assert {p.name for p in (study_dir / "plots").iterdir()} == {
        "loss_vs_total_params.png",
        "loss_vs_expert_size.png",
        "ablation_granularity.png",
        "ablation_shared.png",
        "ablation_heterogeneous.png",
        "ablation_balancing.png",
        "ablation_capacity.png",
        "ablation_matching.png",
    }
    for name in ("loss_vs_total_params", "ablation_capacity"):
        assert paths[name].read_bytes()[:4] == b"\x89PNG"
        assert f"![{name}](plots/{name}.png)" in text


def test_findings_check_the_seed_claims_with_numbers(study_dir):
    _, records = load_study(study_dir)
    lines = findings(aggregate(records))

    def line(prefix):
        return next(text for text in lines if text.startswith(prefix))

    total_m = line("- **Loss vs total params at fixed active** (M")
    assert "loss falls at 2 of 2 steps up in total params" in total_m and "dense -0.1037: **reproduced**" in total_m
    assert total_m.endswith("seed noise: diff -0.1037 (n=1 vs n=1): not testable (n < 2).")
    total_s = line("- **Loss vs total params at fixed active** (S")
    assert "E8" not in total_s and "1 of 1 steps" in total_s  # the failed point is left out
    best = line("- **Best expert size at fixed active** (M)")
    assert "E4: F=126 (k=1, " in best and "**reproduced: the same expert size at every E**" in best
    capacity = line("- **capacity**")
    assert "loss minus dropless: cf=1 +0.0200, cf=2 +0.0100 (positive = dropless better): **reproduced**" in capacity
    assert "seed noise: cf=1 diff 0.0200 (n=1 vs n=1): not testable (n < 2)" in capacity  # one seed: no test
    balancing = line("- **balancing**")
    assert "spread 0.0000 vs the expert-count effect" in balancing and "**reproduced: small**" in balancing
    shared = line("- **shared**")  # fewer total params with a shared expert: the fake loss rises a bit
    assert "; spread 0.0216 vs the expert-count effect 0.1037" in shared and shared.endswith("**reproduced: small**.")


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
