"""Lightning callbacks: routing statistics, divergence guard and model-growing transforms (dense->MoE, E->mE)."""

from moe_lit.callbacks.dense_upcycling import DenseToMoEUpcycling
from moe_lit.callbacks.divergence import DivergenceGuard
from moe_lit.callbacks.expert_upcycling import ExpertUpcycling
from moe_lit.callbacks.routing_monitor import RoutingMonitor

__all__ = ["DenseToMoEUpcycling", "DivergenceGuard", "ExpertUpcycling", "RoutingMonitor"]
