"""``clip_grad_norm`` equals ``torch.nn.utils.clip_grad_norm_`` of one process, sharded or not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_lit.distributed.grad_norm import clip_grad_norm
from moe_lit.model import Transformer
from tests.distributed import grad_norm_script, launch


def reference() -> tuple[float, dict[str, torch.Tensor]]:
    """One process, unsharded: torch's own clipping of the script's gradients."""
    torch.manual_seed(0)
    model = Transformer(grad_norm_script.CONFIG)
    grad_norm_script.backward(model)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_norm_script.MAX_NORM)
    return float(norm), {name: p.grad for name, p in model.named_parameters()}


def test_plain_tensors_match_torch():
    norm, grads = reference()
    torch.manual_seed(0)
    model = Transformer(grad_norm_script.CONFIG)
    grad_norm_script.backward(model)
    assert float(clip_grad_norm(model.parameters(), grad_norm_script.MAX_NORM)) == norm
    assert norm > grad_norm_script.MAX_NORM  # the clip is active
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=0, atol=0)


@pytest.mark.slow
def test_fsdp1_and_fsdp2_shards_clip_like_one_process(tmp_path):
    launch.run_ranks(Path(grad_norm_script.__file__), ["--out", str(tmp_path)], world=2, timeout_s=300)
    results = torch.load(tmp_path / "clipped.pt", weights_only=True)
    norm, grads = reference()
    for strategy, result in results.items():
        assert result["norm"] == pytest.approx(norm, rel=1e-5), strategy
        assert result["grads"].keys() == grads.keys(), strategy
        for name, grad in grads.items():
            torch.testing.assert_close(result["grads"][name], grad, rtol=1e-4, atol=1e-7, msg=f"{strategy} {name}")
