"""Tokenizers both ways: ours (a ``tokenizers`` ``tokenizer.json``) <-> transformers' tokenizer files.

Export wraps our ``tokenizer.json`` in a ``PreTrainedTokenizerFast`` whose EOS, BOS and pad are the
end-of-text token (ours: ``<|endoftext|>``; training writes only EOS, so BOS = EOS as in GPT-2), and
saves it with ``save_pretrained``: ``AutoTokenizer.from_pretrained`` then encodes exactly as ours.
Import keeps the model's ``tokenizer.json`` or, for a GGUF file or a slow-only tokenizer, converts
what ``AutoTokenizer`` loads into one, so eval and generation find it beside the weights.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from moe_lit.convert.hf.core import require_transformers
from moe_lit.errors import MoeLitError

PathLike = str | Path


def hf_tokenizer(tokenizer_file: PathLike, eos_token: str | None = None):
    """A ``PreTrainedTokenizerFast`` of our ``tokenizer.json`` with EOS = BOS = pad = the end-of-text token."""
    from moe_lit.evaluation.harness import load_tokenizer, resolve_eot_id

    transformers = require_transformers(moe=False)
    tokenizer = load_tokenizer(tokenizer_file)
    eos = tokenizer.id_to_token(resolve_eot_id(tokenizer, eos_token))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos, bos_token=eos, pad_token=eos)


def special_token_ids(tokenizer) -> dict[str, int]:
    """``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` of a transformers tokenizer (for the configs)."""
    return {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def write_tokenizer_json(model_dir: PathLike, out_file: PathLike, gguf_file: str | None = None) -> Path | None:
    """Write the ``tokenizer.json`` of a transformers model directory (or of its GGUF file) to ``out_file``.

    Returns None when the directory holds no tokenizer at all (the import then has none either).
    """
    model_dir, out_file = Path(model_dir), Path(out_file)
    if gguf_file is None and (model_dir / "tokenizer.json").is_file():
        shutil.copyfile(model_dir / "tokenizer.json", out_file)
        return out_file
    transformers = require_transformers(moe=False)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, **kwargs)
    except (OSError, ValueError) as exc:
        if gguf_file:
            raise MoeLitError(f"hf: cannot read the tokenizer of {model_dir / gguf_file}: {exc}") from exc
        return None
    if not tokenizer.is_fast:
        raise MoeLitError(f"hf: the tokenizer of {model_dir} has no fast (tokenizer.json) form")
    tokenizer.backend_tokenizer.save(str(out_file))
    return out_file


__all__ = ["hf_tokenizer", "special_token_ids", "write_tokenizer_json"]
