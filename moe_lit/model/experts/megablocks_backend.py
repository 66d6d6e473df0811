"""MegaBlocks dMoE experts (CUDA): MegaBlocks' kernels running on the layer's own weights.

Shape legend: T tokens, D d_model, E experts, K top-k, F one expert's hidden size, N = T*K routed
assignments (see ``layout.py``).

What comes from MegaBlocks (megablocks 0.10.0, installed with the ``gpu`` extra, see docs/gpu.md):
``Arguments`` built from our :class:`~moe_lit.config.MoEConfig`, the dMoE expert MLP that
``dmlp_registry`` builds for ``mlp_type='glu', mlp_impl='grouped'`` (``GroupedGLU``: grouped GEMMs
through ``grouped_gemm``), and the routing ops of ``ParallelDroplessMLP.grouped_forward_once``
(radix sort, histogram, cumsum, gather and weighted scatter kernels). ``GroupedGLU``'s ``w1``,
``v1``, ``w2`` of shape ``(E*F, D)`` are the only copy of the expert weights, registered under
``mlp`` beside our ``bias``: the state-dict keys (``experts.mlp.w1|v1|w2``, ``experts.bias``) are
the torch backend's, so a checkpoint moves between backends bit for bit.

What stays ours: the router and the auxiliary losses (``moe_lit.model.router``). Our router is
MegaBlocks' ``LearnedRouter`` (bias-free ``layer``, softmax, top-k, p=1 renormalisation) with fp32
scores, sigmoid scores and bias balancing on top, and feeds these experts its weights and indices.
NOTE: MegaBlocks' ``ParallelMLP.forward`` and ``LearnedRouter.forward`` append their loss inputs to
module-global lists (the router's z-loss logits even in eval) that the caller must clear every
step. This adapter never calls either, so those lists stay empty; the losses come from our router,
with MegaBlocks' formulas (tests compare them with a real dMoE's batched losses).

grouped_gemm has bf16 kernels only, so on CUDA the expert matmuls run in bf16 whatever the
parameter dtype (fp32 master weights are cast inside the autograd graph); the output comes back in
the input's dtype.

Expert parallelism (:meth:`MegaBlocksExperts.shard_experts`, called by the FSDP2 strategy): the
``Arguments`` get ``moe_expert_model_parallelism=True`` and the expert-parallel process group, so
MegaBlocks' ``GroupedGLU`` holds only this rank's ``E/ep`` experts and scales their gradients by
``1/ep``; ``mlp.w1|v1|w2`` become DTensors ``Shard(0)`` over the expert-parallel mesh (R legend:
ranks of that group, M rows received from them), and the forward is MegaBlocks'
``parallel_forward_once`` for ``hidden_sharding_degree == 1``: tokens travel to their experts' rank
with MegaBlocks' autograd ``all_to_all`` and back.
"""

from __future__ import annotations

import importlib
import math
from typing import Any, ClassVar, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from moe_lit.config import MoEConfig
from moe_lit.errors import MoeLitError
from moe_lit.model.experts.layout import ExpertLayout, RoutingCounts, register_output_bias
from moe_lit.model.experts.torch_backend import Strategy, TorchExperts

INSTALL_HINT = "install the gpu extra as docs/gpu.md says"


def import_megablocks() -> Any:
    """The ``megablocks`` package with the modules the adapter uses, or a helpful MoeLitError."""
    try:
        megablocks = importlib.import_module("megablocks")
        for name in ("megablocks.ops", "megablocks.layers.dmlp_registry", "megablocks.grouped_gemm_util"):
            importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - a broken CUDA build raises anything from ImportError to OSError
        raise MoeLitError(
            f"moe.backend: megablocks does not import ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
        ) from exc
    if not megablocks.grouped_gemm_util.grouped_gemm_is_available():
        raise MoeLitError(f"moe.backend: megablocks imports but grouped_gemm does not; {INSTALL_HINT}")
    return megablocks


def unsupported_reason(cfg: MoEConfig) -> str | None:
    """Why MegaBlocks cannot run a layer of this config (None when it can)."""
    if not cfg.uniform:
        return "heterogeneous expert sizes (MegaBlocks' grouped GEMM needs equal experts)"
    if cfg.capacity_factor is not None:
        return "capacity_factor is set (MegaBlocks' dMoE is dropless; its capacity MoE has no GLU experts)"
    return None


def unavailable_reason() -> str | None:
    """Why MegaBlocks cannot run on this machine (None when it can)."""
    if not torch.cuda.is_available():
        return "no CUDA device (MegaBlocks' kernels are CUDA only)"
    try:
        import_megablocks()
    except MoeLitError as exc:
        return str(exc).removeprefix("moe.backend: ")
    return None


def _keep_init(tensor: torch.Tensor) -> None:
    """MegaBlocks' init hook, left empty: the Transformer initialises every parameter itself."""


def megablocks_arguments(
    d_model: int,
    cfg: MoEConfig,
    num_moe_layers: int = 1,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    expert_parallel_group: dist.ProcessGroup | None = None,
) -> Any:
    """MegaBlocks ``Arguments`` describing one dMoE layer of this config (uniform experts).

    With ``expert_parallel_group`` the layer's experts are split over that group's ranks.
    """
    reason = unsupported_reason(cfg)
    if reason is not None:
        raise MoeLitError(f"moe.backend: MegaBlocks cannot run this layer: {reason}")
    megablocks = import_megablocks()
    return megablocks.Arguments(
        hidden_size=d_model,
        ffn_hidden_size=cfg.expert_sizes[0],
        num_layers=num_moe_layers,
        bias=True,
        # NOTE: the bias is added to the output (ours does it too), not returned beside it.
        return_bias=False,
        activation_fn=F.silu,
        moe_num_experts=cfg.num_experts,
        moe_top_k=cfg.top_k,
        moe_normalize_expert_weights=1 if cfg.renormalize else None,
        moe_loss_weight=cfg.aux_loss_coef if cfg.balancing == "aux_loss" else 0.0,
        moe_zloss_weight=cfg.z_loss_coef,
        mlp_type="glu",
        mlp_impl="grouped",
        fp16=dtype == torch.float16,
        bf16=dtype == torch.bfloat16,
        # NOTE: MegaBlocks defaults to torch.cuda.current_device(); the default device honours
        # `with torch.device("meta")` and Lightning's init_module, so sharded inits stay lazy.
        device=device if device is not None else torch.get_default_device(),
        init_method=_keep_init,
        output_layer_init_method=_keep_init,
        moe_expert_model_parallelism=expert_parallel_group is not None,
        expert_parallel_group=expert_parallel_group,
    )


def _compute_dtype(x_TD: torch.Tensor) -> torch.dtype:
    # NOTE: grouped_gemm's CUDA kernels take bf16 only; elsewhere (CPU tests with stand-in ops)
    # the matmuls keep the input dtype.
    return torch.bfloat16 if x_TD.is_cuda else x_TD.dtype


class MegaBlocksExperts(nn.Module):
    """Dropless routed experts on MegaBlocks kernels; parameters ``mlp.w1|v1|w2`` and ``bias``.

    Off CUDA tensors the layer runs the torch backend's forward on the same parameters
    (``moe.backend: auto``) or raises a one-line ``moe.backend`` error (``megablocks``).
    """

    name: ClassVar[str] = "megablocks"
    """``moe.backend: megablocks``."""
    kernel_device_types: ClassVar[tuple[str, ...]] = ("cuda",)
    """Device types MegaBlocks' kernels take (the CPU stand-ins of tests/gpu/ add 'cpu')."""
    strategy: ClassVar[Strategy] = "auto"
    """The torch forward's slot geometry, off CUDA tensors."""
    bias: torch.Tensor
    """The (D,) expert output bias (:func:`~moe_lit.model.experts.layout.register_output_bias`)."""

    def __init__(self, d_model: int, cfg: MoEConfig, num_moe_layers: int = 1, device: torch.device | None = None):
        super().__init__()
        args = megablocks_arguments(d_model, cfg, num_moe_layers, device=device)
        megablocks = import_megablocks()
        self.cfg = cfg
        self.num_moe_layers = num_moe_layers
        self.layout = ExpertLayout.of(cfg.expert_sizes)
        self.top_k = cfg.top_k
        # NOTE: radix-sort key width, as MegaBlocks' ParallelMLP computes it.
        self.sort_end_bit = max(math.ceil(math.log2(cfg.num_experts)), 1)
        self.mlp = megablocks.layers.dmlp_registry.get(args)
        register_output_bias(self, d_model, cfg.expert_output_bias, device=args.device)

    @classmethod
    def from_config(cls, d_model: int, cfg: MoEConfig) -> MegaBlocksExperts:
        return cls(d_model, cfg)

    @classmethod
    def supports(cls, cfg: MoEConfig, device: torch.device) -> str | None:
        """Why MegaBlocks cannot run a layer of ``cfg`` on ``device`` here (None when it can)."""
        return unsupported_reason(cfg) or unavailable_reason() or cls.device_reason(device)

    @classmethod
    def device_reason(cls, device: torch.device) -> str | None:
        """Why MegaBlocks' kernels cannot take tensors on ``device`` (None when they can)."""
        if device.type in cls.kernel_device_types:
            return None
        return f"the layer's tensors are on {device.type} (MegaBlocks' kernels take CUDA tensors only)"

    @property
    def num_experts(self) -> int:
        return self.layout.num_experts

    @property
    def expert_parallel_group(self) -> dist.ProcessGroup | None:
        """The process group the experts are split over (None: this rank holds all of them)."""
        return self.mlp.args.expert_parallel_group

    def shard_experts(self, mesh: Any) -> None:
        """Keep only this rank's experts of a 1-D expert-parallel DeviceMesh (in place, once).

        ``mlp.w1|v1|w2`` become DTensors ``Shard(0)`` over ``mesh``: this rank's rows are MegaBlocks'
        (experts ``rank*E/ep`` to ``(rank+1)*E/ep``), and a full state dict gathers the one layout.
        """
        from torch.distributed.tensor import DTensor, Shard

        if self.expert_parallel_group is not None:
            return
        size = mesh.size()
        if self.num_experts % size:
            raise MoeLitError(
                f"strategy.expert_parallel_size: {size} does not divide moe.num_experts={self.num_experts}"
            )
        full = dict(self.mlp.named_parameters())
        args = megablocks_arguments(
            self.mlp.args.hidden_size,
            self.cfg,
            self.num_moe_layers,
            device=torch.device("meta"),
            expert_parallel_group=mesh.get_group(),
        )
        # NOTE: built on meta (no memory), then given this rank's rows of the full weights: a
        # clone, so the other experts' rows are freed; from_local makes no communication.
        mlp = import_megablocks().layers.dmlp_registry.get(args)
        rows = self.layout.total_rows // size
        start = mesh.get_local_rank() * rows
        for name, weight_SD in full.items():
            local = weight_SD.detach()[start : start + rows].clone()
            setattr(mlp, name, nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False)))
        self.mlp = mlp

    def forward(
        self, x_TD: torch.Tensor, weights_TK: torch.Tensor, indices_TK: torch.Tensor, capacity: int | None
    ) -> tuple[torch.Tensor, RoutingCounts]:
        if capacity is not None:
            raise MoeLitError("moe.capacity_factor: the MegaBlocks backend is dropless; use moe.backend: torch")
        reason = self.device_reason(x_TD.device)
        if reason is None:
            return self._kernel_forward(x_TD, weights_TK, indices_TK)
        if self.cfg.backend == "megablocks" or self.expert_parallel_group is not None:
            raise MoeLitError(f"moe.backend: 'megablocks' cannot run this layer: {reason}; use backend: auto or torch")
        # NOTE: moe.backend: auto chose this class because the machine has CUDA and megablocks, but
        # these tensors are not on CUDA (a CPU eval, convert or load_model): the torch backend's
        # forward reads nothing but the shared layout (mlp.w1|v1|w2, bias, layout) and a strategy.
        return TorchExperts.forward(cast(TorchExperts, self), x_TD, weights_TK, indices_TK, None)

    # NOTE: eager under torch.compile: MegaBlocks' kernels are opaque extension calls with
    # data-dependent output sizes. Only the CUDA path is excluded; the torch path off CUDA compiles.
    @torch.compiler.disable
    def _kernel_forward(
        self, x_TD: torch.Tensor, weights_TK: torch.Tensor, indices_TK: torch.Tensor
    ) -> tuple[torch.Tensor, RoutingCounts]:
        if self.expert_parallel_group is not None:
            return self._expert_parallel_forward(x_TD, weights_TK, indices_TK)
        # NOTE: looked up per call, not stored: a module attribute would make the layer un-copyable.
        ops = importlib.import_module("megablocks.ops")
        with torch.no_grad():
            experts_N = indices_TK.reshape(-1).int()
            sorted_experts_N, order_N = ops.sort(experts_N, self.sort_end_bit)
            counts_E = ops.histogram(experts_N, self.num_experts)
            bins_E = ops.inclusive_cumsum(counts_E, 0).view(-1)
        compute = _compute_dtype(x_TD)
        x_ND = ops.gather(x_TD.to(compute), order_N, sorted_experts_N, bins_E, self.top_k)
        # NOTE: functional_call runs MegaBlocks' GroupedGLU on compute-dtype views of our
        # parameters: gradients flow back to the (possibly fp32) parameters through the cast.
        params = {name: p.to(compute) for name, p in self.mlp.named_parameters()}
        h_ND = functional_call(self.mlp, params, (x_ND, counts_E))
        y_TD = ops.scatter(h_ND, order_N, sorted_experts_N, weights_TK.reshape(-1).to(compute), bins_E, self.top_k)
        counts = RoutingCounts.of(counts_E.long(), None)
        return y_TD.to(x_TD.dtype) + self.bias, counts

    def _expert_parallel_forward(
        self, x_TD: torch.Tensor, weights_TK: torch.Tensor, indices_TK: torch.Tensor
    ) -> tuple[torch.Tensor, RoutingCounts]:
        megablocks = importlib.import_module("megablocks")
        ops = megablocks.ops
        group = self.expert_parallel_group
        num_ranks = dist.get_world_size(group)
        local_experts = self.num_experts // num_ranks
        with torch.no_grad():
            experts_N = indices_TK.reshape(-1).int()
            sorted_experts_N, order_N = ops.sort(experts_N, self.sort_end_bit)
            counts_E = ops.histogram(experts_N, self.num_experts)
            bins_E = ops.inclusive_cumsum(counts_E, 0).view(-1)
            # NOTE: rank r's experts are E/ep consecutive ids, so counts_E viewed (ep, E/ep) are
            # the rows sent to each rank; the exchange returns, per source rank, the rows coming here.
            received_RE = torch.empty_like(counts_E)
            dist.all_to_all_single(received_RE, counts_E, group=group)
            received_RE = received_RE.view(num_ranks, local_experts).cpu()
            send_counts = counts_E.view(num_ranks, local_experts).sum(dim=1).tolist()
            recv_counts = received_RE.sum(dim=1).tolist()
        compute = _compute_dtype(x_TD)
        x_ND = ops.gather(x_TD.to(compute), order_N, sorted_experts_N, bins_E, self.top_k)
        x_MD, _ = megablocks.layers.all_to_all.all_to_all(x_ND, recv_counts, send_counts, group)
        with torch.no_grad():
            # NOTE: the received rows come grouped by source rank, then by local expert; regroup
            # them by local expert (MegaBlocks' replicate + sort), keeping the order inside a group.
            local_ids = torch.arange(local_experts, dtype=torch.int32, device=x_TD.device).repeat(num_ranks)
            replicate_bins = ops.inclusive_cumsum(received_RE.flatten().to(x_TD.device), 0).view(-1)
            experts_M = ops.replicate(local_ids.unsqueeze(0), replicate_bins, sum(recv_counts)).flatten()
            sorted_experts_M, order_M = ops.sort(experts_M, self.sort_end_bit)
            local_counts = received_RE.sum(dim=0, dtype=torch.int)
            local_bins = ops.inclusive_cumsum(local_counts.to(x_TD.device), 0).view(-1)
        x_MD = ops.gather(x_MD, order_M, sorted_experts_M, local_bins, 1)
        # NOTE: called as a module (no functional_call): FSDP2's hooks on it gather its shards
        # (in bf16 with the strategy's mixed precision, which CUDA requires here), and GroupedGLU
        # takes the local rows of its DTensors and scales their gradients by 1/ep.
        h_MD = self.mlp(x_MD, local_counts).to(compute)
        h_MD = ops.scatter(h_MD, order_M, sorted_experts_M, None, local_bins, 1)
        y_ND, _ = megablocks.layers.all_to_all.all_to_all(h_MD, send_counts, recv_counts, group)
        y_TD = ops.scatter(y_ND, order_N, sorted_experts_N, weights_TK.reshape(-1).to(compute), bins_E, self.top_k)
        counts = RoutingCounts.of(counts_E.long(), None)
        return y_TD.to(x_TD.dtype) + self.bias, counts


__all__ = [
    "MegaBlocksExperts",
    "import_megablocks",
    "megablocks_arguments",
    "unavailable_reason",
    "unsupported_reason",
]
