"""Tiny random transformers models of every supported family (built offline, fp32, seeded)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

COMMON = dict(
    vocab_size=97,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=16,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
)
FAMILY_FIELDS = {
    "llama": dict(intermediate_size=48),
    "mixtral": dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False),
    # a dense first layer, q/k/v biases, a gated shared expert
    "qwen2_moe": dict(
        num_hidden_layers=3,
        intermediate_size=40,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        qkv_bias=True,
        mlp_only_layers=[0],
    ),
    # every second layer sparse, a head dim decoupled from hidden_size / heads, renormalised top-k
    "qwen3_moe": dict(
        num_hidden_layers=3,
        intermediate_size=40,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        head_dim=16,
        decoder_sparse_step=2,
    ),
}
CONFIG_CLASSES = {
    "llama": "LlamaConfig",
    "mixtral": "MixtralConfig",
    "olmoe": "OlmoeConfig",
    "qwen2_moe": "Qwen2MoeConfig",
    "qwen3_moe": "Qwen3MoeConfig",
}
FAMILY_NAMES = list(FAMILY_FIELDS)


def hf_model(name: str, seed: int = 0, **overrides):
    """A random ``<Family>ForCausalLM`` in eval mode, with non-trivial norms and biases."""
    torch.manual_seed(seed)
    fields = {**COMMON, **FAMILY_FIELDS[name], **overrides}
    config = getattr(transformers, CONFIG_CLASSES[name])(**fields)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # a swapped norm or a dropped bias must show in the logits
        for key, param in model.named_parameters():
            if "norm" in key:
                param.uniform_(0.5, 1.5)
            elif key.endswith(".bias"):
                param.normal_(0.0, 0.1)
    return model


def tokens(batch: int = 2, length: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


def hf_experts(model):
    """The fused experts module of a transformers MoE model's first sparse layer."""
    return next(layer.mlp.experts for layer in model.model.layers if hasattr(layer.mlp, "experts"))


def imported_llama(out, vocab_size: int, seq_len: int = 16, **overrides):
    """A random tiny Llama (:func:`hf_model`, 3 layers, FFN width 64, tied embeddings) saved as
    transformers saves it and imported by ``moe-lit convert import-hf``: the moe_lit model directory
    ``out/model`` (no tokenizer: studies then read the data's), a stand-in for an imported SmolLM2."""
    from moe_lit.console_script import main

    fields = dict(vocab_size=vocab_size, num_hidden_layers=3, intermediate_size=64, max_position_embeddings=64)
    hf_model("llama", tie_word_embeddings=True, **{**fields, **overrides}).save_pretrained(out / "hf")
    source, model = str(out / "hf"), str(out / "model")
    assert main(["convert", "import-hf", "--model", source, "--seq-len", str(seq_len), "--out", model]) == 0
    return out / "model"
