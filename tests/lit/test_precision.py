"""train.precision: forced values, and auto by CPU capability and a probe of the model's step."""

from __future__ import annotations

import pytest
import torch

from moe_lit.inference import precision as capability
from moe_lit.inference.precision import PrecisionChoice, native_bf16_flags
from moe_lit.lit import precision
from moe_lit.lit.precision import choose_precision, probe_speedup
from moe_lit.lit.run_config import TrainConfig
from moe_lit.model import Transformer
from tests.helpers.models import tiny

CPU = {"accelerator": "cpu", "devices": 1}


@pytest.fixture
def model():
    torch.manual_seed(0)
    return Transformer(tiny(num_experts=4, expert_size=16))


@pytest.fixture
def dense():
    torch.manual_seed(0)
    return Transformer(tiny(dense=True))


def test_flags_are_read_from_cpuinfo(tmp_path):
    (tmp_path / "amx").write_text("flags : sse amx_bf16 amx_tile\n")
    (tmp_path / "none").write_text("flags : sse avx2 fma\n")
    assert native_bf16_flags(tmp_path / "amx") == ["amx_bf16"]
    assert native_bf16_flags(tmp_path / "none") == []
    assert native_bf16_flags(tmp_path / "missing") == []


def test_forced_and_unset_precisions(model):
    assert choose_precision(None, CPU, model, 2, 16) is None
    assert choose_precision("32-true", CPU, model, 2, 16) == PrecisionChoice("32-true", "train.precision")
    assert choose_precision("bf16-mixed", {"accelerator": "gpu"}, model, 2, 16).precision == "bf16-mixed"


def test_auto_decides_by_capability_then_probe(dense, bf16_cpu, monkeypatch):
    speedups = iter([2.0, 1.1])
    monkeypatch.setattr(precision, "probe_speedup", lambda *args: next(speedups))
    fast = choose_precision("auto", CPU, dense, 2, 16)
    assert fast.precision == "bf16-mixed" and "avx512_bf16, bf16 step probe 2.00x fp32" in fast.line()
    slow = choose_precision("auto", CPU, dense, 2, 16)
    assert slow.precision == "32-true" and "1.10x fp32, below 1.3x" in slow.reason
    several = choose_precision("auto", {**CPU, "devices": 2}, dense, 2, 16)  # no probe: ranks must agree
    assert several.precision == "bf16-mixed" and "no probe" in several.reason
    assert choose_precision("auto", {**CPU, "precision": "bf16-mixed"}, dense, 2, 16) is None  # the trainer's own
    assert choose_precision("auto", {"accelerator": "gpu"}, dense, 2, 16) is None


def test_auto_keeps_an_moe_model_in_fp32(model, bf16_cpu, monkeypatch):
    """Its bf16 loss fails the accuracy check; forcing bf16-mixed stays possible."""
    monkeypatch.setattr(precision, "probe_speedup", lambda *args: pytest.fail("no probe for an MoE model"))
    for trainer in (CPU, {**CPU, "devices": 2}):
        choice = choose_precision("auto", trainer, model, 2, 16)
        assert choice.precision == "32-true" and "an MoE model" in choice.reason
    assert choose_precision("bf16-mixed", CPU, model, 2, 16).precision == "bf16-mixed"


def test_auto_without_native_bf16_keeps_fp32(dense, tmp_path, monkeypatch):
    (tmp_path / "cpuinfo").write_text("flags : sse avx2\n")
    monkeypatch.setattr(capability, "CPUINFO", tmp_path / "cpuinfo")
    monkeypatch.setattr(precision, "probe_speedup", lambda *args: pytest.fail("no probe without native bf16"))
    assert choose_precision("auto", CPU, dense, 2, 16) == PrecisionChoice("32-true", "auto: no native bf16 on this CPU")


def test_probe_leaves_the_model_untouched(model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert probe_speedup(model, batch_size=2, seq_len=16) > 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # routing buffers too
    assert all(p.grad is None for p in model.parameters())


def test_a_precision_outside_the_choices_is_one_line():
    with pytest.raises(Exception, match=r"precision: got 'fp16', allowed values: auto, 32-true, bf16-mixed, null"):
        TrainConfig(max_steps=1, precision="fp16")
