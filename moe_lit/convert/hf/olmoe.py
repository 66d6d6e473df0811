"""OLMoE (``OlmoeForCausalLM``): every layer sparse, full-width q/k RMSNorm, optional renormalisation.

``self_attn.q_norm (H*Dh,)`` / ``k_norm (G*Dh,)`` -> ``attn.q_norm`` / ``k_norm`` with
``qk_norm: full``; ``norm_topk_prob`` <-> ``moe.renormalize`` (OLMoE-1B-7B: false). ``clip_qkv``
and attention biases are refused.
"""

from __future__ import annotations

from typing import Any

from moe_lit.config import ModelConfig
from moe_lit.convert.hf.core import Family, base_fields, check_fields, hf_base_kwargs, hf_expert_size, moe_fields
from moe_lit.errors import MoeLitError


def olmoe_config(hf_config: Any, seq_len: int | None = None) -> ModelConfig:
    check_fields(hf_config, {"clip_qkv": None, "attention_bias": False})
    moe = moe_fields(
        hf_config.num_experts,
        hf_config.intermediate_size,
        hf_config.num_experts_per_tok,
        renormalize=bool(hf_config.norm_topk_prob),
        aux_loss_coef=hf_config.router_aux_loss_coef,
    )
    fields = base_fields(hf_config, seq_len)
    if fields["attn_head_dim"] is not None:  # pragma: no cover - OlmoeConfig has no head_dim
        raise MoeLitError(f"hf: head_dim={fields['attn_head_dim']} is not supported by olmoe")
    return ModelConfig(**fields, d_ff=hf_config.intermediate_size, qk_norm="full", moe=moe)


def to_olmoe(cfg: ModelConfig) -> dict[str, Any]:
    moe = cfg.moe_section()
    return dict(
        **hf_base_kwargs(cfg),
        intermediate_size=hf_expert_size(moe.expert_sizes[0]),
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        norm_topk_prob=moe.renormalize,
        clip_qkv=None,
        attention_bias=False,
        router_aux_loss_coef=moe.aux_loss_coef,
    )


FAMILY = Family(
    name="olmoe",
    config_class="OlmoeConfig",
    features=frozenset({"moe", "renormalize", "no_renormalize", "qk_norm_full"}),
    required=frozenset({"moe", "qk_norm_full"}),
    to_ours=olmoe_config,
    to_hf=to_olmoe,
)
