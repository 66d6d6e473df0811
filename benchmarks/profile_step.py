"""Where a training step's time goes: torch.profiler op table by category, eager and compiled.

    .venv/bin/python -m benchmarks.profile_step [--steps 5] [--threads 2] [--compile] [--shapes E16k2F256 E64k8F64]
        [--precision bf16]

The models, batch and optimizer are those of ``benchmarks.train_step`` (our MoE per shape and
our dense model of equal active size; ``--compile`` adds the compiled twins; ``--precision bf16``
runs every step under bf16 autocast and measures the GEMM peak with bf16 matmuls). After warmup steps
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

Each row also gives the category's share of the step, the step's FLOP-floor fraction (as
``benchmarks.train_step``: all its FLOPs at the best plain matmul rate of this run, measured on
``benchmarks.train_step.GEMM_SHAPES``; the profiler's own cost lowers it a little) and the rate its
GEMMs ran at (their FLOPs, attention scores excluded, over their self time) against that best rate.
The models are profiled one step each per round, ``--steps`` rounds.
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Callable

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
from moe_lit.config import ModelConfig
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


def profile_step_once(step: Callable[[], None]) -> tuple[dict[str, float], float]:
    """(self seconds by op name, wall seconds) of one profiled call of ``step``."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        start = time.perf_counter()
        step()
        wall = time.perf_counter() - start
    by_op: dict[str, float] = {}
    for event in prof.key_averages():
        by_op[event.key] = by_op.get(event.key, 0.0) + event.self_cpu_time_total / 1e6
    return by_op, wall


def categorize(by_op: dict[str, float], wall: float) -> dict[str, float]:
    """Seconds per category; ``overhead`` is ``wall`` minus every other category's op time."""
    by_category = dict.fromkeys(CATEGORIES, 0.0)
    for op, seconds in by_op.items():
        by_category[category(op)] += seconds
    # NOTE: what no kernel's self time covers is framework time too (Python between the ops).
    by_category["overhead"] = max(wall - sum(s for c, s in by_category.items() if c != "overhead"), 0.0)
    return by_category


def matmul_flops(cfg: ModelConfig) -> float:
    """The step's GEMM FLOPs: ``training_flops_per_token`` without its attention-score term."""
    attention = 3 * 4 * cfg.n_layers * cfg.seq_len * cfg.n_heads * cfg.head_dim
    return (training_flops_per_token(cfg) - attention) * BATCH * SEQ


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="profiled steps per model")
    parser.add_argument("--warmup", type=int, default=3, help="unprofiled steps first (include the compile)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="also profile a compiled twin of every model")
    parser.add_argument("--shapes", nargs="+", choices=[shape_tag(s) for s in SHAPES])
    parser.add_argument("--strategy", choices=STRATEGIES, default="auto", help="our experts' slot geometry")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="bf16: steps under autocast")
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
    bf16 = args.precision == "bf16"
    gemm_dtype = torch.bfloat16 if bf16 else torch.float32
    gemms = {(m, k, n): gemm_fn(m, k, n, gemm_dtype) for m, k, n in GEMM_SHAPES}
    gemm_times: dict[tuple[int, int, int], list[float]] = {shape: [] for shape in gemms}
    steps = {name: step_fn(model, hf=False, bf16=bf16) for name, model in models.items()}
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    # NOTE: one profiled step of each model per round, as the other benchmarks interleave: a load
    # spike then hits every model of a round instead of all steps of one.
    ops: dict[str, dict[str, float]] = {name: {} for name in steps}
    walls: dict[str, float] = dict.fromkeys(steps, 0.0)
    for _ in range(args.steps):
        for name, step in steps.items():
            by_op, wall = profile_step_once(step)
            walls[name] += wall / args.steps
            for op, seconds in by_op.items():
                ops[name][op] = ops[name].get(op, 0.0) + seconds / args.steps
        for shape, gemm in gemms.items():
            gemm_times[shape] += interleaved_times({"gemm": gemm}, rounds=3, warmup=1)["gemm"]
    peak = max(2 * m * k * n / median(gemm_times[(m, k, n)]) for m, k, n in GEMM_SHAPES)
    results = {}
    for name, model in models.items():
        wall, by_category = walls[name], categorize(ops[name], walls[name])
        gemm_s = by_category["gemm"]
        results[name] = {
            "step_s": wall,
            "floor_fraction": training_flops_per_token(model.config) * BATCH * SEQ / peak / wall,
            "seconds": by_category,
            "share": {c: s / wall for c, s in by_category.items()},
            "gemm_rate_fraction_of_peak": matmul_flops(model.config) / gemm_s / peak if gemm_s else None,
            "ops": dict(sorted(ops[name].items(), key=lambda kv: -kv[1])),
        }
    setup = {
        "strategy": args.strategy,
        "precision": args.precision,
        "batch": BATCH,
        "seq": SEQ,
        "steps": args.steps,
        "warmup": args.warmup,
        "peak_gemm_gflop_per_s": peak / 1e9,
    }
    report("profile_step", {"setup": setup, "models": results}, save=not args.no_save)


if __name__ == "__main__":
    main()
