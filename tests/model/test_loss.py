"""The chunked head + cross-entropy equals the plain path: loss, gradients, ignored targets, no-grad."""

import pytest
import torch
import torch.nn.functional as F

from moe_lit.config import ConfigError
from moe_lit.model import Transformer
from moe_lit.model.loss import IGNORE_INDEX, linear_cross_entropy
from tests.helpers.models import tiny


def _inputs(num_tokens=13, d=8, vocab=29, ignored=(2, 7)):
    gen = torch.Generator().manual_seed(0)
    x_ND = torch.randn(num_tokens, d, generator=gen, requires_grad=True)
    weight_VD = torch.randn(vocab, d, generator=gen, requires_grad=True)
    targets_N = torch.randint(0, vocab, (num_tokens,), generator=gen)
    targets_N[list(ignored)] = IGNORE_INDEX
    return x_ND, weight_VD, targets_N


def _loss_and_grads(fn, x_ND, weight_VD, targets_N, scale=1.0):
    x, w = x_ND.detach().clone().requires_grad_(), weight_VD.detach().clone().requires_grad_()
    loss = fn(x, w, targets_N)
    (scale * loss).backward()
    return loss.detach(), x.grad, w.grad


def _reference(x_ND, weight_VD, targets_N):
    return F.cross_entropy(x_ND @ weight_VD.t(), targets_N, ignore_index=IGNORE_INDEX)


@pytest.mark.parametrize("chunk", [1, 3, 5, 13, 64, 0])
@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_chunked_equals_plain_cross_entropy(chunk, scale):
    x, w, t = _inputs()
    ref = _loss_and_grads(_reference, x, w, t, scale)
    got = _loss_and_grads(lambda a, b, c: linear_cross_entropy(a, b, c, chunk), x, w, t, scale)
    for expected, actual in zip(ref, got, strict=False):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    assert got[1][[2, 7]].abs().max() == 0  # ignored tokens get no gradient


def test_no_grad_and_frozen_weight_paths():
    x, w, t = _inputs()
    expected = _reference(x, w, t).detach()
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(x, w, t, 4), expected)
    x_only = x.detach().clone().requires_grad_()
    linear_cross_entropy(x_only, w.detach(), t, 4).backward()
    x_ref = x.detach().clone().requires_grad_()
    _reference(x_ref, w.detach(), t).backward()
    torch.testing.assert_close(x_only.grad, x_ref.grad, rtol=1e-5, atol=1e-6)


def test_all_targets_ignored_gives_zero_loss():
    x, w, t = _inputs(ignored=range(13))
    loss = linear_cross_entropy(x, w, t, 4)
    loss.backward()
    assert loss.item() == 0.0 and x.grad.abs().max() == 0


@pytest.mark.parametrize("tied", [False, True])
def test_model_ce_matches_logits_path(tied):
    torch.manual_seed(0)
    model = Transformer(tiny(tie_embeddings=tied, loss_chunk_tokens=5))
    idx_BL = torch.randint(0, 97, (3, 16))
    targets_BL = torch.randint(0, 97, (3, 16))

    out = model(idx_BL, targets_BL)
    assert out.logits_BLV is None
    (out.ce + out.aux_loss).backward()
    chunked = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    plain = model(idx_BL)
    ref_ce = F.cross_entropy(plain.logits_BLV.flatten(0, 1), targets_BL.flatten())
    (ref_ce + plain.aux_loss).backward()
    torch.testing.assert_close(out.ce, ref_ce.detach(), rtol=1e-5, atol=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(chunked[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_loss_chunk_tokens_validation():
    with pytest.raises(ConfigError, match="model.loss_chunk_tokens"):
        tiny(loss_chunk_tokens=-1)
