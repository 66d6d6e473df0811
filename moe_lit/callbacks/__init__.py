"""Lightning callbacks: routing statistics (and, later, model-growing transforms)."""

from moe_lit.callbacks.routing_monitor import RoutingMonitor

__all__ = ["RoutingMonitor"]
