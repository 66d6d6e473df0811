"""Tokenizers both ways: ours (a ``tokenizers`` ``tokenizer.json``) <-> transformers' tokenizer files.

Export wraps our ``tokenizer.json`` in a ``PreTrainedTokenizerFast`` whose EOS, BOS and pad are the
end-of-text token (ours: ``<|endoftext|>``; training writes only EOS, so BOS = EOS as in GPT-2), and
saves it with ``save_pretrained``: ``AutoTokenizer.from_pretrained`` then encodes exactly as ours.

Import keeps the model's ``tokenizer.json`` or, for a GGUF file or a slow-only tokenizer, converts
what ``AutoTokenizer`` loads into one, so eval and generation find it beside the weights; but only
a real one that fits the model (:func:`tokenizer_misfit`). A directory without tokenizer files
(:data:`VOCABULARY_FILES`) has none: transformers 5 would make one up from the model type's
defaults (one or two special tokens for OLMoE and Qwen), on which eval would run silently wrong.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from moe_lit.convert.hf.core import require_transformers

PathLike = str | Path

NO_SPECIAL_IDS: dict[str, int | None] = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
"""The special token ids of a model exported without a tokenizer: none (no made-up end of text)."""

VOCABULARY_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tekken.json",
)
"""Files that hold a tokenizer's vocabulary in a transformers directory (one is enough);
``tokenizer_config.json`` alone only names a class and its special tokens."""

MIN_VOCABULARY_SHARE = 0.5
"""The least share of the model's ``vocab_size`` a tokenizer of that model has.

NOTE: embeddings are padded past the tokenizer (to a multiple of 64 or 128: OLMoE 50280 tokens of
50304, Qwen3 151669 of 151936) but never to twice its size; a made-up tokenizer has a handful."""


class NoTokenizer(Exception):
    """The import writes no tokenizer; the message says why (one line)."""


def hf_tokenizer(tokenizer_file: PathLike, eos_token: str | None = None):
    """A ``PreTrainedTokenizerFast`` of our ``tokenizer.json`` with EOS = BOS = pad = the end-of-text token."""
    from moe_lit.data.tokenizer import load_tokenizer, resolve_eot_id

    transformers = require_transformers(moe=False)
    tokenizer = load_tokenizer(tokenizer_file, require_eos=False)
    eos = tokenizer.id_to_token(resolve_eot_id(tokenizer, eos_token))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos, bos_token=eos, pad_token=eos)


def special_token_ids(tokenizer) -> dict[str, int | None]:
    """``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` of a transformers tokenizer (for the configs)."""
    return {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def tokenizer_misfit(vocabulary: dict[str, int], hf_config: Any) -> str | None:
    """Why a tokenizer (its token -> id ``vocabulary``) is not the one of a model, or None if it fits.

    It fits when its ids lie inside the model's embedding, it fills at least
    :data:`MIN_VOCABULARY_SHARE` of it and it has every special id of the model's config.
    """
    vocab_size, ids = hf_config.vocab_size, set(vocabulary.values())
    if max(ids, default=-1) >= vocab_size:
        return f"its ids reach {max(ids)}, past the model's vocab_size {vocab_size}"
    if len(ids) < MIN_VOCABULARY_SHARE * vocab_size:
        return f"it has {len(ids)} tokens for the model's vocab_size {vocab_size}"
    for name in NO_SPECIAL_IDS:
        value = getattr(hf_config, name, None)
        for token_id in value if isinstance(value, list) else [value]:
            if token_id is not None and token_id >= 0 and token_id not in ids:
                return f"it has no token of the model's {name} {token_id}"
    return None


def write_tokenizer_json(model_dir: PathLike, out_file: PathLike, gguf_file: str | None = None) -> Path:
    """Write the ``tokenizer.json`` of a transformers model directory (or of its GGUF file) to ``out_file``.

    Raises :class:`NoTokenizer` when the directory holds no tokenizer, or one that cannot be read
    or does not fit the model (:func:`tokenizer_misfit`); nothing is written then.
    """
    model_dir, out_file = Path(model_dir), Path(out_file)
    source = f"{model_dir / gguf_file}" if gguf_file else str(model_dir)
    if gguf_file is None and not any((model_dir / name).is_file() for name in VOCABULARY_FILES):
        raise NoTokenizer(f"{source} holds no tokenizer files ({', '.join(VOCABULARY_FILES)})")
    transformers = require_transformers(moe=False)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, **kwargs)
        hf_config = transformers.AutoConfig.from_pretrained(str(model_dir), local_files_only=True, **kwargs)
    except (OSError, ValueError) as exc:
        raise NoTokenizer(f"cannot read the tokenizer of {source} ({str(exc).strip().splitlines()[0]})") from exc
    if not tokenizer.is_fast:
        raise NoTokenizer(f"the tokenizer of {source} has no fast (tokenizer.json) form")
    backend = tokenizer.backend_tokenizer
    misfit = tokenizer_misfit(backend.get_vocab(with_added_tokens=True), hf_config)
    if misfit is not None:
        raise NoTokenizer(f"the tokenizer of {source} is not this model's: {misfit}")
    if gguf_file is None and (model_dir / "tokenizer.json").is_file():
        shutil.copyfile(model_dir / "tokenizer.json", out_file)  # the file itself, byte for byte
    else:
        backend.save(str(out_file))
    return out_file


__all__ = [
    "MIN_VOCABULARY_SHARE",
    "NO_SPECIAL_IDS",
    "VOCABULARY_FILES",
    "NoTokenizer",
    "hf_tokenizer",
    "special_token_ids",
    "tokenizer_misfit",
    "write_tokenizer_json",
]
