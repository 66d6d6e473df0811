"""Inference: KV-cache generation, the forward-only expert path, intra-expert activation sparsity."""

from moe_lit.inference.generate import generate, stream
from moe_lit.model.kv_cache import KVCache

__all__ = ["KVCache", "generate", "stream"]
