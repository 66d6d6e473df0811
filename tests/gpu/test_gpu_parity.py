"""CUDA checks (run by scripts/gpu_check.sh on a GPU machine; skipped elsewhere).

* MegaBlocks backend vs torch backend: outputs, losses and gradients of one MoE layer under bf16
  autocast, from the same state dict.
* torch._grouped_mm path vs the torch backend's own matmuls on CUDA.
* A checkpoint trained on CPU (torch backend, fp32) gives the same loss when evaluated on CUDA
  through the MegaBlocks path and through the torch path.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from moe_lit.checkpoint import export_model, load_model
from moe_lit.config import MoEConfig
from moe_lit.model import Transformer
from moe_lit.model.experts import build_experts
from moe_lit.model.experts.megablocks_backend import MegaBlocksExperts, unavailable_reason
from moe_lit.model.moe import MoELayer
from tests.helpers.models import tiny

pytestmark = pytest.mark.gpu
D, T = 256, 1024


def _needs_megablocks() -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"MegaBlocks unavailable: {reason}")


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _layer(**fields) -> MoELayer:
    cfg = MoEConfig(
        **{"num_experts": 8, "expert_size": 128, "top_k": 2, "z_loss_coef": 1e-3, "backend": "torch", **fields}
    )
    torch.manual_seed(0)
    layer = MoELayer(D, cfg, 1)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(std=0.05)
    return layer.cuda()


def _run(layer: MoELayer, x_BLD: torch.Tensor, g_BLD: torch.Tensor):
    layer.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y, losses = layer(x_BLD)
    ((y.float() * g_BLD).sum() + sum(losses.values())).backward()
    return y, losses, {n: p.grad.float() for n, p in layer.named_parameters()}


@pytest.mark.parametrize("fields", [{}, {"score_func": "sigmoid", "balancing": "bias"}])
def test_megablocks_matches_torch_backend(fields):
    _needs_megablocks()
    reference = _layer(**fields)
    mega = copy.deepcopy(reference)
    mega.experts = build_experts(D, dataclasses.replace(reference.cfg, backend="megablocks"))
    assert isinstance(mega.experts, MegaBlocksExperts)
    mega.experts.load_state_dict(reference.experts.state_dict(), strict=True)
    mega.cuda()
    torch.manual_seed(1)
    x_BLD, g_BLD = torch.randn(2, T // 2, D, device="cuda"), torch.randn(2, T // 2, D, device="cuda")
    y_r, loss_r, grads_r = _run(reference, x_BLD, g_BLD)
    y_m, loss_m, grads_m = _run(mega, x_BLD, g_BLD)
    assert _rel_err(y_m, y_r) < 2e-2
    for name in loss_r:
        assert _rel_err(loss_m[name], loss_r[name]) < 1e-3, name
    for name, grad in grads_r.items():
        assert _rel_err(grads_m[name], grad) < 3e-2, name
    assert torch.equal(mega.router.pending_tokens_per_expert(), reference.router.pending_tokens_per_expert())


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_grouped_gemm_geometry_matches_the_loop_on_cuda(capacity_factor):
    reference = _layer(capacity_factor=capacity_factor)
    reference.experts.strategy = "looped"
    grouped = copy.deepcopy(reference)
    grouped.experts.strategy = "grouped"
    torch.manual_seed(2)
    x_BLD, g_BLD = torch.randn(2, T // 2, D, device="cuda"), torch.randn(2, T // 2, D, device="cuda")
    y_r, _, grads_r = _run(reference, x_BLD, g_BLD)
    y_g, _, grads_g = _run(grouped, x_BLD, g_BLD)
    assert _rel_err(y_g, y_r) < 2e-2
    for name, grad in grads_r.items():
        assert _rel_err(grads_g[name], grad) < 3e-2, name


def _eval_loss(model: Transformer, tokens_BL1: torch.Tensor, autocast: bool) -> float:
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        logits = model(tokens_BL1[:, :-1]).logits_BLV
    return F.cross_entropy(logits.float().flatten(0, 1), tokens_BL1[:, 1:].flatten()).item()


def test_cpu_trained_checkpoint_evaluates_the_same_on_megablocks(tmp_path):
    _needs_megablocks()
    cfg = tiny(d_model=128, n_heads=4, seq_len=64, vocab_size=512, num_experts=8, expert_size=64, top_k=2)
    torch.manual_seed(0)
    model = Transformer(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # a learnable pattern: each sequence counts up by one modulo the vocabulary
    starts = torch.randint(0, cfg.vocab_size, (64, 1))
    data_BL1 = (starts + torch.arange(cfg.seq_len + 1)) % cfg.vocab_size
    for step in range(8):
        batch = data_BL1[(step % 4) * 16 : (step % 4 + 1) * 16]
        out = model(batch[:, :-1])
        loss = F.cross_entropy(out.logits_BLV.flatten(0, 1), batch[:, 1:].flatten()) + out.aux_loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    export_model(model, tmp_path / "ckpt")

    cpu_model = load_model(tmp_path / "ckpt")
    cpu_loss = _eval_loss_cpu(cpu_model, data_BL1)
    mega_model = load_model(tmp_path / "ckpt", map_location="cuda")  # backend auto -> MegaBlocks on CUDA
    assert all(isinstance(layer.experts, MegaBlocksExperts) for layer in mega_model.moe_layers())
    mega_loss = _eval_loss(mega_model, data_BL1.cuda(), autocast=True)
    torch_cfg = cfg.replace(moe={"backend": "torch"})
    torch_model = Transformer(torch_cfg).cuda().eval()
    torch_model.load_state_dict(mega_model.state_dict())
    torch_loss = _eval_loss(torch_model, data_BL1.cuda(), autocast=True)
    assert cpu_loss < 0.9 * _eval_loss_cpu(Transformer(cfg).eval(), data_BL1)  # it did learn something
    assert abs(mega_loss - cpu_loss) / cpu_loss < 1e-2
    assert abs(mega_loss - torch_loss) / torch_loss < 1e-2


def _eval_loss_cpu(model: Transformer, tokens_BL1: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(tokens_BL1[:, :-1]).logits_BLV
    return F.cross_entropy(logits.flatten(0, 1), tokens_BL1[:, 1:].flatten()).item()
