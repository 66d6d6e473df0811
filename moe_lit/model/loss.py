"""Language-model head and cross-entropy in one pass over token chunks, without full logits.

Shape legend: N tokens (batch * sequence), C tokens of one chunk, D d_model, V vocabulary.

``linear_cross_entropy(x_ND, weight_VD, targets_N, chunk_tokens)`` equals
``F.cross_entropy(x_ND @ weight_VD.T, targets_N)`` (mean over the targets that are not
``ignore_index``) and its gradients, but never holds the (N, V) logits: each chunk's logits are
made, turned into the loss and the logits' gradient while still in cache, and the two gradient
matmuls run at once. The backward only scales the saved gradients by the incoming gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
"""Targets equal to this contribute neither loss nor gradient (as in ``F.cross_entropy``)."""


# NOTE: why compute the gradients in the forward. With V = 8192 the (N, V) fp32 logits of a
# 2048-token batch are 67 MB: the plain path writes them, reads them for log-softmax, writes the
# log-probabilities, and repeats in the backward — memory traffic that costs as much as the head's
# matmuls on a CPU (measured with benchmarks/train_step.py ``--loss-chunk-tokens 0`` vs the default). One
# chunk's logits fit in cache; turning them into softmax - onehot right there needs a single exp
# pass. The price is that the gradient matmuls run even if nothing calls backward, so the eager
# path is used only when gradients are required (training); evaluation takes the loss-only path.
class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, weight_VD, targets_N, chunk_tokens: int):
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        num_valid = (targets_N != IGNORE_INDEX).sum().clamp(min=1)
        grad_x_ND = torch.empty_like(x_ND) if need_x else None
        grad_w_VD = torch.zeros(weight_VD.shape, dtype=torch.float32, device=weight_VD.device) if need_w else None
        total = x_ND.new_zeros((), dtype=torch.float32)
        weight_for_x_VD = weight_VD.to(x_ND.dtype)  # once, not per chunk (a copy under bf16 autocast)
        for start in range(0, x_ND.shape[0], chunk_tokens):
            x_CD, t_C = x_ND[start : start + chunk_tokens], targets_N[start : start + chunk_tokens]
            probs_CV, losses_C, valid_C = _chunk_softmax(x_CD, weight_VD, t_C)
            total += losses_C.sum()
            # d loss / d logits = (softmax - onehot) / num_valid on valid rows, 0 on ignored ones
            rows_C = torch.arange(t_C.shape[0], device=t_C.device)
            probs_CV[rows_C[valid_C], t_C[valid_C]] -= 1.0
            probs_CV.mul_((valid_C.to(probs_CV.dtype) / num_valid).unsqueeze(1))
            if grad_x_ND is not None:
                grad_x_ND[start : start + chunk_tokens] = probs_CV.to(x_ND.dtype) @ weight_for_x_VD
            if grad_w_VD is not None:
                grad_w_VD.addmm_(probs_CV.t(), x_CD.float())
        ctx.save_for_backward(grad_x_ND, grad_w_VD)
        ctx.weight_dtype = weight_VD.dtype
        return total / num_valid

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x_ND, grad_w_VD = ctx.saved_tensors
        grad_x = None if grad_x_ND is None else grad_x_ND * grad_loss.to(grad_x_ND.dtype)
        grad_w = None if grad_w_VD is None else (grad_w_VD * grad_loss).to(ctx.weight_dtype)
        return grad_x, grad_w, None, None


def _chunk_softmax(
    x_CD: torch.Tensor, weight_VD: torch.Tensor, targets_C: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 softmax probabilities of one chunk (one exp pass), per-token losses (0 where ignored), validity mask."""
    logits_CV = (x_CD @ weight_VD.t()).float()
    valid_C = targets_C != IGNORE_INDEX
    safe_targets_C = targets_C.where(valid_C, 0)
    target_logit_C = logits_CV.gather(1, safe_targets_C.unsqueeze(1)).squeeze(1)
    max_C = logits_CV.amax(dim=1)
    probs_CV = logits_CV.sub_(max_C.unsqueeze(1)).exp_()
    sum_C = probs_CV.sum(dim=1)
    probs_CV.div_(sum_C.unsqueeze(1))
    losses_C = (max_C + sum_C.log() - target_logit_C) * valid_C
    return probs_CV, losses_C, valid_C


def _loss_only(x_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """The same mean cross-entropy without gradients, chunk by chunk."""
    num_valid = (targets_N != IGNORE_INDEX).sum().clamp(min=1)
    total = x_ND.new_zeros((), dtype=torch.float32)
    for start in range(0, x_ND.shape[0], chunk_tokens):
        logits_CV = (x_ND[start : start + chunk_tokens] @ weight_VD.t()).float()
        total += F.cross_entropy(
            logits_CV, targets_N[start : start + chunk_tokens], ignore_index=IGNORE_INDEX, reduction="sum"
        )
    return total / num_valid


def linear_cross_entropy(
    x_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor, chunk_tokens: int | None = 256
) -> torch.Tensor:
    """Mean cross-entropy of ``x_ND @ weight_VD.T`` against ``targets_N`` (fp32), chunked.

    ``chunk_tokens`` = 0 or None materialises the full logits and calls ``F.cross_entropy``.
    """
    if not chunk_tokens:
        return F.cross_entropy((x_ND @ weight_VD.t()).float(), targets_N, ignore_index=IGNORE_INDEX)
    if torch.is_grad_enabled() and (x_ND.requires_grad or weight_VD.requires_grad):
        return _LinearCrossEntropy.apply(x_ND, weight_VD, targets_N, chunk_tokens)
    return _loss_only(x_ND, weight_VD, targets_N, chunk_tokens)
