"""A word-level tokenizer as small as the tiny transformers models of tests.helpers.hf."""

import pytest


@pytest.fixture
def word_tokenizer(tmp_path):
    """A 97-token word-level ``tokenizer.json`` (EOS ``<|endoftext|>`` = id 0), as small as the models."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, 96)}, "[UNK]": 96}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return path
