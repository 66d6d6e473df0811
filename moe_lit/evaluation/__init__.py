"""Evaluation: the lm-eval model ``moe_lit``, the local multilingual task suite, routing traces.

Importing ``moe_lit.evaluation.harness`` registers the ``moe_lit`` model with lm-eval; the trace
module has no lm-eval dependency, so pruning and conversions import it alone.
"""

from moe_lit.evaluation.routing_trace import RoutingTrace, TraceRecorder, routing_trace

__all__ = ["RoutingTrace", "TraceRecorder", "routing_trace"]
