"""Model configuration: one serializable dataclass tree, validated once.

``ModelConfig`` describes a decoder-only LM whose FFNs are dense SwiGLU blocks or MoE layers
(``MoEConfig``). Every field carries a docstring right below it: LightningCLI / jsonargparse turn
those into ``--help`` text. Validation lives in ``__post_init__`` and raises :class:`ConfigError`
naming the offending field and the allowed values; derived fields (``head_dim``, ``expert_sizes``,
``moe_layer_ids``...) are properties so that a YAML round-trip never carries stale copies.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from typing_extensions import Self

from moe_lit.configbase import (
    ConfigBase,
    ConfigError,
    load_yaml,
    refuse_unknown_keys,
    require,
    require_bool,
    require_choice,
    require_number,
    require_positive_int,
)

ScoreFunc = Literal["softmax", "sigmoid"]
Balancing = Literal["aux_loss", "bias", "none"]
Backend = Literal["auto", "torch", "megablocks"]
QKNorm = Literal["none", "head", "full"]

SCORE_FUNCS = ("softmax", "sigmoid")
BALANCING = ("aux_loss", "bias", "none")
BACKENDS = ("auto", "torch", "megablocks")
QK_NORMS = ("none", "head", "full")


@dataclass
class MoEConfig(ConfigBase):
    """Mixture-of-Experts FFN: router, routed experts, optional shared expert."""

    section: ClassVar[str] = "moe"

    num_experts: int = 8
    """Number of routed experts E per MoE layer."""
    expert_size: int | list[int] = 256
    """Hidden size F of each expert (granularity). One int for equal experts, or a list of E ints
    for heterogeneous experts inside one layer."""
    top_k: int = 2
    """Experts chosen per token (k <= num_experts)."""
    shared_expert_size: int = 0
    """Hidden size of an always-active shared SwiGLU expert; 0 disables it."""
    shared_expert_gate: bool = False
    """Scale the shared expert's output by sigmoid(x . g) with a learned (1, D) gate (Qwen2-MoE);
    needs shared_expert_size > 0."""
    expert_output_bias: bool = True
    """Learn MegaBlocks' (D,) bias on the routed experts' output. False keeps it a fixed zero that
    is neither trained nor saved: the layout the transformers MoE families have (see export)."""
    score_func: ScoreFunc = "softmax"
    """Router score function: softmax (MegaBlocks) | sigmoid (DeepSeek-V3)."""
    renormalize: bool = True
    """Renormalise the k selected weights to sum to 1 (MegaBlocks moe_normalize_expert_weights=1)."""
    unit_weights: bool = False
    """Every selected expert weighs exactly 1 in the forward (MoEfication / DOT-MoE gating); the
    gradient still reaches the router through a straight-through estimator ``1 + s - sg(s)`` of the
    selected scores s. A dense FFN partitioned into experts is then recovered exactly at k = E.
    Needs renormalize: false."""
    balancing: Balancing = "aux_loss"
    """Load balancing: aux_loss (MegaBlocks/Switch loss) | bias (aux-loss-free, DeepSeek-V3) | none."""
    aux_loss_coef: float = 0.01
    """Weight w of the load-balancing loss (used when balancing=aux_loss)."""
    bias_update_rate: float = 1e-3
    """Step size u of the aux-loss-free bias update b_e += u*sign(mean_load - load_e)."""
    z_loss_coef: float = 0.0
    """Weight of the router z-loss mean(logsumexp(logits)^2); 0 disables it."""
    capacity_factor: float | None = None
    """Token dropping: each expert takes at most ceil(cf*T*k/E) tokens; null = dropless."""
    first_dense_layers: int = 0
    """The first n layers keep a dense FFN (DeepSeek style)."""
    layer_interval: int = 1
    """After the first dense layers, every n-th layer is MoE (1 = all of them)."""
    backend: Backend = "auto"
    """Expert implementation: auto (MegaBlocks on CUDA when supported, else torch) | torch | megablocks."""
    layer_expert_sizes: list[list[int]] | None = None
    """Per MoE layer (model order), the hidden sizes of its experts, for models whose layers keep
    different experts (pruning under one global budget); null = every MoE layer has num_experts
    experts of expert_size. When set, num_experts and expert_size describe the widest layer."""

    def __post_init__(self) -> None:
        require_positive_int(self.num_experts, "moe.num_experts")
        if isinstance(self.expert_size, (list, tuple)):
            self.expert_size = list(self.expert_size)
            require(
                len(self.expert_size) == self.num_experts,
                "moe.expert_size",
                f"a list must have num_experts={self.num_experts} entries, got {len(self.expert_size)}",
            )
            for i, size in enumerate(self.expert_size):
                require_positive_int(size, f"moe.expert_size[{i}]")
        else:
            require_positive_int(self.expert_size, "moe.expert_size")
        require_positive_int(self.top_k, "moe.top_k")
        require(
            self.top_k <= self.num_experts,
            "moe.top_k",
            f"must be <= num_experts={self.num_experts}, got {self.top_k}",
        )
        require(
            isinstance(self.shared_expert_size, int) and self.shared_expert_size >= 0,
            "moe.shared_expert_size",
            f"must be an integer >= 0, got {self.shared_expert_size!r}",
        )
        require(
            not self.shared_expert_gate or self.shared_expert_size > 0,
            "moe.shared_expert_gate",
            "needs a shared expert (shared_expert_size > 0)",
        )
        require_choice(self.score_func, "moe.score_func", SCORE_FUNCS)
        require_bool(self.renormalize, "moe.renormalize")
        require(
            not (self.unit_weights and self.renormalize),
            "moe.unit_weights",
            "unit weights replace the renormalised weights; set renormalize: false with unit_weights: true",
        )
        require_choice(self.balancing, "moe.balancing", BALANCING)
        require_choice(self.backend, "moe.backend", BACKENDS)
        for name in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            require_number(getattr(self, name), f"moe.{name}", strictly_positive=False)
        cf = self.capacity_factor
        require(
            cf is None or (isinstance(cf, (int, float)) and not isinstance(cf, bool) and math.isfinite(cf) and cf > 0),
            "moe.capacity_factor",
            f"must be > 0 or null (dropless), got {cf!r}",
        )
        require(
            isinstance(self.first_dense_layers, int) and self.first_dense_layers >= 0,
            "moe.first_dense_layers",
            f"must be an integer >= 0, got {self.first_dense_layers!r}",
        )
        require_positive_int(self.layer_interval, "moe.layer_interval")
        if self.layer_expert_sizes is not None:
            self._validate_layer_expert_sizes()

    def _validate_layer_expert_sizes(self) -> None:
        layers: Any = self.layer_expert_sizes  # user data (YAML): its shape is what this checks
        require(
            isinstance(layers, (list, tuple)) and len(layers) > 0,
            "moe.layer_expert_sizes",
            f"must be a non-empty list of per-layer size lists or null, got {layers!r}",
        )
        for m, sizes in enumerate(layers):
            require(
                isinstance(sizes, (list, tuple)),
                f"moe.layer_expert_sizes[{m}]",
                f"must be a list of expert sizes, got {sizes!r}",
            )
        checked = [list(sizes) for sizes in layers]
        self.layer_expert_sizes = checked
        for m, sizes in enumerate(checked):
            require(
                len(sizes) >= self.top_k,
                f"moe.layer_expert_sizes[{m}]",
                f"has {len(sizes)} experts, fewer than top_k={self.top_k}",
            )
            for i, size in enumerate(sizes):
                require_positive_int(size, f"moe.layer_expert_sizes[{m}][{i}]")
        widest = max(len(sizes) for sizes in self.layer_expert_sizes)
        require(
            widest == self.num_experts,
            "moe.num_experts",
            f"must be the widest layer's count {widest} when layer_expert_sizes is set, got {self.num_experts}",
        )

    def layer(self, slot: int) -> MoEConfig:
        """The config of the ``slot``-th MoE layer: itself, or its entry of ``layer_expert_sizes``."""
        if self.layer_expert_sizes is None:
            return self
        sizes = self.layer_expert_sizes[slot]
        expert_size = sizes[0] if len(set(sizes)) == 1 else list(sizes)
        return dataclasses.replace(self, num_experts=len(sizes), expert_size=expert_size, layer_expert_sizes=None)

    @property
    def expert_sizes(self) -> tuple[int, ...]:
        """Hidden size of every expert, in expert order."""
        if isinstance(self.expert_size, list):
            return tuple(self.expert_size)
        return (self.expert_size,) * self.num_experts

    @property
    def uniform(self) -> bool:
        """True when all experts have the same size (MegaBlocks can run the layer)."""
        return len(set(self.expert_sizes)) == 1

    @property
    def total_expert_size(self) -> int:
        """Sum of the routed experts' hidden sizes: the rows of the stacked w1/v1/w2."""
        return sum(self.expert_sizes)

    def capacity(self, num_tokens: int) -> int | None:
        """Tokens each expert may take for a batch of ``num_tokens``; None when dropless."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)


@dataclass
class ModelConfig(ConfigBase):
    """Decoder-only LM: pre-norm RMSNorm blocks, RoPE, causal SDPA with GQA, SwiGLU or MoE FFN."""

    section: ClassVar[str] = "model"

    vocab_size: int = 8192
    """Vocabulary size (taken from the tokenizer by the CLI)."""
    d_model: int = 256
    """Residual stream width D."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Attention query heads; d_model must be divisible by it."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; null = n_heads (multi-head attention)."""
    attn_head_dim: int | None = None
    """Width Dh of one attention head; null = d_model / n_heads. Set it to decouple the two
    (Qwen3-MoE: n_heads * Dh may differ from d_model)."""
    qk_norm: QKNorm = "none"
    """RMSNorm on queries and keys before RoPE: none | head (one (Dh,) weight shared by the heads,
    Qwen3-MoE) | full (over all heads at once, (H*Dh,) and (G*Dh,), OLMoE)."""
    qkv_bias: bool = False
    """Biases on the q/k/v projections (Qwen2-MoE); the output projection never has one."""
    seq_len: int = 256
    """Maximum sequence length (RoPE table size)."""
    rope_base: float = 10000.0
    """RoPE frequency base theta."""
    d_ff: int = 1024
    """Hidden size of the dense SwiGLU FFN (dense model, and dense layers of an MoE model)."""
    moe: MoEConfig | None = None
    """MoE settings; null = a dense model."""
    tie_embeddings: bool = False
    """Share the input embedding and the output head weights."""
    init_std: float = 0.02
    """Std of the normal init; output projections use init_std / sqrt(2 * n_layers)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    loss_chunk_tokens: int = 256
    """Tokens per chunk of the fused output head + cross-entropy in training/validation (the
    (tokens, vocab) logits are never materialised); 0 = plain head then F.cross_entropy."""

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):
            self.moe = MoEConfig.from_dict(self.moe, "moe")
        require(
            self.moe is None or isinstance(self.moe, MoEConfig),
            "model.moe",
            f"must be a mapping of MoE fields or null (dense), got {self.moe!r}",
        )
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "seq_len", "d_ff"):
            require_positive_int(getattr(self, name), f"model.{name}")
        if self.attn_head_dim is None:
            require(
                self.d_model % self.n_heads == 0,
                "model.n_heads",
                f"d_model={self.d_model} must be divisible by n_heads={self.n_heads} (or set attn_head_dim)",
            )
        else:
            require_positive_int(self.attn_head_dim, "model.attn_head_dim")
        require_choice(self.qk_norm, "model.qk_norm", QK_NORMS)
        if self.n_kv_heads is not None:
            require_positive_int(self.n_kv_heads, "model.n_kv_heads")
            require(
                self.n_heads % self.n_kv_heads == 0,
                "model.n_kv_heads",
                f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}",
            )
        source = (
            "attn_head_dim" if self.attn_head_dim is not None else f"d_model={self.d_model} / n_heads={self.n_heads}"
        )
        require(self.head_dim % 2 == 0, "model.n_heads", f"head_dim={self.head_dim} ({source}) must be even for RoPE")
        for name in ("rope_base", "init_std", "norm_eps"):
            require_number(getattr(self, name), f"model.{name}", strictly_positive=True)
        require_bool(self.tie_embeddings, "model.tie_embeddings")
        require(
            isinstance(self.loss_chunk_tokens, int) and self.loss_chunk_tokens >= 0,
            "model.loss_chunk_tokens",
            f"must be an int >= 0 (0 = no chunking), got {self.loss_chunk_tokens!r}",
        )
        if self.moe is not None:
            require(
                self.moe.first_dense_layers < self.n_layers,
                "moe.first_dense_layers",
                f"must be < n_layers={self.n_layers} (otherwise no layer is MoE; set moe: null)",
            )
            if self.moe.layer_expert_sizes is not None:
                require(
                    len(self.moe.layer_expert_sizes) == len(self.moe_layer_ids),
                    "moe.layer_expert_sizes",
                    f"needs one list per MoE layer ({len(self.moe_layer_ids)}), got {len(self.moe.layer_expert_sizes)}",
                )

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """Indices of the blocks whose FFN is an MoE layer."""
        if self.moe is None:
            return ()
        first, every = self.moe.first_dense_layers, self.moe.layer_interval
        return tuple(i for i in range(first, self.n_layers) if (i - first) % every == 0)

    def moe_section(self) -> MoEConfig:
        """The ``moe`` section, for code that needs an MoE model (a dense config is an error naming it)."""
        if self.moe is None:
            raise ConfigError("moe: this needs an MoE model, the config is dense (moe: null)")
        return self.moe

    def moe_layer_config(self, layer_id: int) -> MoEConfig:
        """The MoE config of block ``layer_id`` (per-layer expert sizes applied)."""
        return self.moe_section().layer(self.moe_layer_ids.index(layer_id))

    @classmethod
    def from_yaml(cls, source: str | Path, name: str = "") -> Self:
        """From a YAML file (a Path) or text (a str): the model's fields, or a ``model:`` mapping
        among other sections (a ``configs/model/*.yaml`` file, which also holds ``optim:``)."""
        data = load_yaml(source, name or cls.section)
        return cls.from_dict(data["model"] if isinstance(data.get("model"), dict) else data, name)

    def in_context(self, context: Mapping[str, Any]) -> Self:
        """A model config of a study spec takes the run's ``seq_len`` (moe_lit.studies.spec.parser)."""
        return self.replace(seq_len=context["seq_len"]) if "seq_len" in context else self


# NOTE: ConfigError and refuse_unknown_keys live in moe_lit.configbase (the bottom layer); they stay
# importable from here, next to the model config most code already imports.
__all__ = ["ConfigError", "MoEConfig", "ModelConfig", "refuse_unknown_keys"]
