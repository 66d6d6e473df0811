"""The routed experts as ``torch.library`` custom ops: the MoE block compiles as one graph.

Shape legend: T tokens, D d_model, E experts, K top-k, S sum of hidden sizes, P expert slots,
H hidden cells (see ``grouped_swiglu.py``).

:func:`routed_swiglu` is the torch backend's whole expert computation, in three steps:

    x_PD, h1_H, h2_H, plan = moe_lit::experts_gate_up(x_TD, indices_TK, w1_SD, v1_SD)  # dispatch, gate/up GEMMs
    act_H = swiglu(h1_H, h2_H)                                                        # model/invariant.py
    y_TD = moe_lit::experts_down(act_H, w2_SD, gate_TK, plan)                          # down GEMMs, gated combine

Each op has a fake implementation (output shapes only) and a hand-written backward, itself an op
(``*_backward``), registered with ``register_autograd``. ``torch.compile`` therefore traces each
op as one opaque node instead of breaking the graph at the dispatch: the router before it, the
SwiGLU product between the two ops (inductor fuses it and its backward into one loop each, as it
does for the dense FFN) and the combine's bias and the residual after them compile into the
block's single graph.

What is data-dependent stays inside the ops. The routing plan travels between them as three
tensors, ``plan = (assign_P, slot_TK, routed_counts_E)``; each op reads the per-expert counts
back as python ints (``.tolist()``) and rebuilds the slot geometry from them
(:func:`~moe_lit.model.experts.grouped_swiglu.restore_slots`). The static arguments (the
layout's expert sizes, the slot geometry, the capacity) are op arguments, so dynamo guards on
them. The slot-major outputs have sizes that do not depend on the routing
(:func:`static_slot_sizes`): packed slots (looped, grouped) are padded to T*K slots and to the
hidden cells of each token's K largest experts, which is exact, no padding at all, for dropless
routing over equal experts; capacity dropping and unequal experts pay one copy of the padded
buffers. Only the padded chunks of the batched geometry have a routing-dependent size (an unbacked
symbolic one in the fake): there the op runs eager, a graph break, unless
``torch._dynamo.config.capture_dynamic_output_shape_ops`` is set.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from moe_lit.model.experts.grouped_swiglu import (
    Geometry,
    Slots,
    plan_dispatch,
    project_down_combine,
    project_down_combine_backward,
    project_gate_up,
    project_gate_up_backward,
    restore_slots,
)
from moe_lit.model.experts.layout import ExpertLayout
from moe_lit.model.invariant import swiglu

Plan = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""``(assign_P, slot_TK, routed_counts_E)``: a routing's slot index maps and per-expert counts."""


def routed_swiglu(
    x_TD: torch.Tensor,
    gate_TK: torch.Tensor,
    indices_TK: torch.Tensor,
    w1_SD: torch.Tensor,
    v1_SD: torch.Tensor,
    w2_SD: torch.Tensor,
    layout: ExpertLayout,
    geometry: Geometry,
    capacity: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y_TD, routed_counts_E)``: ``y_t = sum_k gate_tk * SwiGLU_{e_tk}(x_t)`` (no bias), and the
    assignments per expert before any dropping."""
    sizes = list(layout.sizes)
    needs_autograd = torch.is_grad_enabled() and any(t.requires_grad for t in (x_TD, gate_TK, w1_SD, v1_SD, w2_SD))
    # NOTE: an eager call without autograd runs the ops' implementations directly: the dispatcher's
    # python round trip per op is a visible share of a decoding step. Traced or differentiated, the ops.
    gate_up: Callable[..., tuple[torch.Tensor, ...]] = _experts_gate_up
    down: Callable[..., torch.Tensor] = _experts_down
    if needs_autograd or torch.compiler.is_compiling():
        gate_up, down = torch.ops.moe_lit.experts_gate_up, torch.ops.moe_lit.experts_down
    x_PD, h1_H, h2_H, *plan = gate_up(x_TD, indices_TK, w1_SD, v1_SD, sizes, geometry, capacity)
    # NOTE: without autograd the product overwrites the gate projection's buffer (one hidden buffer fewer).
    act_H = swiglu(h1_H, h2_H, overwrite=not needs_autograd)
    y_TD = down(act_H, w2_SD, gate_TK, *plan, sizes, geometry, capacity)
    return y_TD, plan[2]


def _slots(plan: Plan, geometry: str, capacity: int | None) -> Slots:
    assign_P, slot_TK, routed_counts_E = plan
    kept_E = routed_counts_E if capacity is None else routed_counts_E.clamp(max=capacity)
    return restore_slots(assign_P, slot_TK, kept_E.tolist(), geometry, capacity is not None)  # type: ignore[arg-type]


def no_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast off (the ops' inputs come cast, and their buffers are written with ``out=``), whatever
    the caller's context at run time; nothing to enter when it is off already (every decoding step)."""
    if torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def static_slot_sizes(num_tokens: int, top_k: int, sizes: list[int], geometry: str) -> tuple[int, int] | None:
    """``(P, H)`` the ops' slot-major outputs are padded to, whatever the routing; None for padded chunks.

    Packed slots are at most the T*K assignments (exactly that many when dropless), and a token's
    slots hold at most the hidden cells of the K largest experts (exactly K*F for equal experts).
    """
    if geometry == "batched":
        return None
    return num_tokens * top_k, num_tokens * sum(sorted(sizes, reverse=True)[:top_k])


def _pad_to(t: torch.Tensor, length: int, value: int = 0) -> torch.Tensor:
    """``t`` with its first dim padded to ``length`` with ``value`` (itself when it is that long)."""
    extra = length - t.shape[0]
    if extra == 0:
        return t
    return torch.cat([t, t.new_full((extra, *t.shape[1:]), value)])


# ---------------------------------------------------------------------- gate/up half
def _experts_gate_up(
    x_TD: torch.Tensor,
    indices_TK: torch.Tensor,
    w1_SD: torch.Tensor,
    v1_SD: torch.Tensor,
    sizes: list[int],
    geometry: str,
    capacity: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plan the dispatch, gather the slots, project: ``(x_PD, h1_H, h2_H, assign_P, slot_TK, routed_counts_E)``."""
    with no_autocast(x_TD.device):
        layout = ExpertLayout.of(sizes)
        plan = plan_dispatch(indices_TK, layout, capacity, geometry)  # type: ignore[arg-type]
        x_PD, h1_H, h2_H = project_gate_up(x_TD, w1_SD, v1_SD, plan.slots, layout)
    assign_P = plan.slots.assign_P
    padded = static_slot_sizes(indices_TK.shape[0], indices_TK.shape[1], sizes, geometry)
    if padded is not None:
        num_slots, cells = padded
        # NOTE: padding slots and cells are zeros (the SwiGLU product keeps them zero) and hold the
        # padding assignment N; the ops read only the first P slots and H cells.
        x_PD, h1_H, h2_H = _pad_to(x_PD, num_slots), _pad_to(h1_H, cells), _pad_to(h2_H, cells)
        assign_P = _pad_to(assign_P, num_slots, value=indices_TK.numel())
    return x_PD, h1_H, h2_H, assign_P, plan.slots.slot_TK, plan.routed_counts_E


experts_gate_up = torch.library.custom_op("moe_lit::experts_gate_up", _experts_gate_up, mutates_args=())


@experts_gate_up.register_fake
def _(x_TD, indices_TK, w1_SD, v1_SD, sizes, geometry, capacity):
    padded = static_slot_sizes(indices_TK.shape[0], indices_TK.shape[1], sizes, geometry)
    if padded is None:
        # NOTE: the padded chunks' slot count follows the routing: an unbacked size, which dynamo
        # accepts only with ``capture_dynamic_output_shape_ops`` (else the op runs eager, a graph break).
        ctx = torch.library.get_ctx()
        num_slots = ctx.new_dynamic_size()
        padded = num_slots, num_slots * sizes[0]
    num_slots, cells = padded
    return (
        x_TD.new_empty(num_slots, x_TD.shape[1]),
        x_TD.new_empty(cells),
        x_TD.new_empty(cells),
        indices_TK.new_empty(num_slots),
        indices_TK.new_empty(indices_TK.shape),
        indices_TK.new_empty(len(sizes)),
    )


@torch.library.custom_op("moe_lit::experts_gate_up_backward", mutates_args=())
def experts_gate_up_backward(
    dh1_H: torch.Tensor,
    dh2_H: torch.Tensor,
    x_PD: torch.Tensor,
    w1_SD: torch.Tensor,
    v1_SD: torch.Tensor,
    assign_P: torch.Tensor,
    slot_TK: torch.Tensor,
    routed_counts_E: torch.Tensor,
    sizes: list[int],
    geometry: str,
    capacity: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx_TD, dw1_SD, dv1_SD)`` of :func:`experts_gate_up`."""
    with no_autocast(x_PD.device):
        slots = _slots((assign_P, slot_TK, routed_counts_E), geometry, capacity)
        # NOTE: the incoming gradients may be any strided tensors (expanded ones from a sum, say);
        # the block views and the grouped GEMM need flat buffers.
        dh1_H, dh2_H = dh1_H.contiguous(), dh2_H.contiguous()
        return project_gate_up_backward(dh1_H, dh2_H, x_PD, w1_SD, v1_SD, slots, ExpertLayout.of(sizes))


@experts_gate_up_backward.register_fake
def _(dh1_H, dh2_H, x_PD, w1_SD, v1_SD, assign_P, slot_TK, routed_counts_E, sizes, geometry, capacity):
    return x_PD.new_empty(slot_TK.shape[0], x_PD.shape[1]), torch.empty_like(w1_SD), torch.empty_like(v1_SD)


def _gate_up_setup_context(ctx, inputs, output) -> None:
    _, _, w1_SD, v1_SD, *ctx.static_args = inputs
    x_PD, _, _, *plan = output
    ctx.save_for_backward(x_PD, w1_SD, v1_SD, *plan)
    # NOTE: the gathered rows and the plan are outputs only so that the backward gets them; no
    # gradient flows into them, and none is materialised for them.
    ctx.mark_non_differentiable(x_PD)
    ctx.set_materialize_grads(False)


def _gate_up_backward(ctx, _dx_PD, dh1_H, dh2_H, *_plan_grads):
    # NOTE: both hidden gradients exist whenever this runs: the SwiGLU product consumes both.
    x_PD, w1_SD, v1_SD, *plan = ctx.saved_tensors
    dx_TD, dw1_SD, dv1_SD = torch.ops.moe_lit.experts_gate_up_backward(
        dh1_H, dh2_H, x_PD, w1_SD, v1_SD, *plan, *ctx.static_args
    )
    return dx_TD, None, dw1_SD, dv1_SD, None, None, None


experts_gate_up.register_autograd(_gate_up_backward, setup_context=_gate_up_setup_context)


# ---------------------------------------------------------------------- down half + combine
def _experts_down(
    act_H: torch.Tensor,
    w2_SD: torch.Tensor,
    gate_TK: torch.Tensor,
    assign_P: torch.Tensor,
    slot_TK: torch.Tensor,
    routed_counts_E: torch.Tensor,
    sizes: list[int],
    geometry: str,
    capacity: int | None,
) -> torch.Tensor:
    """``(T, D)``: every slot's down projection, summed per token with its gates."""
    with no_autocast(act_H.device):
        slots = _slots((assign_P, slot_TK, routed_counts_E), geometry, capacity)
        return project_down_combine(act_H.contiguous(), w2_SD, gate_TK, slots, ExpertLayout.of(sizes))


experts_down = torch.library.custom_op("moe_lit::experts_down", _experts_down, mutates_args=())


@experts_down.register_fake
def _(act_H, w2_SD, gate_TK, assign_P, slot_TK, routed_counts_E, sizes, geometry, capacity):
    return act_H.new_empty(gate_TK.shape[0], w2_SD.shape[1])


@torch.library.custom_op("moe_lit::experts_down_backward", mutates_args=())
def experts_down_backward(
    dy_TD: torch.Tensor,
    act_H: torch.Tensor,
    w2_SD: torch.Tensor,
    gate_TK: torch.Tensor,
    assign_P: torch.Tensor,
    slot_TK: torch.Tensor,
    routed_counts_E: torch.Tensor,
    sizes: list[int],
    geometry: str,
    capacity: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dact_H, dgate_TK, dw2_SD)`` of :func:`experts_down`."""
    with no_autocast(act_H.device):
        slots = _slots((assign_P, slot_TK, routed_counts_E), geometry, capacity)
        dact_H, dgate_TK, dw2_SD = project_down_combine_backward(
            dy_TD, act_H, w2_SD, gate_TK, slots, ExpertLayout.of(sizes)
        )
    return _pad_to(dact_H, act_H.shape[0]), dgate_TK, dw2_SD


@experts_down_backward.register_fake
def _(dy_TD, act_H, w2_SD, gate_TK, assign_P, slot_TK, routed_counts_E, sizes, geometry, capacity):
    return torch.empty_like(act_H), torch.empty_like(gate_TK), torch.empty_like(w2_SD)


def _down_setup_context(ctx, inputs, output) -> None:
    act_H, w2_SD, gate_TK, *plan_and_static = inputs
    ctx.save_for_backward(act_H, w2_SD, gate_TK, *plan_and_static[:3])
    ctx.static_args = plan_and_static[3:]


def _down_backward(ctx, dy_TD):
    act_H, w2_SD, gate_TK, *plan = ctx.saved_tensors
    dact_H, dgate_TK, dw2_SD = torch.ops.moe_lit.experts_down_backward(
        dy_TD, act_H, w2_SD, gate_TK, *plan, *ctx.static_args
    )
    return dact_H, dw2_SD, dgate_TK, None, None, None, None, None, None


experts_down.register_autograd(_down_backward, setup_context=_down_setup_context)


__all__ = ["Plan", "experts_down", "experts_gate_up", "routed_swiglu"]
