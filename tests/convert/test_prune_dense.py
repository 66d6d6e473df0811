import pytest
import torch

from moe_lit.config import ConfigError
from moe_lit.convert.calibration import ffn_inputs
from moe_lit.convert.prune_dense import neuron_importance, prune_dense_ffn
from moe_lit.model import Transformer
from tests.helpers.models import tiny


@pytest.fixture(scope="module")
def dense():
    torch.manual_seed(0)
    return Transformer(tiny(dense=True)).eval()


@pytest.fixture(scope="module")
def batches():
    return torch.randint(0, 97, (4, 4, 17), generator=torch.Generator().manual_seed(2))


def test_pruning_dead_neurons_keeps_the_logits(dense, batches):
    dead = Transformer(dense.config)
    dead.load_state_dict(dense.state_dict())
    with torch.no_grad():
        for block in dead.blocks:
            block.ffn.v1.weight[40:].zero_()  # 24 neurons output 0 on every input
    pruned = prune_dense_ffn(dead, ffn_inputs(dead, batches, 256), keep=40)
    assert pruned.config.d_ff == 40
    idx = torch.randint(0, 97, (2, 16))
    assert (pruned(idx).logits_BLV - dead(idx).logits_BLV).abs().max().item() < 1e-5
    assert torch.equal(pruned.blocks[1].ffn.w1.weight, dead.blocks[1].ffn.w1.weight[:40])


def test_kept_neurons_are_the_most_active_in_dense_order(dense, batches):
    calibration = ffn_inputs(dense, batches, 256)
    score_F = neuron_importance(dense, calibration)[0]
    pruned = prune_dense_ffn(dense, calibration, keep=16)
    kept = sorted(torch.topk(score_F, 16).indices.tolist())
    assert torch.equal(pruned.blocks[0].ffn.w2.weight, dense.blocks[0].ffn.w2.weight[:, kept])
    assert torch.equal(pruned.blocks[0].ffn.v1.weight, dense.blocks[0].ffn.v1.weight[kept])


def test_bad_keep_is_refused(dense, batches):
    with pytest.raises(ConfigError, match=r"keep: must be an integer in \[1, d_ff=64\]"):
        prune_dense_ffn(dense, ffn_inputs(dense, batches, 64), keep=65)


def test_calibration_respects_the_token_budget_and_restores_the_mode(dense, batches):
    dense.train()
    calibration = ffn_inputs(dense, batches, 100)
    assert dense.training and set(calibration) == {0, 1}
    assert calibration[0].shape == (100, 32)
    dense.eval()
