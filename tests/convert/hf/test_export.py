"""moe_lit -> transformers: from_pretrained loads the export offline, logits and greedy generations equal ours,
import of the export is the identity, features a format lacks are refused by name with exit 2."""

import copy
import json

import pytest
import torch

from moe_lit.accounting import count_config_params
from moe_lit.checkpoint import export_model, load_config, load_model
from moe_lit.console_script import main
from moe_lit.convert.hf import from_hf, to_hf
from moe_lit.convert.model_input import load_any_model
from moe_lit.errors import MoeLitError
from moe_lit.model import Transformer
from tests.helpers.hf import hf_experts, tokens
from tests.helpers.models import tiny

transformers = pytest.importorskip("transformers")

NO_BIAS = dict(expert_output_bias=False, init_std=0.1)
# NOTE: d_ff is unused when every layer is MoE; mixtral / olmoe import it as the expert size.
NATIVE = {  # our models that each format can hold, using what the format has
    "llama": tiny(dense=True, n_kv_heads=2, init_std=0.1, tie_embeddings=True),
    "mixtral": tiny(n_kv_heads=2, d_ff=16, **NO_BIAS),
    "olmoe": tiny(qk_norm="full", renormalize=False, d_ff=16, **NO_BIAS),
    "qwen2_moe": tiny(
        n_layers=3,
        first_dense_layers=1,
        qkv_bias=True,
        shared_expert_size=24,
        shared_expert_gate=True,
        renormalize=False,
        **NO_BIAS,
    ),
    "qwen3_moe": tiny(n_layers=3, first_dense_layers=1, layer_interval=2, qk_norm="head", attn_head_dim=16, **NO_BIAS),
}


def native(name: str, **changes) -> Transformer:
    cfg = NATIVE[name].replace(**changes) if changes else NATIVE[name]
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # norms and biases off their init, so a wrong mapping shows
        for key, param in model.named_parameters():
            if "norm" in key:
                param.uniform_(0.5, 1.5)
            elif param.dim() == 1:
                param.normal_(0.0, 0.1)
    return model


def greedy(model: Transformer, idx_BL: torch.Tensor, new_tokens: int, eos_id: int = 0) -> torch.Tensor:
    """Greedy decoding by full forwards of our model (no cache); as transformers' ``generate``, a row
    that emitted EOS goes on with pad (= EOS here) and decoding stops when every row has."""
    done_B = torch.zeros(idx_BL.shape[0], dtype=torch.bool)
    for _ in range(new_tokens):
        next_B = model(idx_BL).logits_BLV[:, -1].argmax(dim=-1).masked_fill(done_B, eos_id)
        done_B |= next_B == eos_id
        idx_BL = torch.cat([idx_BL, next_B[:, None]], dim=1)
        if done_B.all():
            break
    return idx_BL


def export(model, name, tmp_path, tokenizer, *extra) -> int:
    export_model(model, tmp_path / "ours", tokenizer)
    args = ["--checkpoint", str(tmp_path / "ours"), "--format", name, "--out", str(tmp_path / "hf"), *extra]
    return main(["export", *args])


@pytest.mark.parametrize("name", list(NATIVE))
def test_export_loads_in_transformers_and_computes_what_ours_does(name, tmp_path, word_tokenizer):
    ours, idx = native(name), tokens()
    assert export(ours, name, tmp_path, word_tokenizer) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    assert hf.config.model_type == name
    with torch.no_grad():
        assert (hf(idx).logits - ours(idx).logits_BLV).abs().max().item() < 1e-4
        prompt = idx[:, :6]
        expected = greedy(ours, prompt, 8)
        generated = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False)
    assert torch.equal(generated, expected)
    # export then import: the identity on the config and the state dict
    back = from_hf(tmp_path / "hf")
    assert back.config == ours.config
    back_state, state = back.state_dict(), ours.state_dict()
    assert back_state.keys() == state.keys() and all(torch.equal(back_state[k], state[k]) for k in state)


def test_export_writes_tokenizer_generation_config_and_shards(tmp_path, word_tokenizer):
    assert export(native("mixtral"), "mixtral", tmp_path, word_tokenizer, "--max-shard-size", "20KB") == 0
    files = {path.name for path in (tmp_path / "hf").iterdir()}
    assert "model.safetensors.index.json" in files and "model-00001-of-" in " ".join(files)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert (tok.eos_token, tok.bos_token, tok.pad_token) == ("<|endoftext|>",) * 3
    assert tok("w3 w17 w95")["input_ids"] == [3, 17, 95]  # as our tokenizer: no added BOS
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["bos_token_id"], generation["pad_token_id"]) == (0, 0, 0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    # moe-lit accounting reads the exported directory, exactly
    assert count_config_params(from_hf(tmp_path / "hf").config).total == sum(p.numel() for p in hf.parameters())
    assert main(["accounting", "--config", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    assert (
        main(["export", "--checkpoint", str(tmp_path / "hf"), "--format", "mixtral", "--out", str(tmp_path / "again")])
        == 0
    )
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == json.loads(
        (tmp_path / "hf" / "config.json").read_text()
    )
    # every model-taking command reads a transformers dir as import-hf would
    idx = torch.randint(0, 97, (1, 8))
    assert torch.equal(load_any_model(tmp_path / "hf")(idx).logits_BLV, from_hf(tmp_path / "hf")(idx).logits_BLV)
    # the layer below the HF import names the loader that reads it
    for load in (load_config, load_model):
        with pytest.raises(MoeLitError, match="a transformers directory; read it with moe_lit.convert.model_input"):
            load(tmp_path / "hf")


def test_export_refuses_a_non_empty_out_unless_forced(tmp_path, word_tokenizer, capsys):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("x")
    assert export(native("llama"), "llama", tmp_path, word_tokenizer) == 2
    assert "--out" in capsys.readouterr().err and (tmp_path / "hf" / "keep.txt").exists()
    assert export(native("llama"), "llama", tmp_path, word_tokenizer, "--force") == 0
    assert not (tmp_path / "hf" / "keep.txt").exists() and (tmp_path / "hf" / "config.json").is_file()


def test_default_moe_with_its_zero_expert_bias_exports(word_tokenizer):
    model = native("mixtral", moe={"expert_output_bias": True})
    for layer in model.moe_layers():
        layer.experts.bias.data.zero_()
    idx = tokens()
    with torch.no_grad():
        assert (to_hf(model, "mixtral")(idx).logits - model(idx).logits_BLV).abs().max().item() < 1e-4


def _nonzero(attribute):
    def change(model):
        for layer in model.moe_layers():
            getattr(layer, attribute[0]).__getattr__(attribute[1]).data.fill_(0.5)
        return model

    return change


@pytest.mark.parametrize(
    "name, fmt, changes, change, message",
    [
        (
            "mixtral",
            "mixtral",
            {"moe": {"expert_size": [8, 16, 16, 24]}},
            None,
            "heterogeneous experts .*no export format has it",
        ),
        ("olmoe", "olmoe", {"moe": {"score_func": "sigmoid"}}, None, "sigmoid routing .*no export format has it"),
        (
            "qwen3_moe",
            "qwen3_moe",
            {"moe": {"balancing": "bias"}},
            _nonzero(("router", "expert_bias")),
            "selection bias .*no export format has it",
        ),
        (
            "mixtral",
            "mixtral",
            {"moe": {"expert_output_bias": True}},
            _nonzero(("experts", "bias")),
            r"expert output bias \(experts.bias; train with moe.expert_output_bias=false\)",
        ),
        ("mixtral", "mixtral", {"moe": {"capacity_factor": 1.0}}, None, "capacity dropping"),
        (
            "olmoe",
            "olmoe",
            {"moe": {"unit_weights": True, "renormalize": False}},
            None,
            "unit routing weights .*no export format has it",
        ),
        (
            "olmoe",
            "olmoe",
            {"moe": {"layer_expert_sizes": [[16] * 4, [16] * 3]}},
            None,
            "different expert counts .*no export format has it",
        ),
        (
            "qwen3_moe",
            "olmoe",
            {"attn_head_dim": None, "moe": {"first_dense_layers": 0, "layer_interval": 1}},
            None,
            "per-head q/k RMSNorm .*unsupported by olmoe; formats that have it: qwen3_moe",
        ),
        (
            "mixtral",
            "llama",
            {},
            None,
            "MoE layers: unsupported by llama; formats that have it: mixtral, olmoe, qwen2_moe, qwen3_moe",
        ),
        ("llama", "mixtral", {}, None, "a dense model .*formats that have it: llama"),
        (
            "mixtral",
            "mixtral",
            {"moe": {"renormalize": False}},
            None,
            "without renormalisation .*formats that have it: olmoe, qwen2_moe, qwen3_moe",
        ),
        ("mixtral", "olmoe", {}, None, "every olmoe model has full-width q/k RMSNorm"),
        (
            "qwen2_moe",
            "olmoe",
            {"qkv_bias": False, "moe": {"shared_expert_gate": False}},
            None,
            "dense FFN layers in an MoE model",
        ),
    ],
)
def test_a_feature_the_format_lacks_is_refused_by_name(
    name, fmt, changes, change, message, tmp_path, word_tokenizer, capsys
):
    model = native(name, **changes)
    model = change(model) if change else model
    with pytest.raises(MoeLitError, match=message):
        to_hf(model, fmt)
    assert export(model, fmt, tmp_path, word_tokenizer) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"export --format {fmt}:" in err
    assert not (tmp_path / "hf").exists()


def test_export_without_a_tokenizer_writes_the_model_alone_with_a_note(tmp_path, capsys, word_tokenizer):
    ours, prompt = native("mixtral"), tokens()[:, :6]
    assert export(ours, "mixtral", tmp_path, None) == 0
    assert sorted(path.name for path in (tmp_path / "hf").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert notes == [
        f"note: {tmp_path / 'ours'} has no stored tokenizer; {tmp_path / 'hf'} holds the model alone "
        "(--tokenizer adds one)"
    ]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert (hf.config.eos_token_id, hf.generation_config.eos_token_id) == (None, None)  # no made-up end of text
    with torch.no_grad():
        generated = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8)
    assert torch.equal(generated, greedy(ours, prompt, 8, eos_id=-1))  # never stops early
    # --tokenizer still adds one
    assert export(ours, "mixtral", tmp_path, None, "--tokenizer", str(word_tokenizer), "--force") == 0
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")("w3 w17")["input_ids"] == [3, 17]


@pytest.mark.parametrize(
    "name, expert_size, dtype",
    [("mixtral", 30, "float32"), ("olmoe", 30, "float32"), ("qwen2_moe", 30, "float32"), ("qwen3_moe", 28, "bfloat16")],
)
def test_an_expert_size_off_the_kernels_multiple_is_padded_exactly(name, expert_size, dtype, tmp_path, word_tokenizer):
    """transformers' default grouped_mm needs 16-byte strides: unpadded, 30 fails in float32, 28 in bfloat16."""
    ours, idx = native(name, moe={"expert_size": expert_size}), tokens()
    assert export(ours, name, tmp_path, word_tokenizer, "--dtype", dtype) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")  # transformers' defaults
    assert hf.config._experts_implementation == "grouped_mm" and hf.dtype == getattr(torch, dtype)
    padded = -(-expert_size // 8) * 8
    assert hf_experts(hf).down_proj.shape[-1] == padded
    reference = copy.deepcopy(ours)  # ours in the exported dtype
    for param in reference.parameters():
        param.data = param.data.to(getattr(torch, dtype)).float()
    prompt = idx[:, :6]
    with torch.no_grad():
        generated = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8)
        back = from_hf(tmp_path / "hf")  # padded shapes come back padded, the logits as they were
        assert back.config.moe.expert_size == padded
        assert (back(idx).logits_BLV - reference(idx).logits_BLV).abs().max().item() < 1e-5
        if dtype == "float32":
            assert (hf(idx).logits - ours(idx).logits_BLV).abs().max().item() < 1e-4
    if dtype == "float32":
        assert torch.equal(generated, greedy(reference, prompt, 8))
    else:  # bfloat16 arithmetic may part from ours; it runs on the default path
        assert generated.shape[1] > prompt.shape[1]


def test_a_d_model_off_the_kernels_multiple_names_the_eager_experts(tmp_path):
    ours, idx = native("mixtral", d_model=36, n_heads=2, n_kv_heads=None), tokens()
    assert export(ours, "mixtral", tmp_path, None, "--dtype", "bfloat16") == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["experts_implementation"] == "eager"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert hf.config._experts_implementation == "eager"
    fast = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", experts_implementation="grouped_mm")
    with torch.no_grad():
        assert hf.generate(idx[:, :6], attention_mask=torch.ones_like(idx[:, :6]), max_new_tokens=4).shape == (2, 10)
        with pytest.raises(RuntimeError, match="strides should be multiple of 16 bytes"):
            fast(idx)
    assert export(native("mixtral"), "mixtral", tmp_path, None, "--force") == 0  # d_model 32: the default
    assert "experts_implementation" not in json.loads((tmp_path / "hf" / "config.json").read_text())


def test_an_ungated_shared_expert_exports_to_qwen2_moe_with_a_zero_gate_exactly(tmp_path):
    ours = native("qwen2_moe", qkv_bias=False, moe={"shared_expert_gate": False})
    idx = tokens()
    assert export(ours, "qwen2_moe", tmp_path, None) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert hf.config.shared_expert_intermediate_size == 24
    assert not hf.model.layers[1].mlp.shared_expert_gate.weight.any()
    prompt = idx[:, :6]
    with torch.no_grad():
        assert (hf(idx).logits - ours(idx).logits_BLV).abs().max().item() < 1e-4
        generated = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8)
        back = from_hf(tmp_path / "hf")
        assert back.config.moe.shared_expert_gate  # comes back gated, computing the same
        assert (back(idx).logits_BLV - ours(idx).logits_BLV).abs().max().item() < 1e-5
    assert torch.equal(generated, greedy(ours, prompt, 8, eos_id=-1))


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # the empty shared expert
def test_a_plain_moe_exports_to_qwen2_moe_with_an_empty_shared_expert():
    model, idx = native("mixtral"), tokens()
    hf = to_hf(model, "qwen2_moe")
    assert hf.config.shared_expert_intermediate_size == 0
    with torch.no_grad():
        assert (hf(idx).logits - model(idx).logits_BLV).abs().max().item() < 1e-4
    back = from_hf(hf)
    assert back.config.moe.shared_expert_size == 0 and back.state_dict().keys() == model.state_dict().keys()
