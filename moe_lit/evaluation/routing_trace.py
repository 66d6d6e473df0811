"""Record routing decisions: which experts each token visits, in every MoE layer.

Shape legend: B batch, L sequence, T = B*L tokens of one forward, N tokens of the whole trace,
S traced sequences (batch rows), M traced MoE layers, K top-k, E experts, D d_model.

``routing_trace(model)`` is a context manager that hooks every router of a ``Transformer`` (or of
any module holding one, e.g. a LightningModule) and the model input; every forward inside the
block appends to the trace. It never changes the computation and removes its hooks on exit.

The ONE trace format, :class:`RoutingTrace`, is what every consumer of routing statistics reads
(per-language analysis, pruning, MAESTRO transition chains, MoE->dense expert scoring):

* ``indices_MNK`` / ``weights_MNK``: the top-k expert ids and combine weights chosen by each MoE
  layer for each token (routed decisions, before any capacity dropping);
* ``probs_MNE`` (optional): every expert's router score;
* ``inputs_MND`` (optional): each MoE layer's input (after the FFN norm), what scores that need
  the experts' outputs (REAP, NAEE reconstruction) recompute them from;
* token metadata: ``seq_N`` (which traced sequence = batch row), ``pos_N`` (position in it),
  ``tokens_N`` (input id), and per-sequence ``labels`` such as ``{"language": [...], "doc": [...]}``.

Tokens of one sequence are contiguous and in order, so consecutive tokens are ``n, n+1`` with the
same ``seq_N`` and ``pos_N`` one apart. Traces concatenate (:meth:`RoutingTrace.concat`), filter
(:meth:`select`, :meth:`where`) and round-trip through ``.pt`` files (:meth:`save`, :meth:`load`).

NOTE: padding tokens are traced like any other token: trace unpadded sequences, or drop the padding
afterwards with :meth:`RoutingTrace.select`. Activation checkpointing re-runs the routers in the
backward pass and would record them twice: trace forwards without it (e.g. under ``no_grad``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moe_lit.errors import MoeLitError
from moe_lit.io import atomic_file

TRACE_FORMAT_VERSION = 1


@dataclass
class RoutingTrace:
    """Routing decisions of M MoE layers for N tokens, with token metadata."""

    layer_ids: tuple[int, ...]
    """Block index of each traced MoE layer (the M axis, in model order)."""
    num_experts: int
    """Experts E per MoE layer."""
    indices_MNK: torch.Tensor
    """Expert ids chosen for each token (int64), best first."""
    weights_MNK: torch.Tensor
    """Combine weights of the chosen experts (float32)."""
    seq_N: torch.Tensor
    """Index of the traced sequence (batch row) each token belongs to (int64)."""
    pos_N: torch.Tensor
    """Position of each token inside its sequence (int64)."""
    tokens_N: torch.Tensor
    """Input token id of each token (int64)."""
    labels: dict[str, list[Any]] = field(default_factory=dict)
    """Per-sequence metadata: label name -> one value per sequence (e.g. language, doc)."""
    probs_MNE: torch.Tensor | None = None
    """Router scores of every expert (softmax or sigmoid, before bias), when recorded."""
    inputs_MND: torch.Tensor | None = None
    """Input of each MoE layer for each token (float32, after the FFN norm), when recorded."""

    def __post_init__(self) -> None:
        self.layer_ids = tuple(self.layer_ids)
        layers, tokens = len(self.layer_ids), self.seq_N.shape[0]
        expected = {"indices_MNK": (layers, tokens), "weights_MNK": (layers, tokens)}
        if self.probs_MNE is not None:
            expected["probs_MNE"] = (layers, tokens, self.num_experts)
        if self.inputs_MND is not None:
            expected["inputs_MND"] = (layers, tokens)
        for name, shape in expected.items():
            got = tuple(getattr(self, name).shape[: len(shape)])
            if got != shape:
                raise MoeLitError(f"routing trace: {name} has leading shape {got}, expected {shape}")
        for name, values in self.labels.items():
            if len(values) != self.num_sequences:
                raise MoeLitError(
                    f"routing trace: label {name!r} has {len(values)} values for {self.num_sequences} sequences"
                )

    # ------------------------------------------------------------------ sizes
    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.seq_N.shape[0])

    @property
    def num_sequences(self) -> int:
        """Sequences the labels describe (sequence ids run from 0 to this - 1)."""
        if self.labels:
            return len(next(iter(self.labels.values())))
        return int(self.seq_N.max()) + 1 if self.num_tokens else 0

    @property
    def top_k(self) -> int:
        return int(self.indices_MNK.shape[-1])

    # ------------------------------------------------------------------ statistics
    def counts_ME(self) -> torch.Tensor:
        """Routed assignments per layer and expert (int64); each row sums to N*K."""
        counts = [torch.bincount(idx_NK.reshape(-1), minlength=self.num_experts) for idx_NK in self.indices_MNK]
        return torch.stack(counts) if counts else torch.zeros(0, self.num_experts, dtype=torch.long)

    def transition_counts(self, src: int, dst: int, lag: int = 0) -> torch.Tensor:
        """``(E, E)`` counts of (expert at layer ``src``, token n) -> (expert at layer ``dst``, token n+lag).

        ``src``/``dst`` index the M axis. ``lag=0`` follows one token up the layers; ``lag=1``
        follows consecutive tokens of the same sequence. All K x K pairs of chosen experts count.
        """
        if lag < 0:
            raise MoeLitError(f"transition_counts: lag must be >= 0, got {lag}")
        first_P, second_P = self.consecutive_pairs(lag)
        src_PK, dst_PK = self.indices_MNK[src][first_P], self.indices_MNK[dst][second_P]
        pair_codes = (src_PK[:, :, None] * self.num_experts + dst_PK[:, None, :]).reshape(-1)
        counts = torch.bincount(pair_codes, minlength=self.num_experts**2)
        return counts.view(self.num_experts, self.num_experts)

    def consecutive_pairs(self, lag: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Token indices ``(n, m)`` where m is ``lag`` positions after n in the same sequence."""
        if lag == 0:
            every_N = torch.arange(self.num_tokens)
            return every_N, every_N
        first_P = torch.arange(self.num_tokens - lag)
        second_P = first_P + lag
        same = (self.seq_N[first_P] == self.seq_N[second_P]) & (self.pos_N[second_P] - self.pos_N[first_P] == lag)
        return first_P[same], second_P[same]

    # ------------------------------------------------------------------ filtering
    def token_labels(self, name: str) -> list[Any]:
        """The value of sequence label ``name`` for every token."""
        if name not in self.labels:
            raise MoeLitError(f"routing trace: no label {name!r}; labels: {sorted(self.labels)}")
        values = self.labels[name]
        return [values[s] for s in self.seq_N.tolist()]

    def select(self, mask_N: torch.Tensor) -> RoutingTrace:
        """The tokens where ``mask_N`` is true (sequence ids and labels are kept)."""
        return RoutingTrace(
            layer_ids=self.layer_ids,
            num_experts=self.num_experts,
            indices_MNK=self.indices_MNK[:, mask_N],
            weights_MNK=self.weights_MNK[:, mask_N],
            seq_N=self.seq_N[mask_N],
            pos_N=self.pos_N[mask_N],
            tokens_N=self.tokens_N[mask_N],
            labels=dict(self.labels),
            probs_MNE=None if self.probs_MNE is None else self.probs_MNE[:, mask_N],
            inputs_MND=None if self.inputs_MND is None else self.inputs_MND[:, mask_N],
        )

    def where(self, **labels: Any) -> RoutingTrace:
        """The tokens of the sequences whose labels equal the given values, e.g. ``where(language="de")``."""
        keep_S = torch.ones(self.num_sequences, dtype=torch.bool)
        for name, value in labels.items():
            if name not in self.labels:
                raise MoeLitError(f"routing trace: no label {name!r}; labels: {sorted(self.labels)}")
            keep_S &= torch.tensor([v == value for v in self.labels[name]], dtype=torch.bool)
        return self.select(keep_S[self.seq_N])

    @staticmethod
    def concat(traces: Sequence[RoutingTrace]) -> RoutingTrace:
        """One trace of several (same layers and experts); sequence ids are renumbered."""
        if not traces:
            raise MoeLitError("routing trace: nothing to concatenate")
        first = traces[0]
        for trace in traces[1:]:
            if (trace.layer_ids, trace.num_experts) != (first.layer_ids, first.num_experts):
                raise MoeLitError("routing trace: cannot concatenate traces of different layers or experts")
        names = sorted({name for trace in traces for name in trace.labels})
        labels = {name: [] for name in names}
        seqs, offset = [], 0
        for trace in traces:
            seqs.append(trace.seq_N + offset)
            for name in names:
                labels[name].extend(trace.labels.get(name, [None] * trace.num_sequences))
            offset += trace.num_sequences
        with_probs = all(trace.probs_MNE is not None for trace in traces)
        with_inputs = all(trace.inputs_MND is not None for trace in traces)
        return RoutingTrace(
            layer_ids=first.layer_ids,
            num_experts=first.num_experts,
            indices_MNK=torch.cat([t.indices_MNK for t in traces], dim=1),
            weights_MNK=torch.cat([t.weights_MNK for t in traces], dim=1),
            seq_N=torch.cat(seqs),
            pos_N=torch.cat([t.pos_N for t in traces]),
            tokens_N=torch.cat([t.tokens_N for t in traces]),
            labels=labels,
            probs_MNE=torch.cat([t.probs_MNE for t in traces], dim=1) if with_probs else None,
            inputs_MND=torch.cat([t.inputs_MND for t in traces], dim=1) if with_inputs else None,
        )

    # ------------------------------------------------------------------ files
    def save(self, path: str | Path) -> Path:
        """Write the trace to a ``.pt`` file (plain tensors, lists and ints) atomically."""
        path = Path(path)
        # NOTE: ids are stored narrow (int16 experts, int32 tokens/positions) and widened on load.
        state = {
            "format_version": TRACE_FORMAT_VERSION,
            "layer_ids": list(self.layer_ids),
            "num_experts": self.num_experts,
            "indices_MNK": self.indices_MNK.to(torch.int16 if self.num_experts < 2**15 else torch.int64),
            "weights_MNK": self.weights_MNK,
            "seq_N": self.seq_N.to(torch.int32),
            "pos_N": self.pos_N.to(torch.int32),
            "tokens_N": self.tokens_N.to(torch.int32),
            "labels": self.labels,
            "probs_MNE": self.probs_MNE,
            "inputs_MND": self.inputs_MND,
        }
        # NOTE: written beside the target and renamed, so a crash never leaves a truncated trace.
        with atomic_file(path) as tmp:
            torch.save(state, tmp)
        return path

    @classmethod
    def load(cls, path: str | Path) -> RoutingTrace:
        path = Path(path)
        if not path.is_file():
            raise MoeLitError(f"routing trace: no such file {path}")
        state = torch.load(path, map_location="cpu", weights_only=True)
        version = state.pop("format_version", None)
        if version != TRACE_FORMAT_VERSION:
            raise MoeLitError(f"routing trace {path}: format version {version}, expected {TRACE_FORMAT_VERSION}")
        for name in ("indices_MNK", "seq_N", "pos_N", "tokens_N"):
            state[name] = state[name].long()
        return cls(**state)


class TraceRecorder:
    """Collects the decisions of every forward while :func:`routing_trace` is active."""

    def __init__(
        self, layer_ids: tuple[int, ...], num_experts: int, top_k: int, record_probs: bool, record_inputs: bool = False
    ) -> None:
        self.layer_ids = layer_ids
        self.num_experts = num_experts
        self.top_k = top_k
        self.record_probs = record_probs
        self.record_inputs = record_inputs
        self._labels: dict[str, Any] = {}
        self._inputs_BL: list[torch.Tensor] = []
        self._row_labels: list[dict[str, Any]] = []
        self._indices: list[list[torch.Tensor]] = [[] for _ in layer_ids]
        self._weights: list[list[torch.Tensor]] = [[] for _ in layer_ids]
        self._probs: list[list[torch.Tensor]] = [[] for _ in layer_ids]
        self._layer_inputs: list[list[torch.Tensor]] = [[] for _ in layer_ids]

    def set_labels(self, **labels: Any) -> None:
        """Labels for the rows of the following forwards: a scalar for all rows, or a list (one per row)."""
        self._labels = dict(labels)

    def _on_input(self, idx_BL: torch.Tensor) -> None:
        batch = idx_BL.shape[0]
        for name, value in self._labels.items():
            if isinstance(value, (list, tuple)) and len(value) != batch:
                raise MoeLitError(f"routing trace: label {name!r} has {len(value)} values for a batch of {batch}")
        for row in range(batch):
            self._row_labels.append(
                {k: (v[row] if isinstance(v, (list, tuple)) else v) for k, v in self._labels.items()}
            )
        self._inputs_BL.append(idx_BL.detach().cpu().long())

    def _on_route(self, slot: int, routing) -> None:
        self._indices[slot].append(routing.indices_TK.detach().cpu().long())
        self._weights[slot].append(routing.weights_TK.detach().cpu().float())
        if self.record_probs:
            self._probs[slot].append(routing.scores_TE.detach().cpu().float())

    def _on_layer_input(self, slot: int, x_BLD: torch.Tensor) -> None:
        self._layer_inputs[slot].append(x_BLD.detach().reshape(-1, x_BLD.shape[-1]).cpu().float())

    def trace(self) -> RoutingTrace:
        """Everything recorded so far as one :class:`RoutingTrace`."""
        steps = len(self._inputs_BL)
        if any(len(chunks) != steps for chunks in self._indices):
            raise MoeLitError("routing trace: a forward did not reach every MoE layer (interrupted forward?)")
        seqs, positions, offset = [], [], 0
        for idx_BL in self._inputs_BL:
            batch, length = idx_BL.shape
            seqs.append(torch.arange(offset, offset + batch).repeat_interleave(length))
            positions.append(torch.arange(length).repeat(batch))
            offset += batch
        names = sorted({name for row in self._row_labels for name in row})
        num_tokens = sum(idx_BL.numel() for idx_BL in self._inputs_BL)
        inputs_MND = None
        if self.record_inputs and self._layer_inputs and self._layer_inputs[0]:
            inputs_MND = _stack(self._layer_inputs, num_tokens, self._layer_inputs[0][0].shape[-1], torch.float32)
        return RoutingTrace(
            layer_ids=self.layer_ids,
            num_experts=self.num_experts,
            indices_MNK=_stack(self._indices, num_tokens, self.top_k, torch.long),
            weights_MNK=_stack(self._weights, num_tokens, self.top_k, torch.float32),
            seq_N=_cat(seqs),
            pos_N=_cat(positions),
            tokens_N=_cat([idx_BL.reshape(-1) for idx_BL in self._inputs_BL]),
            labels={name: [row.get(name) for row in self._row_labels] for name in names},
            probs_MNE=_stack(self._probs, num_tokens, self.num_experts, torch.float32) if self.record_probs else None,
            inputs_MND=inputs_MND,
        )


def _cat(chunks: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.long)


def _stack(per_layer: list[list[torch.Tensor]], num_tokens: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """``(M, N, width)`` from per-layer lists of per-forward ``(T, width)`` chunks."""
    if not per_layer:
        return torch.zeros(0, num_tokens, width, dtype=dtype)
    return torch.stack([torch.cat(chunks) if chunks else torch.zeros(0, width, dtype=dtype) for chunks in per_layer])


def find_transformer(model: nn.Module):
    """The ``Transformer`` inside ``model`` (itself, or e.g. a LightningModule's ``model``)."""
    from moe_lit.model import Transformer

    for module in model.modules():
        if isinstance(module, Transformer):
            return module
    raise MoeLitError(f"routing trace: {type(model).__name__} holds no moe_lit Transformer")


@contextmanager
def routing_trace(model: nn.Module, record_probs: bool = False, record_inputs: bool = False) -> Iterator[TraceRecorder]:
    """Record every MoE layer's routing during the forwards inside the ``with`` block.

    ``record_probs`` adds every expert's router score, ``record_inputs`` each MoE layer's input.

    >>> with routing_trace(model) as recorder:
    ...     recorder.set_labels(language="de")
    ...     model(idx_BL)
    >>> trace = recorder.trace()
    """
    transformer = find_transformer(model)
    moe_blocks = [(i, block.ffn) for i, block in enumerate(transformer.blocks) if block.is_moe]
    moe_cfg = transformer.config.moe
    recorder = TraceRecorder(
        tuple(i for i, _ in moe_blocks),
        moe_cfg.num_experts if moe_cfg else 0,
        moe_cfg.top_k if moe_cfg else 0,
        record_probs,
        record_inputs,
    )
    handles = [transformer.register_forward_pre_hook(lambda _module, args: recorder._on_input(args[0]))]
    for slot, (_, layer) in enumerate(moe_blocks):
        handles.append(
            layer.router.register_forward_hook(
                lambda _module, _args, output, slot=slot: recorder._on_route(slot, output)
            )
        )
        if record_inputs:
            handles.append(
                layer.register_forward_pre_hook(
                    lambda _module, args, slot=slot: recorder._on_layer_input(slot, args[0])
                )
            )
    try:
        yield recorder
    finally:
        for handle in handles:
            handle.remove()


__all__ = ["RoutingTrace", "TraceRecorder", "find_transformer", "routing_trace"]
