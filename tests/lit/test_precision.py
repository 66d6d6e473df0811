"""train.precision: forced values, and auto by CPU capability and a probe of the model's step."""

from __future__ import annotations

import json
from pathlib import Path

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


@pytest.fixture(autouse=True)
def probe_cache(tmp_path, monkeypatch):
    """The probes' cache of this test (never the user's)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "moe_lit" / "precision_probes.json"


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


def test_auto_decides_by_capability_then_probe(dense, bf16_cpu, monkeypatch, probe_cache):
    speedups = iter([2.0, 1.1])
    monkeypatch.setattr(precision, "probe_speedup", lambda *args: next(speedups))
    fast = choose_precision("auto", CPU, dense, 2, 16)
    assert fast.precision == "bf16-mixed" and "avx512_bf16, bf16 step probe 2.00x fp32" in fast.line()
    probe_cache.unlink()  # another machine, as far as the cache knows
    slow = choose_precision("auto", CPU, dense, 2, 16)
    assert slow.precision == "32-true" and "1.10x fp32, below 1.3x" in slow.reason
    several = choose_precision("auto", {**CPU, "devices": 2}, dense, 2, 16)  # no probe: ranks must agree
    assert several.precision == "bf16-mixed" and "no probe" in several.reason
    assert choose_precision("auto", {**CPU, "precision": "bf16-mixed"}, dense, 2, 16) is None  # the trainer's own
    assert choose_precision("auto", {"accelerator": "gpu"}, dense, 2, 16) is None


def test_auto_decides_an_moe_model_by_its_probe_as_a_dense_one(model, bf16_cpu, monkeypatch, probe_cache):
    speedups = iter([2.0, 1.1])
    monkeypatch.setattr(precision, "probe_speedup", lambda *args: next(speedups))
    assert choose_precision("auto", CPU, model, 2, 16).precision == "bf16-mixed"
    probe_cache.unlink()
    assert choose_precision("auto", CPU, model, 2, 16).precision == "32-true"
    assert choose_precision("32-true", CPU, model, 2, 16).precision == "32-true"  # forcing fp32 stays possible


def test_auto_gives_moe_bf16_only_while_its_quoted_bf16_verdict_is_reproduced():
    """The result MOE_BF16_RESULT names exists, and its MoE claim (bf16-mixed trains to fp32's mean
    validation loss, 8 seeds each) is reproduced."""
    result = json.loads((Path(__file__).parents[2] / precision.MOE_BF16_RESULT).read_text())
    moe = result["models"]["moe"]
    assert moe["claim"]["verdict"] == "reproduced"
    assert min(moe["precisions"][p]["n"] for p in ("32-true", "bf16-mixed")) >= 8


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


def test_auto_decides_once_per_machine_and_model_with_the_probe_varying(dense, bf16_cpu, monkeypatch, probe_cache):
    speedups = iter([2.0, 1.0, 1.0])
    monkeypatch.setattr(precision, "probe_speedup", lambda *args: next(speedups))
    first = choose_precision("auto", CPU, dense, 2, 16)
    again = choose_precision("auto", CPU, dense, 2, 16)  # the probe would now say 1.0x: the cache answers
    assert first.precision == again.precision == "bf16-mixed"
    assert again.reason == f"auto: avx512_bf16, bf16 step probe 2.00x fp32 (cached in {probe_cache}); " + (
        "--train.precision 32-true for fp32"
    )
    other_shape = choose_precision("auto", CPU, dense, 4, 16)  # another batch: its own measurement
    assert other_shape.precision == "32-true"
    monkeypatch.setattr(torch, "__version__", "0.0.0")  # another torch: measured again
    assert choose_precision("auto", CPU, dense, 2, 16).precision == "32-true"
    assert len(json.loads(probe_cache.read_text())) == 3


def test_a_resumed_run_keeps_the_precision_its_checkpoint_records(dense, bf16_cpu, monkeypatch):
    monkeypatch.setattr(precision, "probe_speedup", lambda *args: pytest.fail("a resume does not probe"))
    kept = choose_precision("auto", CPU, dense, 2, 16, resumed="32-true")
    assert kept == PrecisionChoice("32-true", "auto: the run's, decided at its start")
    assert choose_precision("bf16-mixed", CPU, dense, 2, 16, resumed="32-true").precision == "bf16-mixed"  # forced


@pytest.mark.slow
def test_train_run_records_its_precision_and_its_resume_keeps_it(dense, bf16_cpu, monkeypatch, probe_cache, tmp_path):
    from moe_lit.checkpoint import read_lightning_checkpoint
    from moe_lit.lit.optim import OptimConfig
    from moe_lit.lit.run import train_run
    from moe_lit.lit.run_config import DataConfig, RunConfig
    from tests.helpers.corpus import prepare_corpus

    prepared = prepare_corpus(tmp_path, paragraphs=20, val_fraction=0.1, test_fraction=0.1)
    speedups = iter([2.0, 1.0])
    monkeypatch.setattr(precision, "probe_speedup", lambda *args: next(speedups))

    def run(steps: int) -> RunConfig:
        return RunConfig(
            data=DataConfig(data_dir=str(prepared), seq_len=16, batch_size=2, val_batches=1),
            optim=OptimConfig(warmup_steps=1),
            train=TrainConfig(max_steps=steps, precision="auto"),
            trainer={"enable_progress_bar": False},
        )

    first = train_run(tiny(dense=True), run(2), tmp_path / "run")
    assert first.precision == "bf16-mixed"
    assert read_lightning_checkpoint(first.checkpoint)["moe_lit_run"]["precision"] == "bf16-mixed"
    probe_cache.unlink()  # a probe now would say 1.0x
    resumed = train_run(tiny(dense=True), run(3), tmp_path / "run", resume_from=first.checkpoint)
    assert resumed.precision == "bf16-mixed" and resumed.steps == 3
