"""``scripts/kill_test.py`` (SIGKILL at a random moment of ``data prepare``, ``fit`` and ``study run``,
then the rerun a user makes) passes one trial: the script runs what users run, so it must not rot."""

import json
import subprocess
import sys

import pytest

from tests.helpers.paths import REPO


@pytest.mark.slow
def test_a_kill_of_each_job_leaves_every_result_equal_to_the_uninterrupted_run(tmp_path):
    argv = [sys.executable, str(REPO / "scripts" / "kill_test.py"), "--trials", "1", "--work", str(tmp_path / "work")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    *trials, summary = [json.loads(line) for line in done.stdout.splitlines()]
    assert [t["job"] for t in trials] == ["prepare", "fit", "study"] and all(t["equal"] for t in trials), trials
    assert summary["failures"] == 0
