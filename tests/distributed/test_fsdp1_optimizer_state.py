"""FSDP1 optimizer state moves to a plain optimizer and back with every Adam moment under its parameter name.

``fsdp1_script.py`` runs raw FSDP1 on 2 gloo processes (one AdamW step, two parameter groups) and saves
with ``FSDPStrategy.optimizer_state``; here the plain-id state loads into a one-process optimizer, and the
state the script loaded back into FSDP1 is compared by name, both against a one-process AdamW step on
the same global batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_lit.lit.optim import build_optimizer
from moe_lit.model import Transformer
from tests.distributed import fsdp1_script, launch
from tests.distributed.fsdp1_script import CONFIG
from tests.distributed.train_script import tokens

# NOTE: one worker runs the module: its module-scoped runs are then made once, not once per worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("fsdp1_optimizer_state")]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp1")
    launch.run_ranks(Path(fsdp1_script.__file__), ["--out", str(out)], world=2, timeout_s=300)
    return torch.load(out / "fsdp1_optim.pt", weights_only=True), torch.load(
        out / "reloaded_by_name.pt", weights_only=True
    )


def _plain():
    torch.manual_seed(0)
    model = Transformer(CONFIG)
    optimizer, _ = build_optimizer(model, fsdp1_script.OPTIM, 0)
    return model, optimizer


@pytest.fixture(scope="module")
def reference():
    """Adam moments by parameter name after one single-process step on the whole batch."""
    model, optimizer = _plain()
    fsdp1_script.train_step(model, optimizer, tokens().tensors[0])
    return {name: optimizer.state[p] for name, p in model.named_parameters()}


def _assert_moments_equal(by_name: dict, reference: dict) -> None:
    assert by_name.keys() == reference.keys()
    for name, state in reference.items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                by_name[name][key],
                state[key],
                rtol=1e-4,
                atol=1e-7,
                msg=lambda m, name=name, key=key: f"{name}.{key}: {m}",
            )


def test_fsdp1_state_loads_into_a_plain_optimizer_by_name(saved, reference):
    plain_state, _ = saved
    assert all(isinstance(i, int) for i in plain_state["state"])
    model, optimizer = _plain()
    optimizer.load_state_dict(plain_state)
    _assert_moments_equal({name: optimizer.state[p] for name, p in model.named_parameters()}, reference)


def test_plain_state_loads_back_into_fsdp1_by_name(saved, reference):
    _, reloaded = saved
    _assert_moments_equal(reloaded["state"], reference)
