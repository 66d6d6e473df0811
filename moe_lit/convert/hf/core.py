"""The shared core of the transformers interop: families, features, the one weight mapping, loading.

Shape legend: E experts, F one expert's hidden size, P that size padded for transformers (:func:`hf_expert_size`),
D d_model (see ``model/experts/layout.py``).

Every supported family loads, in transformers 5, into the same module tree: Llama attention
(``self_attn.{q,k,v,o}_proj``, optional ``q_norm``/``k_norm`` and q/k/v biases), a dense
``mlp.{gate,up,down}_proj`` or a sparse block with a router ``mlp.gate.weight (E, D)`` and fused
experts ``mlp.experts.gate_up_proj (E, 2F, D)`` (gate rows first) and ``mlp.experts.down_proj
(E, D, F)``, plus Qwen2-MoE's ``mlp.shared_expert.*`` and ``mlp.shared_expert_gate (1, D)``. So the
weight mapping is one function each way (:func:`hf_state_to_ours`, :func:`ours_to_hf_state`); a
family module only maps the config. ``save_pretrained`` writes the hub's per-expert names
(``experts.0.gate_proj.weight`` ...) from that tree, so the files are the ones other tools read.

Features: :data:`FEATURES` names every model feature whose presence decides whether a family can
hold a model. A family lists the ones it can express and the ones it cannot do without; export
refuses a model that uses a feature its target lacks, naming the feature and the formats that have it.

Shapes for transformers' fast path: its default experts implementation (``grouped_mm``,
``torch._grouped_mm``) needs every stride a multiple of 16 bytes, so an expert size F or a
``d_model`` that is not a multiple of :data:`HF_ALIGN` fails there (``strides should be multiple of
16 bytes``) in bfloat16, and in float32 too unless a multiple of 4. Export pads F with zero rows
(:func:`hf_expert_size`: a zero gate and up row gives ``silu(0) * 0 = 0``, its zero down column adds
nothing, so the padded expert computes exactly what ours does); ``d_model`` cannot be padded
exactly (the norms average over it), so such a model's config names the ``eager`` implementation
(:func:`experts_implementation`), transformers' own fallback. Import keeps padded shapes padded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moe_lit.config import ModelConfig, MoEConfig
from moe_lit.errors import MoeLitError
from moe_lit.registry import Registry

TESTED_TRANSFORMERS = "5.24.0"
"""The transformers version the parity tests ran with (the fused expert layout needs >= 5)."""

HF_ALIGN = 8
"""Elements per 16 bytes of a 2-byte dtype: the multiple transformers' grouped kernels need of the
expert size and ``d_model`` (of a 4-byte dtype they need 4; 8 serves every dtype a load casts to)."""

FEATURES: dict[str, str] = {
    "dense": "a dense model (no MoE layer)",
    "moe": "MoE layers",
    "dense_layers_in_moe": "dense FFN layers in an MoE model (moe.first_dense_layers / layer_interval)",
    "renormalize": "renormalised top-k weights (moe.renormalize=true)",
    "no_renormalize": "top-k weights without renormalisation (moe.renormalize=false)",
    "head_dim": "a head dim other than d_model / n_heads (attn_head_dim)",
    "qkv_bias": "q/k/v projection biases (qkv_bias=true)",
    "qk_norm_head": "per-head q/k RMSNorm (qk_norm=head)",
    "qk_norm_full": "full-width q/k RMSNorm (qk_norm=full)",
    "gated_shared_expert": "a sigmoid-gated shared expert (moe.shared_expert_gate=true)",
    "shared_expert": "an ungated shared expert (moe.shared_expert_size > 0, shared_expert_gate=false)",
    "heterogeneous_experts": "heterogeneous experts (moe.expert_size is a list of unequal sizes)",
    "sigmoid_routing": "sigmoid routing (moe.score_func=sigmoid)",
    "selection_bias": "a non-zero selection bias of bias balancing (router.expert_bias)",
    "expert_output_bias": "a non-zero expert output bias (experts.bias; train with moe.expert_output_bias=false)",
    "capacity_dropping": "capacity dropping (moe.capacity_factor)",
    "unit_weights": "unit routing weights (moe.unit_weights=true, as after neuron partitioning)",
    "per_layer_experts": "layers with different expert counts (moe.layer_expert_sizes, as after global pruning)",
}


@dataclass(frozen=True)
class Family:
    """One transformers model family: its config mapping both ways and what it can hold."""

    name: str
    """Format name, transformers' ``model_type``."""
    config_class: str
    """Name of transformers' config class (``MixtralConfig`` ...)."""
    features: frozenset[str]
    """Keys of :data:`FEATURES` this family can express."""
    required: frozenset[str]
    """Features every model of this family has (OLMoE always normalises q and k, ...)."""
    to_ours: Callable[[Any, int | None], ModelConfig]
    """transformers config (+ optional seq_len) -> our ModelConfig; refuses what it cannot map."""
    to_hf: Callable[[ModelConfig], dict[str, Any]]
    """Our ModelConfig -> keyword arguments of ``config_class`` (after the feature check)."""

    @property
    def is_moe(self) -> bool:
        return "moe" in self.features

    def hf_config(self, cfg: ModelConfig, special_ids: dict[str, int | None]):
        """The transformers config object of ``cfg`` (``special_ids``: bos/eos/pad token ids)."""
        import transformers

        implementation = experts_implementation(cfg)
        config = getattr(transformers, self.config_class)(**self.to_hf(cfg), **special_ids, **implementation)
        # NOTE: the constructor's argument holds for this process only; as an attribute it is also
        # written to config.json, whose loading passes it back to the constructor.
        for key, value in implementation.items():
            setattr(config, key, value)
        return config


# ----------------------------------------------------------------------------- config helpers
def refuse(field: str, value: Any, allowed: Any) -> MoeLitError:
    return MoeLitError(f"hf: {field}={value!r} is not supported; allowed: {allowed!r}")


def rope_theta(hf_config: Any) -> float:
    """The RoPE base of a config with plain (unscaled) RoPE; refuses scaled variants."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    scaling = getattr(hf_config, "rope_scaling", None)
    scaled = scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default")
    if rope_type != "default" or scaled:
        raise MoeLitError(
            f"hf: rope_parameters.rope_type={rope_type!r} (scaled RoPE) is not supported; allowed: default"
        )
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise MoeLitError("hf: the config has no rope_theta")
    return float(theta)


def check_fields(hf_config: Any, allowed: dict[str, Any]) -> None:
    """Refuse a config field whose value (default: the allowed one) is not the allowed one."""
    for name, value_allowed in allowed.items():
        value = getattr(hf_config, name, value_allowed)
        if value != value_allowed:
            raise refuse(name, value, value_allowed)


def base_fields(hf_config: Any, seq_len: int | None) -> dict[str, Any]:
    """ModelConfig fields every family shares (attention, norms, embeddings, RoPE)."""
    check_fields(hf_config, {"hidden_act": "silu"})
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    return dict(
        vocab_size=hf_config.vocab_size,
        d_model=hf_config.hidden_size,
        n_layers=hf_config.num_hidden_layers,
        n_heads=heads,
        n_kv_heads=None if kv_heads == heads else kv_heads,
        attn_head_dim=None if head_dim * heads == hf_config.hidden_size else head_dim,
        seq_len=seq_len or hf_config.max_position_embeddings,
        rope_base=rope_theta(hf_config),
        tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        init_std=getattr(hf_config, "initializer_range", 0.02),
        norm_eps=hf_config.rms_norm_eps,
    )


def hf_base_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """transformers config arguments every family shares (the inverse of :func:`base_fields`)."""
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.seq_len,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_base},
        tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_std,
        rms_norm_eps=cfg.norm_eps,
        hidden_act="silu",
    )


def moe_fields(num_experts: int, expert_size: int, top_k: int, renormalize: bool, aux_loss_coef: float) -> MoEConfig:
    """Our MoEConfig of a transformers sparse block: softmax top-k, no expert output bias."""
    return MoEConfig(
        num_experts=num_experts,
        expert_size=expert_size,
        top_k=top_k,
        renormalize=renormalize,
        aux_loss_coef=aux_loss_coef,
        expert_output_bias=False,
    )


def moe_layer_pattern(moe_layers: list[int], n_layers: int) -> dict[str, int]:
    """``first_dense_layers`` / ``layer_interval`` giving exactly ``moe_layers``; refuses other sets."""
    if not moe_layers:
        raise MoeLitError("hf: the config has no MoE layer; import it as a dense model (llama)")
    first = moe_layers[0]
    interval = moe_layers[1] - first if len(moe_layers) > 1 else n_layers - first
    if list(range(first, n_layers, interval)) != moe_layers:
        raise MoeLitError(
            f"hf: MoE layers {moe_layers} are not 'the first n dense, then every m-th' "
            "(moe.first_dense_layers / layer_interval); not supported"
        )
    return {"first_dense_layers": first, "layer_interval": interval}


# ----------------------------------------------------------------------------- shapes
def hf_expert_size(expert_size: int) -> int:
    """The expert size written to transformers: ``expert_size`` rounded up to a multiple of :data:`HF_ALIGN`."""
    return -(-expert_size // HF_ALIGN) * HF_ALIGN


def experts_implementation(cfg: ModelConfig) -> dict[str, str]:
    """The ``experts_implementation`` a model's transformers config must name (none where the default works)."""
    return {"experts_implementation": "eager"} if cfg.is_moe and cfg.d_model % HF_ALIGN else {}


# ----------------------------------------------------------------------------- features
def config_features(cfg: ModelConfig) -> set[str]:
    """The :data:`FEATURES` a model of config ``cfg`` uses whatever its weights (all but the biases)."""
    used = {"head_dim"} if cfg.attn_head_dim not in (None, cfg.d_model // cfg.n_heads) else set()
    used |= {"qkv_bias"} if cfg.qkv_bias else set()
    used |= {f"qk_norm_{cfg.qk_norm}"} if cfg.qk_norm != "none" else set()
    moe = cfg.moe
    if moe is None:
        return used | {"dense"}
    used |= {"moe", "renormalize" if moe.renormalize else "no_renormalize"}
    used |= {"dense_layers_in_moe"} if len(cfg.moe_layer_ids) < cfg.n_layers else set()
    if moe.shared_expert_size:
        used |= {"gated_shared_expert" if moe.shared_expert_gate else "shared_expert"}
    used |= {"heterogeneous_experts"} if not moe.uniform else set()
    used |= {"sigmoid_routing"} if moe.score_func == "sigmoid" else set()
    used |= {"capacity_dropping"} if moe.capacity_factor is not None else set()
    used |= {"unit_weights"} if moe.unit_weights else set()
    used |= {"per_layer_experts"} if moe.layer_expert_sizes is not None else set()
    return used


def model_features(model) -> set[str]:
    """The :data:`FEATURES` a built Transformer uses (its config and, for biases, its tensor values)."""
    used = config_features(model.config)
    for layer in model.moe_layers():
        if layer.router.expert_bias is not None and bool(layer.router.expert_bias.any()):
            used.add("selection_bias")
        if bool(layer.experts.bias.any()):
            used.add("expert_output_bias")
    return used


def check_exportable(model, family: Family, families: Registry[Family]) -> None:
    """Refuse, in one line, a model that uses a feature ``family`` lacks (or lacks one it needs)."""
    used = model_features(model)
    prefix = f"export --format {family.name}:"
    for feature, description in FEATURES.items():
        if feature in used and feature not in family.features:
            having = [name for name, fam in families.items() if feature in fam.features]
            where = f"formats that have it: {', '.join(having)}" if having else "no export format has it"
            raise MoeLitError(f"{prefix} {description}: unsupported by {family.name}; {where}")
    missing = sorted(family.required - used)
    if missing:
        raise MoeLitError(f"{prefix} every {family.name} model has {FEATURES[missing[0]]}; this one has not")


# ----------------------------------------------------------------------------- weights
LAYER_MAP = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn.q_proj.weight",
    "self_attn.k_proj.weight": "attn.k_proj.weight",
    "self_attn.v_proj.weight": "attn.v_proj.weight",
    "self_attn.o_proj.weight": "attn.o_proj.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn.w1.weight",
    "mlp.up_proj.weight": "ffn.v1.weight",
    "mlp.down_proj.weight": "ffn.w2.weight",
}
"""Per-layer HF name -> our name of the dense Llama tensors (copied as they are)."""

EXTRA_LAYER_MAP = {
    "self_attn.q_proj.bias": "attn.q_proj.bias",
    "self_attn.k_proj.bias": "attn.k_proj.bias",
    "self_attn.v_proj.bias": "attn.v_proj.bias",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "mlp.gate.weight": "ffn.router.layer.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn.shared_expert.w1.weight",
    "mlp.shared_expert.up_proj.weight": "ffn.shared_expert.v1.weight",
    "mlp.shared_expert.down_proj.weight": "ffn.shared_expert.w2.weight",
    "mlp.shared_expert_gate.weight": "ffn.shared_expert_gate.weight",
}
"""The other tensors copied as they are (optional attention parts, router, Qwen2 shared expert)."""

OURS_TO_HF = {ours: hf for hf, ours in {**LAYER_MAP, **EXTRA_LAYER_MAP}.items()}
HF_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
OUR_EXPERTS = ("ffn.experts.mlp.w1", "ffn.experts.mlp.v1", "ffn.experts.mlp.w2")
# NOTE: our model's state dict decides which tensors exist; these hold no weights of a family's
# format and are checked to be zero (export) or left at zero (import) instead.
UNMAPPED = ("ffn.experts.bias", "ffn.router.expert_bias")


def _split(key: str) -> tuple[str, str]:
    """``blocks.3.attn.q_proj.weight`` -> ``("3", "attn.q_proj.weight")``."""
    _, layer, rest = key.split(".", 2)
    return layer, rest


def experts_to_hf(w1_SD: torch.Tensor, v1_SD: torch.Tensor, w2_SD: torch.Tensor, num_experts: int):
    """Our stacked ``w1/v1/w2 (E*F, D)`` -> transformers' ``gate_up_proj (E, 2P, D)``, ``down_proj (E, D, P)``,
    each expert zero-padded from F to P = :func:`hf_expert_size` rows (exact, see the module docstring)."""
    w1_EFD, v1_EFD, w2_EFD = (w.unflatten(0, (num_experts, -1)) for w in (w1_SD, v1_SD, w2_SD))
    pad = hf_expert_size(w1_EFD.shape[1]) - w1_EFD.shape[1]
    w1_EPD, v1_EPD, w2_EPD = (torch.nn.functional.pad(w, (0, 0, 0, pad)) for w in (w1_EFD, v1_EFD, w2_EFD))
    return torch.cat([w1_EPD, v1_EPD], dim=1), w2_EPD.transpose(1, 2).contiguous()


def experts_from_hf(gate_up_E2FD: torch.Tensor, down_EDF: torch.Tensor):
    """The inverse of :func:`experts_to_hf`."""
    w1_EFD, v1_EFD = gate_up_E2FD.chunk(2, dim=1)
    return w1_EFD.flatten(0, 1), v1_EFD.flatten(0, 1), down_EDF.transpose(1, 2).flatten(0, 1)


def hf_state_to_ours(hf_state: dict[str, torch.Tensor], our_keys: list[str]) -> dict[str, torch.Tensor]:
    """Our state dict (every key of ``our_keys`` but the unmapped ones) from a transformers one.

    ``hf_state`` is consumed (entries popped as they are used): once the model that held them is
    gone, each layer's transformers experts are freed as soon as ours are made.
    """
    state: dict[str, torch.Tensor] = {}
    for key in our_keys:
        if key in ("tok_embeddings.weight", "norm.weight", "lm_head.weight"):
            state[key] = hf_state.pop(
                {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}.get(key, key)
            )
            continue
        layer, rest = _split(key)
        prefix = f"model.layers.{layer}."
        if rest in OURS_TO_HF:
            state[key] = hf_state.pop(prefix + OURS_TO_HF[rest])
        elif rest == OUR_EXPERTS[0]:
            tensors = experts_from_hf(*(hf_state.pop(prefix + name) for name in HF_EXPERTS))
            state.update({f"blocks.{layer}.{name}": t for name, t in zip(OUR_EXPERTS, tensors, strict=False)})
        elif rest not in OUR_EXPERTS and rest not in UNMAPPED:  # pragma: no cover - every tensor is mapped
            raise MoeLitError(f"hf: no transformers tensor for {key}")
    return state


def ours_to_hf_state(model) -> dict[str, torch.Tensor]:
    """The transformers state dict of a Transformer (the inverse of :func:`hf_state_to_ours`).

    An ungated shared expert gets no gate tensor (the caller writes a zero one) and twice its down
    projection: transformers' one shared expert, Qwen2-MoE's, is scaled by ``sigmoid(x . g)``, and
    ``sigmoid(0) * 2 = 1`` exactly (scaling by a power of two rounds nothing).
    """
    ours = model.state_dict()
    ungated = model.config.is_moe and not model.config.moe_section().shared_expert_gate
    state = {"model.embed_tokens.weight": ours["tok_embeddings.weight"], "model.norm.weight": ours["norm.weight"]}
    state["lm_head.weight"] = ours["lm_head.weight"]
    for key, value in ours.items():
        if not key.startswith("blocks."):
            continue
        layer, rest = _split(key)
        prefix = f"model.layers.{layer}."
        if rest == "ffn.shared_expert.w2.weight" and ungated:
            state[prefix + OURS_TO_HF[rest]] = 2 * value
        elif rest in OURS_TO_HF:
            state[prefix + OURS_TO_HF[rest]] = value
        elif rest == OUR_EXPERTS[0]:
            w1_SD, v1_SD, w2_SD = (ours[f"blocks.{layer}.{name}"] for name in OUR_EXPERTS)
            tensors = experts_to_hf(w1_SD, v1_SD, w2_SD, model.config.moe_section().num_experts)
            state.update({prefix + name: t for name, t in zip(HF_EXPERTS, tensors, strict=False)})
    return state


# ----------------------------------------------------------------------------- loading
def require_transformers(moe: bool = True):
    """The transformers module (lazy, with a helpful error); the MoE families need the fused layout of 5.x."""
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - transformers is in the benchmarks extra
        raise MoeLitError("hf: this needs transformers (pip install 'moe_lit[benchmarks]')") from exc
    if moe and int(transformers.__version__.split(".")[0]) < 5:
        raise MoeLitError(
            f"hf: transformers {transformers.__version__} stores MoE experts one by one; the MoE families "
            f"need transformers>=5 (tested with {TESTED_TRANSFORMERS})"
        )
    return transformers


def load_hf_model(source: str | Path, gguf_file: str | None = None, dtype=torch.float32):
    """A local transformers causal LM (directory, or directory + GGUF file), never downloading."""
    transformers = require_transformers(moe=False)
    path = Path(source)
    if not path.exists():
        raise MoeLitError(f"hf: no such directory {path}")
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=dtype, **kwargs)


@contextmanager
def empty_parameters() -> Iterator[None]:
    """Build modules with their parameters on the meta device and their buffers real (accelerate's
    ``init_empty_weights``): no memory and no init for weights that come by assignment, while the
    buffers computed at construction (RoPE tables, counters) stay valid."""
    try:
        from accelerate import init_empty_weights
    except ImportError as exc:  # pragma: no cover - accelerate is in the benchmarks extra
        raise MoeLitError("hf: this needs accelerate (pip install 'moe_lit[benchmarks]')") from exc
    with init_empty_weights(include_buffers=False):
        yield


def assign_state(module: nn.Module, state: dict[str, torch.Tensor], zero_if_absent: Callable[[str], bool]) -> None:
    """Load ``state`` into a module built under :func:`empty_parameters` by assignment (no copy).

    A parameter absent from ``state`` becomes zeros where ``zero_if_absent(name)``, else is an error.
    """
    missing, unexpected = module.load_state_dict(state, strict=False, assign=True)
    if unexpected:  # pragma: no cover - the mapping covers every tensor
        raise MoeLitError(f"hf: tensors with no place in the model: {unexpected[:5]}")
    for name in missing:
        if not zero_if_absent(name):  # pragma: no cover - the mapping covers every tensor
            raise MoeLitError(f"hf: no tensor for {name}")
        owner, _, leaf = name.rpartition(".")
        empty = module.get_parameter(name)
        module.get_submodule(owner).register_parameter(leaf, nn.Parameter(torch.zeros(empty.shape, dtype=empty.dtype)))
