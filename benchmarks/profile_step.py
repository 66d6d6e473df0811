"""Where a training step's time goes: torch.profiler op table by category, eager and compiled.

    .venv/bin/python -m benchmarks.profile_step [--steps 5] [--threads 2] [--compile] [--shapes E16k2F256 E64k8F64]

The models, batch and optimizer are those of ``benchmarks.train_step`` (our MoE per shape and
our dense model of equal active size; ``--compile`` adds the compiled twins). After warmup steps
(which include any compile), ``--steps`` steps run under ``torch.profiler``; every op's *self* CPU
time is put in one category:

* ``gemm``: matmuls (mm, addmm, bmm, grouped mm, linear's kernels);
* ``attention``: SDPA's forward and backward kernels;
* ``gather_scatter``: token movement (index_select, embedding_bag, index_add, gather, scatter,
  index_put, embedding and their backwards, sort, bincount);
* ``elementwise``: pointwise ops and reductions in aten (norms, SiLU, products, softmax,
  residual adds, copies, casts) and inductor's fused C++ kernels (``cpp_fused_*``);
* ``optimizer``: AdamW's kernels;
* ``other``: every remaining op (top-k, the loss' own ops, allocation);
* ``overhead``: the step's wall time minus the ops' self time: Python, the dispatcher, autograd
  and dynamo's guards between ops.

Each row also gives the category's share of the step and, for ``gemm``, the GEMM FLOP/s the step
reached against the best plain matmul rate of this run (``benchmarks.train_step.GEMM_SHAPES``).
"""

from __future__ import annotations

import argparse
import re

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import interleaved_times, median, report, set_threads
from benchmarks.train_step import (
    BATCH,
    GEMM_SHAPES,
    SEQ,
    SHAPES,
    compiled_twin,
    gemm_fn,
    our_config,
    shape_tag,
    step_fn,
)
from moe_lit.accounting import training_flops_per_token
from moe_lit.model.experts.torch_backend import STRATEGIES
from moe_lit.model.transformer import Transformer

CATEGORIES = ("gemm", "attention", "gather_scatter", "elementwise", "optimizer", "other", "overhead")
_VIEWS = (
    "view|_unsafe_view|as_strided|transpose|t|mT|permute|expand|unsqueeze|squeeze|slice|select|narrow|split|"
    "split_with_sizes|chunk|unbind|reshape|flatten|unflatten|detach|alias|resolve_conj|resolve_neg|lift_fresh"
)
_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    # NOTE: first the profiler's ranges around ops (autograd nodes, our autograd Functions' Python,
    # optimizer wrappers, dynamo's guard check) and metadata-only view ops: their self time is
    # framework time between kernels, so it belongs to ``overhead``, whatever their names contain.
    ("overhead", re.compile(rf"^(?!aten::|graph_\d+_cpp_fused|cpp_fused)|^aten::({_VIEWS})$")),
    ("optimizer", re.compile(r"adam|_foreach_")),
    ("attention", re.compile(r"scaled_dot_product|flash_attention|_efficient_attention")),
    ("gemm", re.compile(r"^aten::(mm|addmm|bmm|baddbmm|_grouped_mm|addmv|mv|matmul|linear)_?$")),
    (
        "gather_scatter",
        re.compile(
            r"index_select|embedding|index_add|gather|scatter|index_put|index_copy|^aten::index$|^aten::take"
            r"|^aten::sort|argsort|bincount|histc|repeat_interleave"
        ),
    ),
    (
        "elementwise",
        re.compile(
            r"cpp_fused|^aten::(add|sub|mul|div|neg|exp|log|pow|sqrt|rsqrt|silu|sigmoid|tanh|where|clamp|"
            r"masked_fill|copy|_to_copy|to|fill|zero|zeros_like|ones_like|cat|stack|sum|mean|amax|max|min|"
            r"softmax|_softmax|log_softmax|_log_softmax|rms_norm|_fused_rms_norm|native_layer_norm|square|"
            r"reciprocal|cumsum|addcmul|addcdiv|lerp|sign|abs|clamp_min|clamp_max|eq|ne|lt|gt|ge|le|logsumexp|"
            r"contiguous|clone|exp|log1p)(_|_backward.*|_out)?$|_backward_data$|silu_backward|sigmoid_backward|"
            r"threshold_backward"
        ),
    ),
)


def category(op_name: str) -> str:
    """The category of one profiler op name (``other`` when no rule matches)."""
    for name, rule in _RULES:
        if rule.search(op_name):
            return name
    return "other"


def profile_case(step, steps: int) -> tuple[dict[str, float], dict[str, float], float]:
    """(self seconds per step by category, by op name, wall seconds per step) over ``steps`` steps."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        times = interleaved_times({"step": step}, rounds=steps, warmup=0)["step"]
    by_op: dict[str, float] = {}
    for event in prof.key_averages():
        by_op[event.key] = by_op.get(event.key, 0.0) + event.self_cpu_time_total / 1e6 / steps
    wall = sum(times) / steps
    by_category = dict.fromkeys(CATEGORIES, 0.0)
    for op, seconds in by_op.items():
        by_category[category(op)] += seconds
    # NOTE: what no kernel's self time covers is framework time too (Python between the ops).
    by_category["overhead"] = max(wall - sum(s for c, s in by_category.items() if c != "overhead"), 0.0)
    return by_category, by_op, wall


def gemm_flops(model: Transformer) -> float:
    """The step's matmul FLOPs (all of ``training_flops_per_token``: our accounting counts GEMMs only)."""
    return training_flops_per_token(model.config) * BATCH * SEQ


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="profiled steps per model")
    parser.add_argument("--warmup", type=int, default=3, help="unprofiled steps first (include the compile)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="also profile a compiled twin of every model")
    parser.add_argument("--shapes", nargs="+", choices=[shape_tag(s) for s in SHAPES])
    parser.add_argument("--strategy", choices=STRATEGIES, default="auto", help="our experts' slot geometry")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    set_threads(args.threads)
    torch.manual_seed(0)
    # NOTE: inductor emits profiler events for its C++ kernels only with this flag.
    torch._inductor.config.cpp.enable_kernel_profile = True
    shapes = tuple(s for s in SHAPES if args.shapes is None or shape_tag(s) in args.shapes)
    models: dict[str, Transformer] = {}
    for shape in shapes:
        moe = Transformer(our_config(shape, shape[1] * shape[2]))
        for layer in moe.moe_layers():
            layer.experts.strategy = args.strategy
        models[f"ours_moe_{shape_tag(shape)}"] = moe
        models.setdefault(f"ours_dense_dff{shape[1] * shape[2]}", Transformer(our_config(None, shape[1] * shape[2])))
    if args.compile:
        models.update({f"{name}_compiled": compiled_twin(m, hf=False) for name, m in list(models.items())})
    gemm_times = interleaved_times({f"{m}x{k}x{n}": gemm_fn(m, k, n) for m, k, n in GEMM_SHAPES}, rounds=5, warmup=1)
    peak = max(2 * m * k * n / median(gemm_times[f"{m}x{k}x{n}"]) for m, k, n in GEMM_SHAPES)
    results = {}
    for name, model in models.items():
        step = step_fn(model, hf=False)
        for _ in range(args.warmup):
            step()
        by_category, by_op, wall = profile_case(step, args.steps)
        flops = gemm_flops(model)
        results[name] = {
            "step_s": wall,
            "floor_fraction": flops / peak / wall,
            "seconds": by_category,
            "share": {c: s / wall for c, s in by_category.items()},
            "gemm_rate_fraction_of_peak": flops / by_category["gemm"] / peak if by_category["gemm"] else None,
            "ops": dict(sorted(by_op.items(), key=lambda kv: -kv[1])),
        }
    setup = {
        "strategy": args.strategy,
        "batch": BATCH,
        "seq": SEQ,
        "steps": args.steps,
        "warmup": args.warmup,
        "peak_gemm_gflop_per_s": peak / 1e9,
    }
    report("profile_step", {"setup": setup, "models": results}, save=not args.no_save)


if __name__ == "__main__":
    main()
