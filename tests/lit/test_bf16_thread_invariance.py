"""bf16-mixed training gives the same bits at 1 and 2 intra-op threads, as fp32 does ("same seed, same bits").

Under CPU bf16 autocast every matmul of the demo models runs as a oneDNN bf16 GEMM, whose rounding could
follow the thread count as MKL's skinny fp32 GEMMs did (``tests/model/test_thread_invariance.py``).
Only meaningful where the CPU has native bf16 (``avx512_bf16`` or ``amx_bf16``): elsewhere autocast emulates
it, and ``train.precision: auto`` never picks bf16 there.
"""

import contextlib
import copy
import dataclasses

import pytest
import torch

from moe_lit.commands.demo import MODELS, load_module_config
from moe_lit.distributed.grad_norm import clip_grad_norm
from moe_lit.inference.precision import native_bf16_flags
from moe_lit.model.experts.layout import ExpertLayout
from moe_lit.model.experts.torch_backend import TorchExperts
from moe_lit.model.transformer import Transformer
from tests.helpers.models import random_init, skewed_routing

pytestmark = pytest.mark.skipif(not native_bf16_flags(), reason="the CPU has no native bf16 (avx512_bf16, amx_bf16)")

VOCAB, SEQ, BATCH = 2048, 128, 16
"""The demo's vocabulary and batch (configs/runs/demo.yaml): the expert blocks get the demo's row counts."""


@contextlib.contextmanager
def _threads(count: int):
    start = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(start)


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

    def run(threads: int) -> list[torch.Tensor]:
        with _threads(threads):
            x_in, gates_in = x.clone().requires_grad_(True), gates.clone().requires_grad_(True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y, _ = experts(x_in, gates_in, indices, None)
            grads = torch.autograd.grad((y.float() * dy).sum(), [x_in, gates_in, *experts.parameters()])
        return [y.detach(), *grads]

    one = run(1)
    assert one[0].dtype == torch.bfloat16  # the experts did run in bf16
    for threads in (2, 3):
        assert all(torch.equal(a, b) for a, b in zip(one, run(threads), strict=True)), threads


def _train_bf16(model: Transformer, thread_schedule: list[int], batches: list[torch.Tensor]) -> list[float]:
    """Optimizer steps of ``model`` as bf16-mixed takes them (forward under bf16 autocast, fp32 weights,
    gradients and AdamW, gradient clipping 1.0 as the demo), step i at ``thread_schedule[i]`` threads."""
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    losses = []
    for threads, tokens in zip(thread_schedule, batches, strict=True):
        with _threads(threads):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(tokens[:, :-1], tokens[:, 1:])
            loss = out.ce + out.aux_loss
            loss.backward()
            clip_grad_norm(model.parameters(), 1.0)
            optim.step()
            optim.zero_grad()
        losses.append(loss.item())
    return losses


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
    assert _train_bf16(model, [1] * len(schedule), batches) == _train_bf16(twin, schedule, batches)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values(), strict=True))
