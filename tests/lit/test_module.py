"""MoELitModule on the random-token stand-in datamodule: losses, logging, per-language metrics, bias hook."""

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

from moe_lit.lit.module import MoELitModule
from moe_lit.lit.optim import OptimConfig
from tests.helpers.models import tiny
from tests.lit.fakes import RandomTokenDataModule


def _trainer(**kwargs) -> pl.Trainer:
    defaults = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=2,
    )
    return pl.Trainer(**{**defaults, **kwargs})


def test_training_logs_ce_and_each_aux_loss_and_their_sum():
    torch.manual_seed(0)
    module = MoELitModule(tiny(vocab_size=64, z_loss_coef=1e-3), OptimConfig(warmup_steps=1))
    trainer = _trainer(max_steps=1, log_every_n_steps=1, limit_val_batches=0)
    trainer.fit(module, datamodule=RandomTokenDataModule())
    m = trainer.callback_metrics
    assert {"train/ce", "train/load_balancing", "train/z_loss", "train/loss", "train/lr"} <= set(m)
    assert m["train/loss"] == pytest.approx(float(m["train/ce"] + m["train/load_balancing"] + m["train/z_loss"]))
    assert m["train/z_loss"] > 0 and m["train/load_balancing"] > 0


def test_validation_loss_per_language_is_the_token_mean_cross_entropy():
    torch.manual_seed(0)
    module = MoELitModule(tiny(vocab_size=64))
    datamodule = RandomTokenDataModule(val_batches=2)
    trainer = _trainer()
    trainer.validate(module, datamodule=datamodule, verbose=False)
    expected = {}
    with torch.no_grad():
        for lang, loader in zip(datamodule.languages, datamodule.val_dataloader(), strict=False):
            batches = torch.cat(list(loader))
            logits = module.model(batches[:, :-1]).logits_BLV
            expected[lang] = F.cross_entropy(logits.flatten(0, 1), batches[:, 1:].flatten()).item()
    m = trainer.callback_metrics
    for lang in ("aa", "bb"):
        assert m[f"val/loss_{lang}"].item() == pytest.approx(expected[lang], rel=1e-5)
        assert m[f"val/ppl_{lang}"].item() == pytest.approx(torch.tensor(expected[lang]).exp().item(), rel=1e-5)
    # equal token counts per language: the overall loss is their mean
    assert m["val/loss"].item() == pytest.approx((expected["aa"] + expected["bb"]) / 2, rel=1e-5)


def test_test_stage_logs_per_language_metrics_too():
    module = MoELitModule(tiny(vocab_size=64, dense=True))
    trainer = _trainer(limit_test_batches=1)
    results = trainer.test(module, datamodule=RandomTokenDataModule(), verbose=False)
    assert {"test/loss", "test/loss_aa", "test/loss_bb", "test/ppl"} <= set(trainer.callback_metrics)
    assert len(results) == 2


def test_bias_balancing_updates_router_biases_once_per_step(monkeypatch):
    torch.manual_seed(0)
    module = MoELitModule(tiny(vocab_size=64, balancing="bias", bias_update_rate=0.5), OptimConfig(warmup_steps=1))
    calls = []
    update = module.model.update_router_biases
    monkeypatch.setattr(module.model, "update_router_biases", lambda: (calls.append(1), update()))
    router = module.model.blocks[0].ffn.router
    _trainer(max_steps=3, limit_val_batches=0).fit(module, datamodule=RandomTokenDataModule())
    assert len(calls) == 3
    # each update moves every bias by +-rate or 0 (sign of mean load - load), so after 3 steps
    # the biases are multiples of 0.5 within [-1.5, 1.5], and an unbalanced router moved some
    bias = router.expert_bias
    assert torch.equal(bias * 2, (bias * 2).round()) and bias.abs().max() <= 1.5
    assert bias.abs().sum() > 0
    assert router.tokens_per_expert.sum() == 4 * 16 * 2  # B * L * top_k of the last step's batch
    assert router.pending_tokens_per_expert().sum() == 0  # reset after the step


def test_hyper_parameters_hold_the_model_config_for_moe_lit_checkpoint():
    cfg = tiny(vocab_size=64)
    module = MoELitModule(cfg)
    assert module.hparams["model"] == cfg and module.hparams["optim"] == OptimConfig()
    assert all(k.startswith("model.") for k in module.state_dict())


def test_routing_statistics_of_a_step_sum_every_micro_batch_and_drive_one_bias_update():
    import copy

    torch.manual_seed(0)
    rate = 0.5
    module = MoELitModule(tiny(vocab_size=64, balancing="bias", bias_update_rate=rate), OptimConfig(warmup_steps=1))
    datamodule = RandomTokenDataModule()
    reference = copy.deepcopy(module.model).train()
    loader = iter(datamodule.train_dataloader())
    for _ in range(2):  # the step's two micro-batches, through the untrained weights
        reference(next(loader)[:, :-1])
    _trainer(max_steps=1, limit_val_batches=0, accumulate_grad_batches=2).fit(
        module, datamodule=RandomTokenDataModule()
    )
    for ours, ref in zip(module.model.moe_layers(), reference.moe_layers(), strict=False):
        counts_E = ref.router.pending_tokens_per_expert()
        assert counts_E.sum() == 2 * 4 * 16 * 2  # both micro-batches: 2 x B * L * top_k
        assert torch.equal(ours.router.tokens_per_expert, counts_E)
        assert torch.equal(ours.router.expert_bias, rate * torch.sign(counts_E.mean() - counts_E))  # one update
        assert ours.router.stats().num_tokens == 2 * 4 * 16
