"""Qwen2-MoE (``Qwen2MoeForCausalLM``, Qwen1.5-MoE): q/k/v biases, sigmoid-gated shared expert.

``self_attn.{q,k,v}_proj.bias`` <-> ``attn.*.bias`` (``qkv_bias``); ``mlp.shared_expert.{gate,up,down}_proj``
-> ``ffn.shared_expert.w1|v1|w2`` and ``mlp.shared_expert_gate (1, D)`` -> ``ffn.shared_expert_gate``
(``moe.shared_expert_gate: true``); an ungated shared expert (DeepSeekMoE's) is written with a
zero gate and twice its down projection (exact, see ``core.ours_to_hf_state``) and comes back
gated; a model without a shared expert is written with ``shared_expert_intermediate_size=0``
(empty tensors, output 0). Dense layers
(``mlp_only_layers``, ``decoder_sparse_step``) map to ``first_dense_layers`` / ``layer_interval``
where they have that pattern, and are written as ``mlp_only_layers``. Sliding windows are refused.
"""

from __future__ import annotations

from typing import Any

from moe_lit.config import ModelConfig
from moe_lit.convert.hf.core import (
    Family,
    base_fields,
    hf_base_kwargs,
    hf_expert_size,
    moe_fields,
    moe_layer_pattern,
    refuse,
)


def qwen_moe_layers(hf_config: Any) -> list[int]:
    """The sparse layers of a Qwen2/Qwen3-MoE config (as their decoder layers decide)."""
    step, dense = hf_config.decoder_sparse_step, set(hf_config.mlp_only_layers or ())
    return [i for i in range(hf_config.num_hidden_layers) if i not in dense and (i + 1) % step == 0]


def qwen_moe_fields(hf_config: Any, shared_expert_size: int) -> dict[str, Any]:
    """``moe`` (with its layer pattern) and ``d_ff`` of a Qwen2/Qwen3-MoE config."""
    if getattr(hf_config, "use_sliding_window", False):
        raise refuse("use_sliding_window", True, False)
    moe = moe_fields(
        hf_config.num_experts,
        hf_config.moe_intermediate_size,
        hf_config.num_experts_per_tok,
        renormalize=bool(hf_config.norm_topk_prob),
        aux_loss_coef=hf_config.router_aux_loss_coef,
    )
    pattern: dict[str, Any] = moe_layer_pattern(qwen_moe_layers(hf_config), hf_config.num_hidden_layers)
    moe = moe.__class__(
        **{
            **moe.__dict__,
            **pattern,
            "shared_expert_size": shared_expert_size,
            "shared_expert_gate": shared_expert_size > 0,
        }
    )
    return {"moe": moe, "d_ff": hf_config.intermediate_size}


def to_qwen_moe(cfg: ModelConfig) -> dict[str, Any]:
    """The Qwen2/Qwen3-MoE arguments of ``cfg``'s MoE (dense layers listed in ``mlp_only_layers``)."""
    moe = cfg.moe_section()
    return dict(
        **hf_base_kwargs(cfg),
        intermediate_size=cfg.d_ff,
        moe_intermediate_size=hf_expert_size(moe.expert_sizes[0]),
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        norm_topk_prob=moe.renormalize,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(cfg.n_layers) if i not in cfg.moe_layer_ids],
        use_sliding_window=False,
        router_aux_loss_coef=moe.aux_loss_coef,
    )


def qwen2_moe_config(hf_config: Any, seq_len: int | None = None) -> ModelConfig:
    if "sliding_attention" in (getattr(hf_config, "layer_types", None) or ()):
        raise refuse("layer_types", "sliding_attention", "full_attention")
    fields = base_fields(hf_config, seq_len)
    qwen = qwen_moe_fields(hf_config, hf_config.shared_expert_intermediate_size)
    return ModelConfig(**fields, **qwen, qkv_bias=bool(hf_config.qkv_bias))


def to_qwen2_moe(cfg: ModelConfig) -> dict[str, Any]:
    return dict(
        **to_qwen_moe(cfg), qkv_bias=cfg.qkv_bias, shared_expert_intermediate_size=cfg.moe_section().shared_expert_size
    )


FAMILY = Family(
    name="qwen2_moe",
    config_class="Qwen2MoeConfig",
    features=frozenset(
        {
            "moe",
            "renormalize",
            "no_renormalize",
            "dense_layers_in_moe",
            "qkv_bias",
            "gated_shared_expert",
            "shared_expert",
        }
    ),
    required=frozenset({"moe"}),
    to_ours=qwen2_moe_config,
    to_hf=to_qwen2_moe,
)
