"""The private-API module: its version check, the tested ranges against the lock, the APIs it reaches."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from packaging.version import Version

from moe_lit import _compat
from moe_lit.errors import MoeLitError

LOCK = Path(__file__).resolve().parents[1] / "requirements" / "lock.txt"


def fake_version(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    monkeypatch.setattr(_compat, "installed_version", lambda package: version)


def test_installed_releases_are_the_tested_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_compat.ALLOW_UNTESTED_ENV, raising=False)
    assert all(_compat.require_tested(package) is True for package in _compat.TESTED)


@pytest.mark.parametrize("version", ["2.13.0", "2.13.0+cpu", "2.13.0+cu128", "2.13.4"])
def test_patch_releases_and_build_tags_pass(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    monkeypatch.delenv(_compat.ALLOW_UNTESTED_ENV, raising=False)
    fake_version(monkeypatch, version)
    assert _compat.require_tested("torch") is True


@pytest.mark.parametrize("version", ["2.12.1", "2.14.0", "3.0.0", "2.7.0+cu126"])
def test_untested_release_fails_with_one_line(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    monkeypatch.delenv(_compat.ALLOW_UNTESTED_ENV, raising=False)
    fake_version(monkeypatch, version)
    with pytest.raises(MoeLitError) as info:
        _compat.require_tested("torch")
    message = str(info.value)
    assert "\n" not in message
    assert f"torch {version}" in message and "torch~=2.13.0" in message
    assert f"{_compat.ALLOW_UNTESTED_ENV}=1" in message


def test_env_override_allows_an_untested_release(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_version(monkeypatch, "2.99.0")
    monkeypatch.setenv(_compat.ALLOW_UNTESTED_ENV, "0")
    with pytest.raises(MoeLitError):
        _compat.require_tested("lightning")
    monkeypatch.setenv(_compat.ALLOW_UNTESTED_ENV, "1")
    assert _compat.require_tested("lightning") is False  # allowed, and reported as untested


def test_tested_ranges_start_at_the_locked_versions() -> None:
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", LOCK.read_text(), re.MULTILINE))
    pins = {name.lower().replace("-", "_"): version for name, version in pins.items()}
    for package, spec in _compat.TESTED.items():
        assert spec.startswith("~=")
        assert Version(spec[2:]) == Version(Version(pins[package]).public), package


def test_accessors_check_the_version_before_a_private_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_compat.ALLOW_UNTESTED_ENV, raising=False)
    fake_version(monkeypatch, "0.0.1")
    calls = [
        lambda: _compat.clean_tensor_name("a._checkpoint_wrapped_module.b"),
        lambda: _compat.composable_checkpoint(torch.nn.Linear(1, 1)),
        lambda: _compat.attached_trainer(object()),
        lambda: _compat.load_task_yaml(Path("missing.yaml")),
    ]
    for call in calls:
        with pytest.raises(MoeLitError, match="0.0.1"):
            call()


def test_private_grouped_mm_only_on_a_tested_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    private = object()
    monkeypatch.delattr(torch.nn.functional, "grouped_mm", raising=False)
    monkeypatch.setattr(torch, "_grouped_mm", private, raising=False)
    monkeypatch.delenv(_compat.ALLOW_UNTESTED_ENV, raising=False)
    assert _compat.grouped_mm_op() is private
    fake_version(monkeypatch, "2.9.0")
    with pytest.raises(MoeLitError, match="torch 2.9.0"):
        _compat.grouped_mm_op()
    monkeypatch.delattr(torch, "_grouped_mm")
    assert _compat.grouped_mm_op() is None


def test_every_private_api_exists_on_the_installed_releases() -> None:
    # NOTE: the check that fails first when a lock refresh moves past an API we rely on.
    from lightning.fabric.strategies import model_parallel
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
    from lm_eval.tasks import _yaml_loader
    from torch.distributed import _composable
    from torch.distributed.fsdp import _common_utils

    assert callable(model_parallel._load_raw_module_state)
    assert callable(_common_utils.clean_tensor_name) and callable(_composable.checkpoint)
    assert callable(_yaml_loader.load_yaml) and callable(LightningCLI._parse_ckpt_path)
    strategy = ModelParallelStrategy()
    assert strategy._data_parallel_size == "auto" and isinstance(strategy._save_distributed_checkpoint, bool)
    _compat.resolve_data_parallel_size(strategy)
    assert FSDPStrategy(state_dict_type="sharded")._state_dict_type == "sharded"
    assert _compat.clean_tensor_name("block._checkpoint_wrapped_module.w") == "block.w"
