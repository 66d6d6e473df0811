"""The one tokenizer loader and the one "tokenizer of this model" finder (moe_lit.data.tokenizer)."""

import pytest
import torch

from moe_lit.data.tokenizer import EOS, find_tokenizer, load_tokenizer, model_tokenizer
from moe_lit.errors import MoeLitError


def write_tokenizer(path, special: str):
    """A word-level ``tokenizer.json`` of three words and ``special``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"a": 0, "b": 1, special: 2}, unk_token="a"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


def lightning_file(path, data_dir=None):
    """A Lightning checkpoint whose datamodule read ``data_dir`` (no datamodule when None)."""
    hparams = {"datamodule_hyper_parameters": {"data_dir": str(data_dir)}} if data_dir is not None else {}
    torch.save({"state_dict": {}, **hparams}, path)
    return path


def test_the_tokenizer_of_a_model_is_beside_it_else_in_the_given_data_else_in_its_training_data(tmp_path):
    data, other = tmp_path / "data", tmp_path / "other"
    write_tokenizer(data / "tokenizer.json", EOS)
    write_tokenizer(other / "tokenizer.json", EOS)
    export, bare = tmp_path / "export", tmp_path / "bare"
    write_tokenizer(export / "tokenizer.json", "</s>")
    bare.mkdir()
    ckpt, lone = lightning_file(tmp_path / "run.ckpt", data), lightning_file(tmp_path / "lone.ckpt")

    assert find_tokenizer(export) == find_tokenizer(export, other) == export / "tokenizer.json"
    assert find_tokenizer(bare) is None and find_tokenizer(bare, other) == other / "tokenizer.json"
    assert find_tokenizer(ckpt) == data / "tokenizer.json"
    assert find_tokenizer(ckpt, other) == other / "tokenizer.json"
    assert find_tokenizer(lone) is None and find_tokenizer(ckpt, tmp_path / "empty") is None
    with pytest.raises(MoeLitError, match="no such file or directory"):
        find_tokenizer(tmp_path / "nope.ckpt")


def test_model_tokenizer_takes_the_given_file_any_special_tokens_and_names_the_model_when_there_is_none(tmp_path):
    export, bare = tmp_path / "export", tmp_path / "bare"
    write_tokenizer(export / "tokenizer.json", "</s>")
    bare.mkdir()
    given = write_tokenizer(tmp_path / "given.json", EOS)

    assert model_tokenizer(export).token_to_id("</s>") == 2
    assert model_tokenizer(export, tokenizer=given).token_to_id(EOS) == 2
    with pytest.raises(MoeLitError, match=f"no tokenizer.json stored with {bare} or in {tmp_path}; pass one") as err:
        model_tokenizer(bare, data_dir=tmp_path)
    assert len(str(err.value).splitlines()) == 1


def test_a_tokenizer_for_token_streams_needs_eos_and_the_expected_vocab_size(tmp_path):
    theirs, ours = write_tokenizer(tmp_path / "theirs.json", "</s>"), write_tokenizer(tmp_path / "ours.json", EOS)

    assert load_tokenizer(theirs, require_eos=False).get_vocab_size() == 3
    with pytest.raises(MoeLitError, match=f"tokenizer {theirs}: has no {EOS} token"):
        load_tokenizer(theirs)
    with pytest.raises(MoeLitError, match=f"{ours} has 3 tokens, expected vocab_size 8"):
        load_tokenizer(ours, 8)
    (tmp_path / "broken.json").write_text('{"version": ')
    with pytest.raises(MoeLitError, match="not a readable tokenizer.json"):
        load_tokenizer(tmp_path / "broken.json")
