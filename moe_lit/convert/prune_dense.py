"""Structured pruning of dense FFNs: keep the neurons with the largest mean |activation|.

Shape legend: F dense d_ff, F' kept neurons, D d_model, T calibration tokens.

``prune_dense_ffn(model, calibration, keep)``: in every dense SwiGLU block, neuron ``i`` scores
``mean_t |H_ti|`` (``H = silu(x w1^T) * (x v1^T)`` on the calibration inputs of
:func:`~moe_lit.convert.calibration.ffn_inputs`); the ``keep`` best neurons stay, in their dense
order (their w1 and v1 rows, their w2 column), and ``model.d_ff`` becomes ``keep``. MoE layers and
every other tensor are copied. It is the static baseline of the neuron partitions (same active
FFN size, but the same neurons for every token) and the last step of MoE -> dense conversions.

Guarantee: the pruned FFN computes exactly the sum of the kept neurons' outputs, so pruning only
neurons that are zero on every input (e.g. zero v1 rows) leaves the logits unchanged (1e-5).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from moe_lit.config import ConfigError
from moe_lit.convert.calibration import dense_ffn_ids, neuron_activations
from moe_lit.convert.common import rebuild
from moe_lit.errors import MoeLitError
from moe_lit.model import Transformer


def neuron_importance(model: Transformer, calibration: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """``{block: (F,) mean |activation|}`` of every dense FFN over its calibration inputs."""
    missing = [i for i in dense_ffn_ids(model) if i not in calibration]
    if missing:
        raise MoeLitError(f"calibration: no FFN inputs for dense block(s) {missing}")
    return {i: neuron_activations(model.dense_ffn(i), calibration[i]).abs().mean(0) for i in dense_ffn_ids(model)}


@torch.no_grad()
def prune_dense_ffn(model: Transformer, calibration: Mapping[int, torch.Tensor], keep: int) -> Transformer:
    """``model`` with every dense FFN cut to its ``keep`` most active neurons (module docstring)."""
    d_ff = model.config.d_ff
    if not (isinstance(keep, int) and 1 <= keep <= d_ff):
        raise ConfigError(f"keep: must be an integer in [1, d_ff={d_ff}], got {keep!r}")
    importance = neuron_importance(model, calibration)
    new = rebuild(model, model.config.replace(d_ff=keep))
    for layer_id, score_F in importance.items():
        kept_F = torch.sort(torch.topk(score_F, keep).indices).values
        source, target = model.dense_ffn(layer_id), new.dense_ffn(layer_id)
        kept_F = kept_F.to(source.w1.weight.device)
        target.w1.weight.copy_(source.w1.weight[kept_F])
        target.v1.weight.copy_(source.v1.weight[kept_F])
        target.w2.weight.copy_(source.w2.weight[:, kept_F])
    return new


__all__ = ["neuron_importance", "prune_dense_ffn"]
