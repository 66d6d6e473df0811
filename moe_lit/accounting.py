"""Analytic parameter and FLOP accounting, and the matched-config builder.

All counts come from the config alone and are tested to equal the built model's. Conventions:

* ``embedding`` = input embedding + output head (the head only when it is not tied).
* ``active`` = parameters touched by one token. A routed expert set contributes ``k/E`` of its
  parameters: exact for equal experts, the expectation under uniform routing for heterogeneous
  ones (rounded to an integer). Router, expert output bias, shared expert (and its gate),
  attention (q/k/v biases, q/k norms) and norms are always active.
* forward FLOPs per token = 2 x (active matmul parameters, head included, embedding lookup
  excluded) + attention scores and values ``4 * n_layers * seq_len * n_heads * head_dim``
  (full context, as in the PaLM/Chinchilla convention); training is about 3x that.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from moe_lit.config import ConfigError, ModelConfig, MoEConfig

if TYPE_CHECKING:
    from moe_lit.model.transformer import Transformer


@dataclass(frozen=True)
class ParamCounts:
    total: int
    active: int
    embedding: int

    @property
    def total_non_embedding(self) -> int:
        return self.total - self.embedding

    @property
    def active_non_embedding(self) -> int:
        return self.active - self.embedding


def _attention_params(cfg: ModelConfig) -> int:
    q_and_o = 2 * cfg.d_model * cfg.n_heads * cfg.head_dim
    k_and_v = 2 * cfg.d_model * cfg.kv_heads * cfg.head_dim
    return q_and_o + k_and_v + _attention_vector_params(cfg)


def _attention_vector_params(cfg: ModelConfig) -> int:
    """q/k/v biases and q/k norm weights of one attention layer (no matmul FLOPs)."""
    qkv_bias = (cfg.n_heads + 2 * cfg.kv_heads) * cfg.head_dim if cfg.qkv_bias else 0
    qk_norm = {"none": 0, "head": 2 * cfg.head_dim, "full": (cfg.n_heads + cfg.kv_heads) * cfg.head_dim}
    return qkv_bias + qk_norm[cfg.qk_norm]


def _moe_params(d_model: int, moe: MoEConfig) -> tuple[int, int]:
    """(total, active) parameters of one MoE layer."""
    shared = 3 * d_model * moe.shared_expert_size + (d_model if moe.shared_expert_gate else 0)
    always = moe.num_experts * d_model + _expert_bias_params(d_model, moe) + shared
    experts = 3 * d_model * moe.total_expert_size
    return always + experts, always + _active_share(experts, moe.top_k, moe.num_experts)


def _expert_bias_params(d_model: int, moe: MoEConfig) -> int:
    return d_model if moe.expert_output_bias else 0


def _active_share(expert_params: int, top_k: int, num_experts: int) -> int:
    return round(expert_params * top_k / num_experts)


def count_config_params(cfg: ModelConfig) -> ParamCounts:
    """Total / active / embedding parameters of the model a config builds."""
    embedding = cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2)
    total = active = embedding + cfg.d_model  # final norm
    for layer in range(cfg.n_layers):
        shared = _attention_params(cfg) + 2 * cfg.d_model
        if layer in cfg.moe_layer_ids:
            ffn_total, ffn_active = _moe_params(cfg.d_model, cfg.moe_layer_config(layer))
        else:
            ffn_total = ffn_active = 3 * cfg.d_model * cfg.d_ff
        total += shared + ffn_total
        active += shared + ffn_active
    return ParamCounts(total=total, active=active, embedding=embedding)


def count_model_params(model: Transformer) -> ParamCounts:
    """The same counts measured on a built :class:`~moe_lit.model.Transformer`."""
    from moe_lit.model.moe import MoELayer

    total = sum(p.numel() for p in model.parameters())
    inactive = 0
    for module in model.modules():
        if isinstance(module, MoELayer):
            experts = sum(p.numel() for p in module.experts.mlp.parameters())
            inactive += experts - _active_share(experts, module.cfg.top_k, module.cfg.num_experts)
    embedding = model.tok_embeddings.weight.numel()
    if model.lm_head.weight is not model.tok_embeddings.weight:
        embedding += model.lm_head.weight.numel()
    return ParamCounts(total=total, active=total - inactive, embedding=embedding)


def forward_flops_per_token(cfg: ModelConfig) -> int:
    """Forward FLOPs per token (see the module docstring for the convention)."""
    counts = count_config_params(cfg)
    norms = cfg.d_model * (2 * cfg.n_layers + 1)
    expert_biases = _expert_bias_params(cfg.d_model, cfg.moe) * len(cfg.moe_layer_ids) if cfg.moe else 0
    vectors = norms + expert_biases + cfg.n_layers * _attention_vector_params(cfg)
    matmul_params = counts.active - cfg.vocab_size * cfg.d_model - vectors
    if cfg.tie_embeddings:
        matmul_params += cfg.vocab_size * cfg.d_model  # the tied head is still a matmul
    attention = 4 * cfg.n_layers * cfg.seq_len * cfg.n_heads * cfg.head_dim
    return 2 * matmul_params + attention


def training_flops_per_token(cfg: ModelConfig) -> int:
    """Forward + backward FLOPs per token (3x forward)."""
    return 3 * forward_flops_per_token(cfg)


# ----------------------------------------------------------------------------- matched configs
MatchMode = Literal["active", "total"]


def matched_moe_config(
    dense: ModelConfig,
    num_experts: int,
    top_k: int,
    match: MatchMode = "active",
    shared_fraction: float = 0.0,
    size_profile: Sequence[float] | None = None,
    **moe_fields,
) -> ModelConfig:
    """An MoE config matched to a dense one on active (or total) parameters.

    Every FFN of ``dense`` becomes an MoE layer with ``num_experts`` experts and ``top_k`` routed
    per token. A fraction ``shared_fraction`` of the dense d_ff becomes an always-on shared expert.
    Expert sizes are solved so that the MoE layer's active (``match='active'``) or total
    (``match='total'``) parameters equal the dense FFN's, router and expert bias included; with
    ``match='active'`` the granularity is ``top_k`` (expert size ~ d_ff / top_k).
    ``size_profile`` (E relative sizes) makes heterogeneous experts with the same mean size.
    Other ``MoEConfig`` fields pass through ``moe_fields``.
    """
    if match not in ("active", "total"):
        raise ConfigError(f"match: got {match!r}, allowed values: active, total")
    if not 0.0 <= shared_fraction < 1.0:
        raise ConfigError(f"shared_fraction: must be in [0, 1), got {shared_fraction}")
    d, shared = dense.d_model, round(shared_fraction * dense.d_ff)
    bias = d if moe_fields.get("expert_output_bias", True) else 0
    budget = 3 * d * dense.d_ff - num_experts * d - bias - 3 * d * shared
    divisor = 3 * d * (top_k if match == "active" else num_experts)
    mean_size = budget / divisor
    if mean_size < 1:
        raise ConfigError(
            f"moe.expert_size: matching {match} parameters of d_ff={dense.d_ff} with num_experts={num_experts}, "
            f"top_k={top_k} leaves an expert size of {mean_size:.2f} < 1; use fewer experts or a larger d_ff"
        )
    expert_size = _expert_sizes(mean_size, num_experts, size_profile)
    moe = MoEConfig(
        num_experts=num_experts, expert_size=expert_size, top_k=top_k, shared_expert_size=shared, **moe_fields
    )
    return dense.replace(moe=moe)


def _expert_sizes(mean_size: float, num_experts: int, profile: Sequence[float] | None):
    if profile is None:
        return max(1, round(mean_size))
    if len(profile) != num_experts or min(profile) <= 0:
        raise ConfigError(f"size_profile: needs {num_experts} positive relative sizes, got {list(profile)}")
    scale = mean_size * num_experts / sum(profile)
    return [max(1, round(p * scale)) for p in profile]


def accounting_rows(configs: dict[str, ModelConfig]) -> list[dict[str, object]]:
    rows = []
    for name, cfg in configs.items():
        counts = count_config_params(cfg)
        moe = cfg.moe
        rows.append(
            {
                "name": name,
                "experts": moe.num_experts if moe else 0,
                "top_k": moe.top_k if moe else 0,
                "expert_size": (moe.expert_size if moe else cfg.d_ff),
                "total": counts.total,
                "active": counts.active,
                "total_non_emb": counts.total_non_embedding,
                "active_non_emb": counts.active_non_embedding,
                "total/active": round(counts.total / counts.active, 3),
                "fwd_flops/token": forward_flops_per_token(cfg),
            }
        )
    return rows


def markdown_table(rows: list[dict[str, object]]) -> str:
    """A markdown table from rows of equal keys."""
    if not rows:
        return ""
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(row[k]) for k in header) + " |" for row in rows]
    return "\n".join(lines)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if not math.isnan(value) else "nan"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10_000:
        return f"{value:,}"
    return str(value)
