"""Qwen3-MoE (``Qwen3MoeForCausalLM``, e.g. Qwen3-30B-A3B): per-head q/k RMSNorm, decoupled head dim.

``self_attn.q_norm`` / ``k_norm (Dh,)`` -> ``attn.q_norm`` / ``k_norm`` with ``qk_norm: head``;
``head_dim`` -> ``attn_head_dim`` when ``n_heads * head_dim != hidden_size``; ``norm_topk_prob``
<-> ``moe.renormalize``; dense layers as for Qwen2-MoE. Attention biases and sliding windows are refused.
"""

from __future__ import annotations

from typing import Any

from moe_lit.config import ModelConfig
from moe_lit.convert.hf.core import Family, base_fields, check_fields
from moe_lit.convert.hf.qwen2_moe import qwen_moe_fields, to_qwen_moe


def qwen3_moe_config(hf_config: Any, seq_len: int | None = None) -> ModelConfig:
    check_fields(hf_config, {"attention_bias": False})
    return ModelConfig(**base_fields(hf_config, seq_len), **qwen_moe_fields(hf_config, 0), qk_norm="head")


def to_qwen3_moe(cfg: ModelConfig) -> dict[str, Any]:
    return dict(**to_qwen_moe(cfg), head_dim=cfg.head_dim, attention_bias=False)


FAMILY = Family(
    name="qwen3_moe",
    config_class="Qwen3MoeConfig",
    features=frozenset({"moe", "renormalize", "no_renormalize", "dense_layers_in_moe", "qk_norm_head", "head_dim"}),
    required=frozenset({"moe", "qk_norm_head"}),
    to_ours=qwen3_moe_config,
    to_hf=to_qwen3_moe,
)
