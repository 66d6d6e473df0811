"""Lightning callbacks: routing statistics and model-growing transforms (dense->MoE, E->mE)."""

from moe_lit.callbacks.dense_upcycling import DenseToMoEUpcycling
from moe_lit.callbacks.expert_upcycling import ExpertUpcycling
from moe_lit.callbacks.routing_monitor import RoutingMonitor

__all__ = ["DenseToMoEUpcycling", "ExpertUpcycling", "RoutingMonitor"]
