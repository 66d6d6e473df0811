"""A preallocated key/value cache for incremental decoding, grouped-query aware.

Shape legend: B batch rows, G key/value heads, S cache slots, L tokens of one forward step,
Dh head dim, N layers.

The cache stores keys and values of every layer in two ``(N, B, G, S, Dh)`` buffers: G is the
model's key/value head count, not its query head count, so grouped-query attention keeps its
memory saving. Rows of unequal prompt length are *left padded*: row b's first ``pad_B[b]`` slots
hold padding that no query ever attends to, and its rotary positions start at 0 on its first real
token, so every row computes what it would compute alone (up to float rounding).

:class:`KVCache` owns the slot counter: ``Transformer.forward(idx, kv_cache=cache)`` feeds the next
L tokens of every row at slots ``cache.length .. cache.length + L - 1`` and advances it.

A *static* cache (``static=True``, what compiled decoding uses) computes the same attention with
shapes that never change between decode steps: keys/values are written with ``index_copy_`` at
the step's slot tensor and every step attends over all ``S`` slots, the slots not written yet
masked out. Nothing in a layer's step depends on a Python int, so a compiled block traces one
decode graph for the whole generation instead of one per key length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_lit.config import ModelConfig
from moe_lit.errors import MoeLitError


@dataclass(frozen=True)
class StepView:
    """What every attention layer needs for one forward step over slots ``start .. start+L-1``."""

    start: int
    """First slot written by this step."""
    slots_L: torch.Tensor
    """The slots written by this step, ``start .. start+L-1``."""
    positions_BL: torch.Tensor
    """Rotary position of each new token (slot minus its row's padding; 0 on padding)."""
    mask_B1LS: torch.Tensor
    """Boolean attention mask over the slots ``0 .. start+L-1`` (a static cache: all slots): causal
    and without padding (a padding query sees only itself)."""


class LayerKVCache:
    """One layer's view of a :class:`KVCache`; attention calls :meth:`update` once per step."""

    def __init__(self, cache: KVCache, layer: int) -> None:
        self.cache = cache
        # NOTE: this layer's views of the cache buffers, taken once: a compiled block then gets
        # two tensors, not a layer index that dynamo would guard on (one graph for every layer
        # instead of a second one once the index changes).
        self.k_BGSDh, self.v_BGSDh = cache.k_NBGSDh[layer], cache.v_NBGSDh[layer]

    @property
    def step(self) -> StepView:
        return self.cache.current_step()

    def update(self, k_BGLDh: torch.Tensor, v_BGLDh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's keys/values; returns all keys/values up to the end of the step (a
        static cache: all slots, the mask hiding the ones not written yet)."""
        step = self.step
        if self.cache.static:
            self.k_BGSDh.index_copy_(2, step.slots_L, k_BGLDh)
            self.v_BGSDh.index_copy_(2, step.slots_L, v_BGLDh)
            return self.k_BGSDh, self.v_BGSDh
        end = step.start + k_BGLDh.shape[2]
        self.k_BGSDh[:, :, step.start : end] = k_BGLDh
        self.v_BGSDh[:, :, step.start : end] = v_BGLDh
        return self.k_BGSDh[:, :, :end], self.v_BGSDh[:, :, :end]


class KVCache:
    """Keys and values of every layer for ``batch`` rows and up to ``max_slots`` slots."""

    def __init__(
        self,
        cfg: ModelConfig,
        batch: int,
        max_slots: int,
        pad_B: torch.Tensor | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        static: bool = False,
    ) -> None:
        if not 0 < max_slots <= cfg.seq_len:
            raise MoeLitError(f"kv cache: max_slots={max_slots} must be in 1..seq_len={cfg.seq_len} (the RoPE table)")
        shape = (cfg.n_layers, batch, cfg.kv_heads, max_slots, cfg.head_dim)
        self.k_NBGSDh = torch.zeros(shape, device=device, dtype=dtype)
        self.v_NBGSDh = torch.zeros(shape, device=device, dtype=dtype)
        self.pad_B = torch.zeros(batch, dtype=torch.long, device=device) if pad_B is None else pad_B.to(device)
        self.static = static
        self.length = 0
        self._step: StepView | None = None
        self.layers = [LayerKVCache(self, i) for i in range(cfg.n_layers)]

    @property
    def max_slots(self) -> int:
        return self.k_NBGSDh.shape[3]

    def begin(self, num_tokens: int) -> StepView:
        """Prepare a step of ``num_tokens`` new tokens per row (called by the Transformer)."""
        end = self.length + num_tokens
        if end > self.max_slots:
            raise MoeLitError(f"kv cache: {end} slots needed, only {self.max_slots} allocated")
        device = self.pad_B.device
        slots_L = torch.arange(self.length, end, device=device)
        slots_S = torch.arange(self.max_slots if self.static else end, device=device)
        real_BS = slots_S.unsqueeze(0) >= self.pad_B.unsqueeze(1)
        causal_LS = slots_S.unsqueeze(0) <= slots_L.unsqueeze(1)
        # NOTE: a padding query attends to itself only: a fully masked row would give NaNs that
        # reach real rows through the padding's values (0 * NaN), and the MoE router.
        own_LS = slots_S.unsqueeze(0) == slots_L.unsqueeze(1)
        mask_B1LS = ((causal_LS.unsqueeze(0) & real_BS.unsqueeze(1)) | own_LS.unsqueeze(0)).unsqueeze(1)
        positions_BL = (slots_L.unsqueeze(0) - self.pad_B.unsqueeze(1)).clamp(min=0)
        self._step = StepView(self.length, slots_L, positions_BL, mask_B1LS)
        return self._step

    def current_step(self) -> StepView:
        if self._step is None:
            raise MoeLitError("kv cache: no step in progress (Transformer.forward calls begin)")
        return self._step

    def advance(self) -> None:
        """Close the step: its slots now hold keys/values."""
        step = self.current_step()
        self.length = step.start + step.positions_BL.shape[1]
        self._step = None
