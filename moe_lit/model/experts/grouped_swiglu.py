"""Dispatch -> per-expert SwiGLU -> weighted combine over expert slots, in two halves with hand-written backwards.

Shape legend: T tokens, D d_model, E experts, K top-k, F one expert's hidden size, S sum of hidden sizes,
N = T*K routed assignments, P expert *slots* (rows of the grouped buffers), H hidden cells (sum over
experts of slots_e * F_e), B chunks and C rows per chunk (batched path).

Every kept assignment owns one slot; the slots of expert e are contiguous, in token order. Three
slot geometries share all the code below: :class:`ExpertBlocks` runs each matmul of the SwiGLU
over all experts (the only geometry-specific code), the elementwise work runs once over the whole
flat hidden buffers.

* grouped: the slots are packed (no padding) and every matmul is ONE grouped GEMM
  (``torch._grouped_mm`` with the experts' row offsets). Equal expert sizes, rows 16-byte aligned.
* batched: the slots come in B chunks of C rows, each chunk serving one expert (a busy expert may
  get several chunks, an idle one none), unused slots are padding, and ONE 3-D block covers them
  all, so each matmul is one ``torch.bmm``. It needs equal expert sizes and stays dropless: C and
  the chunk counts follow the routing (``choose_chunking``).
* looped: the slots are packed, one 2-D block per expert, each matmul a ``torch.mm`` per expert.
  It handles heterogeneous sizes.

The SwiGLU runs in two halves around its elementwise product, each with its backward:
:func:`project_gate_up` (gather the slots' token rows, gate and up projections) and
:func:`project_down_combine` (down projection, gate-weighted combine); ``ops.py`` registers them
as custom ops and computes the product between them (``model/invariant.py:swiglu``).

Token rows move with gathers only (no scatter-add over tokens): the dispatch gathers token rows
into slots, the combine is ``F.embedding_bag`` (a fused gather + weighted sum over the k slots of
a token), and the backward reuses the same two index maps. Padding slots read an appended zero row of
the input, so they compute exact zeros and add nothing to any weight gradient; a dropped
assignment (capacity mode) points at an appended zero row of the output buffers.

Every op here gives the same bits at any intra-op thread count (``torch.set_num_threads``), as the
dense FFN does: a block of fewer than :data:`SERIAL_BLOCK_ROWS` slots runs its matmuls on one
thread (:meth:`ExpertBlocks._each_block`; ``model/invariant.py`` says why).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import torch
import torch.nn.functional as F

from moe_lit._compat import grouped_mm_op
from moe_lit.model.experts.layout import ExpertLayout
from moe_lit.model.invariant import one_thread

# NOTE: the fixed cost of one chunk in the batched path, in rows of compute: the copy of its
# expert's weights and the reduction of their gradients, plus the per-matrix overhead of a batched
# gemm with few rows. Fitted on this project's 2-core CPU with forced chunk sizes on skewed routing:
# 30-80 rows. It keeps the chooser from splitting into many small chunks.
CHUNK_OVERHEAD_ROWS = 64

HOST_PLAN_ASSIGNMENTS = 64
"""Routings of at most this many assignments (decoding steps) are planned in python lists
(``_plan_on_host``): per-op overhead, not arithmetic, is what a plan of a few tokens costs."""

SERIAL_BLOCK_ROWS = 32
"""Blocks of fewer slots than this run their matmuls on one thread, whatever ``torch.get_num_threads()``.

NOTE: a block's row count follows the routing, so an expert that gets few tokens makes a GEMM far
skinnier than any of the dense model's. MKL's fp32 GEMM rounds such skinny products differently at
different thread counts (rows 2-11 against 255 or 128 columns, ``tests/model/test_thread_invariance.py``),
and the difference grew into 0.18 nats of the demo MoE's validation loss between 1 and 2 threads.
On one thread the rounding cannot follow the thread count; a block this small gains nothing from
more threads. The margin above 11 is for kernels this machine did not show."""

Geometry = Literal["grouped", "batched", "looped"]
ALIGN_BYTES = 16
"""Grouped GEMM kernels need every row stride to be a multiple of 16 bytes."""


@dataclass(frozen=True)
class Slots:
    """Slot geometry and index maps of one routing decision (see the module docstring)."""

    rows: tuple[int, ...]
    """Slots per expert: contiguous blocks, in expert order."""
    geometry: Geometry
    """How the matmuls run over the slots: grouped GEMMs, padded chunks and ``bmm``, or a loop of ``mm``."""
    chunk_rows: int
    """Slots per chunk (batched only; 0 otherwise)."""
    chunk_expert: torch.Tensor | None
    """Expert of each chunk when some expert has no chunk or several; None when chunk e is expert e."""
    assign_P: torch.Tensor
    """Flat assignment ``t*K + k`` held by each slot; padding slots hold N (an appended zero gate)."""
    slot_TK: torch.Tensor
    """Slot of each assignment; a dropped assignment holds P (an appended zero row of the outputs)."""
    may_drop: bool
    """Capacity mode: some ``slot_TK`` may point at the zero row P."""

    @property
    def num_slots(self) -> int:
        return sum(self.rows)

    @cached_property
    def token_P(self) -> torch.Tensor:
        """Token feeding each slot; padding slots hold T, the index of an appended zero row."""
        # NOTE: padding slots hold assignment N, and N // K == T.
        return self.assign_P // self.slot_TK.shape[1]

    @property
    def batched(self) -> bool:
        return self.geometry == "batched"


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
    """Each matmul of the expert SwiGLU over all slots, in the slots' geometry.

    Slot-major tensors (first dim P, plus an optional zero row) and flat hidden buffers (H cells:
    each slot's F_e activations, slot after slot) are the currency; rows and cells beyond P and H
    (the ops' static-size padding, ``ops.py``) are ignored. A *block* is what one matmul
    call sees: the whole ``(P, .)`` for grouped, the ``(B, C, .)`` chunks for batched, one expert's
    ``(rows_e, .)`` for looped.
    """

    def __init__(self, slots: Slots, layout: ExpertLayout, d_model: int) -> None:
        self.slots, self.layout, self.d_model = slots, layout, d_model
        looped = slots.geometry == "looped"
        self._block_rows = slots.rows if looped else (slots.num_slots,)
        self._block_sizes = layout.sizes if looped else (layout.sizes[0],)
        self._cells = [r * f for r, f in zip(self._block_rows, self._block_sizes, strict=False)]
        self._uniform = len(set(self._block_sizes)) == 1
        # NOTE: the grouped GEMMs' group ends, made once per routing (not per matmul: on CUDA each
        # would be a host-to-device copy).
        self._offs_E = (
            torch.tensor(list(itertools.accumulate(slots.rows)), dtype=torch.int32, device=slots.assign_P.device)
            if slots.geometry == "grouped"
            else None
        )
        self.hidden_cells = sum(self._cells)
        self._filled = [i for i, rows in enumerate(self._block_rows) if rows]
        self._empty = [i for i, rows in enumerate(self._block_rows) if not rows]
        # the slots of each filled block as one matmul sees them (a batched chunk's C rows)
        self._filled_rows = (
            [slots.chunk_rows] * len(self._filled) if slots.batched else [self._block_rows[i] for i in self._filled]
        )
        self._row_starts = list(itertools.accumulate(self._block_rows, initial=0))
        self._cell_starts = list(itertools.accumulate(self._cells, initial=0))
        # NOTE: a decoding step fills a few of many experts: then slices of those beat one split
        # into a view per expert.
        self._few_filled = 4 * len(self._filled) <= len(self._block_rows)

    # ------------------------------------------------------------------ views
    # NOTE: the views of the filled blocks only, in block order; each list comes from one ``split``
    # call unless few blocks are filled: with 64 experts the backward touches ~20 block views per
    # expert, and view-by-view slicing cost measurable Python time.
    def _pieces(self, t: torch.Tensor, sizes: Sequence[int], starts: Sequence[int]) -> list[torch.Tensor]:
        """Views of the filled blocks of ``t`` along its first dim (block i: ``sizes[i]`` from ``starts[i]``)."""
        if self._few_filled:
            return [t[starts[i] : starts[i] + sizes[i]] for i in self._filled]
        pieces = t[: starts[len(sizes)]].split(list(sizes))
        return [pieces[i] for i in self._filled] if self._empty else list(pieces)

    def _rows(self, t_P: torch.Tensor) -> list[torch.Tensor]:
        """The filled blocks of a slot-major tensor (first dim P, extra rows ignored)."""
        if self.slots.batched:
            t = t_P[: self.slots.num_slots]
            return [t.view(-1, self.slots.chunk_rows, *t.shape[1:])] if self._filled else []
        return self._pieces(t_P, self._block_rows, self._row_starts)

    def _hidden(self, h_H: torch.Tensor) -> list[torch.Tensor]:
        """The filled blocks of a flat hidden buffer: ``(B, C, F)`` batched, else ``(rows, F)``."""
        h_PF = self._uniform_rows(h_H)
        if h_PF is None:  # looped over experts of different sizes
            cells = self._pieces(h_H, self._cells, self._cell_starts)
            return [c.view(self._block_rows[i], -1) for c, i in zip(cells, self._filled, strict=True)]
        if self.slots.batched:
            return [h_PF.view(-1, self.slots.chunk_rows, h_PF.shape[1])] if self._filled else []
        return self._pieces(h_PF, self._block_rows, self._row_starts)

    def _weights(self, w_SD: torch.Tensor) -> list[torch.Tensor]:
        """Weights of the filled blocks: ``(E, F, D)`` grouped; ``(B, F, D)`` chunks batched (a gather
        when chunks repeat experts); ``(F_e, D)`` looped."""
        if self.slots.geometry == "looped":
            return self._pieces(w_SD, self.layout.sizes, self.layout.offsets)
        if not self._filled:
            return []
        if self.slots.chunk_expert is None:
            return [self.layout.as_EFD(w_SD)]
        # NOTE: a 2-D row gather; index_select over a 3-D tensor takes a slower path on CPU.
        num_experts, size = self.layout.num_experts, self.layout.sizes[0]
        w_BX = w_SD.view(num_experts, size * self.d_model).index_select(0, self.slots.chunk_expert)
        return [w_BX.view(-1, size, self.d_model)]

    def _uniform_rows(self, h_H: torch.Tensor) -> torch.Tensor | None:
        """The flat hidden buffer as ``(P, F)`` when every block has the same F, else None."""
        return self._cells_of(h_H).view(-1, self._block_sizes[0]) if self._uniform else None

    def _cells_of(self, h_H: torch.Tensor) -> torch.Tensor:
        """The first H cells of a flat hidden buffer (the slots' own)."""
        return h_H[: self.hidden_cells]

    # ------------------------------------------------------------------ matmuls over all blocks
    def _each_block(
        self,
        matmul: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
        a: list[torch.Tensor],
        b: list[torch.Tensor],
        out: list[torch.Tensor],
    ) -> None:
        """``matmul(a_i, b_i, out_i)`` for every filled block i; the blocks of fewer than
        :data:`SERIAL_BLOCK_ROWS` slots together on one thread."""
        blocks = list(zip(a, b, out, self._filled_rows, strict=True))
        for a_i, b_i, out_i, rows in blocks:
            if rows >= SERIAL_BLOCK_ROWS:
                matmul(a_i, b_i, out_i)
        serial = [block for block in blocks if block[3] < SERIAL_BLOCK_ROWS]
        if serial:
            with one_thread():
                for a_i, b_i, out_i, _ in serial:
                    matmul(a_i, b_i, out_i)

    def project_in(self, x_PD: torch.Tensor, w_SD: torch.Tensor) -> torch.Tensor:
        """Flat hidden buffer of ``x_p @ w_e^T`` for every slot p (expert e)."""
        if self.slots.geometry == "grouped":
            x = x_PD[: self.slots.num_slots]
            return _grouped_mm(x, self.layout.as_EFD(w_SD).mT, offs=self._offs_E).view(-1)
        h_H = x_PD.new_empty(self.hidden_cells)
        self._each_block(_matmul_into, self._rows(x_PD), [w.mT for w in self._weights(w_SD)], self._hidden(h_H))
        return h_H

    def project_out(self, h_H: torch.Tensor, w_SD: torch.Tensor, add_to: torch.Tensor | None = None) -> torch.Tensor:
        """``h_p @ w_e`` for every slot, as ``(P, D)`` plus a zero row P when an assignment may point
        there; with ``add_to`` the products are added into it (same shape) instead."""
        num_slots = self.slots.num_slots
        if self.slots.geometry == "grouped":
            h_PF = self._cells_of(h_H).view(num_slots, -1)
            o_PD = _grouped_mm(h_PF, self.layout.as_EFD(w_SD), offs=self._offs_E)
            if add_to is not None:
                add_to[:num_slots] += o_PD
                return add_to
            return _with_zero_row(o_PD) if self.slots.may_drop else o_PD
        if add_to is None:
            # NOTE: one extra zero row at index P when dropped assignments point there.
            add_to = h_H.new_empty(num_slots + self.slots.may_drop, self.d_model)
            if self.slots.may_drop:
                add_to[-1].zero_()
            matmul: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] = _matmul_into
        else:
            matmul = _add_matmul_
        self._each_block(matmul, self._hidden(h_H), self._weights(w_SD), self._rows(add_to))
        return add_to

    def weight_grad(self, h_H: torch.Tensor, y_PD: torch.Tensor, like_SD: torch.Tensor) -> torch.Tensor:
        """The stacked ``(S, D)`` gradient ``sum_p h_p^T y_p`` of every expert's (F_e, D) matrix."""
        if self.slots.geometry == "grouped":
            num_slots = self.slots.num_slots
            h_PF = self._cells_of(h_H).view(num_slots, -1)
            g_EFD = _grouped_mm(h_PF.mT, y_PD[:num_slots], offs=self._offs_E)
            return g_EFD.view_as(like_SD)
        # chunks that repeat an expert: their gradients are summed into it
        repeated_E = self.slots.chunk_expert if self.slots.batched and self._filled else None
        if repeated_E is not None:
            g_SD = torch.zeros_like(like_SD)
            outs = [like_SD.new_empty(len(repeated_E), self.layout.sizes[0], self.d_model)]
        elif self.slots.batched:
            g_SD = torch.empty_like(like_SD) if self._filled else torch.zeros_like(like_SD)
            outs = [self.layout.as_EFD(g_SD)] if self._filled else []
        else:
            g_SD = torch.empty_like(like_SD)
            outs = self._pieces(g_SD, self.layout.sizes, self.layout.offsets)
            for e in self._empty:  # idle experts get exact zeros
                g_SD[self.layout.rows(e)].zero_()
        self._each_block(_matmul_into, [h.mT for h in self._hidden(h_H)], self._rows(y_PD), outs)
        if repeated_E is not None:
            num_experts, width = self.layout.num_experts, self.layout.sizes[0] * self.d_model
            g_SD.view(num_experts, width).index_add_(0, repeated_E, outs[0].view(-1, width))
        return g_SD

    # ------------------------------------------------------------------ per-slot elementwise work
    def row_dots(self, a_H: torch.Tensor, b_H: torch.Tensor, out_P: torch.Tensor) -> None:
        """``out_P[p] = <a_p, b_p>`` over each slot's hidden cells (entries beyond P untouched)."""
        a_PF, b_PF = self._uniform_rows(a_H), self._uniform_rows(b_H)
        if a_PF is not None:
            torch.linalg.vecdot(a_PF, b_PF, out=out_P[: a_PF.shape[0]])
            return
        for a, b, out in zip(self._hidden(a_H), self._hidden(b_H), self._rows(out_P), strict=False):
            torch.linalg.vecdot(a, b, out=out)

    def scale_rows_(self, h_H: torch.Tensor, scale_P: torch.Tensor) -> torch.Tensor:
        """Multiply each slot's hidden cells by its entry of ``scale_P``, in place; returns ``h_H``."""
        h_PF = self._uniform_rows(h_H)
        if h_PF is not None:
            h_PF.mul_(scale_P[: h_PF.shape[0]].unsqueeze(-1))
            return h_H
        for h, scale in zip(self._hidden(h_H), self._rows(scale_P), strict=False):
            h.mul_(scale.unsqueeze(-1))
        return h_H


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
    """The grouped GEMM of the grouped geometry (chosen only where the op exists; offsets made for it)."""
    op = grouped_mm_op()
    if op is None or offs is None:
        raise RuntimeError("the grouped geometry needs F.grouped_mm (or torch._grouped_mm) and group offsets")
    return op(a, b, offs=offs)


def _matmul_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out = a @ b``."""
    torch.matmul(a, b, out=out)


def _add_matmul_(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out += a @ b`` for 2-D (``addmm_``) or batched 3-D (``baddbmm_``) blocks."""
    (out.baddbmm_ if out.dim() == 3 else out.addmm_)(a, b)


def _with_zero_row(x_TD: torch.Tensor) -> torch.Tensor:
    return torch.cat([x_TD, x_TD.new_zeros(1, x_TD.shape[1])])


def gather_slots(x_TD: torch.Tensor, slots: Slots) -> torch.Tensor:
    """``(P, D)``: the token row of every slot (padding slots, batched only, read an appended zero row)."""
    # NOTE: packed slots all hold a kept assignment, so only padded chunks need the zero row's copy of x.
    source_TD = _with_zero_row(x_TD) if slots.batched else x_TD
    return source_TD.index_select(0, slots.token_P)


def _gate_of_slots(gate_TK: torch.Tensor, slots: Slots) -> torch.Tensor:
    """``(P,)``: the gate of every slot's assignment (padding slots: an appended zero gate)."""
    gate_N = gate_TK.reshape(-1)
    return (F.pad(gate_N, (0, 1)) if slots.batched else gate_N).index_select(0, slots.assign_P)


# ---------------------------------------------------------------------- the two halves of the SwiGLU
# NOTE: the experts' SwiGLU ``y_t = sum_k gate_tk * (silu(x_t w1_e^T) * (x_t v1_e^T)) w2_e`` runs in two
# halves around its elementwise product, each with its hand-written backward: the product itself is
# ``model/invariant.py:swiglu``, which torch.compile fuses (``ops.py``).
def project_gate_up(
    x_TD: torch.Tensor, w1_SD: torch.Tensor, v1_SD: torch.Tensor, slots: Slots, layout: ExpertLayout
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_PD, h1_H, h2_H)``: the slots' token rows and their gate and up projections."""
    blocks = ExpertBlocks(slots, layout, x_TD.shape[1])
    x_PD = gather_slots(x_TD, slots)
    return x_PD, blocks.project_in(x_PD, w1_SD), blocks.project_in(x_PD, v1_SD)


def project_gate_up_backward(
    dh1_H: torch.Tensor,
    dh2_H: torch.Tensor,
    x_PD: torch.Tensor,
    w1_SD: torch.Tensor,
    v1_SD: torch.Tensor,
    slots: Slots,
    layout: ExpertLayout,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx_TD, dw1_SD, dv1_SD)`` of :func:`project_gate_up`."""
    blocks = ExpertBlocks(slots, layout, x_PD.shape[1])
    dw1_SD, dv1_SD = blocks.weight_grad(dh1_H, x_PD, w1_SD), blocks.weight_grad(dh2_H, x_PD, v1_SD)
    dx_PD = blocks.project_out(dh2_H, v1_SD, add_to=blocks.project_out(dh1_H, w1_SD))
    return F.embedding_bag(slots.slot_TK, dx_PD, mode="sum"), dw1_SD, dv1_SD


def project_down_combine(
    act_H: torch.Tensor, w2_SD: torch.Tensor, gate_TK: torch.Tensor, slots: Slots, layout: ExpertLayout
) -> torch.Tensor:
    """``(T, D)``: every slot's down projection, summed per token with its gates."""
    blocks = ExpertBlocks(slots, layout, w2_SD.shape[1])
    return combine_slots(slots, blocks.project_out(act_H, w2_SD), gate_TK)


def project_down_combine_backward(
    dy_TD: torch.Tensor,
    act_H: torch.Tensor,
    w2_SD: torch.Tensor,
    gate_TK: torch.Tensor,
    slots: Slots,
    layout: ExpertLayout,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dact_H, dgate_TK, dw2_SD)`` of :func:`project_down_combine`."""
    blocks = ExpertBlocks(slots, layout, w2_SD.shape[1])
    dyg_PD = gather_slots(dy_TD.contiguous(), slots)
    gate_P = _gate_of_slots(gate_TK, slots)
    # NOTE: the gates are applied in hidden space (F wide, not D): a slot's output gradient
    # is gate * dy, so dL/dact = gate * (dy @ w2^T) and dL/dgate = <act, dy @ w2^T>.
    dact_H = blocks.project_in(dyg_PD, w2_SD)
    dgate_P = dyg_PD.new_zeros(slots.num_slots + 1)
    blocks.row_dots(act_H, dact_H, out_P=dgate_P)
    blocks.scale_rows_(dact_H, gate_P)
    dw2_SD = blocks.weight_grad(blocks.scale_rows_(act_H.clone(), gate_P), dyg_PD, w2_SD)
    dgate_TK = dgate_P.index_select(0, slots.slot_TK.reshape(-1)).view_as(gate_TK)
    return dact_H, dgate_TK, dw2_SD


def combine_slots(
    slots: Slots, o_PD: torch.Tensor, gate_TK: torch.Tensor, bias_D: torch.Tensor | None = None
) -> torch.Tensor:
    """``y_t = bias + sum_k gate_tk * o_{slot_tk}`` (a fused gather + weighted sum; no bias: none added)."""
    y_TD = F.embedding_bag(slots.slot_TK, o_PD, per_sample_weights=gate_TK, mode="sum")
    return y_TD if bias_D is None else y_TD + bias_D


# ---------------------------------------------------------------------- slots
def slot_rows(
    kept_counts: list[int], geometry: Geometry, device: torch.device
) -> tuple[tuple[int, ...], int, torch.Tensor | None]:
    """``(rows, chunk_rows, chunk_expert)`` of :class:`Slots` for the kept assignments per expert."""
    if geometry != "batched":
        return tuple(kept_counts), 0, None
    chunk_rows, chunks = choose_chunking(kept_counts)
    rows = tuple(c * chunk_rows for c in chunks)
    if all(c == 1 for c in chunks):
        return rows, chunk_rows, None
    experts_E = torch.arange(len(chunks), device=device)
    return rows, chunk_rows, torch.repeat_interleave(experts_E, torch.tensor(chunks, device=device))


def build_slots(
    shape_TK: torch.Size,
    order_N: torch.Tensor,
    sorted_experts_N: torch.Tensor,
    rank_N: torch.Tensor,
    kept_counts: list[int],
    geometry: Geometry,
    capacity: int | None,
) -> Slots:
    """Slot index maps from the expert-sorted assignments: ``order_N`` (flat ids), their experts and
    their rank inside their expert."""
    num_tokens, top_k = shape_TK
    num_assignments = num_tokens * top_k
    device = order_N.device
    rows, chunk_rows, chunk_expert = slot_rows(kept_counts, geometry, device)
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
    return Slots(
        rows, geometry, chunk_rows, chunk_expert, assign_P, slot_TK.view(num_tokens, top_k), capacity is not None
    )


@dataclass
class Dispatch:
    """Where each kept assignment goes, and the routing counts the MoE layer reports."""

    slots: Slots
    """Slot geometry and index maps consumed by the SwiGLU's two halves."""
    kept_counts: list[int]
    """Kept assignments per expert (python ints: they size the per-expert slot blocks)."""
    routed_counts_E: torch.Tensor
    """Assignments per expert before dropping."""
    dropped: torch.Tensor
    """Number of dropped assignments (0-dim)."""


def plan_dispatch(indices_TK: torch.Tensor, layout: ExpertLayout, capacity: int | None, geometry: Geometry) -> Dispatch:
    """Group assignments by expert; with a capacity, drop each expert's overflow in token order."""
    if indices_TK.numel() <= HOST_PLAN_ASSIGNMENTS and geometry != "batched":
        return _plan_on_host(indices_TK, layout, capacity, geometry)
    experts_N = indices_TK.reshape(-1)
    order_N = torch.argsort(experts_N, stable=True)
    routed_counts_E = torch.bincount(experts_N, minlength=layout.num_experts)
    starts_E = torch.cumsum(routed_counts_E, 0) - routed_counts_E
    sorted_experts_N = experts_N.index_select(0, order_N)
    rank_N = torch.arange(order_N.numel(), device=order_N.device) - starts_E.index_select(0, sorted_experts_N)
    if capacity is not None:
        kept_counts_E = routed_counts_E.clamp(max=capacity)
        dropped = routed_counts_E.sum() - kept_counts_E.sum()
    else:
        kept_counts_E = routed_counts_E
        dropped = torch.zeros((), dtype=torch.long, device=indices_TK.device)
    kept_counts = kept_counts_E.tolist()
    slots = build_slots(indices_TK.shape, order_N, sorted_experts_N, rank_N, kept_counts, geometry, capacity)
    return Dispatch(slots, kept_counts, routed_counts_E, dropped)


def _plan_on_host(indices_TK: torch.Tensor, layout: ExpertLayout, capacity: int | None, geometry: Geometry) -> Dispatch:
    """:func:`plan_dispatch` for packed slots, computed in python lists: the same plan from one
    device-to-host read and four small tensors, instead of about twenty tensor ops."""
    num_tokens, top_k = indices_TK.shape
    experts_N = indices_TK.reshape(-1).tolist()
    routed = [0] * layout.num_experts
    for expert in experts_N:
        routed[expert] += 1
    kept = routed if capacity is None else [min(count, capacity) for count in routed]
    starts = list(itertools.accumulate(kept, initial=0))
    num_slots = starts[-1]
    # NOTE: assignments in flat (token-major) order, so each expert's kept ones are its first, as
    # the stable sort of plan_dispatch keeps them; a dropped one points at the zero row P.
    seen = [0] * layout.num_experts
    slot_N, assign_P = [num_slots] * len(experts_N), [0] * num_slots
    for n, expert in enumerate(experts_N):
        if seen[expert] < kept[expert]:
            slot_N[n] = starts[expert] + seen[expert]
            assign_P[slot_N[n]] = n
        seen[expert] += 1
    device = indices_TK.device
    slots = Slots(
        rows=tuple(kept),
        geometry=geometry,
        chunk_rows=0,
        chunk_expert=None,
        assign_P=torch.tensor(assign_P, dtype=torch.long, device=device),
        slot_TK=torch.tensor(slot_N, dtype=torch.long, device=device).view(num_tokens, top_k),
        may_drop=capacity is not None,
    )
    routed_counts_E = torch.tensor(routed, dtype=torch.long, device=device)
    dropped = torch.tensor(len(experts_N) - num_slots, dtype=torch.long, device=device)
    return Dispatch(slots, kept, routed_counts_E, dropped)


def restore_slots(
    assign_P: torch.Tensor, slot_TK: torch.Tensor, kept_counts: list[int], geometry: Geometry, may_drop: bool
) -> Slots:
    """The :class:`Slots` of a routing from its two index maps and kept counts (what the custom ops
    pass between them, ``assign_P`` possibly padded beyond P: ``ops.py``)."""
    rows, chunk_rows, chunk_expert = slot_rows(kept_counts, geometry, assign_P.device)
    assign_P = assign_P[: sum(rows)]
    return Slots(rows, geometry, chunk_rows, chunk_expert, assign_P, slot_TK, may_drop)
