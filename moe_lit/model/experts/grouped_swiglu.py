"""Dispatch -> per-expert SwiGLU -> weighted combine as ONE autograd Function with a hand-written backward.

Shape legend: T tokens, D d_model, E experts, K top-k, F one expert's hidden size, S sum of hidden sizes,
N = T*K routed assignments, P expert *slots* (rows of the grouped buffers), H hidden cells (sum over
experts of slots_e * F_e).

Every kept assignment owns one slot; the slots of expert e are contiguous, in token order. Two slot
geometries share all the code below:

* batched: the slots come in B chunks of C rows, each chunk serving one expert (a busy expert may
  get several chunks, an idle one none), unused slots are padding, and each matmul is ONE
  ``torch.bmm`` over ``(B, C, .)`` views. It needs equal expert sizes and stays dropless: C and
  the chunk counts follow the routing (``choose_chunking``).
* looped: the slots are packed (no padding) and each matmul is a loop of ``torch.mm`` over experts.
  It handles heterogeneous sizes, and wins where nothing runs in parallel (one CPU thread).

Token rows move with gathers only (no scatter-add over tokens): the dispatch gathers token rows
into slots, the combine is ``F.embedding_bag`` (a fused gather + weighted sum over the k slots of
a token), and the backward reuses the same two index maps. Padding slots read an appended zero row of
the input, so they compute exact zeros and add nothing to any weight gradient; a dropped
assignment (capacity mode) points at an appended zero row of the output buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F

from moe_lit.model.experts.layout import ExpertLayout

Weights = Union[torch.Tensor, tuple[torch.Tensor, ...]]
"""Grouped weights: ``(B, F, D)`` per chunk (batched) or one ``(F_e, D)`` view per expert (looped)."""

# NOTE: the fixed cost of one chunk in the batched path, in rows of compute: the copy of its
# expert's weights and the reduction of their gradients, plus the per-matrix overhead of a batched
# gemm with few rows. Fitted on this project's 2-core CPU (forced chunk sizes on skewed routing,
# README "Performance"): 30-80 rows. It keeps the chooser from splitting into many small chunks.
CHUNK_OVERHEAD_ROWS = 64


@dataclass(frozen=True)
class Slots:
    """Slot geometry and index maps of one routing decision (see the module docstring)."""

    rows: tuple[int, ...]
    """Slots per expert: contiguous blocks, in expert order."""
    batched: bool
    """True: equal chunks of ``chunk_rows`` slots and ``bmm``; False: packed slots and a loop of ``mm``."""
    chunk_rows: int
    """Slots per chunk (batched only; 0 otherwise)."""
    chunk_expert: Optional[torch.Tensor]
    """Expert of each chunk when some expert has no chunk or several; None when chunk e is expert e."""
    token_P: torch.Tensor
    """Token feeding each slot; padding slots hold T, the index of an appended zero row."""
    assign_P: torch.Tensor
    """Flat assignment ``t*K + k`` held by each slot; padding slots hold N (an appended zero gate)."""
    slot_TK: torch.Tensor
    """Slot of each assignment; a dropped assignment holds P (an appended zero row of the outputs)."""

    @property
    def num_slots(self) -> int:
        return sum(self.rows)


def choose_chunking(counts: list[int]) -> tuple[int, list[int]]:
    """Chunk size C and chunks per expert for the batched path: the least ``chunks * (C + overhead)``.

    One chunk per expert (C = the largest count) needs no weight copy; splitting the busy experts
    into several chunks of a smaller C pads much less when the routing is skewed.
    """
    num_experts, top = len(counts), max(counts, default=0)
    if top == 0:
        return 1, [0] * num_experts
    counts_E = torch.tensor(counts)
    candidates_M = torch.cat([counts_E[counts_E > 0], torch.tensor([-(-top // j) for j in range(2, 9)])]).unique()
    chunks_ME = -torch.div(-counts_E.unsqueeze(0), candidates_M.unsqueeze(1), rounding_mode="floor")
    costs_M = chunks_ME.sum(1) * (candidates_M + CHUNK_OVERHEAD_ROWS)
    best = int(costs_M.argmin())
    if num_experts * (top + CHUNK_OVERHEAD_ROWS) <= int(costs_M[best]):
        return top, [1] * num_experts
    return int(candidates_M[best]), chunks_ME[best].tolist()


class ExpertMatmuls:
    """The per-expert matmuls of a SwiGLU layer and of its backward, batched over chunks or looped.

    Hidden activations live in one flat buffer of H cells (expert e's block is a ``(rows_e, F_e)``
    view; in the batched path, chunk b's block a ``(C, F)`` view), so the elementwise parts run
    once over all experts whatever the geometry.
    """

    def __init__(self, slots: Slots, layout: ExpertLayout, d_model: int) -> None:
        self.slots, self.layout, self.d_model = slots, layout, d_model
        cells = [r * f for r, f in zip(slots.rows, layout.sizes)]
        self.hidden_cells = sum(cells)
        self._cell_offsets = [0]
        for c in cells:
            self._cell_offsets.append(self._cell_offsets[-1] + c)
        self._row_offsets = [0]
        for r in slots.rows:
            self._row_offsets.append(self._row_offsets[-1] + r)

    # ------------------------------------------------------------------ views
    def _hidden(self, h_H: torch.Tensor, e: int) -> torch.Tensor:
        return h_H[self._cell_offsets[e] : self._cell_offsets[e + 1]].view(self.slots.rows[e], self.layout.sizes[e])

    def _token_rows(self, x_PD: torch.Tensor, e: int) -> torch.Tensor:
        return x_PD[self._row_offsets[e] : self._row_offsets[e + 1]]

    def _chunks(self, t: torch.Tensor, width: int) -> torch.Tensor:
        """``(B, C, width)`` view of a slot-major buffer."""
        return t.view(-1, self.slots.chunk_rows, width)

    def weights(self, w_SD: torch.Tensor) -> Weights:
        """Per-chunk weights ``(B, F, D)`` (a view, or a gather when chunks repeat experts), or per-expert views."""
        if not self.slots.batched:
            return self.layout.split(w_SD)
        if self.slots.chunk_expert is None:
            return self.layout.as_EFD(w_SD)
        # NOTE: a 2-D row gather; index_select over a 3-D tensor takes a slower path on CPU.
        num_experts, size = self.layout.num_experts, self.layout.sizes[0]
        w_BX = w_SD.view(num_experts, size * self.d_model).index_select(0, self.slots.chunk_expert)
        return w_BX.view(-1, size, self.d_model)

    # ------------------------------------------------------------------ row-wise ops on hidden buffers
    def row_dot(self, a_H: torch.Tensor, b_H: torch.Tensor) -> torch.Tensor:
        """``(P,)`` dot product of each slot's hidden row in ``a`` and ``b``."""
        if self.slots.batched:
            f = self.layout.sizes[0]
            return torch.linalg.vecdot(a_H.view(-1, f), b_H.view(-1, f))
        out_P = a_H.new_zeros(self.slots.num_slots)
        for e in range(self.layout.num_experts):
            if self.slots.rows[e]:
                torch.linalg.vecdot(self._hidden(a_H, e), self._hidden(b_H, e), out=self._token_rows(out_P, e))
        return out_P

    def scale_rows(self, h_H: torch.Tensor, s_P: torch.Tensor, out_H: torch.Tensor) -> torch.Tensor:
        """``out = h * s`` with one scale per slot row (``out_H`` may be ``h_H``)."""
        if self.slots.batched:
            f = self.layout.sizes[0]
            torch.mul(h_H.view(-1, f), s_P.unsqueeze(1), out=out_H.view(-1, f))
            return out_H
        for e in range(self.layout.num_experts):
            if self.slots.rows[e]:
                torch.mul(self._hidden(h_H, e), self._token_rows(s_P, e).unsqueeze(1), out=self._hidden(out_H, e))
        return out_H

    # ------------------------------------------------------------------ matmuls
    def x_wt(self, x_PD: torch.Tensor, w: Weights) -> torch.Tensor:
        """``h = x @ w^T`` per expert -> flat hidden ``(H,)``."""
        h_H = x_PD.new_empty(self.hidden_cells)
        if self.slots.batched:
            torch.bmm(self._chunks(x_PD, self.d_model), w.transpose(1, 2), out=self._chunks(h_H, w.shape[1]))
            return h_H
        for e, w_FD in enumerate(w):
            if self.slots.rows[e]:
                torch.mm(self._token_rows(x_PD, e), w_FD.t(), out=self._hidden(h_H, e))
        return h_H

    def h_w(self, h_H: torch.Tensor, w: Weights, out_PD: torch.Tensor, accumulate: bool) -> None:
        """``out (+)= h @ w`` per expert, written into the slot rows of ``out_PD``."""
        if self.slots.batched:
            h_BCF, out_BCD = self._chunks(h_H, w.shape[1]), self._chunks(out_PD, self.d_model)
            if accumulate:
                out_BCD.baddbmm_(h_BCF, w)
            else:
                torch.bmm(h_BCF, w, out=out_BCD)
            return
        for e, w_FD in enumerate(w):
            if not self.slots.rows[e]:
                continue
            if accumulate:
                self._token_rows(out_PD, e).addmm_(self._hidden(h_H, e), w_FD)
            else:
                torch.mm(self._hidden(h_H, e), w_FD, out=self._token_rows(out_PD, e))

    def ht_y(self, h_H: torch.Tensor, y_PD: torch.Tensor) -> torch.Tensor:
        """Weight gradient ``h^T @ y`` per expert (chunks of one expert summed) -> stacked ``(S, D)``."""
        layout, slots = self.layout, self.slots
        if slots.batched:
            f = layout.sizes[0]
            g_BFD = torch.bmm(self._chunks(h_H, f).transpose(1, 2), self._chunks(y_PD, self.d_model))
            if slots.chunk_expert is None:
                return g_BFD.view(layout.total_rows, self.d_model)
            g_EX = g_BFD.new_zeros(layout.num_experts, f * self.d_model)
            g_EX.index_add_(0, slots.chunk_expert, g_BFD.view(-1, f * self.d_model))
            return g_EX.view(layout.total_rows, self.d_model)
        g_SD = y_PD.new_empty(layout.total_rows, self.d_model)
        for e, g_FD in enumerate(layout.split(g_SD)):
            if slots.rows[e]:
                torch.mm(self._hidden(h_H, e).t(), self._token_rows(y_PD, e), out=g_FD)
            else:
                g_FD.zero_()
        return g_SD


def _with_zero_row(x_TD: torch.Tensor) -> torch.Tensor:
    return torch.cat([x_TD, x_TD.new_zeros(1, x_TD.shape[1])])


class GroupedSwiGLU(torch.autograd.Function):
    """``y_t = bias + sum_k gate_tk * SwiGLU_{e_tk}(x_t)`` for all tokens at once (see module docstring)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        x_TD: torch.Tensor,
        gate_TK: torch.Tensor,
        w1_SD: torch.Tensor,
        v1_SD: torch.Tensor,
        w2_SD: torch.Tensor,
        bias_D: torch.Tensor,
        slots: Slots,
        layout: ExpertLayout,
    ) -> torch.Tensor:
        mm = ExpertMatmuls(slots, layout, x_TD.shape[1])
        w1, v1, w2 = mm.weights(w1_SD), mm.weights(v1_SD), mm.weights(w2_SD)
        x_PD = _with_zero_row(x_TD).index_select(0, slots.token_P)
        h1_H, h2_H = mm.x_wt(x_PD, w1), mm.x_wt(x_PD, v1)
        act_H = F.silu(h1_H).mul_(h2_H)
        # NOTE: one extra zero row at index P: dropped assignments point there.
        o_PD = x_TD.new_empty(slots.num_slots + 1, x_TD.shape[1])
        o_PD[-1].zero_()
        mm.h_w(act_H, w2, o_PD[:-1], accumulate=False)
        y_TD = F.embedding_bag(slots.slot_TK, o_PD, per_sample_weights=gate_TK, mode="sum") + bias_D
        ctx.save_for_backward(x_PD, h1_H, h2_H, act_H, gate_TK, w1_SD, v1_SD, w2_SD)
        ctx.mm = mm
        return y_TD

    @staticmethod
    def backward(ctx, dy_TD: torch.Tensor):  # type: ignore[override]
        x_PD, h1_H, h2_H, act_H, gate_TK, w1_SD, v1_SD, w2_SD = ctx.saved_tensors
        mm: ExpertMatmuls = ctx.mm
        slots = mm.slots
        w1, v1, w2 = mm.weights(w1_SD), mm.weights(v1_SD), mm.weights(w2_SD)
        dy_TD = dy_TD.contiguous()
        dyg_PD = _with_zero_row(dy_TD).index_select(0, slots.token_P)
        # NOTE: the gates are applied in hidden space (F wide, not D): the output gradient of a slot
        # is gate * dy, so dL/dact = gate * (dy @ w2^T) and dL/dgate = <act, dy @ w2^T>.
        da_H = mm.x_wt(dyg_PD, w2)
        dgate_P = F.pad(mm.row_dot(act_H, da_H), (0, 1))
        dgate_TK = dgate_P.index_select(0, slots.slot_TK.reshape(-1)).view_as(gate_TK)
        gate_P = F.pad(gate_TK.reshape(-1), (0, 1)).index_select(0, slots.assign_P)
        dw2_SD = mm.ht_y(mm.scale_rows(act_H, gate_P, torch.empty_like(act_H)), dyg_PD)
        da_H = mm.scale_rows(da_H, gate_P, da_H)
        silu_H = F.silu(h1_H)
        dh2_H = da_H * silu_H
        dh1_H = torch.ops.aten.silu_backward(da_H.mul_(h2_H), h1_H)
        dw1_SD, dv1_SD = mm.ht_y(dh1_H, x_PD), mm.ht_y(dh2_H, x_PD)
        dx_PD = x_PD.new_empty(slots.num_slots + 1, x_PD.shape[1])
        dx_PD[-1].zero_()
        mm.h_w(dh1_H, w1, dx_PD[:-1], accumulate=False)
        mm.h_w(dh2_H, v1, dx_PD[:-1], accumulate=True)
        dx_TD = F.embedding_bag(slots.slot_TK, dx_PD, mode="sum")
        return dx_TD, dgate_TK, dw1_SD, dv1_SD, dw2_SD, dy_TD.sum(0), None, None


def grouped_swiglu(
    x_TD: torch.Tensor,
    gate_TK: torch.Tensor,
    w1_SD: torch.Tensor,
    v1_SD: torch.Tensor,
    w2_SD: torch.Tensor,
    bias_D: torch.Tensor,
    slots: Slots,
    layout: ExpertLayout,
) -> torch.Tensor:
    """Functional entry point of :class:`GroupedSwiGLU`."""
    return GroupedSwiGLU.apply(x_TD, gate_TK, w1_SD, v1_SD, w2_SD, bias_D, slots, layout)


def build_slots(
    indices_TK: torch.Tensor,
    order_N: torch.Tensor,
    rank_N: torch.Tensor,
    kept_counts: list[int],
    batched: bool,
    capacity: Optional[int],
) -> Slots:
    """Slot index maps from the expert-sorted assignments (``order_N``) and their rank inside their expert."""
    num_tokens, top_k = indices_TK.shape
    num_assignments = num_tokens * top_k
    device = indices_TK.device
    sorted_experts_N = indices_TK.reshape(-1).index_select(0, order_N)
    chunk_rows, chunk_expert = 0, None
    if batched:
        chunk_rows, chunks = choose_chunking(kept_counts)
        rows = tuple(c * chunk_rows for c in chunks)
        if any(c != 1 for c in chunks):
            experts_E = torch.arange(len(chunks), device=device)
            chunk_expert = torch.repeat_interleave(experts_E, torch.tensor(chunks, device=device))
    else:
        rows = tuple(kept_counts)
    starts_E = torch.tensor([0, *rows], device=device).cumsum(0)[:-1]
    slot_N = starts_E.index_select(0, sorted_experts_N) + rank_N
    num_slots = sum(rows)
    if capacity is not None:
        keep_N = rank_N < capacity
        slot_N = torch.where(keep_N, slot_N, num_slots)
        kept_order_N, kept_slot_N = order_N[keep_N], slot_N[keep_N]
    else:
        kept_order_N, kept_slot_N = order_N, slot_N
    assign_P = torch.full((num_slots,), num_assignments, dtype=torch.long, device=device)
    assign_P.index_copy_(0, kept_slot_N, kept_order_N)
    slot_TK = torch.empty(num_assignments, dtype=torch.long, device=device)
    slot_TK.index_copy_(0, order_N, slot_N)
    # NOTE: padding slots hold assignment N, and N // K == T is the appended zero row of the input.
    return Slots(rows, batched, chunk_rows, chunk_expert, assign_P // top_k, assign_P, slot_TK.view(num_tokens, top_k))
