"""DivergenceGuard with a forced NaN: stop names step and tensor, skip leaves the weights, no NaN checkpoint."""

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from moe_lit.callbacks import DivergenceGuard
from moe_lit.callbacks.divergence import DivergenceError
from moe_lit.checkpoint import load_model
from moe_lit.config import ConfigError
from moe_lit.lit.module import MoELitModule
from moe_lit.lit.optim import OptimConfig
from tests.helpers.models import tiny
from tests.lit.fakes import RandomTokenDataModule

POISONED = "model.blocks.1.attn_norm.weight"


class PoisonAt(Callback):
    """From training batch ``at_batch`` on: ``weight`` writes NaN into one weight once; ``grad`` sets
    one gradient entry to inf once; ``loss`` makes every later loss NaN through a NaN weight that is
    restored right after backward (the weights stay finite, the gradients do not)."""

    def __init__(self, at_batch: int, where: str = "weight") -> None:
        self.at_batch, self.where, self._saved = at_batch, where, None

    def _param(self, pl_module):
        return dict(pl_module.named_parameters())[POISONED]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        hit = batch_idx == self.at_batch or (self.where == "loss" and batch_idx > self.at_batch)
        if hit and self.where in ("weight", "loss"):
            with torch.no_grad():
                self._saved = self._param(pl_module)[0].item()
                self._param(pl_module)[0] = float("nan")

    def on_after_backward(self, trainer, pl_module):
        if self.where == "grad" and trainer.fit_loop.batch_idx == self.at_batch:
            self._param(pl_module).grad[0] = float("inf")
        if self.where == "loss" and self._saved is not None:
            with torch.no_grad():
                self._param(pl_module)[0] = self._saved


class Weights(Callback):
    """The weights after every optimizer step."""

    def __init__(self):
        self.after = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after[trainer.global_step] = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


def _fit(tmp_path, callbacks, max_steps=5, **kwargs):
    torch.manual_seed(0)
    module = MoELitModule(tiny(vocab_size=64), OptimConfig(warmup_steps=0, schedule="constant"))
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0, every_n_train_steps=1)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[checkpoint, *callbacks],
        **kwargs,
    )
    trainer.fit(module, datamodule=RandomTokenDataModule())
    return module, trainer


def test_a_nan_loss_stops_before_the_update_naming_step_and_tensor_and_keeps_the_last_good_checkpoint(tmp_path):
    with pytest.raises(DivergenceError) as info:
        _fit(tmp_path, [PoisonAt(at_batch=2), DivergenceGuard()])
    message = str(info.value)
    assert len(message.splitlines()) == 1
    assert "at step 3: non-finite loss nan" in message and f"weight {POISONED}" in message
    assert str(tmp_path / "last.ckpt") in message
    kept = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert kept["global_step"] == 2  # written after step 2, never overwritten
    assert all(torch.isfinite(v).all() for v in load_model(tmp_path / "last.ckpt").state_dict().values())


def test_non_finite_gradients_are_caught_only_when_checked(tmp_path):
    with pytest.raises(DivergenceError, match=f"at step 2: non-finite gradient; .*gradient of {POISONED}"):
        _fit(tmp_path / "a", [PoisonAt(at_batch=1, where="grad"), DivergenceGuard(check_grads=True)])
    # unchecked, the inf gradient reaches AdamW and makes the weight nan; the checkpoint is refused
    with pytest.raises(
        DivergenceError, match=f"at step 2: weight {POISONED} is not finite; refusing to write a checkpoint"
    ):
        _fit(tmp_path / "b", [PoisonAt(at_batch=1, where="grad"), DivergenceGuard()])
    assert torch.load(tmp_path / "b" / "last.ckpt", weights_only=True)["global_step"] == 1


def test_skip_policy_leaves_the_weights_of_a_bad_step_untouched_and_stops_after_max_skips(tmp_path):
    weights = Weights()
    guard = DivergenceGuard(policy="skip", max_skips=2, check_grads=True)
    _, trainer = _fit(tmp_path / "a", [PoisonAt(at_batch=1, where="grad"), guard, weights], max_steps=4)
    assert guard.skipped_steps == [2] and trainer.global_step == 4
    for name, value in weights.after[1].items():
        assert torch.equal(weights.after[2][name], value), name  # the skipped step changed nothing
    assert not torch.equal(weights.after[3][POISONED], weights.after[2][POISONED])  # training went on
    assert torch.load(tmp_path / "a" / "last.ckpt", weights_only=True)["callbacks"]  # skips are saved
    # every loss from batch 2 on is NaN: two skips, then it stops
    stop = DivergenceGuard(policy="skip", max_skips=2)
    with pytest.raises(DivergenceError, match="at step 5: non-finite loss nan; .*2 step\\(s\\) skipped before"):
        _fit(tmp_path / "b", [PoisonAt(at_batch=2, where="loss"), stop], max_steps=8)
    assert stop.skipped_steps == [3, 4]
    assert torch.load(tmp_path / "b" / "last.ckpt", weights_only=True)["global_step"] == 4


@pytest.mark.parametrize(
    "kwargs, field",
    [({"policy": "retry"}, "policy"), ({"max_skips": 0}, "max_skips"), ({"check_grads": "yes"}, "check_grads")],
)
def test_bad_guard_settings_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=f"DivergenceGuard.{field}:"):
        DivergenceGuard(**kwargs)
