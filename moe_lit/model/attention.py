"""Causal self-attention with RoPE and grouped-query attention on top of PyTorch SDPA.

Shape legend: B batch, L sequence, D d_model, H query heads, G key/value heads, Dh head dim.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from moe_lit.config import ModelConfig

if TYPE_CHECKING:
    from moe_lit.model.kv_cache import LayerKVCache


def rope_tables(seq_len: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``(L, Dh/2)`` for rotary position embeddings."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles_LH = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles_LH.cos(), angles_LH.sin()


def apply_rope(x_BHLDh: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of each head, as Llama / HF ``rotate_half``."""
    length = x_BHLDh.shape[-2]
    return _rotate(x_BHLDh, cos[:length], sin[:length])


def apply_rope_at(
    x_BHLDh: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions_BL: torch.Tensor
) -> torch.Tensor:
    """:func:`apply_rope` at explicit per-row positions (KV-cache decoding, left-padded rows)."""
    return _rotate(x_BHLDh, cos[positions_BL].unsqueeze(1), sin[positions_BL].unsqueeze(1))


def _rotate(x_BHLDh: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.to(x_BHLDh.dtype), sin.to(x_BHLDh.dtype)
    x1, x2 = x_BHLDh.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class HeadRMSNorm(nn.RMSNorm):
    """RMSNorm over each head of a ``(..., heads * Dh)`` projection, one ``(Dh,)`` weight for all heads."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        head_dim = self.normalized_shape[0]
        return super().forward(x.unflatten(-1, (-1, head_dim))).flatten(-2)


def qk_norms(cfg: ModelConfig) -> tuple[nn.Module, nn.Module]:
    """The query and key norms of ``cfg.qk_norm`` (identities for ``none``)."""
    if cfg.qk_norm == "head":
        return HeadRMSNorm(cfg.head_dim, eps=cfg.norm_eps), HeadRMSNorm(cfg.head_dim, eps=cfg.norm_eps)
    if cfg.qk_norm == "full":
        return (
            nn.RMSNorm(cfg.n_heads * cfg.head_dim, eps=cfg.norm_eps),
            nn.RMSNorm(cfg.kv_heads * cfg.head_dim, eps=cfg.norm_eps),
        )
    return nn.Identity(), nn.Identity()


class CausalSelfAttention(nn.Module):
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        self.q_norm, self.k_norm = qk_norms(cfg)
        cos, sin = rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_base)
        # NOTE: derived from the config, so not saved in checkpoints.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x_BLD: torch.Tensor, kv_cache: LayerKVCache | None = None) -> torch.Tensor:
        batch, length, _ = x_BLD.shape
        q = self.q_norm(self.q_proj(x_BLD)).view(batch, length, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_norm(self.k_proj(x_BLD)).view(batch, length, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x_BLD).view(batch, length, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if kv_cache is not None:
            return self._attend_cached(q, k, v, kv_cache)
        q, k = apply_rope(q, self.rope_cos, self.rope_sin), apply_rope(k, self.rope_cos, self.rope_sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))

    def _attend_cached(self, q, k, v, kv_cache: LayerKVCache) -> torch.Tensor:
        """This step's queries against the cached keys/values plus its own (see ``model/kv_cache.py``)."""
        batch, _, length, _ = q.shape
        step = kv_cache.step
        q = apply_rope_at(q, self.rope_cos, self.rope_sin, step.positions_BL)
        k = apply_rope_at(k, self.rope_cos, self.rope_sin, step.positions_BL)
        k_all, v_all = kv_cache.update(k, v)
        out = F.scaled_dot_product_attention(
            q, k_all, v_all, attn_mask=step.mask_B1LS, enable_gqa=self.n_kv_heads != self.n_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
