"""The models give the same bits at any intra-op thread count, in fp32 and under bf16 autocast ("same seed,
same bits": ThreadShare changes the count mid-run, and machines differ in cores).

Two kinds of CPU kernel followed the thread count (``moe_lit/model/invariant.py``): MKL's skinny fp32 GEMMs
(an expert given a handful of tokens) and ``silu`` over more than one grain of hidden cells (its range split
where the thread count says). The sizes here are the demo's (d_model 128, 32 experts of 251, vocabulary 2048,
batch 16 x 128), and the counts include 3 and 5, which split a power-of-two buffer off the vector width.
bf16 cases run only where the CPU has native bf16 (``avx512_bf16``, ``amx_bf16``): elsewhere autocast
emulates it, and ``train.precision: auto`` never picks it.
"""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from moe_lit.commands.demo import MODELS, load_module_config
from moe_lit.inference.precision import native_bf16_flags
from moe_lit.model.experts.layout import ExpertLayout
from moe_lit.model.experts.torch_backend import TorchExperts
from moe_lit.model.invariant import swiglu
from moe_lit.model.transformer import Transformer
from tests.helpers.models import experts_pass, random_init, skewed_routing, torch_threads, train_at_threads

VOCAB, SEQ, BATCH = 2048, 128, 16
"""The demo's vocabulary and batch (configs/runs/demo.yaml)."""

PRECISIONS = [
    pytest.param(False, id="fp32"),
    pytest.param(
        True,
        id="bf16",
        marks=pytest.mark.skipif(not native_bf16_flags(), reason="the CPU has no native bf16 (avx512_bf16, amx_bf16)"),
    ),
]


def demo_config(name: str, **changes):
    model_cfg, _ = load_module_config(MODELS[name])
    return dataclasses.replace(model_cfg, vocab_size=VOCAB, seq_len=SEQ, **changes)


def test_swiglu_gives_the_one_thread_bits_of_the_plain_product_at_any_thread_count():
    # 1,028,849 cells: more than one grain, and a length whose split at 3 threads falls off the vector width
    gen = torch.Generator().manual_seed(0)
    h1, h2, dout = (4 * torch.randn(1_028_849, generator=gen) for _ in range(3))

    def plain():
        a, b = h1.clone().requires_grad_(True), h2.clone().requires_grad_(True)
        out = F.silu(a) * b
        return [out.detach(), *torch.autograd.grad(out, [a, b], dout)]

    def invariant():
        a, b = h1.clone().requires_grad_(True), h2.clone().requires_grad_(True)
        out = swiglu(a, b)
        overwritten = swiglu(h1.clone(), h2, overwrite=True)
        return [out.detach(), *torch.autograd.grad(out, [a, b], dout), overwritten]

    with torch_threads(1):
        reference = plain()
    with torch_threads(3):
        assert not torch.equal(plain()[0], reference[0])  # what the helper is for, on this length
        got = invariant()
    assert all(torch.equal(a, b) for a, b in zip([*reference, reference[0]], got, strict=True))


@pytest.mark.parametrize("bf16", PRECISIONS)
@pytest.mark.parametrize("strategy", ["looped", "batched"])
def test_experts_forward_and_backward_are_the_same_bits_at_1_2_3_and_5_threads(strategy, bf16):
    # blocks of 2-11 slots (the skinny GEMMs, one thread), 20-100 slots (threaded GEMMs) and the rest
    cfg = demo_config("moe")
    num_experts, size = cfg.moe.num_experts, cfg.moe.expert_size
    indices = skewed_routing(2048, [2, 5, 6, 7, 10, 11, 20, 33, 40, 47, 64, 100], num_experts=num_experts)
    experts = random_init(TorchExperts(cfg.d_model, ExpertLayout.of([size] * num_experts), strategy=strategy))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2048, cfg.d_model, generator=gen)
    gates = torch.rand(2048, 2, generator=gen)
    dy = torch.randn(2048, cfg.d_model, generator=gen)

    one = experts_pass(experts, indices, x, gates, dy, threads=1, bf16=bf16)
    assert one[0].dtype == (torch.bfloat16 if bf16 else torch.float32)
    for threads in (2, 3, 5):
        other = experts_pass(experts, indices, x, gates, dy, threads, bf16=bf16)
        assert all(torch.equal(a, b) for a, b in zip(one, other, strict=True)), threads


ROUTING_OPTIONS = {"score_func": "sigmoid", "shared_expert_size": 256, "shared_expert_gate": True, "z_loss_coef": 1e-3}
"""The other router and expert options, on the demo MoE (with per-head qk norm)."""


@pytest.mark.parametrize("bf16", PRECISIONS)
@pytest.mark.parametrize("name", [*sorted(MODELS), "moe-options"])
def test_demo_models_train_to_the_same_losses_and_weights_whatever_the_threads(name, bf16):
    # steps at 3, 1 and 5 threads (changing mid-run, as ThreadShare does) against 1 thread throughout;
    # two of the demo model's layers at its batch: the same GEMM and SwiGLU shapes, half the time
    schedule = [3, 1, 5]
    cfg = demo_config(name.removesuffix("-options"), n_layers=2)
    if name.endswith("-options"):
        cfg = dataclasses.replace(cfg, qk_norm="head", moe=dataclasses.replace(cfg.moe, **ROUTING_OPTIONS))
    torch.manual_seed(0)
    model = Transformer(cfg)
    twin = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(2)
    batches = [torch.randint(VOCAB, (BATCH, SEQ + 1), generator=gen) for _ in schedule]
    assert train_at_threads(model, [1] * len(schedule), batches, 1e-3, bf16=bf16) == train_at_threads(
        twin, schedule, batches, 1e-3, bf16=bf16
    )
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values(), strict=True))
