"""Inference precision (``--precision`` of generate and eval): forced values, auto by CPU
capability and a probe of the model's forward, bf16 weights that decode like fp32."""

from __future__ import annotations

import json

import pytest
import torch

from moe_lit.console_script import main
from moe_lit.errors import MoeLitError
from moe_lit.inference import generate
from moe_lit.inference import precision as capability
from moe_lit.inference.precision import (
    PrecisionChoice,
    choose_inference_precision,
    probe_forward_speedup,
    run_in_precision,
)
from moe_lit.model import Transformer
from tests.helpers.models import random_init, tiny


@pytest.fixture
def dense():
    return random_init(Transformer(tiny(dense=True, seq_len=32)).eval())


def test_forced_precisions_and_a_bad_value(dense):
    assert choose_inference_precision("32-true", dense, "cpu") == PrecisionChoice("32-true", "--precision")
    assert choose_inference_precision("bf16-true", dense, "cuda").precision == "bf16-true"
    with pytest.raises(MoeLitError, match=r"precision: got 'fp16', allowed values: auto, 32-true, bf16-true"):
        choose_inference_precision("fp16", dense, "cpu")


def test_auto_decides_by_capability_then_probe(dense, bf16_cpu, monkeypatch):
    speedups = iter([2.0, 1.1])
    monkeypatch.setattr(capability, "probe_forward_speedup", lambda model: next(speedups))
    fast = choose_inference_precision("auto", dense, "cpu")
    assert fast.precision == "bf16-true" and "avx512_bf16, bf16 forward probe 2.00x fp32" in fast.line()
    slow = choose_inference_precision("auto", dense, "cpu")
    assert slow.precision == "32-true" and "1.10x fp32, below 1.3x" in slow.reason
    assert choose_inference_precision("auto", dense, "cuda").precision == "32-true"


def test_auto_keeps_fp32_for_an_moe_and_without_native_bf16(dense, tmp_path, monkeypatch, bf16_cpu):
    monkeypatch.setattr(capability, "probe_forward_speedup", lambda model: pytest.fail("no probe here"))
    moe = Transformer(tiny(num_experts=4, expert_size=16))
    choice = choose_inference_precision("auto", moe, "cpu")
    assert choice.precision == "32-true" and "an MoE model" in choice.reason
    (tmp_path / "plain").write_text("flags : sse avx2\n")
    monkeypatch.setattr(capability, "CPUINFO", tmp_path / "plain")
    assert choose_inference_precision("auto", dense, "cpu").reason == "auto: no native bf16 on this CPU"


def test_probe_leaves_the_model_in_fp32_and_untouched(dense):
    before = {k: v.clone() for k, v in dense.state_dict().items()}
    assert probe_forward_speedup(dense) > 0
    assert all(v.dtype == torch.float32 and torch.equal(before[k], v) for k, v in dense.state_dict().items())


@pytest.mark.parametrize("moe", [False, True])
def test_bf16_weights_stay_near_fp32_and_the_bf16_cache_decodes_like_recompute(moe):
    """bf16 weights move each log-probability by less than 0.05 here; decoding with the bf16 KV
    cache picks the tokens a bf16 full recompute picks; the dense model's greedy tokens are fp32's
    (an MoE's may part where a routing choice flips)."""
    config = tiny(num_experts=4, expert_size=16, seq_len=32) if moe else tiny(dense=True, seq_len=32)
    fp32 = random_init(Transformer(config).eval())
    bf16 = run_in_precision(random_init(Transformer(config).eval()), PrecisionChoice("bf16-true", "test"))
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    idx_BL = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        exact, rounded = (m(idx_BL).logits_BLV.float().log_softmax(-1) for m in (fp32, bf16))
    assert (exact - rounded).abs().max() < 0.05
    prompts = idx_BL.tolist()
    assert generate(bf16, prompts, 6) == _recompute_greedy(bf16, prompts, 6)
    if not moe:
        assert generate(bf16, prompts, 6) == generate(fp32, prompts, 6)


@torch.no_grad()
def _recompute_greedy(model, prompts: list[list[int]], steps: int) -> list[list[int]]:
    rows = [list(p) for p in prompts]
    for _ in range(steps):
        logits_BV = model(torch.tensor(rows)).logits_BLV[:, -1]
        for row, token in zip(rows, logits_BV.argmax(-1).tolist(), strict=True):
            row.append(token)
    return [row[len(p) :] for row, p in zip(rows, prompts, strict=True)]


def test_generate_and_eval_say_their_precision(exported, prepared_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    args = ["generate", "--checkpoint", str(exported), "--prompt", "Open", "--max-new-tokens", "4"]
    assert main([*args, "--precision", "bf16-true"]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == ["precision: bf16-true (--precision)"] and captured.out.startswith("Open")
    assert main(args) == 0  # auto: an MoE stays in fp32
    assert "precision: 32-true (auto: an MoE model" in capsys.readouterr().err
    out = tmp_path / "e"
    eval_args = ["eval", "--checkpoint", str(exported), "--tasks", "moe_lit_pairs_en", "--data", str(prepared_dir)]
    eval_args += ["--limit", "2", "--bootstrap-iters", "0", "--precision", "32-true", "--out", str(out)]
    assert main(eval_args) == 0
    assert json.loads((out / "results.json").read_text())["moe_lit_precision"] == "precision: 32-true (--precision)"
    markdown = (out / "results.md").read_text()
    assert "--precision 32-true" in markdown and "\nprecision: 32-true (--precision)\n" in markdown


def test_a_precision_outside_the_choices_exits_2_naming_it(exported, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--checkpoint", str(exported), "--prompt", "a", "--precision", "fp16"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert exc.value.code == 2 and "--precision: invalid choice: 'fp16'" in last and "bf16-true" in last
