"""Routing statistics under DDP and FSDP2 (2 gloo processes) with gradient accumulation 2 and
``balancing: bias``: after several steps the selection biases and the step's statistics are equal on
every rank and equal to one process trained on the same global batches.

Without the all-reduce each rank would nudge its biases from its own half of the batch (FSDP2 never
broadcasts buffers, so they drift apart), and without accumulation the statistics would cover the
last micro-batch only; either makes the counts, and so the biases, differ from the single process.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import train_script
from tests.distributed.launch import run_script

pytestmark = pytest.mark.slow
STEPS, ACCUMULATE = 3, 2


def _routers(out, rank):
    return torch.load(out / f"routers_rank{rank}.pt", weights_only=True)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    train_script.train("single", STEPS, out, accumulate=ACCUMULATE, bias=True)
    return _routers(out, 0)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_biases_and_statistics_agree_on_every_rank_and_with_one_process(tmp_path, single, strategy):
    run_script(strategy, STEPS, tmp_path, extra=["--accumulate", str(ACCUMULATE), "--bias"])
    ranks = [_routers(tmp_path, rank) for rank in (0, 1)]
    bias = "blocks.1.ffn.router.expert_bias"
    counts = "blocks.1.ffn.router.tokens_per_expert"
    assert single[bias].abs().sum() > 0  # the biases moved
    assert single[counts].sum() == train_script.GLOBAL_BATCH * train_script.CONFIG.seq_len * 2  # whole batch, top-2
    for routers in ranks:
        assert torch.equal(routers[bias], ranks[0][bias])  # every rank
        assert torch.equal(routers[bias], single[bias])  # one process on the same global batches
        assert torch.equal(routers[counts], single[counts])
        # dropped, entropy sum, tokens: the entropy sum adds floats in another order
        torch.testing.assert_close(
            routers["blocks.1.ffn.router.step_totals"], single["blocks.1.ffn.router.step_totals"]
        )
