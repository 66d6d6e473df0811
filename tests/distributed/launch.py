"""Start one subprocess per rank of a ``torch.distributed`` script (env:// rendezvous on localhost)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(script: Path, args: list[str], world: int, timeout_s: float) -> None:
    """Run ``script args`` as ranks 0..world-1 of one gloo job; fail with the log of a failed rank."""
    env = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    cmd = [sys.executable, str(script), *args]
    procs = [
        subprocess.Popen(cmd, env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(world)
    ]
    try:
        logs = [proc.communicate(timeout=timeout_s)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()  # no-op for finished ranks; a hung rank must not outlive the test
    for rank, (proc, log) in enumerate(zip(procs, logs, strict=False)):
        assert proc.returncode == 0, f"{script.name} rank {rank} failed:\n{log[-4000:]}"


TRAIN_SCRIPT = Path(__file__).with_name("train_script.py")
RUN_TIMEOUT_S = 600


def run_script(strategy: str, steps: int, out: Path, resume: Path | None = None, extra: list[str] = ()) -> Path:
    """One ``train_script.py`` run under ``strategy`` (it launches its own ranks); its checkpoint."""
    cmd = [sys.executable, str(TRAIN_SCRIPT), "--strategy", strategy, "--steps", str(steps), "--out", str(out), *extra]
    if resume is not None:
        cmd += ["--resume", str(resume)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env)
    assert done.returncode == 0, f"{strategy} run failed:\n{done.stderr[-4000:]}"
    return out / "model.ckpt"
