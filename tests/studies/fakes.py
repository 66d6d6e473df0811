"""Fake training functions for the study engine: same interface as ``train_run``.

Module-level so that spawned worker processes can import them (``--parallel``).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from moe_lit.accounting import count_config_params
from moe_lit.studies.plugins import MODULES

CALLS_FILE = "fake_calls.jsonl"
MODULE_PROBE = "test_module_probe"
"""The registered name of :func:`module_probe` (a point's module is called by name)."""


def _log_call(out_dir: Path, model_cfg, start=None) -> None:
    # NOTE: calls are appended to a file beside runs/ (not a global list) so that calls made in
    # spawned workers are counted too.
    call = {"out_dir": Path(out_dir).name, "num_experts": _experts(model_cfg), "start": start and str(start)}
    with open(Path(out_dir).parents[1] / CALLS_FILE, "a") as handle:
        handle.write(json.dumps(call) + "\n")


def _experts(model_cfg) -> int:
    return model_cfg.moe.num_experts if model_cfg.moe else 1


def fake_loss(model_cfg, seed: int) -> float:
    """Decreases with total params, independent of anything else (deterministic)."""
    return round(6.0 - 0.1 * math.log(count_config_params(model_cfg).total) + 0.001 * seed, 6)


def fake_train(model_cfg, run, out_dir, callbacks=(), resume_from=None, init_from=None):
    """A successful run: a RunResult-like dict; writes the fork checkpoints its SaveAtSteps asks for."""
    _log_call(out_dir, model_cfg, resume_from or init_from)
    for callback in callbacks:
        for path in getattr(callback, "paths", {}).values():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("fake checkpoint")
    loss = fake_loss(model_cfg, run.train.seed)
    return {
        "tokens": run.tokens,
        "steps": run.steps,
        "val_loss": loss,
        "val_loss_per_language": {"en": loss - 0.1, "de": loss + 0.1},
        "tokens_per_s": 1000.0,
        "load_imbalance": 1.5 if model_cfg.moe else 1.0,
        "wall_s": 0.01,
    }


def fail_on_16_experts(model_cfg, run, out_dir, **kwargs):
    """Raises for every 16-expert model, trains the others."""
    if _experts(model_cfg) == 16:
        _log_call(out_dir, model_cfg)
        raise RuntimeError("out of memory (fake)")
    return fake_train(model_cfg, run, out_dir, **kwargs)


def crash_on_16_experts(model_cfg, run, out_dir, **kwargs):
    """Kills its whole process for every 16-expert model (a segfault / OOM kill)."""
    if _experts(model_cfg) == 16:
        os._exit(3)
    return fake_train(model_cfg, run, out_dir, **kwargs)


def read_calls(out_dir: Path) -> list[dict]:
    path = Path(out_dir) / CALLS_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def interrupt(*args, **kwargs):
    """Ctrl-C while training."""
    raise KeyboardInterrupt


def module_probe(cfg, optim, parent=None, tag=""):
    """A point's module factory for the engine tests: what it was built with, not a LightningModule."""
    return {"d_ff": cfg.d_ff, "lr": optim.lr, "parent": parent, "tag": tag}


MODULES.register(MODULE_PROBE, module_probe)


def train_with_module(model_cfg, run, out_dir, callbacks=(), resume_from=None, init_from=None, module_factory=None):
    """fake_train that also builds the module (when given) and writes the final checkpoint a child starts from."""
    from moe_lit.lit.run import CHECKPOINT_DIR, LAST_CHECKPOINT

    result = fake_train(model_cfg, run, out_dir, callbacks, resume_from, init_from)
    (Path(out_dir) / CHECKPOINT_DIR).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / CHECKPOINT_DIR / LAST_CHECKPOINT).write_text("fake checkpoint")
    if module_factory is not None:
        module = module_factory(model_cfg, run.optim)
        result["module"] = {**module, "parent": str(module["parent"])}
    return result
