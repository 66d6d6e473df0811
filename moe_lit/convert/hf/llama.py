"""Llama (``LlamaForCausalLM``): dense models, e.g. SmolLM2, TinyLlama, Llama-2/3 without rope scaling.

Mapping: ``embed_tokens`` -> ``tok_embeddings``; per layer ``input_layernorm`` -> ``attn_norm``,
``self_attn.{q,k,v,o}_proj`` -> ``attn.{q,k,v,o}_proj``, ``post_attention_layernorm`` ->
``ffn_norm``, ``mlp.gate_proj`` -> ``ffn.w1`` (activated), ``mlp.up_proj`` -> ``ffn.v1``,
``mlp.down_proj`` -> ``ffn.w2``; ``norm`` -> ``norm``; ``lm_head`` -> ``lm_head`` (or tied). RoPE
needs no permutation: HF Llama rotates the two halves of each head (``rotate_half``) exactly as
``moe_lit.model.attention.apply_rope`` does, with the same inverse frequencies ``theta^(-2i/Dh)``.
Llama's ``attention_bias`` also biases ``o_proj`` (ours never does), so it is refused.
"""

from __future__ import annotations

from typing import Any

from moe_lit.config import ModelConfig
from moe_lit.convert.hf.core import Family, base_fields, check_fields, hf_base_kwargs
from moe_lit.errors import MoeLitError


def llama_config(hf_config: Any, seq_len: int | None = None) -> ModelConfig:
    """The ModelConfig of a ``transformers.LlamaConfig`` (``seq_len`` defaults to max_position_embeddings)."""
    if getattr(hf_config, "model_type", None) != "llama":
        raise MoeLitError(f"hf: model_type={getattr(hf_config, 'model_type', None)!r}; allowed: llama")
    check_fields(hf_config, {"attention_bias": False, "mlp_bias": False})
    return ModelConfig(**base_fields(hf_config, seq_len), d_ff=hf_config.intermediate_size, moe=None)


def to_llama(cfg: ModelConfig) -> dict[str, Any]:
    return dict(**hf_base_kwargs(cfg), head_dim=cfg.head_dim, intermediate_size=cfg.d_ff, attention_bias=False)


FAMILY = Family(
    name="llama",
    config_class="LlamaConfig",
    features=frozenset({"dense", "head_dim"}),
    required=frozenset({"dense"}),
    to_ours=llama_config,
    to_hf=to_llama,
)
