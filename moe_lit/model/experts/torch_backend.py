"""Pure-PyTorch dropless experts (CPU and GPU), in MegaBlocks' parameter layout.

Shape legend: T tokens, D d_model, E experts, K top-k, F one expert's hidden size,
S sum of hidden sizes, N = T*K routed assignments (see ``layout.py``).

The forward groups the N (token, expert) assignments by expert with one stable sort
(:func:`plan_dispatch`) and runs the grouped computation (gather, per-expert SwiGLU, weighted
combine) as two custom ops with hand-written backwards around the SwiGLU's elementwise product
(``ops.py``: one graph under ``torch.compile``), then adds the bias. Dropless mode never drops an
assignment. Capacity mode keeps, for each expert, the first ``capacity`` assignments in token order
(the stable sort keeps that order deterministic) and drops the rest: a dropped assignment
contributes nothing, the residual stream carries the token.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from torch import nn

from moe_lit._compat import grouped_mm_op
from moe_lit.config import MoEConfig
from moe_lit.errors import MoeLitError
from moe_lit.model.experts.grouped_swiglu import ALIGN_BYTES, Dispatch, Geometry, plan_dispatch
from moe_lit.model.experts.layout import ExpertLayout, RoutingCounts, register_output_bias
from moe_lit.model.experts.ops import no_autocast, routed_swiglu

Strategy = Literal["auto", "grouped", "batched", "looped"]
STRATEGIES = ("auto", "grouped", "batched", "looped")


def grouped_gemm_fits(layout: ExpertLayout, d_model: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the grouped-GEMM geometry can run: equal experts, the op exists, rows 16-byte aligned,
    and bf16 on CUDA (the only dtype its CUDA kernels take)."""
    if not layout.uniform or grouped_mm_op() is None or (device.type == "cuda" and dtype != torch.bfloat16):
        return False
    return all(n * dtype.itemsize % ALIGN_BYTES == 0 for n in (d_model, layout.sizes[0]))


def choose_geometry(
    strategy: Strategy, layout: ExpertLayout, d_model: int, dtype: torch.dtype, device: torch.device
) -> Geometry:
    """The slot geometry for ``strategy``; ``auto``: the loop for unequal sizes and for float32 on CPU,
    padded ``bmm`` chunks for bf16 on CPU, else grouped GEMMs where they fit, else ``bmm`` chunks.

    NOTE: on CPU in float32 the loop of per-expert GEMMs is as fast as any geometry (``python -m
    benchmarks.moe_layer``; docs/performance.md): it does no padding, and torch's CPU grouped GEMM is
    itself a loop over the experts. A bf16 GEMM of a few hundred rows pays a fixed cost per call that
    the loop pays once per expert and matmul, so under bf16 one ``bmm`` over all chunks is faster
    (``python -m benchmarks.moe_layer --precision bf16``). On GPUs one grouped GEMM replaces a
    kernel launch per expert.
    """
    grouped_fits = grouped_gemm_fits(layout, d_model, dtype, device)
    if strategy != "auto":
        if strategy == "grouped" and not grouped_fits:
            raise ValueError(
                "strategy: 'grouped' needs equal expert sizes, torch._grouped_mm, 16-byte aligned rows "
                "and bf16 on CUDA; use 'auto'"
            )
        return strategy
    if not layout.uniform or (device.type == "cpu" and dtype != torch.bfloat16):
        return "looped"
    if device.type == "cpu":
        return "batched"
    return "grouped" if grouped_fits else "batched"


class ExpertWeights(nn.Module):
    """The stacked expert matrices ``w1``, ``v1``, ``w2`` of shape (S, D): MegaBlocks' ``mlp``."""

    def __init__(self, d_model: int, layout: ExpertLayout) -> None:
        super().__init__()
        self.layout = layout
        self.w1 = nn.Parameter(torch.empty(layout.total_rows, d_model))
        self.v1 = nn.Parameter(torch.empty(layout.total_rows, d_model))
        self.w2 = nn.Parameter(torch.empty(layout.total_rows, d_model))


class TorchExperts(nn.Module):
    """Dropless (or capacity-limited) routed experts; ``mlp`` + ``bias`` as in MegaBlocks dMoE.

    ``strategy`` picks the slot geometry of the matmuls: ``auto`` (see :func:`choose_geometry`),
    ``grouped`` (grouped GEMMs), ``batched`` (chunked bmm) — both for equal sizes only — or
    ``looped``. All give the same results up to float rounding.
    """

    bias: torch.Tensor
    """The (D,) expert output bias (:func:`~moe_lit.model.experts.layout.register_output_bias`)."""

    def __init__(
        self, d_model: int, layout: ExpertLayout, strategy: Strategy = "auto", output_bias: bool = True
    ) -> None:
        super().__init__()
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy: got {strategy!r}, allowed values: {', '.join(STRATEGIES)}")
        if strategy in ("grouped", "batched") and not layout.uniform:
            raise ValueError(f"strategy: {strategy!r} needs equal expert sizes; use 'auto' or 'looped'")
        self.mlp = ExpertWeights(d_model, layout)
        register_output_bias(self, d_model, output_bias)
        self.strategy: Strategy = strategy

    @property
    def layout(self) -> ExpertLayout:
        return self.mlp.layout

    # ------------------------------------------------------------ the ExpertsBackend protocol
    name: ClassVar[str] = "torch"
    """``moe.backend: torch``."""

    @classmethod
    def from_config(cls, d_model: int, cfg: MoEConfig) -> TorchExperts:
        return cls(d_model, ExpertLayout.of(cfg.expert_sizes), output_bias=cfg.expert_output_bias)

    @classmethod
    def supports(cls, cfg: MoEConfig, device: torch.device) -> str | None:
        """Every config on every device."""
        return None

    @property
    def expert_parallel_group(self) -> None:
        return None

    def shard_experts(self, mesh: Any) -> None:
        raise MoeLitError(
            f"strategy.expert_parallel_size: {mesh.size()} needs the MegaBlocks backend (moe.backend: megablocks); "
            "the torch backend keeps every expert on every rank"
        )

    def forward(
        self, x_TD: torch.Tensor, weights_TK: torch.Tensor, indices_TK: torch.Tensor, capacity: int | None
    ) -> tuple[torch.Tensor, RoutingCounts]:
        device_type = x_TD.device.type
        # NOTE: the ops' buffers are written with out=, which autocast cannot see: cast the inputs to
        # the autocast dtype here (as torch.amp.custom_fwd would) and run them without autocast.
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x_TD.dtype
        geometry = choose_geometry(self.strategy, self.layout, x_TD.shape[-1], dtype, x_TD.device)
        x, weights, w1, v1, w2 = (t.to(dtype) for t in (x_TD, weights_TK, self.mlp.w1, self.mlp.v1, self.mlp.w2))
        with no_autocast(x_TD.device):
            y_TD, routed_counts_E = routed_swiglu(x, weights, indices_TK, w1, v1, w2, self.layout, geometry, capacity)
            y_TD = y_TD + self.bias.to(dtype)
        return y_TD, RoutingCounts.of(routed_counts_E, capacity)


__all__ = ["Dispatch", "ExpertWeights", "TorchExperts", "choose_geometry", "grouped_gemm_fits", "plan_dispatch"]
