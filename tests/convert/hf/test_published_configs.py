"""The configs of two released MoEs (copied from their config.json): they map, and the accounting of
their directories is exact against the transformers model (built on meta: no memory, no weights)."""

import json

import pytest

from moe_lit.accounting import count_config_params
from moe_lit.console_script import main
from moe_lit.convert.hf import config_from_hf

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

PUBLISHED = {
    "OLMoE-1B-7B-0924": dict(
        model_type="olmoe",
        vocab_size=50304,
        hidden_size=2048,
        intermediate_size=1024,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        num_experts=64,
        num_experts_per_tok=8,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        norm_topk_prob=False,
        clip_qkv=None,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    ),
    "Qwen3-30B-A3B": dict(
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        use_sliding_window=False,
    ),
}
EXPECTED = {  # (total, active) parameters, and what the import turns on
    "OLMoE-1B-7B-0924": (6_919_161_856, 1_282_017_280, dict(qk_norm="full", attn_head_dim=None), False),
    "Qwen3-30B-A3B": (30_532_122_624, 3_353_032_704, dict(qk_norm="head", attn_head_dim=128), True),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_config_maps_and_counts_exactly(name, tmp_path, capsys):
    fields = dict(PUBLISHED[name])
    hf_config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    cfg = config_from_hf(hf_config)
    total, active, options, renormalize = EXPECTED[name]
    assert {key: getattr(cfg, key) for key in options} == options and cfg.moe.renormalize == renormalize
    with accelerate.init_empty_weights():
        hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    counts = count_config_params(cfg)
    assert counts.total == sum(p.numel() for p in hf.parameters()) == total and counts.active == active
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text(json.dumps(PUBLISHED[name]))
    assert main(["accounting", "--config", str(tmp_path / name)]) == 0
    assert f"{total:,}" in capsys.readouterr().out
