"""Write a model as a transformers directory: config, weights (sharded past a size), tokenizer, generation config.

The directory is written into a temporary sibling and renamed into place (``moe_lit.io``), so an
interrupted export never leaves a directory that looks complete. The files are transformers' own
(``save_pretrained`` of the model, the tokenizer and a ``GenerationConfig``), so
``AutoModelForCausalLM.from_pretrained(DIR)`` and ``AutoTokenizer.from_pretrained(DIR)`` load them
offline. Without a tokenizer the directory holds the model alone (as transformers' own
``save_pretrained`` of a model does), with no special token ids: generation stops at its length.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moe_lit.convert.hf.families import to_hf
from moe_lit.convert.hf.tokenizer import NO_SPECIAL_IDS, hf_tokenizer, special_token_ids
from moe_lit.errors import MoeLitError
from moe_lit.io import atomic_directory, check_output

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""``--dtype`` choices of the exported weights."""


def export_hf(
    model,
    fmt: str,
    out_dir: str | Path,
    tokenizer_file: str | Path | None,
    eos_token: str | None = None,
    dtype: str = "float32",
    max_shard_size: str = "5GB",
    force: bool = False,
) -> Path:
    """Export ``model`` (a Transformer) as format ``fmt`` into ``out_dir``; returns the directory.

    ``tokenizer_file`` None writes the model alone. Refuses a non-empty ``out_dir`` unless
    ``force``, a tokenizer larger than the model's vocabulary and any feature ``fmt`` lacks (see
    ``core.check_exportable``).
    """
    out_dir = Path(out_dir)
    check_output(out_dir, {"--tokenizer": tokenizer_file}, force)
    if dtype not in DTYPES:
        raise MoeLitError(f"--dtype: got {dtype!r}, allowed values: {', '.join(DTYPES)}")
    tokenizer = None if tokenizer_file is None else hf_tokenizer(tokenizer_file, eos_token)
    if tokenizer is not None and len(tokenizer) > model.config.vocab_size:
        raise MoeLitError(
            f"--tokenizer: {tokenizer_file} has {len(tokenizer)} tokens, more than the model's vocab_size "
            f"{model.config.vocab_size}"
        )
    from transformers import GenerationConfig

    ids = NO_SPECIAL_IDS if tokenizer is None else special_token_ids(tokenizer)
    hf_model = to_hf(model, fmt, ids, DTYPES[dtype])
    hf_model.generation_config = GenerationConfig(**ids)
    with atomic_directory(out_dir) as tmp:
        hf_model.save_pretrained(str(tmp), max_shard_size=max_shard_size)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    return out_dir


__all__ = ["DTYPES", "export_hf"]
