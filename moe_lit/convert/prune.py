"""Expert pruning: remove experts from every MoE layer, a pure function.

Shape legend: E experts before, E' kept, D d_model, S / S' stacked expert rows before / after
(see ``experts/layout.py``), K top-k.

``prune_experts(model, keep)`` keeps, in every MoE block, the experts listed in ``keep[block]``
(in the listed order, sorted by :func:`plan_pruning`): their router rows, their selection bias
(``expert_bias``) and their rows of ``w1``/``v1``/``w2`` (heterogeneous experts are just unequal
row counts). Attention, norms, the expert output bias and the shared expert are copied unchanged.
Layers that keep the same experts give an ordinary config (``num_experts = E'``); layers that keep
different counts or sizes (a global budget) are described by ``moe.layer_expert_sizes``.

Guarantee (dropless layers; tested to 1e-5): the pruned model computes exactly the original model
in which every pruned expert's router logit is set to -inf before the scores *and* its selection
(score + bias) to -inf before top-k. Then softmax renormalises over the kept experts — the kept
experts' softmax over E' rows equals the original softmax with the pruned logits at -inf, so the
equality holds with and without ``renormalize`` — and sigmoid scores of kept experts are unchanged.
What it is *not*: masking after the softmax. With ``renormalize=False`` that keeps the original
weights, which differ from the pruned model's by the kept experts' share of the softmax mass;
with ``renormalize=True`` both coincide. With a ``capacity_factor`` each expert's capacity
becomes ``ceil(cf * T * k / E')``, as for any model with E' experts, so drops can differ.

Top-k stays unless a layer keeps fewer than k experts: that is refused, or with
``clamp_top_k=True`` the model's top-k becomes the smallest kept count (one top-k for all layers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from moe_lit.config import ConfigError, ModelConfig
from moe_lit.convert.common import rebuild
from moe_lit.errors import MoeLitError
from moe_lit.model import MoELayer, Transformer
from moe_lit.model.router import Router

EXPERT_MATRICES = ("w1", "v1", "w2")


# ----------------------------------------------------------------------------- plan
def removal_counts(num_experts: int, fraction: float | None = None, num: int | None = None) -> int:
    """Experts to remove out of ``num_experts``: ``round(fraction * num_experts)`` or ``num``."""
    if (fraction is None) == (num is None):
        raise ConfigError("fraction/num: give exactly one of fraction (in [0, 1)) or num (experts to remove)")
    if fraction is not None:
        if not (isinstance(fraction, (int, float)) and 0 <= fraction < 1):
            raise ConfigError(f"fraction: must be in [0, 1) (the share of experts removed), got {fraction!r}")
        return round(fraction * num_experts)
    if not (isinstance(num, int) and not isinstance(num, bool) and num >= 0):
        raise ConfigError(f"num: must be an integer >= 0 (experts removed), got {num!r}")
    return num


def plan_pruning(
    scores: Mapping[int, torch.Tensor],
    fraction: float | None = None,
    num: int | None = None,
    global_budget: bool = False,
    min_keep: int = 1,
) -> dict[int, list[int]]:
    """Kept experts per block (ascending ids) from per-block ``(E,)`` importance scores.

    Uniform: every layer drops its ``num`` (or ``round(fraction * E)``) lowest-scoring experts.
    Global (``global_budget=True``): ``num`` (or ``round(fraction * total)``) experts go over all
    layers together, lowest scores first, so the scores must be comparable across layers; no layer
    drops below ``min_keep`` experts (the caller passes top-k so that routing stays valid).
    Ties go to the lower expert id (kept first).
    """
    if not scores:
        raise MoeLitError("prune: no MoE layer to prune (no scores)")
    if global_budget:
        return _plan_global(scores, fraction, num, min_keep)
    return {
        block: sorted(_ranking(scores_E)[: kept_count(scores_E.numel(), block, fraction, num)])
        for block, scores_E in scores.items()
    }


def kept_count(num_experts: int, block: int, fraction: float | None = None, num: int | None = None) -> int:
    """Experts a layer keeps under a per-layer budget (at least one)."""
    remove = removal_counts(num_experts, fraction, num)
    if remove >= num_experts:
        raise ConfigError(
            f"fraction/num: removing {remove} of the {num_experts} experts of block {block} leaves none; "
            f"remove at most {num_experts - 1}"
        )
    return num_experts - remove


def _ranking(scores_E: torch.Tensor) -> list[int]:
    """Expert ids by decreasing score, ties to the lower id."""
    return sorted(range(scores_E.numel()), key=lambda e: (-float(scores_E[e]), e))


def _plan_global(scores, fraction, num, min_keep) -> dict[int, list[int]]:
    total = sum(s.numel() for s in scores.values())
    remove = removal_counts(total, fraction, num)
    removable = sum(max(s.numel() - min_keep, 0) for s in scores.values())
    if remove > removable:
        raise ConfigError(
            f"fraction/num: removing {remove} of {total} experts would leave a layer below {min_keep} experts "
            f"(top-k); at most {removable} can go under the global budget"
        )
    candidates = sorted(
        ((float(s[e]), block, e) for block, s in scores.items() for e in range(s.numel())),
        key=lambda t: (t[0], t[1], -t[2]),
    )
    kept_count = {block: s.numel() for block, s in scores.items()}
    removed: set[tuple[int, int]] = set()
    for _, block, expert in candidates:
        if len(removed) == remove:
            break
        if kept_count[block] > min_keep:
            removed.add((block, expert))
            kept_count[block] -= 1
    return {block: [e for e in range(s.numel()) if (block, e) not in removed] for block, s in scores.items()}


# ----------------------------------------------------------------------------- transform
def pruned_config(cfg: ModelConfig, keep: Mapping[int, Sequence[int]], clamp_top_k: bool = False) -> ModelConfig:
    """The config of ``cfg``'s model after keeping ``keep[block]`` in every MoE block."""
    moe = cfg.moe
    if moe is None:
        raise MoeLitError("prune: the model is dense (model.moe is null); nothing to prune")
    blocks = cfg.moe_layer_ids
    missing = [b for b in blocks if b not in keep]
    extra = [b for b in keep if b not in blocks]
    if missing or extra:
        raise ConfigError(f"keep: needs exactly the MoE blocks {list(blocks)}, missing {missing}, not MoE {extra}")
    sizes = []
    for block in blocks:
        layer_sizes = cfg.moe_layer_config(block).expert_sizes
        kept = list(keep[block])
        if not kept or len(set(kept)) != len(kept) or not all(0 <= e < len(layer_sizes) for e in kept):
            raise ConfigError(
                f"keep[{block}]: needs distinct expert ids in [0, {len(layer_sizes)}) and at least one, got {kept}"
            )
        sizes.append([layer_sizes[e] for e in kept])
    top_k = _top_k(moe.top_k, sizes, blocks, clamp_top_k)
    widest = max(sizes, key=len)
    same = all(s == sizes[0] for s in sizes)
    new_moe = dataclasses.replace(
        moe,
        num_experts=len(widest),
        expert_size=widest[0] if len(set(widest)) == 1 else widest,
        top_k=top_k,
        layer_expert_sizes=None if same else sizes,
    )
    return cfg.replace(moe=new_moe)


def _top_k(top_k: int, sizes: list[list[int]], blocks: Sequence[int], clamp: bool) -> int:
    fewest = min(len(s) for s in sizes)
    if fewest >= top_k:
        return top_k
    if not clamp:
        block = blocks[[len(s) for s in sizes].index(fewest)]
        raise ConfigError(
            f"top_k: block {block} keeps {fewest} experts, fewer than top_k={top_k}; keep more experts "
            "or clamp top-k to the survivors (clamp_top_k / --clamp-top-k)"
        )
    return fewest


def prune_experts(model: Transformer, keep: Mapping[int, Sequence[int]], clamp_top_k: bool = False) -> Transformer:
    """The model keeping only ``keep[block]`` experts in every MoE block (``model`` untouched)."""
    new = rebuild(model, pruned_config(model.config, keep, clamp_top_k))
    for block in model.config.moe_layer_ids:
        _prune_layer(model.moe_layer(block), new.moe_layer(block), list(keep[block]))
    return new


@torch.no_grad()
def _prune_layer(old: MoELayer, new: MoELayer, keep: list[int]) -> None:
    """Router rows, selection biases and expert rows of the kept experts."""
    copy_router_rows(old.router, new.router, keep)
    layout = old.experts.layout
    rows_S = torch.cat([torch.arange(layout.offsets[e], layout.offsets[e + 1]) for e in keep])
    rows_S = rows_S.to(old.router.layer.weight.device)
    for name in EXPERT_MATRICES:
        getattr(new.experts.mlp, name).copy_(getattr(old.experts.mlp, name)[rows_S])


@torch.no_grad()
def copy_router_rows(old: Router, new: Router, keep: Sequence[int]) -> None:
    """Copy the router rows (and selection biases) of the experts ``keep`` into ``new``."""
    index_E = torch.tensor(list(keep), device=old.layer.weight.device)
    new.layer.weight.copy_(old.layer.weight[index_E])
    if old.expert_bias is not None and new.expert_bias is not None:
        new.expert_bias.copy_(old.expert_bias[index_E])


# ----------------------------------------------------------------------------- memory
def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and persistent buffers (shared tensors counted once)."""
    seen, total = set(), 0
    for tensor in model.state_dict().values():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def memory_saved(original: Transformer, pruned: Transformer) -> dict[str, float]:
    """Parameters and bytes before / after and the saved share (of the whole model)."""
    from moe_lit.accounting import count_model_params

    before, after = count_model_params(original).total, count_model_params(pruned).total
    bytes_before, bytes_after = model_bytes(original), model_bytes(pruned)
    return {
        "params_before": before,
        "params_after": after,
        "params_saved": before - after,
        "params_saved_fraction": (before - after) / before,
        "bytes_before": bytes_before,
        "bytes_after": bytes_after,
        "bytes_saved": bytes_before - bytes_after,
    }


__all__ = [
    "copy_router_rows",
    "kept_count",
    "memory_saved",
    "model_bytes",
    "plan_pruning",
    "prune_experts",
    "pruned_config",
    "removal_counts",
]
