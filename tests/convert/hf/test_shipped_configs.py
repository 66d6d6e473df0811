"""Every model config shipped in configs/model/ exports: built at test size, trained 2 steps, exported
to each format docs/conversion.md names for it (the model alone, no tokenizer), loaded by
``AutoModelForCausalLM.from_pretrained`` with its default arguments; its greedy generation equals
ours, and importing the export back keeps our logits."""

import re
from pathlib import Path

import pytest
import torch

from moe_lit.checkpoint import export_model
from moe_lit.config import ModelConfig
from moe_lit.console_script import main
from moe_lit.convert.hf import FAMILIES, from_hf
from moe_lit.convert.hf.core import HF_ALIGN, config_features
from moe_lit.inference.generate import generate
from moe_lit.model import Transformer
from tests.helpers.hf import hf_experts

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[3]
CONFIGS = sorted((REPO / "configs" / "model").glob("*.yaml"))
VOCAB, SEQ = 97, 16
WIDTH, HEADS = 64, 4
"""Test size of the realistic presets (d_model and query heads)."""


def formats_of(cfg: ModelConfig) -> list[str]:
    """The export formats whose features hold every one ``cfg`` uses and that need none it lacks."""
    used = config_features(cfg)
    return [name for name, fam in FAMILIES.items() if used <= fam.features and fam.required <= used]


def documented_formats() -> dict[str, list[str]]:
    """docs/conversion.md's table of shipped configs: config stem -> the formats of its row."""
    text = (REPO / "docs" / "conversion.md").read_text()
    rows = re.findall(r"^\| `configs/model/([\w.-]+)\.yaml` \| ([^|]+) \|", text, re.MULTILINE)
    return {stem: re.findall(r"`(\w+)`", formats) for stem, formats in rows}


def at_test_size(cfg: ModelConfig) -> ModelConfig:
    """A tiny config (97 tokens, 16 positions, its first dense layers and two more) using exactly the
    features of ``cfg``; the realistic presets also narrowed to d_model 64 and 8 experts of 30 (not
    a multiple of 8: export pads it)."""
    moe = cfg.moe
    layers = 2 if moe is None else moe.first_dense_layers + 2 * moe.layer_interval
    small = cfg.replace(vocab_size=VOCAB, seq_len=SEQ, n_layers=min(cfg.n_layers, layers))
    if moe is not None and cfg.d_model > 128:
        small = small.replace(
            d_model=WIDTH,
            n_heads=HEADS,
            n_kv_heads=None if cfg.n_kv_heads is None else HEADS // 2,
            attn_head_dim=None if cfg.attn_head_dim is None else 2 * WIDTH // HEADS,
            d_ff=96,
            moe={
                "num_experts": 8,
                "expert_size": 30,
                "top_k": min(moe.top_k, 4),
                "shared_expert_size": 60 if moe.shared_expert_size else 0,
            },
        )
    assert config_features(small) == config_features(cfg)
    return small


def trained(cfg: ModelConfig, steps: int = 2) -> Transformer:
    """``cfg`` built (seed 0) and trained ``steps`` AdamW steps on random tokens, in eval mode."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        idx = torch.randint(0, VOCAB, (2, SEQ + 1))
        out = model(idx[:, :-1], idx[:, 1:])
        (out.ce + out.aux_loss).backward()
        optimizer.step()
        optimizer.zero_grad()
        model.update_router_biases()
    return model.eval()


def test_every_shipped_config_is_in_the_docs_table_with_every_format_it_exports_to():
    documented = documented_formats()
    assert sorted(documented) == [path.stem for path in CONFIGS]
    for path in CONFIGS:
        formats = formats_of(ModelConfig.from_yaml(path))
        assert formats, f"{path.name} exports to no format"
        assert documented[path.stem] == formats, path.name


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # qwen2_moe: an empty shared expert
@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.stem)
def test_a_shipped_config_exports_and_transformers_generates_what_we_do(path, tmp_path, capsys):
    cfg = at_test_size(ModelConfig.from_yaml(path))
    ours = trained(cfg)
    export_model(ours, tmp_path / "ours")  # no tokenizer stored
    prompts = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    expected = torch.tensor(generate(ours, prompts.tolist(), max_new_tokens=8))
    for fmt in formats_of(cfg):
        out = tmp_path / fmt
        assert main(["export", "--checkpoint", str(tmp_path / "ours"), "--format", fmt, "--out", str(out)]) == 0
        assert "holds the model alone" in capsys.readouterr().out
        hf = transformers.AutoModelForCausalLM.from_pretrained(out)
        if cfg.is_moe:  # the fast default path, with the expert size padded to a multiple of 8
            assert hf.config._experts_implementation == "grouped_mm"
            assert hf_experts(hf).down_proj.shape[-1] % HF_ALIGN == 0
        with torch.no_grad():
            generated = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=8)
        assert torch.equal(generated[:, prompts.shape[1] :], expected), fmt
        back = from_hf(out)
        with torch.no_grad():
            assert (back(prompts).logits_BLV - ours(prompts).logits_BLV).abs().max().item() < 1e-5
        if path.stem == f"tiny-{fmt.replace('_', '-')}":  # a family preset: exactly that family's model
            back_state, state = back.state_dict(), ours.state_dict()
            assert back_state.keys() == state.keys() and all(torch.equal(back_state[k], state[k]) for k in state)
