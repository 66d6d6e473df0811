"""The committed tiny model configs: the MoE one is the accounting builder's active-matched MoE."""

from pathlib import Path

import yaml

from moe_lit.accounting import count_config_params, matched_moe_config
from moe_lit.config import ModelConfig
from moe_lit.lit.optim import OptimConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_tiny_moe_is_the_active_matched_tiny_dense():
    dense = ModelConfig.from_yaml(CONFIGS / "model/tiny-dense.yaml")
    moe = ModelConfig.from_yaml(CONFIGS / "model/tiny-moe.yaml")
    assert not dense.is_moe
    assert moe == matched_moe_config(dense, num_experts=8, top_k=2, match="active", expert_output_bias=False)
    dense_counts, moe_counts = count_config_params(dense), count_config_params(moe)
    assert abs(moe_counts.active - dense_counts.active) / dense_counts.active < 1e-3
    assert moe_counts.total > 1.5 * dense_counts.total


def test_both_tiny_models_share_the_optimizer_settings():
    docs = [yaml.safe_load((CONFIGS / f"model/tiny-{name}.yaml").read_text()) for name in ("dense", "moe")]
    assert docs[0]["optim"] == docs[1]["optim"]
    OptimConfig(**docs[0]["optim"])
