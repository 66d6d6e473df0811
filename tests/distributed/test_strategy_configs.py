"""Trainer YAMLs build our strategies; optimizer-state keys convert between plain ids and names."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
import yaml

from moe_lit.distributed.optim_state import optimizer_state_by_id, optimizer_state_by_name
from moe_lit.errors import MoeLitError
from moe_lit.lit.optim import OptimConfig, build_optimizer
from moe_lit.lit.strategies import FSDP2Strategy, FSDPStrategy
from moe_lit.model import Transformer
from moe_lit.model.transformer import Block
from tests.helpers.models import tiny

TRAINER_DIR = Path(__file__).resolve().parents[2] / "configs" / "trainer"


def _strategy(yaml_name: str):
    spec = yaml.safe_load((TRAINER_DIR / yaml_name).read_text())["strategy"]
    if isinstance(spec, str):
        return spec
    module, _, name = spec["class_path"].rpartition(".")
    return getattr(importlib.import_module(module), name)(**spec.get("init_args", {}))


def test_trainer_yamls_build_the_strategies():
    assert _strategy("ddp.yaml") == "ddp"
    fsdp = _strategy("fsdp.yaml")
    assert isinstance(fsdp, FSDPStrategy)
    assert fsdp.kwargs["auto_wrap_policy"]._module_classes == {Block}
    assert fsdp.mixed_precision.param_dtype == torch.bfloat16 and fsdp.mixed_precision.reduce_dtype == torch.float32
    for name in ("fsdp2.yaml", "multinode-slurm.yaml"):
        fsdp2 = _strategy(name)
        assert isinstance(fsdp2, FSDP2Strategy)
        assert (fsdp2.mixed_precision, fsdp2._save_distributed_checkpoint, fsdp2._tensor_parallel_size) == (
            "bf16",
            False,
            1,
        )
        assert fsdp2.expert_parallel_size == 1
    ep = _strategy("fsdp2-ep.yaml")
    assert isinstance(ep, FSDP2Strategy) and (ep.expert_parallel_size, ep.mixed_precision) == (2, "bf16")


def test_activation_checkpointing_wraps_blocks():
    policy = FSDPStrategy(activation_checkpointing=True)._activation_checkpointing_kwargs["auto_wrap_policy"]
    assert policy._module_classes == {Block}
    assert FSDPStrategy()._activation_checkpointing_kwargs == {}


@pytest.mark.parametrize("cls", [FSDPStrategy, FSDP2Strategy])
def test_mixed_precision_is_validated(cls):
    with pytest.raises(MoeLitError, match="strategy.mixed_precision: got 'fp16', allowed values: bf16, null"):
        cls(mixed_precision="fp16")


def test_optimizer_state_keys_round_trip_in_group_order():
    model = Transformer(tiny())
    optimizer, _ = build_optimizer(model, OptimConfig(warmup_steps=0, schedule="constant"), 0)
    model(torch.randint(0, 97, (2, 8))).logits_BLV.sum().backward()
    optimizer.step()
    plain = optimizer.state_dict()
    assert len(plain["param_groups"]) == 2  # decay / no decay: ids are NOT in module order
    named = optimizer_state_by_name(plain, optimizer, model)
    name_of = {id(p): n for n, p in model.named_parameters()}
    for group, ours in zip(named["param_groups"], optimizer.param_groups, strict=False):
        assert group["params"] == [name_of[id(p)] for p in ours["params"]]
    for name, param in model.named_parameters():
        assert named["state"][name]["exp_avg"].shape == param.shape
    back = optimizer_state_by_id(named)
    assert [g["params"] for g in back["param_groups"]] == [g["params"] for g in plain["param_groups"]]
    for i, state in plain["state"].items():
        assert torch.equal(back["state"][i]["exp_avg_sq"], state["exp_avg_sq"])
    assert optimizer_state_by_id({}) == {}


def test_optimizer_state_from_another_optimizer_config_is_refused():
    model = Transformer(tiny())
    optimizer, _ = build_optimizer(model, OptimConfig(warmup_steps=0, schedule="constant"), 0)
    model(torch.randint(0, 97, (2, 8))).logits_BLV.sum().backward()
    optimizer.step()
    plain = optimizer.state_dict()
    single_group = torch.optim.AdamW(model.parameters())
    with pytest.raises(MoeLitError, match="optimizer has 2 parameter groups, this run has 1"):
        optimizer_state_by_name(plain, single_group, model)
