"""DDP and FSDP2 on CPU (2 gloo processes) against one process, and checkpoints across strategies.

One chain of runs: DDP trains steps 1-2, FSDP2 resumes its checkpoint for steps 3-4 (each a
subprocess: Lightning's launcher re-runs the command for rank 1), one process (this one) resumes
FSDP2's checkpoint for steps 5-6. A single-process run of steps 1-4 and 5-6 in this process is the
reference: weights (read back through ``moe_lit.checkpoint.load_model``, the CPU path) and the
loss on a fixed batch agree after step 4 and after step 6, so each strategy trains like one
process and each checkpoint, Adam moments included, resumes under another strategy.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_lit.checkpoint import load_model
from tests.distributed import train_script
from tests.distributed.launch import run_script

# NOTE: one worker runs the module: its module-scoped runs are then made once, not once per worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("strategies_cpu")]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("strategies")
    ddp2 = run_script("ddp", 2, root / "ddp2")
    fsdp4 = run_script("fsdp2", 4, root / "fsdp4", resume=ddp2)
    single6 = train_script.train("single", 6, root / "single6", resume=fsdp4)
    ref4 = train_script.train("single", 4, root / "ref4")
    ref6 = train_script.train("single", 6, root / "ref6", resume=ref4)
    return {"fsdp4": fsdp4, "single6": single6, "ref4": ref4, "ref6": ref6}


def _loss(model) -> float:
    batch = train_script.tokens().tensors[0]
    with torch.no_grad():
        logits = model(batch[:, :-1]).logits_BLV
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()


@pytest.mark.parametrize("run,reference", [("fsdp4", "ref4"), ("single6", "ref6")])
def test_distributed_runs_match_one_process(checkpoints, run, reference):
    ours, ref = load_model(checkpoints[run]), load_model(checkpoints[reference])
    assert ours.state_dict().keys() == ref.state_dict().keys()
    for name, value in ref.state_dict().items():
        # NOTE: 2 processes sum the gradient in another order than 1; Adam's first steps divide by
        # sqrt(v), so for a weight whose gradient is near zero a 1e-7 rounding difference becomes a
        # ~1e-5 weight difference (seen: 1 of 2048 entries at 1.4e-5). A wrong shard, resume or
        # moment mapping moves weights by ~lr = 1e-2.
        torch.testing.assert_close(
            ours.state_dict()[name], value, rtol=1e-4, atol=5e-5, msg=lambda m, name=name: f"{name}: {m}"
        )
    assert _loss(ours) == pytest.approx(_loss(ref), rel=1e-5)
    untrained = train_script.MoELitModule(train_script.CONFIG).model.eval()
    assert _loss(ref) < _loss(untrained) - 0.1  # the runs did train


def test_checkpoints_record_their_steps(checkpoints):
    for name, steps in (("fsdp4", 4), ("single6", 6)):
        ckpt = torch.load(checkpoints[name], map_location="cpu", weights_only=True)
        assert ckpt["global_step"] == steps
        assert len(ckpt["optimizer_states"][0]["state"]) == sum(1 for _ in load_model(checkpoints[name]).parameters())
