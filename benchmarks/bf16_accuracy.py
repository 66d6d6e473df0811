"""bf16-mixed vs fp32 training of the demo models: two distributions of the final validation loss.

    .venv/bin/python -m benchmarks.bf16_accuracy [--seeds 0 1 ... 7] [--models moe dense] [--store DIR]
    .venv/bin/python -m benchmarks.bf16_accuracy --from benchmarks/results/bf16_accuracy-<stamp>.json

Each demo model (``moe-lit demo``'s :data:`~moe_lit.commands.demo.MODELS`) trains the demo's run
(:data:`~moe_lit.commands.demo.RUN`, ``configs/runs/demo.yaml``, under the model YAML's optimizer,
as the demo builds it) on the demo's data, once per seed in ``32-true`` and once in ``bf16-mixed``
(``train.precision``), through :func:`moe_lit.lit.run.train_run`, on :data:`THREADS` thread(s)
(``OMP_NUM_THREADS`` set too, so that ThreadShare never changes the count during a run). Each run's
result is stored in ``--store`` as it finishes (one JSON per model, precision and seed): an
interrupted benchmark started again with the same settings trains only the runs it lacks, and
several processes on one store share the runs out (each claims a run before it trains it).

The claim per model, through the studies' claims layer (:mod:`moe_lit.studies.verdicts`,
``pairing: independent``): the mean final validation loss of bf16-mixed equals fp32's within
:data:`MARGIN` nats, the two precisions' seeds taken as two independent samples (Welch's TOST,
statsmodels ``ttost_ind``; Holm over the models): the verdict does not assume that float noise
leaves a seed's two runs tied (issue 53), and the paired analysis stands beside it. One verdict:
reproduced (equivalence shown), contradicted (the difference shown beyond the margin), not detected
(neither, MDE beside it). Beside it: n, mean and sd per precision, the sd ratio bf16 / fp32 with
its F-test CI and the Brown-Forsythe p (``scipy.stats.levene``, median-centred), the per-seed
correlation of the two precisions (how much a seed's data order and initialisation still tie them)
with, as a second analysis and not the verdict, the same claim paired by seed (paired TOST), and
the wall ratio (both precisions of a seed run one after the other, under the same load).
``--from`` judges again the runs of a stored result, or those a ``--store`` holds so far (no training).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from benchmarks.common import report, set_threads
from moe_lit.commands.demo import MODELS, RUN, load_module_config, model_runs, prepare_default_data
from moe_lit.config import ModelConfig
from moe_lit.configbase import load_yaml
from moe_lit.inference.precision import native_bf16_flags
from moe_lit.io import atomic_write_json
from moe_lit.lit.run import train_run
from moe_lit.lit.run_config import RunConfig
from moe_lit.resources import CONFIGS_DIR
from moe_lit.stats import ALPHA, summarize
from moe_lit.studies.verdicts import BY_SEED, EQUIVALENT, INDEPENDENT, Claim, judge, report_json

PRECISIONS = ("32-true", "bf16-mixed")
LOSS = "final val loss"
THREADS = 1
"""Intra-op threads of every run: one, so that the runs do not depend on the machine's load."""
MARGIN = 0.065
"""Equivalence margin, nats of mean final validation loss: one fp32 seed-to-seed sd of the demo
MoE (0.0649 over 5 seeds, ``results/demo-seeds5``; the dense model's is 0.0650). bf16 passes where
it moves the mean loss by less than a change of seed moves one run."""
DEFAULT_STORE = Path("runs/bf16_accuracy")
SETUP_FILE = "setup.json"
RUN_FILE = re.compile(r"(\w+)-(32-true|bf16-mixed)-(\d+)\.json")
"""A stored run's file name: model, precision, seed."""
CLAIM_POLL_S = 30
"""Seconds between two looks at runs that other processes of the same store are training."""


def demo_runs(data_dir: Path) -> dict[str, tuple[ModelConfig, RunConfig]]:
    """Per demo model: its ModelConfig and the run ``moe-lit demo`` gives it (:func:`model_runs`), on ``data_dir``."""
    settings = {"data.data_dir": str(data_dir), "trainer.enable_progress_bar": False}
    models = {name: load_module_config(path) for name, path in MODELS.items()}
    runs = model_runs(RunConfig.merge(load_yaml(RUN, "--config"), settings), models)
    return {name: (model_cfg, runs[name]) for name, (model_cfg, _) in models.items()}


def packaged(path: Path) -> str:
    """``path`` of a packaged config relative to the package's parent (the same in every checkout)."""
    return str(path.relative_to(CONFIGS_DIR.parents[1]))


def run_one(model_cfg: object, run: RunConfig, precision: str, seed: int, tmp: Path) -> dict[str, object]:
    """One training run of the benchmark: its final val loss, curve, wall time and thread count."""
    load_before = os.getloadavg()[0]
    result = train_run(
        model_cfg, run.replace(train={"seed": seed, "precision": precision}), tmp / f"{precision}-{seed}"
    )
    threads = torch.get_num_threads()
    if threads != THREADS:
        raise RuntimeError(f"bf16_accuracy: the run ended on {threads} threads, not {THREADS}")
    return {
        "val_loss": result.val_loss,
        "curve": result.curve,
        "wall_s": result.wall_s,
        "tokens_per_s": result.tokens_per_s,
        "precision": result.precision,
        "threads": threads,
        "load_avg_1m": [load_before, os.getloadavg()[0]],
    }


def sd_ratio(bf16: list[float], fp32: list[float]) -> dict[str, float]:
    """sd(bf16) / sd(fp32) with its 95% CI from the F distribution of the variance ratio (normal
    samples), and the Brown-Forsythe test of equal spreads (robust to non-normal tails)."""
    from scipy import stats

    a, b = summarize(bf16), summarize(fp32)
    if min(a.n, b.n) < 2 or b.std == 0:
        return {"ratio": math.nan, "ci": [math.nan, math.nan], "p_f_test": math.nan, "p_brown_forsythe": math.nan}
    ratio = a.std / b.std
    dfa, dfb = a.n - 1, b.n - 1
    low = ratio / math.sqrt(stats.f.ppf(1 - ALPHA / 2, dfa, dfb))
    high = ratio / math.sqrt(stats.f.ppf(ALPHA / 2, dfa, dfb))
    return {
        "ratio": ratio,
        "ci": [low, high],
        "p_f_test": float(2 * min(stats.f.cdf(ratio**2, dfa, dfb), stats.f.sf(ratio**2, dfa, dfb))),
        "p_brown_forsythe": float(stats.levene(bf16, fp32, center="median").pvalue),
    }


def seed_correlation(runs: dict[str, dict], seeds: list[int]) -> float:
    """Pearson correlation of bf16's and fp32's final loss over the seeds both ran."""
    from scipy import stats

    both = [s for s in seeds if all(f"{p}/{s}" in runs for p in PRECISIONS)]
    pairs = [[runs[f"{p}/{s}"]["val_loss"] for s in both] for p in PRECISIONS]
    return float(stats.pearsonr(*pairs).statistic) if len(both) > 2 else math.nan


def verdict(runs: dict[str, dict[str, dict]], seeds: list[int], margin: float, names: list[str]) -> dict[str, dict]:
    """Per model of ``runs`` (model -> "precision/seed" -> run): the claim's row (Welch estimate,
    CI, TOST, Holm p over the models, MDE, verdict), each precision's n, mean and sd, the sd ratio,
    the seed correlation and the wall ratio."""
    evidence, rest = [], {}
    for name in names:
        loss = {
            p: {s: runs[name][f"{p}/{s}"]["val_loss"] for s in seeds if f"{p}/{s}" in runs[name]} for p in PRECISIONS
        }
        text = f"{name}: bf16-mixed trains to fp32's mean validation loss"
        claim = Claim(text, LOSS, PRECISIONS[::-1], EQUIVALENT, margin, pairing=INDEPENDENT)
        evidence.append(claim.on(loss["bf16-mixed"], loss["32-true"]))
        by_seed = Claim(text, LOSS, PRECISIONS[::-1], EQUIVALENT, margin, pairing=BY_SEED)
        wall = {p: summarize([runs[name][f"{p}/{s}"]["wall_s"] for s in loss[p]]).mean for p in PRECISIONS}
        rest[name] = {
            "precisions": {p: vars(summarize(list(loss[p].values()))) for p in PRECISIONS},
            "sd_ratio_bf16_over_fp32": sd_ratio(list(loss["bf16-mixed"].values()), list(loss["32-true"].values())),
            "seed_correlation": seed_correlation(runs[name], seeds),
            "paired_by_seed": report_json(judge([by_seed.on(loss["bf16-mixed"], loss["32-true"])]))[0],
            "wall_s_fp32_over_bf16": wall["32-true"] / wall["bf16-mixed"],
        }
    rows = report_json(judge(evidence))
    return {name: {"claim": row, **rest[name]} for name, row in zip(names, rows, strict=True)}


def rejudge(path: Path, margin: float) -> dict[str, object]:
    """The verdicts at ``margin`` of a stored result's runs, or of the runs in a store directory so far."""
    if path.is_dir():
        setup, runs = json.loads((path / SETUP_FILE).read_text()), stored_runs(path)
        seeds = sorted({int(key.split("/")[1]) for model in runs.values() for key in model})
    else:
        stored = json.loads(path.read_text())
        setup, runs = stored["setup"], {name: model["runs"] for name, model in stored["models"].items()}
        seeds = setup["seeds"]
    return {
        "setup": {**setup, "seeds": seeds, "source": str(path), "margin": margin},
        "models": {name: {"runs": runs[name], **row} for name, row in verdict(runs, seeds, margin, list(runs)).items()},
    }


def stored_runs(store: Path) -> dict[str, dict[str, dict]]:
    """The finished runs in ``store``: model -> "precision/seed" -> run."""
    runs: dict[str, dict[str, dict]] = {}
    for path in sorted(store.glob("*.json")):
        if match := RUN_FILE.fullmatch(path.name):
            name, precision, seed = match.groups()
            runs.setdefault(name, {})[f"{precision}/{seed}"] = json.loads(path.read_text())
    return runs


def open_store(store: Path, setup: dict[str, object]) -> None:
    """``store`` ready for this benchmark's runs: created with ``setup``, or holding runs of the same setup."""
    setup_file = store / SETUP_FILE
    if setup_file.is_file():
        earlier = json.loads(setup_file.read_text())
        if earlier != setup:
            raise SystemExit(f"--store: {store} holds runs of another setup ({setup_file}); give another --store")
        return
    atomic_write_json(setup_file, setup)


def stored_run(
    store: Path, name: str, precision: str, seed: int, train: Callable[[], dict[str, object]]
) -> dict[str, object] | None:
    """The run's stored result, else ``train()``'s, stored; None while another live process trains it."""
    path = store / f"{name}-{precision}-{seed}.json"
    if path.is_file():
        return json.loads(path.read_text())
    if not claim(path.with_suffix(".claim")):
        return None
    result = train()
    atomic_write_json(path, result)
    path.with_suffix(".claim").unlink()
    print(
        f"bf16_accuracy: {name} {precision} seed {seed}: val loss {result['val_loss']:.4f}, {result['wall_s']:.0f} s",
        flush=True,
    )
    return result


def claim(path: Path) -> bool:
    """Whether this process may train the run of the claim file ``path``: it created it, or the
    process that did has died (its pid inside)."""
    try:
        with path.open("x") as handle:
            handle.write(str(os.getpid()))
        return True
    except FileExistsError:
        owner = int(path.read_text() or 0)
    if owner and Path(f"/proc/{owner}").exists():
        return False
    path.unlink(missing_ok=True)
    return claim(path)


def train_all(configs: dict, names: list[str], seeds: list[int], store: Path) -> dict[str, dict[str, dict]]:
    """Every run of ``names`` x ``seeds`` x :data:`PRECISIONS` (both precisions of a seed one after the
    other), from ``store`` or trained here; runs that other processes claimed are waited for."""
    runs: dict[str, dict[str, dict]] = {name: {} for name in names}
    pending = [(name, seed, precision) for name in names for seed in seeds for precision in PRECISIONS]
    with tempfile.TemporaryDirectory() as tmp:
        while pending:
            waiting = []
            for name, seed, precision in pending:
                model_cfg, run = configs[name]
                train = partial(run_one, model_cfg, run, precision, seed, Path(tmp) / name)
                result = stored_run(store, name, precision, seed, train)
                if result is None:
                    waiting.append((name, seed, precision))
                else:
                    runs[name][f"{precision}/{seed}"] = result
            if waiting:
                time.sleep(CLAIM_POLL_S)
            pending = waiting
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(8)))
    parser.add_argument("--margin", type=float, default=MARGIN, help="equivalence margin, nats of mean val loss")
    parser.add_argument("--data", type=Path, help="prepared data directory (default: the demo's)")
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS), default=list(MODELS))
    parser.add_argument("--store", type=Path, default=DEFAULT_STORE, help="where each run's result is kept")
    parser.add_argument(
        "--from", dest="source", type=Path, help="judge again the runs of a stored result, or of a --store so far"
    )
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    if args.margin <= 0:
        parser.error(f"--margin: must be > 0, got {args.margin}")
    if args.source is not None:
        report("bf16_accuracy", rejudge(args.source, args.margin), save=not args.no_save)
        return
    if len(set(args.seeds)) < 2:
        parser.error("--seeds: at least two (equivalence needs a noise estimate)")
    set_threads(THREADS)
    data_dir = prepare_default_data(str(args.data) if args.data else None)
    configs = demo_runs(data_dir)
    setup = {
        "run": packaged(RUN),
        "runs": {name: run.to_dict() for name, (_, run) in configs.items()},
        "models": {name: packaged(path) for name, path in MODELS.items()},
        "threads": THREADS,
        "cpu_bf16_flags": native_bf16_flags(),
    }
    open_store(args.store, setup)
    runs = train_all(configs, args.models, args.seeds, args.store)
    judged = verdict(runs, args.seeds, args.margin, args.models)
    results = {name: {"runs": runs[name], **judged[name]} for name in args.models}
    setup |= {"seeds": args.seeds, "margin": args.margin, "store": str(args.store)}
    report("bf16_accuracy", {"setup": setup, "models": results}, save=not args.no_save)


if __name__ == "__main__":
    main()
