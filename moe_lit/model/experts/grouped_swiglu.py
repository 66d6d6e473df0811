"""Dispatch -> per-expert SwiGLU -> weighted combine as ONE autograd Function with a hand-written backward.

Shape legend: T tokens, D d_model, E experts, K top-k, F one expert's hidden size, S sum of hidden sizes,
N = T*K routed assignments, P expert *slots* (rows of the grouped buffers), H hidden cells (sum over
experts of slots_e * F_e), B chunks and C rows per chunk (batched path).

Every kept assignment owns one slot; the slots of expert e are contiguous, in token order. Two slot
geometries share all the code below, which runs the SwiGLU math block by block
(:class:`ExpertBlocks`):

* batched: the slots come in B chunks of C rows, each chunk serving one expert (a busy expert may
  get several chunks, an idle one none), unused slots are padding, and ONE 3-D block covers them
  all, so each matmul is one ``torch.bmm``. It needs equal expert sizes and stays dropless: C and
  the chunk counts follow the routing (``choose_chunking``).
* looped: the slots are packed (no padding), one 2-D block per expert, each matmul a ``torch.mm``.
  It handles heterogeneous sizes, and wins where nothing runs in parallel (one CPU thread).

Token rows move with gathers only (no scatter-add over tokens): the dispatch gathers token rows
into slots, the combine is ``F.embedding_bag`` (a fused gather + weighted sum over the k slots of
a token), and the backward reuses the same two index maps. Padding slots read an appended zero row of
the input, so they compute exact zeros and add nothing to any weight gradient; a dropped
assignment (capacity mode) points at an appended zero row of the output buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from moe_lit.model.experts.layout import ExpertLayout


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


class ExpertBlocks:
    """Views of the slot buffers as blocks that one set of matmuls handles.

    batched: ONE block, the ``(B, C, .)`` views of all chunks, whose matmuls are ``bmm``s.
    looped: one ``(rows_e, .)`` block per expert, whose matmuls are ``mm``s; the elementwise work of
    an expert then runs while its rows are still in cache (measured about 10% faster than op-by-op
    over all experts, on one thread). Hidden activations of all blocks live in one flat buffer.
    """

    def __init__(self, slots: Slots, layout: ExpertLayout, d_model: int) -> None:
        self.slots, self.layout, self.d_model = slots, layout, d_model
        sizes = (layout.sizes[0],) if slots.batched else layout.sizes
        rows = (slots.num_slots,) if slots.batched else slots.rows
        self._hidden_shapes = [
            (-1, slots.chunk_rows, sizes[0]) if slots.batched else (r, f) for r, f in zip(rows, sizes)
        ]
        cells = [r * f for r, f in zip(rows, sizes)]
        self.hidden_cells = sum(cells)
        self._cell_offsets = _offsets(cells)
        self._row_offsets = _offsets(rows)

    def is_empty(self, i: int) -> bool:
        return self._row_offsets[i + 1] == self._row_offsets[i]

    def rows(self, t_P: torch.Tensor, i: int) -> torch.Tensor:
        """Block i of a slot-major tensor (first dim P): ``(B, C, ...)`` batched, ``(rows_e, ...)`` looped."""
        t = t_P[self._row_offsets[i] : self._row_offsets[i + 1]]
        return t.view(-1, self.slots.chunk_rows, *t.shape[1:]) if self.slots.batched else t

    def hidden(self, h_H: torch.Tensor, i: int) -> torch.Tensor:
        """Block i of a flat hidden buffer: ``(B, C, F)`` batched, ``(rows_e, F_e)`` looped."""
        return h_H[self._cell_offsets[i] : self._cell_offsets[i + 1]].view(self._hidden_shapes[i])

    def weights(self, w_SD: torch.Tensor) -> list[torch.Tensor]:
        """Per-block weights: ``(B, F, D)`` chunks (a view, or a gather when chunks repeat experts), or ``(F_e, D)``."""
        if not self.slots.batched:
            return list(self.layout.split(w_SD))
        if self.slots.chunk_expert is None:
            return [self.layout.as_EFD(w_SD)]
        # NOTE: a 2-D row gather; index_select over a 3-D tensor takes a slower path on CPU.
        num_experts, size = self.layout.num_experts, self.layout.sizes[0]
        w_BX = w_SD.view(num_experts, size * self.d_model).index_select(0, self.slots.chunk_expert)
        return [w_BX.view(-1, size, self.d_model)]

    def new_weight_grad(self, like_SD: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A stacked ``(S, D)`` gradient buffer and the per-block outputs the matmuls write into."""
        if not self.slots.batched:
            g_SD = torch.empty_like(like_SD)
            return g_SD, list(self.layout.split(g_SD))
        if self.slots.chunk_expert is None:
            g_SD = torch.empty_like(like_SD)
            return g_SD, [self.layout.as_EFD(g_SD)]
        size = self.layout.sizes[0]
        return torch.zeros_like(like_SD), [like_SD.new_empty(len(self.slots.chunk_expert), size, self.d_model)]

    def reduce_weight_grad(self, g_SD: torch.Tensor, blocks: list[torch.Tensor]) -> torch.Tensor:
        """Sum the chunks of each expert into ``g_SD`` (batched with repeated experts); else a no-op."""
        if self.slots.batched and self.slots.chunk_expert is not None:
            num_experts, width = self.layout.num_experts, self.layout.sizes[0] * self.d_model
            g_SD.view(num_experts, width).index_add_(0, self.slots.chunk_expert, blocks[0].view(-1, width))
        return g_SD


def _offsets(lengths) -> list[int]:
    out = [0]
    for length in lengths:
        out.append(out[-1] + length)
    return out


def _add_matmul_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b`` for 2-D (``addmm_``) or batched 3-D (``baddbmm_``) blocks."""
    (out.baddbmm_ if out.dim() == 3 else out.addmm_)(a, b)


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
        blocks = ExpertBlocks(slots, layout, x_TD.shape[1])
        x_PD = _with_zero_row(x_TD).index_select(0, slots.token_P)
        h1_H, h2_H, act_H = (x_TD.new_empty(blocks.hidden_cells) for _ in range(3))
        # NOTE: one extra zero row at index P: dropped assignments point there.
        o_PD = x_TD.new_empty(slots.num_slots + 1, x_TD.shape[1])
        o_PD[-1].zero_()
        weights = zip(blocks.weights(w1_SD), blocks.weights(v1_SD), blocks.weights(w2_SD))
        for i, (w1, v1, w2) in enumerate(weights):
            if blocks.is_empty(i):
                continue
            x, h1, h2, act = (
                blocks.rows(x_PD, i),
                blocks.hidden(h1_H, i),
                blocks.hidden(h2_H, i),
                blocks.hidden(act_H, i),
            )
            torch.matmul(x, w1.mT, out=h1)
            torch.matmul(x, v1.mT, out=h2)
            torch.mul(F.silu(h1), h2, out=act)
            torch.matmul(act, w2, out=blocks.rows(o_PD, i))
        y_TD = F.embedding_bag(slots.slot_TK, o_PD, per_sample_weights=gate_TK, mode="sum") + bias_D
        ctx.save_for_backward(x_PD, h1_H, h2_H, act_H, gate_TK, w1_SD, v1_SD, w2_SD)
        ctx.blocks = blocks
        return y_TD

    @staticmethod
    def backward(ctx, dy_TD: torch.Tensor):  # type: ignore[override]
        x_PD, h1_H, h2_H, act_H, gate_TK, w1_SD, v1_SD, w2_SD = ctx.saved_tensors
        blocks: ExpertBlocks = ctx.blocks
        slots = blocks.slots
        dyg_PD = _with_zero_row(dy_TD.contiguous()).index_select(0, slots.token_P)
        gate_P = F.pad(gate_TK.reshape(-1), (0, 1)).index_select(0, slots.assign_P)
        dgate_P = x_PD.new_zeros(slots.num_slots + 1)
        dx_PD = x_PD.new_empty(slots.num_slots + 1, x_PD.shape[1])
        dx_PD[-1].zero_()
        (dw1_SD, dw1s), (dv1_SD, dv1s), (dw2_SD, dw2s) = (blocks.new_weight_grad(w) for w in (w1_SD, v1_SD, w2_SD))
        weights = zip(blocks.weights(w1_SD), blocks.weights(v1_SD), blocks.weights(w2_SD))
        for i, (w1, v1, w2) in enumerate(weights):
            if blocks.is_empty(i):
                for g in (dw1s[i], dv1s[i], dw2s[i]):
                    g.zero_()
                continue
            x, dyg, gate = blocks.rows(x_PD, i), blocks.rows(dyg_PD, i), blocks.rows(gate_P, i).unsqueeze(-1)
            h1, h2, act = blocks.hidden(h1_H, i), blocks.hidden(h2_H, i), blocks.hidden(act_H, i)
            # NOTE: the gates are applied in hidden space (F wide, not D): a slot's output gradient
            # is gate * dy, so dL/dact = gate * (dy @ w2^T) and dL/dgate = <act, dy @ w2^T>.
            da = torch.matmul(dyg, w2.mT)
            torch.linalg.vecdot(act, da, out=blocks.rows(dgate_P, i))
            torch.matmul((act * gate).mT, dyg, out=dw2s[i])
            da.mul_(gate)
            dh2 = da * F.silu(h1)
            dh1 = torch.ops.aten.silu_backward(da.mul_(h2), h1)
            torch.matmul(dh1.mT, x, out=dw1s[i])
            torch.matmul(dh2.mT, x, out=dv1s[i])
            dx = blocks.rows(dx_PD, i)
            torch.matmul(dh1, w1, out=dx)
            _add_matmul_(dx, dh2, v1)
        dgate_TK = dgate_P.index_select(0, slots.slot_TK.reshape(-1)).view_as(gate_TK)
        dx_TD = F.embedding_bag(slots.slot_TK, dx_PD, mode="sum")
        grads = [blocks.reduce_weight_grad(g, gs) for g, gs in ((dw1_SD, dw1s), (dv1_SD, dv1s), (dw2_SD, dw2s))]
        return dx_TD, dgate_TK, *grads, dy_TD.sum(0), None, None


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
    shape_TK: torch.Size,
    order_N: torch.Tensor,
    sorted_experts_N: torch.Tensor,
    rank_N: torch.Tensor,
    kept_counts: list[int],
    batched: bool,
    capacity: Optional[int],
) -> Slots:
    """Slot index maps from the expert-sorted assignments: ``order_N`` (flat ids), their experts and
    their rank inside their expert."""
    num_tokens, top_k = shape_TK
    num_assignments = num_tokens * top_k
    device = order_N.device
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
