"""The result lines of scripts/gpu_check.sh: one JSON object per step, appended as the step ends.

    python scripts/gpu_check_results.py record RESULTS NAME EXIT SECONDS TIMEOUT_S LOG [SKIPPED_REASON]
    python scripts/gpu_check_results.py compare RESUME_STEP RUN_DIR [RUN_DIR ...]

``record`` appends ``{"step", "exit", "seconds", "timeout_s", "log", ...numbers}`` to RESULTS
(``log`` where LOG exists): the numbers are the JSON object of the LOG's last ``numbers: {...}``
line, and for a pytest log the count of each outcome of its ``-v`` lines (they survive a timeout,
its summary line does not). An exit of 124 is a timeout (``"timed_out": true``); a SKIPPED_REASON
marks a step that did not run (``"skipped"``). ``compare`` prints, as a ``numbers:`` line, the
largest absolute difference of ``train/loss`` and ``train/grad_norm`` between each RUN_DIR's
uninterrupted fit (``RUN_DIR/logs/fit/metrics.csv``) and the fit resumed from its RESUME_STEP
checkpoint into ``RUN_DIR-resumed`` (``logs/fit-step<N>/metrics.csv``), over the steps both
logged; it exits 1 when a run has no step to compare.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

NUMBERS_PREFIX = "numbers: "
PYTEST_OUTCOME = re.compile(r"^\S+::\S+ (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
TIMEOUT_EXIT = 124
COMPARED = ("train/loss", "train/grad_norm")


def log_numbers(log: Path) -> dict[str, Any]:
    """The last ``numbers:`` object of ``log`` and its pytest outcome counts (empty when neither)."""
    if not log.is_file():
        return {}
    numbers: dict[str, Any] = {}
    outcomes: dict[str, int] = {}
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith(NUMBERS_PREFIX):
            numbers = json.loads(line[len(NUMBERS_PREFIX) :])
        elif match := PYTEST_OUTCOME.match(line):
            outcomes[match.group(1).lower()] = outcomes.get(match.group(1).lower(), 0) + 1
    return {**numbers, **({"tests": outcomes} if outcomes else {})}


def record(results: Path, name: str, exit_code: int, seconds: int, timeout_s: int, log: Path, skipped: str) -> None:
    line: dict[str, Any] = {"step": name, "exit": exit_code, "seconds": seconds, "timeout_s": timeout_s}
    if exit_code == TIMEOUT_EXIT:
        line["timed_out"] = True
    if skipped:
        line["skipped"] = skipped
    if log.is_file():
        line["log"] = log.name
    line |= log_numbers(log)
    with results.open("a") as handle:
        handle.write(json.dumps(line) + "\n")
    print(f"== {name}: exit {exit_code} in {seconds}s (limit {timeout_s}s) {json.dumps(line)}", flush=True)


def resume_diffs(run_dir: Path, resume_step: int) -> dict[str, Any]:
    """``steps`` compared and the largest absolute difference of each logged value over them."""
    from moe_lit.lit.run import read_metrics

    def by_step(csv_path: Path) -> dict[int, dict[str, float]]:
        rows = read_metrics(csv_path) if csv_path.is_file() else []
        return {int(row["step"]): row for row in rows if COMPARED[0] in row}

    full = by_step(run_dir / "logs" / "fit" / "metrics.csv")
    resumed_dir = run_dir.with_name(f"{run_dir.name}-resumed")
    resumed = by_step(resumed_dir / "logs" / f"fit-step{resume_step}" / "metrics.csv")
    steps = sorted(set(full) & set(resumed))
    diffs: dict[str, Any] = {"steps": len(steps)}
    for key in COMPARED:
        pairs = [(full[s][key], resumed[s][key]) for s in steps if key in full[s] and key in resumed[s]]
        diffs[f"max_abs_diff_{key.split('/')[-1]}"] = max((abs(a - b) for a, b in pairs), default=None)
    return diffs


def main(argv: list[str]) -> int:
    if argv[:1] == ["record"] and len(argv) in (7, 8):
        results, name, exit_code, seconds, timeout_s, log = argv[1:7]
        record(Path(results), name, int(exit_code), int(seconds), int(timeout_s), Path(log), "".join(argv[7:]))
        return 0
    if argv[:1] == ["compare"] and len(argv) >= 3:
        diffs = {Path(d).name: resume_diffs(Path(d), int(argv[1])) for d in argv[2:]}
        print(NUMBERS_PREFIX + json.dumps({"resumed_vs_uninterrupted": diffs}))
        return 0 if all(d["steps"] for d in diffs.values()) else 1
    print("\n".join(__doc__.strip().splitlines()[2:4]), file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
