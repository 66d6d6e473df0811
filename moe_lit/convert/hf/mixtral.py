"""Mixtral (``MixtralForCausalLM``): every layer sparse, softmax top-k always renormalised.

Router ``mlp.gate`` -> ``ffn.router.layer``; fused experts ``mlp.experts.gate_up_proj`` /
``down_proj`` <-> our stacked ``ffn.experts.mlp.w1|v1|w2`` (see ``core``). A sliding window is
refused (our attention is full causal); the router's jitter noise only acts in training and is
not carried.
"""

from __future__ import annotations

from typing import Any

from moe_lit.config import ModelConfig
from moe_lit.convert.hf.core import Family, base_fields, hf_base_kwargs, hf_expert_size, moe_fields, refuse


def mixtral_config(hf_config: Any, seq_len: int | None = None) -> ModelConfig:
    if getattr(hf_config, "sliding_window", None) is not None:
        raise refuse("sliding_window", hf_config.sliding_window, None)
    moe = moe_fields(
        hf_config.num_local_experts,
        hf_config.intermediate_size,
        hf_config.num_experts_per_tok,
        renormalize=True,
        aux_loss_coef=hf_config.router_aux_loss_coef,
    )
    return ModelConfig(**base_fields(hf_config, seq_len), d_ff=hf_config.intermediate_size, moe=moe)


def to_mixtral(cfg: ModelConfig) -> dict[str, Any]:
    moe = cfg.moe_section()
    return dict(
        **hf_base_kwargs(cfg),
        head_dim=cfg.head_dim,
        intermediate_size=hf_expert_size(moe.expert_sizes[0]),
        num_local_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        sliding_window=None,
        router_aux_loss_coef=moe.aux_loss_coef,
    )


FAMILY = Family(
    name="mixtral",
    config_class="MixtralConfig",
    features=frozenset({"moe", "renormalize", "head_dim"}),
    required=frozenset({"moe"}),
    to_ours=mixtral_config,
    to_hf=to_mixtral,
)
