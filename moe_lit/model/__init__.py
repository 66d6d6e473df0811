"""Model components: decoder LM with dense SwiGLU or MoE FFNs."""

from moe_lit.model.moe import MoELayer
from moe_lit.model.transformer import LMOutput, Transformer

__all__ = ["LMOutput", "MoELayer", "Transformer"]
