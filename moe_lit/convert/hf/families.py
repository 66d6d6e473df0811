"""The family registry and the two transforms: :func:`from_hf` (transformers -> ours) and :func:`to_hf`.

Both are pure: the source model is untouched (its tensors are copied) and the result is in eval
mode. Guarantees (tests/convert/hf/, fp32, tiny random models of every family): imported logits
equal transformers' < 1e-4; a model exported and loaded back by ``from_pretrained`` gives our
logits < 1e-4; export then import is the identity on the state dict.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

import torch

from moe_lit.config import ModelConfig
from moe_lit.convert.hf import llama, mixtral, olmoe, qwen2_moe, qwen3_moe
from moe_lit.convert.hf.core import (
    Family,
    check_exportable,
    hf_state_to_ours,
    load_hf_model,
    ours_to_hf_state,
    require_transformers,
)
from moe_lit.errors import MoeLitError
from moe_lit.model import Transformer

FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (llama.FAMILY, mixtral.FAMILY, olmoe.FAMILY, qwen2_moe.FAMILY, qwen3_moe.FAMILY)
}
"""Export formats and importable model types, by transformers' ``model_type``."""


def family(name: Optional[str]) -> Family:
    """The family of a format / ``model_type``; a one-line error naming the allowed ones."""
    if name not in FAMILIES:
        raise MoeLitError(f"hf: model_type={name!r} is not supported; allowed: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def config_from_hf(hf_config: Any, seq_len: Optional[int] = None) -> ModelConfig:
    """Our ModelConfig of a transformers config of any supported family."""
    return family(getattr(hf_config, "model_type", None)).to_ours(hf_config, seq_len)


def from_hf(
    hf_model_or_dir: Any, gguf_file: Optional[str] = None, seq_len: Optional[int] = None
) -> Transformer:
    """A float32 Transformer with the weights of a transformers causal LM (object or local directory)."""
    hf_model = hf_model_or_dir
    if isinstance(hf_model_or_dir, (str, Path)):
        hf_model = load_hf_model(hf_model_or_dir, gguf_file)
    cfg = config_from_hf(hf_model.config, seq_len)
    if cfg.is_moe:
        require_transformers(moe=True)
    # NOTE: the throw-away initialisation must not advance the caller's global RNG (pure transform).
    with torch.random.fork_rng(devices=[]):
        model = Transformer(cfg)
    hf_state = hf_model.state_dict()
    keys = [k for k in model.state_dict() if not (cfg.tie_embeddings and k == "lm_head.weight")]
    state = hf_state_to_ours(hf_state, keys)
    missing, unexpected = model.load_state_dict({k: v.detach().float().clone() for k, v in state.items()}, strict=False)
    missing = [k for k in missing if not (cfg.tie_embeddings and k == "lm_head.weight")]
    if missing or unexpected:  # pragma: no cover - the mapping covers every tensor
        raise MoeLitError(f"hf: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
    return model.eval()


def from_hf_llama(hf_model_or_dir: Any, gguf_file: Optional[str] = None, seq_len: Optional[int] = None) -> Transformer:
    """:func:`from_hf` restricted to ``LlamaForCausalLM`` (the original entry point)."""
    hf_model = hf_model_or_dir
    if isinstance(hf_model_or_dir, (str, Path)):
        hf_model = load_hf_model(hf_model_or_dir, gguf_file)
    llama.llama_config(hf_model.config, seq_len)  # refuses anything but a plain Llama
    return from_hf(hf_model, seq_len=seq_len)


def to_hf(model: Transformer, fmt: str, special_ids: Optional[dict[str, int]] = None, dtype=torch.float32):
    """A transformers model of format ``fmt`` computing what ``model`` computes (eval mode).

    ``special_ids`` (``bos_token_id``, ``eos_token_id``, ``pad_token_id``) go into its config.
    Refuses (one line) a model that uses a feature ``fmt`` lacks, naming the formats that have it.
    """
    target = FAMILIES.get(fmt)
    if target is None:
        raise MoeLitError(f"--format: got {fmt!r}, allowed values: {', '.join(FAMILIES)}")
    check_exportable(model, target, FAMILIES)
    transformers = require_transformers(moe=target.is_moe)
    from transformers.initialization import no_init_weights

    hf_config = target.hf_config(model.config, special_ids or {})
    # NOTE: the weights arrive by assignment, so skip transformers' (costly, RNG-consuming) init.
    with no_init_weights():
        hf_model = transformers.AutoModelForCausalLM.from_config(hf_config)
    state = {k: v.detach().to("cpu", dtype, copy=True) for k, v in ours_to_hf_state(model).items()}
    missing, unexpected = hf_model.load_state_dict(state, strict=False, assign=True)
    for key in missing:
        # NOTE: only Qwen2-MoE's shared expert may be absent from ours; zeros (an empty expert, a
        # zero gate) contribute exactly nothing.
        if ".mlp.shared_expert" not in key:  # pragma: no cover - the mapping covers every tensor
            raise MoeLitError(f"hf: no tensor of ours for {key}")
        param = hf_model.get_parameter(key)
        param.data = torch.zeros_like(param, dtype=dtype)
    if unexpected:  # pragma: no cover - the mapping covers every tensor
        raise MoeLitError(f"hf: tensors with no place in {fmt}: {unexpected[:5]}")
    if model.config.tie_embeddings:
        hf_model.tie_weights()
    return hf_model.to(dtype).eval()


def hf_config_dir_to_ours(path: Union[str, Path]) -> ModelConfig:
    """Our ModelConfig of a transformers model directory's ``config.json`` (no weights read)."""
    transformers = require_transformers(moe=False)
    return config_from_hf(transformers.AutoConfig.from_pretrained(str(path), local_files_only=True))


__all__ = ["FAMILIES", "config_from_hf", "family", "from_hf", "from_hf_llama", "hf_config_dir_to_ours", "to_hf"]
