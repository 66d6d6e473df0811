import os

import pytest
import torch

from moe_lit.config import ModelConfig, MoEConfig

torch.set_num_threads(min(2, os.cpu_count() or 1))


def tiny(**moe_fields) -> ModelConfig:
    """A tiny model config; MoE when moe fields are given (``dense=True`` for a dense model)."""
    dense = moe_fields.pop("dense", False)
    model_fields = {k: moe_fields.pop(k) for k in list(moe_fields) if k in ModelConfig.__dataclass_fields__}
    base = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, seq_len=16, d_ff=64)
    base.update(model_fields)
    if dense:
        return ModelConfig(**base)
    moe = dict(num_experts=4, expert_size=16, top_k=2)
    moe.update(moe_fields)
    return ModelConfig(moe=MoEConfig(**moe), **base)


@pytest.fixture
def tiny_cfg():
    return tiny


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        # NOTE: the marker, not the keywords: keywords include directory names such as tests/gpu/.
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
