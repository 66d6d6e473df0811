"""Byte-level BPE tokenizer (``tokenizers``) trained on the language mix.

Byte-level: every string of every script encodes without unknown tokens. The only special token
is ``EOS``, written after each paragraph, so a token stream is ``para EOS para EOS ...``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from moe_lit.errors import MoeLitError

EOS = "<|endoftext|>"
DEFAULT_VOCAB_SIZE = 8192
TOKEN_DTYPE = np.int32


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE, progress: bool = False):
    """Train a byte-level BPE on ``texts``; its vocabulary holds at most ``vocab_size`` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        # NOTE: on a terminal only: elsewhere its bars print nothing but blank lines on stdout.
        show_progress=progress and sys.stderr.isatty(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def read_tokenizer_file(path: str | Path):
    """A ``tokenizers.Tokenizer`` from its ``tokenizer.json``; a one-line error naming the file if unreadable."""
    from tokenizers import Tokenizer

    if not Path(path).is_file():
        raise MoeLitError(f"tokenizer: no such file {path}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # NOTE: tokenizers raises a bare Exception for unreadable JSON
        raise MoeLitError(f"tokenizer {path}: not a readable tokenizer.json") from exc


def load_tokenizer(path: Path, expected_vocab_size: int | None = None):
    """A saved tokenizer; a one-line error when it is missing, lacks EOS or has another vocab size."""
    tokenizer = read_tokenizer_file(path)
    if tokenizer.token_to_id(EOS) is None:
        raise MoeLitError(f"tokenizer {path}: has no {EOS} token; train one with moe-lit data prepare")
    if expected_vocab_size is not None and tokenizer.get_vocab_size() != expected_vocab_size:
        raise MoeLitError(
            f"tokenizer/vocab mismatch: {path} has {tokenizer.get_vocab_size()} tokens, "
            f"expected vocab_size {expected_vocab_size}"
        )
    return tokenizer


def encode_paragraphs(tokenizer, texts: Sequence[str]) -> np.ndarray:
    """Token ids of ``texts``, each paragraph followed by EOS, as one flat array."""
    eos = tokenizer.token_to_id(EOS)
    pieces = [np.asarray(enc.ids + [eos], dtype=TOKEN_DTYPE) for enc in tokenizer.encode_batch(list(texts))]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=TOKEN_DTYPE)
