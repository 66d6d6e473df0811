"""Compiled blocks under DDP and FSDP2 (2 gloo processes on CPU) train like one eager process.

``CompileBlocks`` compiles after the strategy wrapped the module (DDP) or sharded it
(``configure_model``: FSDP2's ``fully_shard``), so the compiled graphs see DDP's hooks and FSDP2's
unsharded parameters. Two optimizer steps of each, compiled with inductor, against two eager
single-process steps: the weights agree to the tolerance the eager strategies meet
(``test_strategies_cpu.py``), and the checkpoint keys are the eager ones.
"""

from __future__ import annotations

import json

import pytest
import torch

from moe_lit.checkpoint import load_model
from tests.distributed import train_script
from tests.distributed.launch import run_script

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return load_model(train_script.train("single", 2, tmp_path_factory.mktemp("eager") / "single2"))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_compiled_distributed_training_matches_one_eager_process(strategy, reference, tmp_path):
    compiled = load_model(run_script(strategy, 2, tmp_path / strategy, extra=["--compile"]))
    for rank in (0, 1):
        counts = json.loads((tmp_path / strategy / f"compiled_rank{rank}.json").read_text())
        assert counts["blocks"] == train_script.CONFIG.n_layers and counts["frames"] > 0, counts
    assert compiled.state_dict().keys() == reference.state_dict().keys()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(
            compiled.state_dict()[name], value, rtol=1e-4, atol=5e-5, msg=lambda m, name=name: f"{name}: {m}"
        )
    torch.manual_seed(0)  # the runs' initial weights (train_script seeds everything with 0)
    untrained = train_script.MoELitModule(train_script.CONFIG).model
    moved = [(p - q).abs().max().item() for p, q in zip(reference.parameters(), untrained.parameters(), strict=True)]
    assert max(moved) > 1e-3  # two steps at lr 1e-2 moved the weights
