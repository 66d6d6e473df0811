"""bf16-mixed training gives the same bits at 1 and 2 intra-op threads, as fp32 does ("same seed, same bits").

Under CPU bf16 autocast every matmul of the demo models runs as a oneDNN bf16 GEMM, whose rounding could
follow the thread count as MKL's skinny fp32 GEMMs did (``tests/model/test_thread_invariance.py``).
Only meaningful where the CPU has native bf16 (``avx512_bf16`` or ``amx_bf16``): elsewhere autocast emulates
it, and ``train.precision: auto`` never picks bf16 there.
"""

import copy
import dataclasses

import pytest
import torch

from moe_lit.commands.demo import MODELS, load_module_config
from moe_lit.inference.precision import native_bf16_flags
from moe_lit.model.experts.layout import ExpertLayout
from moe_lit.model.experts.torch_backend import TorchExperts
from moe_lit.model.transformer import Transformer
from tests.helpers.models import experts_pass, random_init, skewed_routing, train_at_threads

pytestmark = pytest.mark.skipif(not native_bf16_flags(), reason="the CPU has no native bf16 (avx512_bf16, amx_bf16)")

VOCAB, SEQ, BATCH = 2048, 128, 16
"""The demo's vocabulary and batch (configs/runs/demo.yaml): the expert blocks get the demo's row counts."""


@pytest.mark.parametrize("strategy", ["looped", "batched"])
def test_experts_under_bf16_autocast_are_the_same_bits_at_1_2_and_3_threads(strategy):
    # blocks below SERIAL_BLOCK_ROWS (one thread) and above it (threaded bf16 GEMMs), at the demo's sizes
    experts_cfg, _ = load_module_config(MODELS["moe"])
    d_model, size = experts_cfg.d_model, experts_cfg.moe.expert_size
    indices = skewed_routing(2048, [2, 5, 11, 20, 33, 40, 64, 100], num_experts=experts_cfg.moe.num_experts)
    experts = random_init(
        TorchExperts(d_model, ExpertLayout.of([size] * experts_cfg.moe.num_experts), strategy=strategy)
    )
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2048, d_model, generator=gen)
    gates = torch.rand(2048, 2, generator=gen)
    dy = torch.randn(2048, d_model, generator=gen)

    one = experts_pass(experts, indices, x, gates, dy, threads=1, bf16=True)
    assert one[0].dtype == torch.bfloat16  # the experts did run in bf16
    for threads in (2, 3):
        other = experts_pass(experts, indices, x, gates, dy, threads, bf16=True)
        assert all(torch.equal(a, b) for a, b in zip(one, other, strict=True)), threads


@pytest.mark.parametrize("name", sorted(MODELS))
def test_demo_models_train_in_bf16_to_the_same_losses_and_weights_at_1_and_2_threads(name):
    # steps 1 and 3 at 2 threads, step 2 at 1 (as ThreadShare may change it mid-run), against 1 thread throughout;
    # two of the demo model's layers at its batch: the same GEMM shapes, half the time
    model_cfg, _ = load_module_config(MODELS[name])
    schedule = [2, 1, 2]
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(model_cfg, vocab_size=VOCAB, seq_len=SEQ, n_layers=2))
    twin = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(2)
    batches = [torch.randint(VOCAB, (BATCH, SEQ + 1), generator=gen) for _ in schedule]
    assert train_at_threads(model, [1] * len(schedule), batches, 1e-3, bf16=True) == train_at_threads(
        twin, schedule, batches, 1e-3, bf16=True
    )
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values(), strict=True))
