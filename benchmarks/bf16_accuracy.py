"""bf16-mixed vs fp32 training of the demo models: is the validation loss the same within a stated margin?

    .venv/bin/python -m benchmarks.bf16_accuracy [--steps 300] [--seeds 0 1 2] [--margin 0.05] [--data DIR]
    .venv/bin/python -m benchmarks.bf16_accuracy --from benchmarks/results/bf16_accuracy-<stamp>.json

Each demo model (``configs/model/tiny-dense.yaml``, ``tiny-moe.yaml``) trains ``--steps`` steps on
the bundled corpus (``moe-lit data prepare``'s default directory, the demo's seq 128 x batch 16)
once per seed in ``32-true`` and once in ``bf16-mixed`` (``train.precision``, the same data order
per seed), through :func:`moe_lit.lit.run.train_run`. The claim per model, through the studies'
claims layer (:mod:`moe_lit.studies.verdicts`): the final validation loss of bf16-mixed equals
fp32's within ``--margin`` nats, paired by seed (TOST, Holm over the models), with one verdict:
reproduced (equivalence shown), contradicted (the difference shown beyond the margin), not
detected (neither, MDE beside it). The default margin, 0.05, is about one fp32 seed-to-seed
standard deviation of this final loss (0.044 dense, 0.025 MoE in
``bf16_accuracy-20261202-061015.json``): bf16 passes where it moves the loss by less than a
change of seed does. The fp32 and bf16 seed spreads are reported beside it, and the wall time per
run (both precisions run under the same load, one after the other per seed). ``--from`` judges the
runs of a stored result again (no training).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.common import report
from moe_lit.commands.demo import MODELS, load_module_config, prepare_default_data
from moe_lit.inference.precision import native_bf16_flags
from moe_lit.lit.run import train_run
from moe_lit.lit.run_config import DataConfig, RunConfig, TrainConfig
from moe_lit.stats import summarize
from moe_lit.studies.verdicts import EQUIVALENT, Claim, judge, report_json

SEQ, BATCH, VAL_BATCHES = 128, 16, 4
PRECISIONS = ("32-true", "bf16-mixed")
LOSS = "final val loss"


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


def verdict(runs: dict[str, dict[str, float]], seeds: list[int], margin: float, names: list[str]) -> dict[str, dict]:
    """Per model of ``runs`` (model -> "precision/seed" -> run): the claim's row (estimate, CI,
    TOST, Holm p over the models, MDE, verdict), the fp32 and bf16 seed spreads and the wall ratio."""
    evidence, spread = [], {}
    for name in names:
        loss = {p: {s: runs[name][f"{p}/{s}"]["val_loss"] for s in seeds} for p in PRECISIONS}
        claim = Claim(
            f"{name}: bf16-mixed trains to fp32's validation loss", LOSS, PRECISIONS[::-1], EQUIVALENT, margin
        )
        evidence.append(claim.on(loss["bf16-mixed"], loss["32-true"]))
        wall = {p: sum(runs[name][f"{p}/{s}"]["wall_s"] for s in seeds) for p in PRECISIONS}
        spread[name] = {
            "fp32_seed_sd": summarize(list(loss["32-true"].values())).std,
            "bf16_seed_sd": summarize(list(loss["bf16-mixed"].values())).std,
            "bf16_minus_fp32": {s: loss["bf16-mixed"][s] - loss["32-true"][s] for s in seeds},
            "wall_s_fp32_over_bf16": wall["32-true"] / wall["bf16-mixed"],
        }
    rows = report_json(judge(evidence))
    return {name: {"claim": row, **spread[name]} for name, row in zip(names, rows, strict=True)}


def rejudge(path: Path, margin: float) -> dict[str, object]:
    """The verdicts of a stored result's runs at ``margin``."""
    stored = json.loads(path.read_text())
    seeds, models = stored["setup"]["seeds"], stored["models"]
    runs = {name: models[name]["runs"] for name in models}
    return {
        "setup": {**stored["setup"], "source": str(path), "margin": margin},
        "models": verdict(runs, seeds, margin, list(runs)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--margin", type=float, default=0.05, help="equivalence margin, nats of val loss")
    parser.add_argument("--data", type=Path, help="prepared data directory (default: moe-lit data prepare's)")
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS), default=list(MODELS))
    parser.add_argument("--from", dest="source", type=Path, help="judge the runs of a stored result again")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    if args.margin <= 0:
        parser.error(f"--margin: must be > 0, got {args.margin}")
    if args.source is not None:
        report("bf16_accuracy", rejudge(args.source, args.margin), save=not args.no_save)
        return
    if len(args.seeds) < 2:
        parser.error("--seeds: at least two (equivalence needs a noise estimate)")
    data_dir = prepare_default_data(args.data)
    with tempfile.TemporaryDirectory() as tmp:
        runs = {
            name: {
                f"{precision}/{seed}": run_one(name, precision, seed, args.steps, data_dir, Path(tmp))
                for seed in args.seeds
                for precision in PRECISIONS
            }
            for name in args.models
        }
    judged = verdict(runs, args.seeds, args.margin, args.models)
    setup = {
        "steps": args.steps,
        "seeds": args.seeds,
        "seq": SEQ,
        "batch": BATCH,
        "margin": args.margin,
        "cpu_bf16_flags": native_bf16_flags(),
    }
    results = {name: {"runs": runs[name], **judged[name]} for name in args.models}
    report("bf16_accuracy", {"setup": setup, "models": results}, save=not args.no_save)


if __name__ == "__main__":
    main()
