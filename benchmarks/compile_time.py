"""What ``train.compile`` costs and buys over a whole run: compile seconds, its share, the cache.

    .venv/bin/python -m benchmarks.compile_time [--steps 500] [--model configs/model/tiny-moe.yaml]

Three fresh processes train the demo's model (``configs/model/tiny-moe.yaml``, the demo's data,
seq 128, batch 16, no validation) for ``--steps`` steps with :func:`moe_lit.lit.run.train_run`:

1. ``eager``;
2. ``compiled_cold``: ``train.compile: true`` with an empty inductor cache (a new temporary
   ``TORCHINDUCTOR_CACHE_DIR``);
3. ``compiled_warm``: the same again, reusing that cache.

Each reports its wall time, the run's tokens/s, ``CompileBlocks``' ``compile_s`` (the slow first
batches beyond the median batch) and ``compile/fraction`` (its share of all batches' time), and
inductor's FX-graph cache hits and misses in that process. Run it on an idle machine: the three
runs are sequential, not interleaved.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import report, set_threads
from moe_lit.resources import CONFIGS_DIR

RESULT_PREFIX = "compile_time_result: "


def child(args: argparse.Namespace) -> None:
    """One run in this process; prints its measurements as one JSON line."""
    from torch._dynamo.utils import counters

    from moe_lit.commands.demo import load_module_config, prepare_default_data
    from moe_lit.lit.run import train_run
    from moe_lit.lit.run_config import DataConfig, RunConfig, TrainConfig

    set_threads(args.threads)
    model_cfg, optim = load_module_config(args.model)
    data_dir = prepare_default_data(None)
    run = RunConfig(
        data=DataConfig(data_dir=str(data_dir), seq_len=128, batch_size=16, val_batches=1),
        optim=optim,
        train=TrainConfig(max_steps=args.steps, val_every=args.steps, compile=args.compile),
    )
    start = time.perf_counter()
    result = train_run(model_cfg, run, args.out)
    wall = time.perf_counter() - start
    metrics = {}
    for path in Path(args.out).rglob("metrics.csv"):
        with path.open() as f:
            for row in csv.DictReader(f):
                metrics.update({k: float(v) for k, v in row.items() if k.startswith("compile") and v})
    measured = {
        "wall_s": wall,
        "tokens_per_s": result.tokens_per_s,
        "val_loss": result.val_loss,
        "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"],
        **metrics,
    }
    print(RESULT_PREFIX + json.dumps(measured), flush=True)


def run_child(args: argparse.Namespace, name: str, compile: bool, cache_dir: str, root: Path) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.compile_time", "--child", "--steps", str(args.steps)]
    cmd += ["--model", str(args.model), "--threads", str(args.threads), "--out", str(root / name)]
    cmd += ["--compile"] if compile else []
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"compile_time: the {name} run failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix(RESULT_PREFIX))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--model", type=Path, default=CONFIGS_DIR / "model/tiny-moe.yaml")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-save", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        root, cache = Path(tmp), str(Path(tmp) / "inductor-cache")
        runs = {
            "eager": run_child(args, "eager", False, cache, root),
            "compiled_cold": run_child(args, "compiled_cold", True, cache, root),
            "compiled_warm": run_child(args, "compiled_warm", True, cache, root),
        }
    eager = runs["eager"]["wall_s"]
    ratios = {
        name: {
            "wall_over_eager": run["wall_s"] / eager,
            "tokens_per_s_over_eager": run["tokens_per_s"] / runs["eager"]["tokens_per_s"],
        }
        for name, run in runs.items()
        if name != "eager"
    }
    setup = {"model": str(args.model), "steps": args.steps, "seq": 128, "batch": 16, "threads": args.threads}
    goals = {"compile_fraction_below": 0.1, "warm_run_all_cache_hits": True}
    report("compile_time", {"setup": setup, "goals": goals, "runs": runs, "ratios": ratios}, save=not args.no_save)


if __name__ == "__main__":
    main()
