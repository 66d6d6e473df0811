"""transformers -> moe_lit: logits equal transformers' for every family; the tokenizer comes along."""

import pytest
import torch

from moe_lit.checkpoint import load_model
from moe_lit.console_script import main
from moe_lit.convert.hf import FAMILIES, from_hf
from moe_lit.errors import MoeLitError
from tests.helpers.hf import CONFIG_CLASSES, FAMILY_NAMES, hf_model, tokens

transformers = pytest.importorskip("transformers")

EXPECTED = {  # what each tiny model must turn into
    "llama": dict(moe=None, qk_norm="none"),
    "mixtral": dict(renormalize=True, qk_norm="none", moe_layers=(0, 1)),
    "olmoe": dict(renormalize=False, qk_norm="full", moe_layers=(0, 1)),
    "qwen2_moe": dict(renormalize=False, qkv_bias=True, shared=(24, True), moe_layers=(1, 2)),
    "qwen3_moe": dict(renormalize=True, qk_norm="head", head_dim=16, moe_layers=(1,)),
}


def test_every_registered_family_has_a_tiny_model_so_the_parity_tests_cover_it():
    assert FAMILY_NAMES == list(FAMILIES.names()) == list(EXPECTED)
    assert CONFIG_CLASSES == {name: FAMILIES[name].config_class for name in FAMILY_NAMES}


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_imported_logits_equal_transformers_logits(name):
    hf, idx = hf_model(name), tokens()
    ours = from_hf(hf)
    cfg, expected = ours.config, EXPECTED[name]
    assert cfg.qk_norm == expected.get("qk_norm", "none") and cfg.qkv_bias == expected.get("qkv_bias", False)
    assert cfg.head_dim == expected.get("head_dim", 8)
    if cfg.moe is not None:
        assert cfg.moe.renormalize == expected["renormalize"] and cfg.moe_layer_ids == expected["moe_layers"]
        assert (cfg.moe.shared_expert_size, cfg.moe.shared_expert_gate) == expected.get("shared", (0, False))
    with torch.no_grad():
        expected_logits = hf(idx).logits
        assert (ours(idx).logits_BLV - expected_logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", ["olmoe", "qwen2_moe"])
def test_import_command_writes_weights_and_tokenizer(name, tmp_path, word_tokenizer):
    hf, idx = hf_model(name, eos_token_id=0), tokens()  # a special id the 97-word tokenizer has
    hf.save_pretrained(tmp_path / "hf")
    transformers.PreTrainedTokenizerFast(tokenizer_file=str(word_tokenizer), eos_token="<|endoftext|>").save_pretrained(
        tmp_path / "hf"
    )
    assert main(["convert", "import-hf", "--model", str(tmp_path / "hf"), "--out", str(tmp_path / "ours")]) == 0
    assert (tmp_path / "ours" / "tokenizer.json").read_text() == (tmp_path / "hf" / "tokenizer.json").read_text()
    with torch.no_grad():
        assert (load_model(tmp_path / "ours")(idx).logits_BLV - hf(idx).logits).abs().max().item() < 1e-4


def test_tokenizer_without_tokenizer_json_is_converted(tmp_path, word_tokenizer):
    from tokenizers import Tokenizer

    from moe_lit.convert.hf.tokenizer import NoTokenizer, write_tokenizer_json

    hf_model("llama").save_pretrained(tmp_path / "hf")
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(word_tokenizer), eos_token="<|endoftext|>")
    hf_tok.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").rename(tmp_path / "elsewhere.json")  # only tokenizer_config.json left
    with pytest.raises(NoTokenizer, match="holds no tokenizer files"):
        write_tokenizer_json(tmp_path / "hf", tmp_path / "out.json")
    assert not (tmp_path / "out.json").exists()
    (tmp_path / "elsewhere.json").rename(tmp_path / "hf" / "tokenizer.json")
    (tmp_path / "hf" / "tokenizer_config.json").unlink()  # AutoTokenizer still finds tokenizer.json
    assert write_tokenizer_json(tmp_path / "hf", tmp_path / "out.json") == tmp_path / "out.json"
    assert Tokenizer.from_file(str(tmp_path / "out.json")).encode("w3 w5").ids == [3, 5]


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_a_directory_without_tokenizer_files_imports_with_none_and_one_line(name, tmp_path, capsys):
    """transformers 5 makes up a tokenizer of 1-2 tokens for olmoe and qwen from the model type alone."""
    hf_model(name).save_pretrained(tmp_path / "hf")
    assert main(["convert", "import-hf", "--model", str(tmp_path / "hf"), "--out", str(tmp_path / "ours")]) == 0
    assert not (tmp_path / "ours" / "tokenizer.json").exists()
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert notes == [
        f"note: no tokenizer written: {tmp_path / 'hf'} holds no tokenizer files (tokenizer.json, tokenizer.model, "
        f"vocab.json, vocab.txt, spiece.model, sentencepiece.bpe.model, tekken.json); {tmp_path / 'ours'} has none "
        "(eval needs --tokenizer)"
    ]


def _vocabulary(size: int, start: int = 0) -> dict[str, int]:
    return {f"w{i}": i for i in range(start, start + size)}


@pytest.mark.parametrize(
    "vocabulary, special, message",
    [
        (_vocabulary(97), {}, None),
        (_vocabulary(97), {"eos_token_id": 96, "bos_token_id": 1, "pad_token_id": -1}, None),
        (_vocabulary(60), {}, None),  # an embedding padded past the tokenizer
        (_vocabulary(2), {}, "it has 2 tokens for the model's vocab_size 97"),
        (_vocabulary(98), {}, "its ids reach 97, past the model's vocab_size 97"),
        (_vocabulary(90), {"eos_token_id": 95}, "it has no token of the model's eos_token_id 95"),
        (_vocabulary(90), {"eos_token_id": [1, 93]}, "it has no token of the model's eos_token_id 93"),
    ],
)
def test_a_tokenizer_fits_a_model_by_its_ids_size_and_special_ids(vocabulary, special, message):
    from types import SimpleNamespace

    from moe_lit.convert.hf.tokenizer import tokenizer_misfit

    assert tokenizer_misfit(vocabulary, SimpleNamespace(vocab_size=97, **special)) == message


def test_a_tokenizer_that_is_not_the_models_is_not_imported(tmp_path, word_tokenizer, capsys):
    hf = hf_model("mixtral", vocab_size=300)  # the 97-word tokenizer fills a third of it
    hf.save_pretrained(tmp_path / "hf")
    transformers.PreTrainedTokenizerFast(tokenizer_file=str(word_tokenizer), eos_token="<|endoftext|>").save_pretrained(
        tmp_path / "hf"
    )
    assert main(["convert", "import-hf", "--model", str(tmp_path / "hf"), "--out", str(tmp_path / "ours")]) == 0
    assert not (tmp_path / "ours" / "tokenizer.json").exists()
    out = capsys.readouterr().out
    assert (
        f"note: no tokenizer written: the tokenizer of {tmp_path / 'hf'} is not this model's: it has 97 tokens " in out
    )


@pytest.mark.parametrize(
    "name, overrides, message",
    [
        ("olmoe", dict(clip_qkv=8.0), "clip_qkv=8.0 is not supported"),
        ("mixtral", dict(sliding_window=8), "sliding_window=8 is not supported"),
        ("qwen3_moe", dict(use_sliding_window=True, sliding_window=8), "use_sliding_window=True is not supported"),
        ("qwen2_moe", dict(num_hidden_layers=4, mlp_only_layers=[2]), r"MoE layers \[0, 1, 3\]"),
        ("olmoe", dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    ],
)
def test_unsupported_variants_are_refused_by_name(name, overrides, message, tmp_path):
    hf = hf_model(name, **overrides)
    with pytest.raises(MoeLitError, match=message):
        from_hf(hf)
    hf.save_pretrained(tmp_path / "hf")
    assert main(["convert", "import-hf", "--model", str(tmp_path / "hf"), "--out", str(tmp_path / "ours")]) == 2
    assert not (tmp_path / "ours").exists()


def test_import_is_pure_and_can_keep_bfloat16(tmp_path):
    hf, idx = hf_model("qwen3_moe"), tokens()
    before = {k: v.clone() for k, v in hf.state_dict().items()}
    rng = torch.get_rng_state()
    ours = from_hf(hf)
    assert torch.equal(torch.get_rng_state(), rng)  # no throw-away initialisation
    with torch.no_grad():
        next(ours.parameters()).add_(1.0)  # ours owns its tensors
    assert all(torch.equal(v, before[k]) for k, v in hf.state_dict().items())
    hf.save_pretrained(tmp_path / "hf")
    args = ["--model", str(tmp_path / "hf"), "--dtype", "bfloat16", "--out", str(tmp_path / "ours")]
    assert main(["convert", "import-hf", *args]) == 0
    from safetensors.torch import load_file

    assert {v.dtype for v in load_file(tmp_path / "ours" / "model.safetensors").values()} == {torch.bfloat16}
    with torch.no_grad():
        assert (load_model(tmp_path / "ours")(idx).logits_BLV - hf(idx).logits).abs().max().item() < 0.1
