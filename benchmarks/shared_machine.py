"""A training run on a machine that is not idle: alone vs beside a competing 2-thread process.

    .venv/bin/python -m benchmarks.shared_machine [--steps 60] [--rounds 2] [--data DIR]

Each case is a fresh ``moe-lit fit --config configs/experiments/tiny-moe.yaml --train.max_steps 60``
(the demo's MoE, seq 128, batch 16; progress bar, summary and validation off) timed from start to
exit, alone and beside a competitor started two seconds before it: a process looping 512 x 512
matmuls on 2 threads (its iterations/s are reported too: the fit must not win by starving it). Each runs in its own
session, as from two terminals or two jobs (with the kernel's autogroups, each session gets an
equal share of the CPUs, whatever its number of threads).
Two thread rules:

* ``pinned``: ``OMP_NUM_THREADS`` set to the cores (torch's default count, the rule left out);
* ``thread_share``: :class:`moe_lit.callbacks.threads.ThreadShare` (the cores others leave free).

The cases run interleaved, ``--rounds`` times in rotating order; the slowdown of a rule is the
median over rounds of beside / alone. ``--data``: a prepared data directory (default: the demo's
``data_cache/default``; ``--data synthetic`` prepares a seeded random-word corpus of three
languages with the demo's vocabulary size under ``benchmarks/.cache/``, offline).
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import median, report
from moe_lit.resources import CONFIGS_DIR

COMPETITOR = """
import signal, sys, time, torch
torch.set_num_threads(2)
a, n, start = torch.randn(512, 512), 0, time.perf_counter()
def stop(*_):
    print(n / (time.perf_counter() - start), flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
while True:
    a = (a @ a).tanh_()
    n += 1
"""
CACHE = Path(__file__).resolve().parent / ".cache"
RULES = {"pinned": {"OMP_NUM_THREADS": str(os.cpu_count() or 1)}, "thread_share": {}}


def synthetic_data() -> Path:
    """A seeded random-word corpus (en/de/ru letters), prepared once with vocabulary 8192."""
    from moe_lit.data.prepare import PrepareConfig, prepare

    source, out = CACHE / "shared_machine_corpus", CACHE / "shared_machine_data"
    if not source.exists():
        rng = random.Random(0)
        for lang, letters in {"en": "abcdefghij", "de": "klmnopqrst", "ru": "абвгдежзий"}.items():
            (source / lang).mkdir(parents=True)
            for i in range(8):
                paragraphs = [
                    " ".join("".join(rng.choices(letters, k=rng.randint(2, 7))) for _ in range(20)) for _ in range(400)
                ]
                (source / lang / f"doc{i}.txt").write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    prepare(PrepareConfig(source=str(source), out=out, vocab_size=8192, progress=False))
    return out


def fit(data: str | None, steps: int, env: dict[str, str], out: Path) -> float:
    """Wall seconds of one ``moe-lit fit`` run in a fresh process."""
    argv = [
        sys.executable,
        "-m",
        "moe_lit.console_script",
        "fit",
        "--config",
        str(CONFIGS_DIR / "experiments/tiny-moe.yaml"),
    ]
    argv += ["--train.max_steps", str(steps), "--trainer.val_check_interval", str(steps), "--out", str(out)]
    argv += ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false", "--force"]
    argv += ["--data.data_dir", data] if data else []
    start = time.perf_counter()
    subprocess.run(
        argv, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    return time.perf_counter() - start


def case(rule: str, beside: bool, args: argparse.Namespace, data: str | None, work: Path) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | RULES[rule]
    competitor = None
    if beside:
        competitor = subprocess.Popen(
            [sys.executable, "-c", COMPETITOR], stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        time.sleep(2.0)
    try:
        wall = fit(data, args.steps, env, work / f"{rule}-{'beside' if beside else 'alone'}")
    finally:
        if competitor is not None:
            competitor.terminate()
            rate = float(competitor.communicate(timeout=60)[0].strip() or "nan")
    return {"wall_s": round(wall, 2), **({"competitor_matmuls_per_s": round(rate, 1)} if beside else {})}


def ratios(runs: dict[str, list[dict[str, float]]], rule: str) -> list[float]:
    """Per round: the wall time beside the competitor over the time alone."""
    pairs = zip(runs[f"{rule}/alone"], runs[f"{rule}/beside"], strict=True)
    return [beside["wall_s"] / alone["wall_s"] for alone, beside in pairs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--data", help="prepared data directory, or 'synthetic' (default: the demo's)")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    data = str(synthetic_data()) if args.data == "synthetic" else args.data
    cases = [(rule, beside) for rule in RULES for beside in (False, True)]
    runs: dict[str, list[dict[str, float]]] = {f"{r}/{'beside' if b else 'alone'}": [] for r, b in cases}
    load = {"load_avg_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for rule, beside in cases[round_ % len(cases) :] + cases[: round_ % len(cases)]:
                runs[f"{rule}/{'beside' if beside else 'alone'}"].append(case(rule, beside, args, data, Path(tmp)))
    load["load_avg_after"] = os.getloadavg()
    slowdown = {rule: round(median(ratios(runs, rule)), 2) for rule in RULES}
    autogroup = Path("/proc/sys/kernel/sched_autogroup_enabled")
    load["autogroup"] = autogroup.read_text().strip() == "1" if autogroup.exists() else None
    result = {"steps": args.steps, "data": args.data or "demo", "runs": runs, "slowdown_beside": slowdown, **load}
    report("shared_machine", result, save=not args.no_save)


if __name__ == "__main__":
    main()
