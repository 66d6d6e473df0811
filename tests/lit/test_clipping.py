"""Gradient clipping with every AdamW kernel and precision: fused AdamW clips under bf16-mixed
(Lightning's plugin refuses it), with the unfused kernel's gradient norms and losses."""

from __future__ import annotations

import csv

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision

from moe_lit.lit.module import MoELitModule
from tests.helpers.cli_runs import fit
from tests.helpers.models import tiny


def logged(run_dir) -> list[float]:
    """``train/loss, train/grad_norm`` of every step of a run's metrics.csv, in one list."""
    with (run_dir / "logs" / "fit" / "metrics.csv").open() as handle:
        rows = [r for r in csv.DictReader(handle) if r.get("train/loss")]
    return [float(r[key]) for r in rows for key in ("train/loss", "train/grad_norm")]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_fused_adamw_clips_like_the_unfused_kernel(precision, prepared, tmp_path):
    runs = {}
    for kernel in ("fused", "for_loop"):
        out = tmp_path / kernel
        args = ["--trainer.precision", precision, "--trainer.gradient_clip_val", "0.5", "--train.max_steps", "4"]
        assert fit(prepared, *args, "--model.optim.implementation", kernel, "--out", str(out)) == 0
        runs[kernel] = logged(out)
    assert len(runs["fused"]) == 2 * 4
    assert runs["fused"][:2] == runs["for_loop"][:2]  # the same first gradients, clipped the same
    assert runs["fused"] == pytest.approx(runs["for_loop"], rel=1e-4)
    assert all(norm > 0.5 for norm in runs["fused"][1::2])  # the clip was active at every step


@pytest.mark.parametrize(("clip", "fused"), [(1.0, None), (None, True)])
def test_loss_scaling_with_clipping_takes_the_foreach_kernel(clip, fused):
    # NOTE: a scaler's unscale happens inside a fused step, after clipping would need it.
    scaled = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    trainer = pl.Trainer(accelerator="cpu", max_steps=5, gradient_clip_val=clip, logger=False, plugins=[scaled])
    module = MoELitModule(tiny())
    module.trainer = trainer
    optimizer = module.configure_optimizers()["optimizer"]
    assert optimizer.defaults["fused"] is fused and optimizer.defaults["foreach"] is (None if fused else True)
