"""``build_experts`` / ``resolve_backend``: which backend runs, and the errors and logs that say why."""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

import moe_lit.model.experts.megablocks_backend as megablocks_backend
from moe_lit.config import ConfigError
from moe_lit.errors import MoeLitError
from moe_lit.model import Transformer
from moe_lit.model.experts import resolve_backend
from moe_lit.model.experts.megablocks_backend import import_megablocks, unsupported_reason
from tests.helpers.models import tiny

NO_MEGABLOCKS = pytest.mark.skipif(importlib.util.find_spec("megablocks") is not None, reason="megablocks is installed")


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine")


@CPU_ONLY
def test_auto_on_cpu_is_torch_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_backend(tiny().moe) == "torch"
        Transformer(tiny())


@CPU_ONLY
def test_forced_megablocks_without_cuda_names_the_field_and_the_reason():
    with pytest.raises(ConfigError, match=r"moe.backend: 'megablocks' cannot run here: no CUDA device"):
        Transformer(tiny(backend="megablocks"))


@pytest.mark.parametrize(
    "fields,reason",
    [({"expert_size": [8, 16, 16, 24]}, "heterogeneous expert sizes"), ({"capacity_factor": 1.0}, "capacity_factor")],
)
def test_unsupported_configs(fields, reason, fake_cuda):
    cfg = tiny(**fields).moe
    assert reason in unsupported_reason(cfg)
    with pytest.raises(ConfigError, match=f"moe.backend: 'megablocks' cannot run here: {reason}"):
        resolve_backend(tiny(backend="megablocks", **fields).moe)
    with pytest.warns(UserWarning, match=f"moe.backend=auto: using the torch backend: {reason}"):
        assert resolve_backend(cfg) == "torch"


@pytest.mark.parametrize("fields", [{}, {"score_func": "sigmoid", "balancing": "bias"}, {"shared_expert_size": 8}])
def test_supported_configs_pick_megablocks_when_it_is_there(fields, monkeypatch, fake_cuda):
    # NOTE: routing stays in our router, so sigmoid scores, bias balancing and a shared expert
    # all run on MegaBlocks' expert kernels.
    assert unsupported_reason(tiny(**fields).moe) is None
    monkeypatch.setattr(megablocks_backend, "unavailable_reason", lambda: None)
    assert resolve_backend(tiny(**fields).moe) == "megablocks"
    assert resolve_backend(tiny(backend="torch", **fields).moe) == "torch"


@NO_MEGABLOCKS
def test_cuda_without_megablocks_falls_back_with_the_install_hint(fake_cuda):
    with pytest.warns(UserWarning, match="megablocks does not import.*gpu extra"):
        assert resolve_backend(tiny().moe) == "torch"
    with pytest.raises(ConfigError, match="moe.backend: 'megablocks' cannot run here: megablocks does not import"):
        resolve_backend(tiny(backend="megablocks").moe)


@NO_MEGABLOCKS
def test_lazy_import_error_is_a_user_error():
    with pytest.raises(MoeLitError, match=r"^moe.backend: megablocks does not import .*gpu extra"):
        import_megablocks()
