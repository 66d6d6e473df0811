"""The realistic model presets in configs/model/: their analytic counts match the published models'.

Nothing is allocated: counts are analytic (moe_lit.accounting) and the one build is on the meta device.
"""

from pathlib import Path

import pytest
import torch

from moe_lit.accounting import count_config_params, count_model_params
from moe_lit.config import ModelConfig
from moe_lit.model import Transformer

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "model"

PUBLISHED = {
    # name: (published vocab_size, total params, active params), from
    # OLMoE-1B-7B: Muennighoff et al. 2024 (arXiv:2409.02060) and the allenai/OLMoE-1B-7B-0924 card:
    #   "1B active and 7B total" (6.92B total, 1.28B active).
    "olmoe-1b-7b": (50304, 6.92e9, 1.28e9),
    # Qwen3-30B-A3B: the Qwen/Qwen3-30B-A3B model card, "30.5B in total and 3.3B activated".
    "qwen3-moe-30b-a3b": (151936, 30.5e9, 3.3e9),
    # DeepSeekMoE-16B: Dai et al. 2024 (arXiv:2401.06066), "16.4B total parameters", "2.8B activated".
    "deepseek-moe-16b": (102400, 16.4e9, 2.8e9),
}


def preset(name: str) -> ModelConfig:
    vocab_size = PUBLISHED[name][0]
    return ModelConfig.from_yaml(CONFIGS / f"{name}.yaml").replace(vocab_size=vocab_size, seq_len=4096)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_counts_are_within_5_percent_of_the_published_model(name):
    _, total, active = PUBLISHED[name]
    counts = count_config_params(preset(name))
    assert abs(counts.total - total) / total < 0.05, counts
    assert abs(counts.active - active) / active < 0.05, counts


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_builds_into_the_counted_model_on_the_meta_device(name):
    cfg = preset(name)
    with torch.device("meta"):
        model = Transformer(cfg)
    assert count_model_params(model) == count_config_params(cfg)


def test_deepseek_preset_keeps_its_first_layer_dense_and_a_shared_expert():
    cfg = preset("deepseek-moe-16b")
    assert cfg.moe_layer_ids == tuple(range(1, 28)) and cfg.moe.shared_expert_size == 2 * cfg.moe.expert_size
