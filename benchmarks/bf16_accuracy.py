"""bf16-mixed vs fp32 training of the demo models: validation losses, judged by fp32's seed noise.

    .venv/bin/python -m benchmarks.bf16_accuracy [--steps 300] [--seeds 0 1] [--data DIR]

Each demo model (``configs/model/tiny-dense.yaml``, ``tiny-moe.yaml``) trains ``--steps`` steps on
the bundled corpus (``moe-lit data prepare``'s default directory, the demo's seq 128 x batch 16)
once per seed in ``32-true`` and once in ``bf16-mixed`` (``train.precision``, the same data order
per seed), through :func:`moe_lit.lit.run.train_run`. The tolerance is the fp32 seed-to-seed
noise: the largest |fp32(seed a) - fp32(seed b)| of final validation losses. bf16 passes where
every paired |bf16(seed) - fp32(seed)| stays within it, i.e. changing the precision moves the loss
less than changing the seed does. Wall time per run is reported beside it (both precisions run
under the same load, one after the other per seed).
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
from pathlib import Path

from benchmarks.common import report
from moe_lit.commands.demo import MODELS, load_module_config, prepare_default_data
from moe_lit.lit.precision import native_bf16_flags
from moe_lit.lit.run import train_run
from moe_lit.lit.run_config import DataConfig, RunConfig, TrainConfig

SEQ, BATCH, VAL_BATCHES = 128, 16, 4
PRECISIONS = ("32-true", "bf16-mixed")


def run_one(name: str, precision: str, seed: int, steps: int, data_dir: Path, out: Path) -> dict[str, float]:
    model_cfg, optim = load_module_config(MODELS[name])
    run = RunConfig(
        data=DataConfig(data_dir=str(data_dir), seq_len=SEQ, batch_size=BATCH, val_batches=VAL_BATCHES),
        optim=optim,
        train=TrainConfig(max_steps=steps, val_every=steps, seed=seed, precision=precision),
        trainer={"enable_progress_bar": False},
    )
    result = train_run(model_cfg, run, out / f"{name}-{precision}-{seed}")
    return {"val_loss": result.val_loss, "wall_s": result.wall_s}


def verdict(runs: dict[str, dict[str, float]], seeds: list[int]) -> dict[str, object]:
    """The fp32 seed noise, the paired bf16 - fp32 differences, and whether they stay within it."""
    fp32 = {s: runs[f"32-true/{s}"]["val_loss"] for s in seeds}
    noise = max(abs(fp32[a] - fp32[b]) for a, b in itertools.combinations(seeds, 2))
    diffs = {s: runs[f"bf16-mixed/{s}"]["val_loss"] - fp32[s] for s in seeds}
    wall = {p: sum(runs[f"{p}/{s}"]["wall_s"] for s in seeds) for p in PRECISIONS}
    return {
        "fp32_seed_noise": noise,
        "bf16_minus_fp32": diffs,
        "within_tolerance": all(abs(d) <= noise for d in diffs.values()),
        "wall_s_fp32_over_bf16": wall["32-true"] / wall["bf16-mixed"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--data", type=Path, help="prepared data directory (default: moe-lit data prepare's)")
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS), default=list(MODELS))
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    if len(args.seeds) < 2:
        parser.error("--seeds: at least two (the tolerance is the fp32 seed-to-seed noise)")
    data_dir = prepare_default_data(args.data)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            runs = {
                f"{precision}/{seed}": run_one(name, precision, seed, args.steps, data_dir, Path(tmp))
                for seed in args.seeds
                for precision in PRECISIONS
            }
            results[name] = {"runs": runs, **verdict(runs, args.seeds)}
    setup = {
        "steps": args.steps,
        "seeds": args.seeds,
        "seq": SEQ,
        "batch": BATCH,
        "cpu_bf16_flags": native_bf16_flags(),
    }
    report("bf16_accuracy", {"setup": setup, "models": results}, save=not args.no_save)


if __name__ == "__main__":
    main()
