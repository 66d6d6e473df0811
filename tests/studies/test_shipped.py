"""The shipped studies under results/: re-rendering their reports changes no record and no hash,
and every summary judges its claims with the four verdicts only."""

import json
import re

import pytest

from moe_lit.studies.identity import Call
from moe_lit.studies.study import load_study
from moe_lit.studies.verdicts import (
    CONTRADICTED,
    CONVERTED_MOE,
    NOT_DETECTED,
    REPRODUCED,
    TRAINED_MOE,
    UNTESTABLE,
    VERDICTS,
)
from tests.helpers.paths import REPO, STUDIES

RESULTS = REPO / "results"
SHIPPED = sorted(d.name for d in RESULTS.iterdir() if (d / "study.json").is_file())
# NOTE: the *-smollm2 studies start from an imported model on disk (hashed with its files), not in the checkout.
FROM_CONFIG = [name for name in SHIPPED if (STUDIES / f"{name}.yaml").is_file() and not name.endswith("-smollm2")]


@pytest.mark.parametrize("name", FROM_CONFIG)
def test_the_study_file_still_expands_to_the_shipped_points(name):
    plan = json.loads((RESULTS / name / "study.json").read_text())
    study = load_study(STUDIES / f"{name}.yaml")
    assert [p.hash for p in study.points] == [p["hash"] for p in plan["points"]]


@pytest.mark.parametrize("name", SHIPPED)
def test_every_record_is_the_plans_and_holds_its_hash(name):
    plan = json.loads((RESULTS / name / "study.json").read_text())
    hashes = {p["hash"] for p in plan["points"]}
    records = sorted((RESULTS / name / "runs").glob("*.json"))
    assert records and {r.stem for r in records} <= hashes
    assert all(json.loads(r.read_text())["hash"] == r.stem for r in records)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_claim_of_a_summary_has_its_numbers_and_one_of_the_four_verdicts(name):
    summary = (RESULTS / name / "summary.md").read_text()
    claims = json.loads((RESULTS / name / "report.json").read_text())["claims"]
    assert claims and "Claims (verdicts: reproduced, contradicted, not detected, untestable here)" in summary
    header = (
        "| claim | object: paper / here | a - b | estimate [95% CI] | Holm simultaneous CI | test | p | Holm p "
        "| MDE (power 0.8) | paper | verdict |"
    )
    assert header in summary
    rows = [line for line in summary.split(header, 1)[1].split("\n\n", 1)[0].splitlines()[2:] if line]
    assert len(rows) == len(claims)
    for row, claim in zip(rows, claims, strict=True):
        assert claim["verdict"] in VERDICTS and f"| **{claim['verdict']}**" in row
        assert (claim["reason"] is not None) == (claim["verdict"] == "untestable here")


@pytest.mark.parametrize("name", SHIPPED)
def test_every_claim_states_its_object_and_none_is_judged_on_another(name):
    claims = json.loads((RESULTS / name / "report.json").read_text())["claims"]
    for claim in claims:
        assert claim["paper_object"] and claim["study_object"], claim["claim"]
        if not claim["objects_match"]:
            assert claim["verdict"] == UNTESTABLE and "the paper tested" in claim["reason"], claim["claim"]
        pretrained_moe = claim["paper_object"].startswith(TRAINED_MOE)
        if pretrained_moe and claim["study_object"].startswith(CONVERTED_MOE):
            assert claim["verdict"] not in (REPRODUCED, CONTRADICTED), claim["claim"]


@pytest.mark.parametrize("name", SHIPPED)
def test_a_not_detected_row_shows_the_interval_its_verdict_used(name):
    for claim in json.loads((RESULTS / name / "report.json").read_text())["claims"]:
        if claim["verdict"] != NOT_DETECTED:
            continue
        low, high = claim["ci_holm"]
        if claim["decides"] == "difference":
            assert low <= 0 <= high, claim["claim"]
        else:  # against the margin: neither inside it nor beyond it
            bottom, top = claim["margin"]
            assert not bottom < low <= high < top and not (low > top or high < bottom), claim["claim"]


def test_the_upcycling_utility_claim_is_judged_by_its_registered_design():
    claims = json.loads((RESULTS / "upcycling-e8-e32" / "report.json").read_text())["claims"]
    (utility,) = [c for c in claims if "utility selection" in c["claim"]]
    assert utility["verdict"] == NOT_DETECTED and utility["mde"] == pytest.approx(0.0217, abs=5e-5)
    assert utility["second_analysis"].startswith("Second analysis, not the verdict")


def _seed_unit_row(claim: dict) -> str:
    """The numbers of a judged claim as docs/lifecycle-smollm2.md's "seed as the unit" table gives them."""
    low, high = claim["ci"]
    holm_low, holm_high = claim["ci_holm"]
    p = "1" if claim["p_holm"] >= 1 else f"{claim['p_holm']:#.2g}"
    return (
        f"| {claim['estimate']:+.3f} [{low:+.3f}, {high:+.3f}] | [{holm_low:+.3f}, {holm_high:+.3f}] "
        f"| {p} | {claim['mde']:.2f} | {claim['verdict']} |"
    )


def test_the_lifecycle_page_gives_every_judged_claim_with_the_reports_numbers():
    claims = json.loads((RESULTS / "lifecycle-smollm2" / "report.json").read_text())["claims"]
    judged = [c for c in claims if c["verdict"] != UNTESTABLE]
    page = (REPO / "docs" / "lifecycle-smollm2.md").read_text()
    assert judged and f"Holm over the {len(judged)} claims judged" in page
    table = [line for line in page.splitlines() if line.endswith(tuple(f"| {v} |" for v in VERDICTS))]
    assert len(table) == len(judged)
    for claim in judged:
        assert any(line.endswith(_seed_unit_row(claim)) for line in table), (claim["claim"], _seed_unit_row(claim))


def test_the_lifecycle_pages_model_table_carries_each_records_numbers():
    runs = (RESULTS / "lifecycle-smollm2" / "runs").glob("*.json")
    records = {record["name"]: record for record in (json.loads(path.read_text()) for path in runs)}
    page = (REPO / "docs" / "lifecycle-smollm2.md").read_text()
    rows = page.split("| point | params | bpb | task acc | bpb before | task acc before |", 1)[1].split("\n\n", 1)[0]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in rows.splitlines()[2:]]
    assert len(cells) == 12
    for name, _, bpb, acc, bpb_before, acc_before in cells:
        record = records[name.split()[0]]
        assert bpb == f"{record['bpb_mean']:.3f}", name
        assert acc == f"{record['task_acc']:.3f} ± {record['task_acc_se']:.3f}", name
        before = record.get("before") or {}
        shown = (f"{before['bpb_mean']:.3f}", f"{before['task_acc']:.3f}") if before else ("", "")
        assert (bpb_before, acc_before) == shown, name


def test_no_old_verdict_words_in_results_readme_docs_or_code():
    files = [REPO / "README.md", *(REPO / "docs").glob("*.md"), *RESULTS.glob("*/summary.md")]
    files += [*RESULTS.glob("*/report.json"), *(REPO / "moe_lit").rglob("*.py"), *STUDIES.glob("*.yaml")]
    # NOTE: the pattern spells the old words with \s+, so that this file does not hold them either
    offending = [str(f.relative_to(REPO)) for f in files if re.search(r"not\s+reproduced", f.read_text(), re.I)]
    assert offending == []


def test_call_of_names_a_plug_in_by_the_name_its_hash_covers():
    from moe_lit.convert.recipes import prune_by_importance
    from moe_lit.studies.measures import local_suite

    assert Call.of(prune_by_importance, fraction=0.5).name == "prune_by_importance"
    assert Call.of(local_suite, limit=5) == Call("local_suite", {"limit": 5})
    assert Call.of(local_suite, limit=5).to_dict() == {"name": "local_suite", "version": 1, "kwargs": {"limit": 5}}
    with pytest.raises(ValueError, match="is not a registered study plug-in"):
        Call.of(lambda: None)
