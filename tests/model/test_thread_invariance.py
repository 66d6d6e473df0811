"""The MoE's expert path gives the same bits at any intra-op thread count, as the dense FFN does.

The expert blocks' row counts follow the routing; an expert given a handful of tokens makes a skinny
GEMM, which MKL rounds differently at 1 and 2 threads (rows 5-11 against 128 or 255 columns). The sizes
here are the demo's (d_model 128, expert size 255) so that the threaded kernels run.
"""

import copy

import pytest
import torch

from moe_lit.config import ModelConfig, MoEConfig
from moe_lit.model.experts.layout import ExpertLayout
from moe_lit.model.experts.torch_backend import TorchExperts
from moe_lit.model.transformer import Transformer
from tests.helpers.models import experts_pass, random_init, skewed_routing, train_at_threads

D, F = 128, 255


@pytest.mark.parametrize("strategy", ["looped", "batched"])
def test_experts_forward_and_backward_are_the_same_bits_at_1_2_and_3_threads(strategy):
    # experts 0-5 get 2, 5, 6, 7, 10 and 11 tokens: the skinny GEMMs that used to follow the thread count
    indices = skewed_routing(1024, [2, 5, 6, 7, 10, 11], num_experts=10)
    experts = random_init(TorchExperts(D, ExpertLayout.of([F] * 10), strategy=strategy))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1024, D, generator=gen)
    gates = torch.rand(1024, 2, generator=gen)
    dy = torch.randn(1024, D, generator=gen)

    one = experts_pass(experts, indices, x, gates, dy, threads=1)
    for threads in (2, 3):
        other = experts_pass(experts, indices, x, gates, dy, threads)
        assert all(torch.equal(a, b) for a, b in zip(one, other, strict=True)), threads


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
    assert train_at_threads(model, [1] * len(schedule), batches, 1e-2) == train_at_threads(
        twin, schedule, batches, 1e-2
    )
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values(), strict=True))
