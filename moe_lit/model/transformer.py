"""Decoder-only LM: token embedding, pre-norm blocks (attention + dense or MoE FFN), head.

Shape legend: B batch, L sequence, D d_model, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast, overload

import torch
from torch import nn

from moe_lit.config import ModelConfig
from moe_lit.model.attention import CausalSelfAttention
from moe_lit.model.loss import linear_cross_entropy
from moe_lit.model.mlp import SwiGLU
from moe_lit.model.moe import MoELayer
from moe_lit.model.router import RoutingStats, finish_routing_step

if TYPE_CHECKING:
    from moe_lit.model.kv_cache import KVCache, LayerKVCache


@dataclass
class LMOutput:
    logits_BLV: torch.Tensor | None
    """Next-token logits; None when the forward got targets and computed ``ce`` without them."""
    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)
    """Weighted auxiliary losses summed over layers, by name (load_balancing, z_loss)."""
    ce: torch.Tensor | None = None
    """Mean next-token cross-entropy (fp32) when the forward got targets."""

    @property
    def aux_loss(self) -> torch.Tensor:
        """Sum of all auxiliary losses (0 for a dense model)."""
        like = self.logits_BLV if self.logits_BLV is not None else self.ce
        if like is None:
            raise ValueError("LMOutput holds neither logits nor ce")
        return sum(self.aux_losses.values(), torch.zeros((), device=like.device))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        if layer_id in cfg.moe_layer_ids:
            self.ffn: nn.Module = MoELayer(cfg.d_model, cfg.moe_layer_config(layer_id), len(cfg.moe_layer_ids))
        else:
            self.ffn = SwiGLU(cfg.d_model, cfg.d_ff)

    @property
    def is_moe(self) -> bool:
        return isinstance(self.ffn, MoELayer)

    def forward(
        self, x_BLD: torch.Tensor, kv_cache: LayerKVCache | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        x_BLD = x_BLD + self.attn(self.attn_norm(x_BLD), kv_cache)
        if self.is_moe:
            ffn_out, losses = self.ffn(self.ffn_norm(x_BLD))
        else:
            ffn_out, losses = self.ffn(self.ffn_norm(x_BLD)), {}
        return x_BLD + ffn_out, losses


if TYPE_CHECKING:

    class BlockList(nn.ModuleList):
        """What the type checker sees of ``Transformer.blocks``: an ``nn.ModuleList`` of :class:`Block`."""

        @overload
        def __getitem__(self, idx: slice) -> BlockList: ...
        @overload
        def __getitem__(self, idx: int) -> Block: ...
        def __getitem__(self, idx: int | slice) -> Block | BlockList: ...
        def __iter__(self) -> Iterator[Block]: ...


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        # NOTE: a plain ModuleList at run time (every wrapper and checkpoint sees the usual module);
        # the cast only tells the type checker that its items are Blocks.
        self.blocks = cast("BlockList", nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers)))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight
        self.reset_parameters()

    def moe_layers(self) -> list[MoELayer]:
        return [block.ffn for block in self.blocks if isinstance(block.ffn, MoELayer)]

    def moe_layer(self, layer_id: int) -> MoELayer:
        """The MoE FFN of block ``layer_id`` (an error for a dense block)."""
        ffn = self.blocks[layer_id].ffn
        if not isinstance(ffn, MoELayer):
            raise TypeError(f"block {layer_id} has a {type(ffn).__name__} FFN, not an MoE layer")
        return ffn

    def dense_ffn(self, layer_id: int) -> SwiGLU:
        """The dense SwiGLU FFN of block ``layer_id`` (an error for an MoE block)."""
        ffn = self.blocks[layer_id].ffn
        if not isinstance(ffn, SwiGLU):
            raise TypeError(f"block {layer_id} has a {type(ffn).__name__} FFN, not a dense SwiGLU")
        return ffn

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(init_std) everywhere; output projections scaled by 1/sqrt(2*n_layers) (GPT-2)."""
        std, out_std = self.config.init_std, self.config.init_std / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            if param.dim() == 1:
                # norms start at one, expert output biases at zero
                param.fill_(1.0 if "norm" in name else 0.0)
            elif name.endswith(("o_proj.weight", "w2.weight", "mlp.w2")):
                nn.init.normal_(param, std=out_std)
            else:
                nn.init.normal_(param, std=std)

    def forward(
        self, idx_BL: torch.Tensor, targets_BL: torch.Tensor | None = None, kv_cache: KVCache | None = None
    ) -> LMOutput:
        """Logits, or with ``targets_BL`` the mean cross-entropy through the chunked head (no logits).

        With ``kv_cache`` (``moe_lit.model.kv_cache``) ``idx_BL`` holds the next tokens of every
        row: they attend to the cached ones, are cached in turn, and the cache advances.
        """
        if kv_cache is not None:
            kv_cache.begin(idx_BL.shape[1])
        x_BLD, aux_losses = self.hidden_states(idx_BL, kv_cache)
        if kv_cache is not None:
            kv_cache.advance()
        if targets_BL is None:
            return LMOutput(self.lm_head(x_BLD), aux_losses)
        ce = linear_cross_entropy(
            x_BLD.flatten(0, 1), self.lm_head.weight, targets_BL.flatten(), self.config.loss_chunk_tokens
        )
        return LMOutput(None, aux_losses, ce=ce)

    def hidden_states(
        self, idx_BL: torch.Tensor, kv_cache: KVCache | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The final norm's output ``(B, L, D)`` and the summed auxiliary losses; with ``kv_cache``
        its step must have begun (``forward`` begins and advances it around this call)."""
        x_BLD = self.tok_embeddings(idx_BL)
        aux_losses: dict[str, torch.Tensor] = {}
        for i, block in enumerate(self.blocks):
            x_BLD, losses = block(x_BLD, None if kv_cache is None else kv_cache.layers[i])
            for name, value in losses.items():
                aux_losses[name] = aux_losses[name] + value if name in aux_losses else value
        return self.norm(x_BLD), aux_losses

    @torch.no_grad()
    def update_router_biases(self) -> bool:
        """Finish the optimizer step's routing (call once per step, on every rank): all-reduce the
        routers' statistics over the data-parallel ranks, store them, take the aux-loss-free
        balancing step (no-op without balancing=bias), reset. False when nothing was routed since
        the last call (then nothing changes). See :func:`moe_lit.model.router.finish_routing_step`."""
        return finish_routing_step([layer.router for layer in self.moe_layers()])

    def routing_stats(self) -> dict[int, RoutingStats]:
        """The last finished step's routing statistics, by block index of each MoE layer."""
        return {i: block.ffn.router.stats() for i, block in enumerate(self.blocks) if isinstance(block.ffn, MoELayer)}
