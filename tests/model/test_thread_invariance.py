"""The MoE's expert path gives the same bits at any intra-op thread count, as the dense FFN does.

The expert blocks' row counts follow the routing; an expert given a handful of tokens makes a skinny
GEMM, which MKL rounds differently at 1 and 2 threads (rows 5-11 against 128 or 255 columns). The sizes
here are the demo's (d_model 128, expert size 255) so that the threaded kernels run.
"""

import contextlib
import copy

import pytest
import torch

from moe_lit.config import ModelConfig, MoEConfig
from moe_lit.distributed.grad_norm import clip_grad_norm
from moe_lit.model.experts.layout import ExpertLayout
from moe_lit.model.experts.torch_backend import TorchExperts
from moe_lit.model.transformer import Transformer
from tests.helpers.models import random_init, skewed_routing

D, F = 128, 255


@contextlib.contextmanager
def _threads(count: int):
    start = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(start)


@pytest.mark.parametrize("strategy", ["looped", "batched"])
def test_experts_forward_and_backward_are_the_same_bits_at_1_2_and_3_threads(strategy):
    # experts 0-5 get 2, 5, 6, 7, 10 and 11 tokens: the skinny GEMMs that used to follow the thread count
    indices = skewed_routing(1024, [2, 5, 6, 7, 10, 11], num_experts=10)
    experts = random_init(TorchExperts(D, ExpertLayout.of([F] * 10), strategy=strategy))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1024, D, generator=gen)
    gates = torch.rand(1024, 2, generator=gen)
    dy = torch.randn(1024, D, generator=gen)

    def run(threads: int) -> list[torch.Tensor]:
        with _threads(threads):
            x_in, gates_in = x.clone().requires_grad_(True), gates.clone().requires_grad_(True)
            y, _ = experts(x_in, gates_in, indices, None)
            grads = torch.autograd.grad((y * dy).sum(), [x_in, gates_in, *experts.parameters()])
        return [y.detach(), *grads]

    one = run(1)
    for threads in (2, 3):
        assert all(torch.equal(a, b) for a, b in zip(one, run(threads), strict=True)), threads


def _train(model: Transformer, thread_schedule: list[int], batches: list[torch.Tensor]) -> list[float]:
    """Optimizer steps of ``model`` on ``batches``, step i at ``thread_schedule[i]`` threads; the losses."""
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    losses = []
    for threads, tokens in zip(thread_schedule, batches, strict=True):
        with _threads(threads):
            out = model(tokens[:, :-1], tokens[:, 1:])
            loss = out.ce + out.aux_loss
            loss.backward()
            clip_grad_norm(model.parameters(), 1.0)
            optim.step()
            optim.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "schedule",
    [[2, 2, 2], [2, 1, 3]],
    ids=["two-threads", "changing-mid-run-as-ThreadShare-does"],
)
def test_tiny_moe_trains_to_the_same_losses_and_weights_whatever_the_threads(schedule):
    # 16 experts for 128 tokens x top-2: 16 per expert on average, so some get a handful
    moe = MoEConfig(num_experts=16, expert_size=F, top_k=2, expert_output_bias=False, aux_loss_coef=0.01)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(d_model=D, n_layers=1, n_heads=4, d_ff=512, vocab_size=256, moe=moe))
    twin = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(2)
    batches = [torch.randint(256, (4, 33), generator=gen) for _ in schedule]
    assert _train(model, [1] * len(schedule), batches) == _train(twin, schedule, batches)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values(), strict=True))
