"""Every shipped ``results/<study>/summary.md`` is what ``moe-lit study report`` writes from its records.

The records (``study.json``, ``runs/*.json``) are copied to an empty results directory and the report
is rebuilt there; a shipped summary that differs is stale (a report change not rerun on the results).
Only the records are copied, as a clean clone has them: a study run here also leaves its points' run
directories (checkpoints, tens of GB for lifecycle-smollm2) beside them.
"""

import shutil

import pytest

from moe_lit.console_script import main
from tests.helpers.paths import REPO

pytestmark = pytest.mark.slow  # plots are drawn again too

STUDIES = sorted(path.parent.name for path in (REPO / "results").glob("*/study.json"))


@pytest.mark.parametrize("study", STUDIES)
def test_a_shipped_summary_equals_its_rerendered_self(study, tmp_path, capsys):
    shipped = REPO / "results" / study
    out = tmp_path / "results" / study
    out.mkdir(parents=True)
    shutil.copy(shipped / "study.json", out)
    (out / "runs").mkdir()
    for record in (shipped / "runs").glob("*.json"):
        shutil.copy(record, out / "runs")
    assert main(["study", "report", "--out", str(out)]) == 0, capsys.readouterr().err
    assert (out / "summary.md").read_text() == (shipped / "summary.md").read_text()


def test_every_study_with_results_is_checked():
    assert len(STUDIES) >= 9 and "upcycling-e8-e32" in STUDIES  # the glob finds the shipped studies
