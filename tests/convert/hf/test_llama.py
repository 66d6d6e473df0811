import pytest
import torch

from moe_lit.checkpoint import load_model
from moe_lit.console_script import main
from moe_lit.convert import dense_to_moe
from moe_lit.errors import MoeLitError

transformers = pytest.importorskip("transformers")


def _hf_llama(tie: bool, **overrides):
    torch.manual_seed(0)
    fields = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        rope_theta=5000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
    )
    fields.update(overrides)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)).eval()
    with torch.no_grad():  # non-trivial norms so that a swapped norm mapping shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_imported_llama_logits_equal_transformers_logits(tie, tmp_path):
    from moe_lit.convert.hf import from_hf_llama

    hf = _hf_llama(tie)
    idx = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    ours = from_hf_llama(hf)
    cfg = ours.config
    assert (cfg.n_kv_heads, cfg.rope_base, cfg.norm_eps, cfg.tie_embeddings) == (2, 5000.0, 1e-6, tie)
    with torch.no_grad():
        expected = hf(idx).logits
    assert (ours(idx).logits_BLV - expected).abs().max().item() < 1e-5
    hf.save_pretrained(tmp_path / "hf")  # the directory route, offline, through the CLI
    assert main(["convert", "import-hf", "--model", str(tmp_path / "hf"), "--out", str(tmp_path / "ours")]) == 0
    from_dir = load_model(tmp_path / "ours")
    assert (from_dir(idx).logits_BLV - expected).abs().max().item() < 1e-5
    upcycled = dense_to_moe(ours, "granular", num_experts=4, top_k=2, granularity=2)
    assert (upcycled(idx).logits_BLV - expected).abs().max().item() < 1e-5


def test_unsupported_llama_variants_are_refused():
    from moe_lit.convert.hf import from_hf_llama

    with pytest.raises(MoeLitError, match="attention_bias=True is not supported"):
        from_hf_llama(_hf_llama(False, attention_bias=True))
    with pytest.raises(MoeLitError, match="rope_type='linear'"):
        from_hf_llama(_hf_llama(False, rope_scaling={"rope_type": "linear", "factor": 2.0}))
