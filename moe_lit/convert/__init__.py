"""Model transforms: pure functions (model in, new model out) with documented guarantees.

``dense_to_moe`` (copy / granular / drop upcycling), ``expand_experts`` (E -> mE expert
duplication with uniform or utility-based selection); ``moe_lit.convert.hf`` (import from and
export to the transformers families) is imported on use: it needs transformers.
"""

from moe_lit.convert.dense_to_moe import RECIPES, dense_to_moe
from moe_lit.convert.expand import (
    ExpertExpansion,
    ExpertUtility,
    UtilityAccumulator,
    allocate_copies,
    apply_expansion,
    expand_experts,
    expert_utility,
    plan_expansion,
)

__all__ = [
    "ExpertExpansion",
    "ExpertUtility",
    "RECIPES",
    "UtilityAccumulator",
    "allocate_copies",
    "apply_expansion",
    "dense_to_moe",
    "expand_experts",
    "expert_utility",
    "plan_expansion",
]
