"""Byte-level BPE tokenizer (``tokenizers``) trained on the language mix.

Byte-level: every string of every script encodes without unknown tokens. The only special token
is ``EOS``, written after each paragraph, so a token stream is ``para EOS para EOS ...``.

Every tokenizer is read here: :func:`load_tokenizer` (ours, or an imported model's with its own
special tokens) and :func:`find_tokenizer` / :func:`model_tokenizer`, the tokenizer of a model
(beside an exported directory, else in the data directory it was trained on).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from moe_lit.data.layout import tokenizer_file
from moe_lit.errors import MoeLitError

EOS = "<|endoftext|>"
DEFAULT_VOCAB_SIZE = 8192
TOKEN_DTYPE = np.int32
EOT_CANDIDATES = (EOS, "</s>", "<eos>", "<|eos|>", "[EOS]")
"""Special tokens taken as end-of-text, in this order, when ``eot_token`` is not given."""


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


def tokenizer_fingerprint(path: str | Path) -> str:
    """The SHA-256 of a ``tokenizer.json`` (hex, first 16 digits): what a checkpoint records of
    the tokenizer it was trained with, so that a resume onto other data is refused."""
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def load_tokenizer(path: str | Path, expected_vocab_size: int | None = None, *, require_eos: bool = True):
    """A ``tokenizers.Tokenizer`` from its ``tokenizer.json``; a one-line error naming the file when it
    is missing or unreadable, has another vocab size than ``expected_vocab_size``, or (``require_eos``,
    a tokenizer our token streams are written with) lacks ``EOS``. ``require_eos=False`` takes a model's
    tokenizer with any special tokens (an imported model's ``</s>``, see :func:`resolve_eot_id`)."""
    from tokenizers import Tokenizer

    if not Path(path).is_file():
        raise MoeLitError(f"tokenizer: no such file {path}")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # NOTE: tokenizers raises a bare Exception for unreadable JSON
        raise MoeLitError(f"tokenizer {path}: not a readable tokenizer.json") from exc
    if require_eos and tokenizer.token_to_id(EOS) is None:
        raise MoeLitError(f"tokenizer {path}: has no {EOS} token; train one with moe-lit data prepare")
    if expected_vocab_size is not None and tokenizer.get_vocab_size() != expected_vocab_size:
        raise MoeLitError(
            f"tokenizer/vocab mismatch: {path} has {tokenizer.get_vocab_size()} tokens, "
            f"expected vocab_size {expected_vocab_size}"
        )
    return tokenizer


def find_tokenizer(model: str | Path, data_dir: str | Path | None = None) -> Path | None:
    """The ``tokenizer.json`` of a model, or None: the one beside an exported directory (an imported
    model's own), else the one of ``data_dir`` when given, else, for a Lightning ``.ckpt``, the one of
    the data directory its datamodule read."""
    from moe_lit.checkpoint import read_lightning_checkpoint

    beside = tokenizer_file(model)
    if beside.is_file():
        return beside
    if data_dir is not None:
        candidate: Path | None = tokenizer_file(data_dir)
    elif Path(model).is_dir():
        candidate = None
    else:  # a .ckpt (read_lightning_checkpoint names a missing or unreadable file)
        trained_on = read_lightning_checkpoint(model).get("datamodule_hyper_parameters", {}).get("data_dir")
        candidate = tokenizer_file(trained_on) if trained_on else None
    return candidate if candidate is not None and candidate.is_file() else None


def model_tokenizer(model: str | Path, *, tokenizer: str | Path | None = None, data_dir: str | Path | None = None):
    """The tokenizer of a model, loaded: the ``tokenizer`` file when given, else :func:`find_tokenizer`'s
    (any special tokens); a one-line error when there is none."""
    found = tokenizer or find_tokenizer(model, data_dir)
    if found is None:
        where = f"stored with {model}" + (f" or in {data_dir}" if data_dir is not None else "")
        raise MoeLitError(f"tokenizer: no tokenizer.json {where}; pass one explicitly")
    return load_tokenizer(found, require_eos=False)


def resolve_eot_id(tokenizer, eot_token: str | None = None) -> int:
    """Id of ``eot_token``, else of the first known end-of-text special token the tokenizer has."""
    candidates = (eot_token,) if eot_token else EOT_CANDIDATES
    for token in candidates:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token_id
    raise MoeLitError(f"tokenizer: no end-of-text token among {list(candidates)}; pass eot_token=<token>")


def encode_paragraphs(tokenizer, texts: Sequence[str]) -> np.ndarray:
    """Token ids of ``texts``, each paragraph followed by EOS, as one flat array."""
    eos = tokenizer.token_to_id(EOS)
    pieces = [np.asarray(enc.ids + [eos], dtype=TOKEN_DTYPE) for enc in tokenizer.encode_batch(list(texts))]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=TOKEN_DTYPE)
