"""The family registry and the two transforms: :func:`from_hf` (transformers -> ours) and :func:`to_hf`.

A family is one module of this package with its :class:`~moe_lit.convert.hf.core.Family`,
registered in :data:`FAMILIES` under transformers' ``model_type``; every list of families (the
``--format`` choices, help texts, error messages) reads the registry.

Both are pure: the source model is untouched (its tensors are copied) and the result is in eval
mode. Guarantees (tests/convert/hf/, fp32, tiny random models of every family): imported logits
equal transformers' < 1e-4; a model exported and loaded back by ``from_pretrained`` gives our
logits < 1e-4; export then import is the identity on the state dict, and keeps the logits where
export pads the experts or gates an ungated shared expert (see ``core``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from moe_lit.config import ModelConfig
from moe_lit.convert.hf import llama, mixtral, olmoe, qwen2_moe, qwen3_moe
from moe_lit.convert.hf.core import (
    Family,
    assign_state,
    check_exportable,
    empty_parameters,
    hf_state_to_ours,
    load_hf_model,
    ours_to_hf_state,
    require_transformers,
)
from moe_lit.errors import MoeLitError
from moe_lit.model import Transformer
from moe_lit.registry import Registry

FAMILIES: Registry[Family] = Registry("HF family")
"""Export formats and importable model types, by transformers' ``model_type``."""
for _family in (llama.FAMILY, mixtral.FAMILY, olmoe.FAMILY, qwen2_moe.FAMILY, qwen3_moe.FAMILY):
    FAMILIES.register(_family.name, _family)


def family(name: str | None) -> Family:
    """The family of a format / ``model_type``; a one-line error naming the allowed ones."""
    if name is None or name not in FAMILIES:
        raise MoeLitError(f"hf: model_type={name!r} is not supported; allowed: {', '.join(FAMILIES.names())}")
    return FAMILIES[name]


def config_from_hf(hf_config: Any, seq_len: int | None = None) -> ModelConfig:
    """Our ModelConfig of a transformers config of any supported family."""
    return family(getattr(hf_config, "model_type", None)).to_ours(hf_config, seq_len)


def from_hf(
    hf_model_or_dir: Any, gguf_file: str | None = None, seq_len: int | None = None, dtype=torch.float32
) -> Transformer:
    """A Transformer (weights in ``dtype``) computing what a transformers causal LM computes.

    Args:
        hf_model_or_dir: A model object (its tensors are copied) or a local directory (loaded in
            ``dtype`` and its tensors taken over, so the peak memory is about one model).
        gguf_file: GGUF file name inside the directory (needs `pip install gguf accelerate`).
        seq_len: RoPE table size; default: max_position_embeddings.
        dtype: dtype to load and keep the weights in (bfloat16 halves the memory of a big import).
    """
    from_dir = isinstance(hf_model_or_dir, (str, Path))
    hf_model = load_hf_model(hf_model_or_dir, gguf_file, dtype) if from_dir else hf_model_or_dir
    cfg = config_from_hf(hf_model.config, seq_len)
    if cfg.is_moe:
        require_transformers(moe=True)
    with empty_parameters():
        model = Transformer(cfg)
    if cfg.tie_embeddings:
        del model.lm_head.weight  # re-tied below, once the embedding holds its weights
    hf_state = hf_model.state_dict()
    del hf_model  # from a directory, hf_state now holds the only references (freed layer by layer)
    state = hf_state_to_ours(hf_state, list(model.state_dict()))
    state = {k: v.detach().to(dtype=dtype, copy=not from_dir) for k, v in state.items()}
    assign_state(model, state, lambda name: False)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.tok_embeddings.weight
    return model.eval()


def from_hf_llama(hf_model_or_dir: Any, gguf_file: str | None = None, seq_len: int | None = None) -> Transformer:
    """:func:`from_hf` restricted to ``LlamaForCausalLM`` (the original entry point)."""
    hf_model = hf_model_or_dir
    if isinstance(hf_model_or_dir, (str, Path)):
        hf_model = load_hf_model(hf_model_or_dir, gguf_file)
    llama.llama_config(hf_model.config, seq_len)  # refuses anything but a plain Llama
    return from_hf(hf_model, seq_len=seq_len)


def to_hf(model: Transformer, fmt: str, special_ids: dict[str, int | None] | None = None, dtype=torch.float32):
    """A transformers model of format ``fmt`` computing what ``model`` computes (eval mode).

    ``special_ids`` (``bos_token_id``, ``eos_token_id``, ``pad_token_id``) go into its config.
    Refuses (one line) a model that uses a feature ``fmt`` lacks, naming the formats that have it.
    """
    if fmt not in FAMILIES:
        raise MoeLitError(f"--format: got {fmt!r}, allowed values: {', '.join(FAMILIES.names())}")
    target = FAMILIES[fmt]
    check_exportable(model, target, FAMILIES)
    transformers = require_transformers(moe=target.is_moe)
    hf_config = target.hf_config(model.config, special_ids or {})
    with empty_parameters():
        hf_model = transformers.AutoModelForCausalLM.from_config(hf_config)
    state = {k: v.detach().to("cpu", dtype, copy=True) for k, v in ours_to_hf_state(model).items()}
    # NOTE: only Qwen2-MoE's shared expert may be absent from ours: zeros (an empty expert, a zero
    # gate) contribute exactly nothing.
    assign_state(hf_model, state, lambda name: ".mlp.shared_expert" in name)
    if model.config.tie_embeddings:
        hf_model.tie_weights()
    return hf_model.to(dtype).eval()


def hf_config_dir_to_ours(path: str | Path) -> ModelConfig:
    """Our ModelConfig of a transformers model directory's ``config.json`` (no weights read)."""
    transformers = require_transformers(moe=False)
    return config_from_hf(transformers.AutoConfig.from_pretrained(str(path), local_files_only=True))


__all__ = ["FAMILIES", "config_from_hf", "family", "from_hf", "from_hf_llama", "hf_config_dir_to_ours", "to_hf"]
