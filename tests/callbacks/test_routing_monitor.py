import math

import lightning.pytorch as pl
import pytest
import torch

from moe_lit.callbacks import RoutingMonitor
from moe_lit.config import ConfigError
from moe_lit.lit.module import MoELitModule
from moe_lit.lit.optim import OptimConfig
from moe_lit.model.router import RoutingStats, token_entropy
from tests.helpers.models import tiny
from tests.lit.fakes import RandomTokenDataModule


class Recorder(pl.loggers.Logger):
    """Keeps every logged metrics dict with its step."""

    def __init__(self):
        super().__init__()
        self.rows = []

    name, version = "recorder", 0

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "10"])
def test_every_n_steps_is_validated_at_construction(bad):
    with pytest.raises(ConfigError, match="every_n_steps"):
        RoutingMonitor(every_n_steps=bad)


def test_load_imbalance_and_entropy_formulas():
    def imbalance(counts):
        return RoutingStats(torch.tensor(counts), 0.0, 0.0, 0).load_imbalance

    def score_entropy(scores_TE, score_func):
        return token_entropy(scores_TE, score_func).mean()

    assert imbalance([4.0, 4.0, 4.0, 4.0]) == 1.0
    assert imbalance([8, 0, 0, 0]) == 4.0
    assert math.isnan(imbalance([0.0, 0.0]))
    uniform_TE = torch.full((5, 4), 0.25)
    assert score_entropy(uniform_TE, "softmax").item() == pytest.approx(math.log(4))
    one_hot_TE = torch.eye(4)
    assert score_entropy(one_hot_TE, "softmax").item() == pytest.approx(0.0, abs=1e-6)
    # sigmoid scores are normalised per token first: equal scores are uniform whatever their value
    assert score_entropy(torch.full((3, 4), 0.9), "sigmoid").item() == pytest.approx(math.log(4))


def test_monitor_logs_every_n_steps_per_moe_layer_and_matches_the_router_buffers():
    torch.manual_seed(0)
    cfg = tiny(vocab_size=64, n_layers=3, first_dense_layers=1, capacity_factor=0.5)
    module = MoELitModule(cfg, OptimConfig(warmup_steps=1))
    monitor, logger = RoutingMonitor(every_n_steps=2), Recorder()
    trainer = pl.Trainer(
        max_steps=4,
        logger=logger,
        callbacks=[monitor],
        limit_val_batches=0,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        log_every_n_steps=100,
    )
    trainer.fit(module, datamodule=RandomTokenDataModule())
    rows = [(step, m) for step, m in logger.rows if any(k.startswith("routing/") for k in m)]
    assert [step for step, _ in rows] == [2, 4]
    last = rows[-1][1]
    # layer 0 is dense; layers 1 and 2 are MoE
    assert {k.split("/")[1] for k in last} == {"layer1", "layer2", "mean"}
    router = module.model.blocks[2].ffn.router
    counts, (dropped, entropy_sum, tokens) = router.tokens_per_expert, router.step_totals.tolist()
    assert tokens == 4 * 16 and counts.sum() == tokens * 2  # the last step's batch: B * L tokens, top-2
    assert last["routing/layer2/load_imbalance"] == pytest.approx((counts.max() / counts.mean()).item())
    assert last["routing/layer2/dropped_fraction"] == pytest.approx(dropped / counts.sum().item())
    assert last["routing/layer2/entropy"] == pytest.approx(entropy_sum / tokens)
    # capacity 0.5 must drop assignments; entropy of 4-expert softmax scores lies in (0, ln 4]
    assert 0 < last["routing/layer2/dropped_fraction"] < 1
    assert 0 < last["routing/layer1/entropy"] <= math.log(4) + 1e-6
    mean = (last["routing/layer1/load_imbalance"] + last["routing/layer2/load_imbalance"]) / 2
    assert last["routing/mean/load_imbalance"] == pytest.approx(mean)
    assert not any(h for r in (module.model.blocks[1].ffn.router, router) for h in r._forward_hooks.values())


def test_monitor_follows_a_model_swapped_mid_run():
    from types import SimpleNamespace

    from moe_lit.model import Transformer

    monitor, logger = RoutingMonitor(every_n_steps=1), Recorder()
    first, second = Transformer(tiny(vocab_size=64)), Transformer(tiny(vocab_size=64, num_experts=8))
    holder = SimpleNamespace(model=first)
    trainer = SimpleNamespace(global_step=1, is_global_zero=True, loggers=[logger])
    holder.model = second  # an upcycling callback swapped the network
    second.train()(torch.randint(0, 64, (2, 8)))
    second.update_router_biases()
    monitor.on_train_batch_end(trainer, holder, None, None, 0)
    ((step, metrics),) = logger.rows
    expected = second.routing_stats()[0]
    assert step == 1 and metrics["routing/layer0/load_imbalance"] == pytest.approx(expected.load_imbalance)
    assert expected.tokens_per_expert_E.numel() == 8 and expected.num_tokens == 16
