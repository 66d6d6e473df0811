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
