"""The routed experts' custom ops (``moe_lit/model/experts/ops.py``): torch.library's opcheck passes
for every op and slot geometry, and a compiled MoE block is one graph whose losses and gradients
are the eager dispatch's."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from moe_lit.model import Transformer
from moe_lit.model.compile import compile_blocks
from moe_lit.model.experts.ops import static_slot_sizes
from tests.helpers.models import tiny

D = 8
OP_CASES = {
    "dropless": ([4, 4, 4, 4], None, "looped"),
    "capacity": ([4, 4, 4, 4], 2, "looped"),
    "unequal": ([4, 8, 2, 6], None, "looped"),
    "grouped": ([4, 4, 4, 4], 2, "grouped"),
    "batched": ([4, 4, 4, 4], None, "batched"),
}


def _opcheck_every_op(sizes, capacity, geometry, device="cpu", dtype=torch.float32) -> None:
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    x_TD = randn(6, D).requires_grad_(True)
    w1_SD, v1_SD, w2_SD = (randn(sum(sizes), D).requires_grad_(True) for _ in range(3))
    gate_TK, indices_TK = randn(6, len(sizes)).softmax(-1).topk(2, dim=-1)
    static = (sizes, geometry, capacity)
    x_PD, h1_H, h2_H, *plan = (
        t.detach() for t in torch.ops.moe_lit.experts_gate_up(x_TD, indices_TK, w1_SD, v1_SD, *static)
    )
    act_H = (F.silu(h1_H) * h2_H).requires_grad_(True)
    calls = {
        "experts_gate_up": (x_TD, indices_TK, w1_SD, v1_SD, *static),
        "experts_down": (act_H, w2_SD, gate_TK.requires_grad_(True), *plan, *static),
        "experts_gate_up_backward": (
            torch.randn_like(h1_H),
            torch.randn_like(h2_H),
            x_PD,
            w1_SD.detach(),
            v1_SD.detach(),
            *plan,
            *static,
        ),
        "experts_down_backward": (randn(6, D), act_H.detach(), w2_SD.detach(), gate_TK.detach(), *plan, *static),
    }
    for name, args in calls.items():
        result = torch.library.opcheck(getattr(torch.ops.moe_lit, name), args)
        assert set(result.values()) == {"SUCCESS"}, (name, result)


@pytest.mark.parametrize("case", list(OP_CASES))
def test_every_op_passes_opcheck(case):
    _opcheck_every_op(*OP_CASES[case])


def test_packed_slot_buffers_have_routing_independent_sizes():
    assert static_slot_sizes(5, 2, [4, 4, 4], "looped") == (10, 40)  # dropless over equal experts: exact
    assert static_slot_sizes(5, 2, [4, 8, 2], "grouped") == (10, 5 * (8 + 4))  # each token's 2 largest experts
    assert static_slot_sizes(5, 2, [4, 4, 4], "batched") is None  # padded chunks follow the routing


def _loss(model, idx_BL, bf16: bool = False):
    with torch.autocast(idx_BL.device.type, dtype=torch.bfloat16, enabled=bf16):
        out = model(idx_BL, idx_BL)
    return out.ce + out.aux_loss


@pytest.mark.slow
@pytest.mark.parametrize(
    "moe_fields",
    [{}, {"capacity_factor": 1.0, "expert_size": [8, 16, 24, 16]}],
    ids=["dropless", "capacity-unequal"],
)
def test_a_compiled_moe_block_is_one_graph_with_the_eager_losses_and_gradients(moe_fields):
    # NOTE: aot_eager runs what inductor gets (fake tensors, AOT autograd through the ops'
    # registered backwards) without its C++ compile; tests/lit/test_compile.py trains with inductor.
    torch.manual_seed(0)
    eager = Transformer(tiny(vocab_size=64, **moe_fields))
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    counters.clear()
    compile_blocks(compiled, backend="aot_eager")
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled)]
    gen = torch.Generator().manual_seed(1)
    frames = []
    for step in range(4):  # a new random batch, and so a new routing, every step
        idx_BL = torch.randint(0, 64, (2, 16), generator=gen)
        losses, grads = [], []
        for model, optimizer in zip((eager, compiled), optimizers, strict=True):
            loss = _loss(model, idx_BL)
            loss.backward()
            losses.append(loss.detach())
            grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
            optimizer.step()
            optimizer.zero_grad()
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
        if step == 0:
            torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)
        frames.append(counters["frames"]["ok"])
    assert dict(counters["graph_break"]) == {}
    assert frames[1] == frames[-1], frames  # after the second step (router sums exist), no new graph


@pytest.mark.gpu
def test_on_cuda_the_ops_pass_opcheck_and_a_compiled_bf16_block_is_one_graph_with_the_eager_losses():
    # NOTE: scripts/gpu_check.sh runs this on a lent GPU: the grouped GEMMs (bf16, CUDA's only
    # grouped-GEMM dtype) and the padded chunks through the ops, then a compiled step under bf16
    # autocast (the inductor compile of the same path runs in its throughput benchmark).
    _opcheck_every_op([8, 8, 8, 8], 2, "grouped", "cuda", torch.bfloat16)
    _opcheck_every_op([8, 8, 8, 8], None, "batched", "cuda")
    torch.manual_seed(0)
    eager = Transformer(tiny(vocab_size=64, d_model=64, expert_size=32)).cuda()
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    counters.clear()
    compile_blocks(compiled, backend="aot_eager")
    idx_BL = torch.randint(0, 64, (2, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    losses = []
    for model in (eager, compiled):
        assert model.moe_layer(0).experts.layout.uniform
        loss = _loss(model, idx_BL, bf16=True)
        loss.backward()
        losses.append(loss.detach())
    assert dict(counters["graph_break"]) == {}
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-3, atol=1e-3)
    grads = [{n: p.grad for n, p in m.named_parameters()} for m in (eager, compiled)]
    torch.testing.assert_close(grads[1], grads[0], rtol=2e-2, atol=2e-3)
