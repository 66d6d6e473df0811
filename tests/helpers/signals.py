"""A ``moe-lit`` subprocess stopped by SIGTERM once it has checkpointed, and its one interruption line."""

import re
import signal
import subprocess
import sys
import time

LINE = re.compile(r"SIGTERM at step (\d+) of \d+: checkpoint (\S+); resume: (.+) \(exit 143\)$")


def signal_when_checkpointed(argv, cwd, checkpoints, timeout_s=300.0) -> tuple[int, str]:
    """Start ``python -m moe_lit.console_script *argv``, SIGTERM it once a ``last.ckpt`` matches ``checkpoints``
    (it checkpoints every step), and return its exit status and stderr."""
    with open(cwd / "stderr.txt", "w") as err, open(cwd / "stdout.txt", "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moe_lit.console_script", *argv], cwd=cwd, stdout=out, stderr=err
        )
        deadline = time.monotonic() + timeout_s
        while not list(cwd.glob(checkpoints)) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=timeout_s)
    return code, (cwd / "stderr.txt").read_text()


def interruption(stderr: str) -> tuple[int, str, str]:
    """(step, checkpoint, resume command) of the one interruption line."""
    lines = [line for line in stderr.splitlines() if "SIGTERM at step" in line]
    assert len(lines) == 1, stderr
    match = LINE.search(lines[0])
    assert match, lines[0]
    return int(match.group(1)), match.group(2), match.group(3)
