"""Full training step (forward, backward, AdamW) tokens/s: our MoE vs transformers' OLMoE vs our dense.

    .venv/bin/python -m benchmarks.train_step [--rounds 7] [--threads 2] [--clock wall|cpu] [--optimizer fused]
        [--compile] [--shapes E16k2F256 E64k8F64]

All models are built from random weights with identical dimensions (vocab 8192, d_model 256,
4 layers, 4 heads, seq 256, batch 8) and timed INTERLEAVED in one process, in fp32 and (by
default) beside it under CPU bf16 autocast (``_bf16`` names; fp32 weights and AdamW, as
Lightning's bf16-mixed), with bf16 GEMMs for the bf16 FLOP floor. For each MoE shape
(E, k, F) three models run: ours, ``OlmoeForCausalLM`` and our dense model with d_ff = k*F (equal
active parameters). Both MoE models use softmax routing, renormalised top-k weights, untied
embeddings and a 0.01 load-balancing loss; the loss is the same cross-entropy and the optimizer
the same AdamW (fused by default) for all. OLMoE additionally RMS-normalises q and k (a few
elementwise ops per layer; its 2*256 norm weights per layer replace our 256 expert-bias entries in
the parameter count) and runs its experts with transformers' default ``grouped_mm`` path
(``torch._grouped_mm``; ``--olmoe-experts eager`` times the per-expert loop instead).

``--thread-fix MODEL [MODEL ...]`` times instead the cost of thread invariance (issue 53,
``moe_lit/model/invariant.py``): the training step of trained demo models (``results/demo/models/moe``
and ``.../dense``, made by ``make demo``) and of the same configs freshly initialised, on the demo's
first training batch, ``invariant`` (the default: expert blocks of fewer than ``SERIAL_BLOCK_ROWS``
slots and the SwiGLU product on one thread) against ``threaded`` (every op on all threads, the
behaviour before it), interleaved, as the median per-round ratio invariant / threaded; beside it, for
an MoE, how many expert blocks of that batch are that small and their share of the routed
assignments (of the expert FLOPs).

``--compile`` adds a compiled twin of every model (same initial weights; each transformer block /
OLMoE decoder layer compiled in place with inductor, as ``train.compile`` does), timed in the same
interleaved rounds; the warmup rounds include the compile (keep ``--warmup`` >= 2: our MoE
compiles a second graph at its second forward, once its routers hold pending sums). Every
model's ``floor_fraction`` is the FLOP floor over its median step time (1.0 = every FLOP at the
best GEMM rate of the run).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import CLOCKS, interleaved_times, median, paired_ratio, report, set_threads
from moe_lit.accounting import training_flops_per_token
from moe_lit.config import ModelConfig, MoEConfig
from moe_lit.inference.precision import native_bf16_flags
from moe_lit.lit.optim import ADAMW_KERNELS
from moe_lit.lit.throughput import training_step
from moe_lit.model.compile import compile_blocks
from moe_lit.model.experts.torch_backend import STRATEGIES
from moe_lit.model.transformer import Transformer

VOCAB, D_MODEL, LAYERS, HEADS, SEQ, BATCH = 8192, 256, 4, 4, 256, 8
SHAPES = ((16, 2, 256), (64, 8, 64))
AUX_COEF = 0.01


def our_config(shape: tuple[int, int, int] | None, d_ff: int, loss_chunk_tokens: int = 256) -> ModelConfig:
    moe = None
    if shape is not None:
        num_experts, top_k, size = shape
        moe = MoEConfig(num_experts=num_experts, expert_size=size, top_k=top_k, aux_loss_coef=AUX_COEF)
    return ModelConfig(
        vocab_size=VOCAB,
        d_model=D_MODEL,
        n_layers=LAYERS,
        n_heads=HEADS,
        seq_len=SEQ,
        d_ff=d_ff,
        moe=moe,
        loss_chunk_tokens=loss_chunk_tokens,
    )


def olmoe(shape: tuple[int, int, int], experts_implementation: str) -> nn.Module:
    try:
        from transformers import OlmoeConfig, OlmoeForCausalLM
    except ImportError as err:  # pragma: no cover - benchmark-only extra
        raise SystemExit("this benchmark needs transformers: pip install -e '.[benchmarks]'") from err
    num_experts, top_k, size = shape
    cfg = OlmoeConfig(
        vocab_size=VOCAB,
        hidden_size=D_MODEL,
        intermediate_size=size,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=SEQ,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        output_router_logits=True,
        router_aux_loss_coef=AUX_COEF,
        use_cache=False,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = OlmoeForCausalLM(cfg)
    model.set_experts_implementation(experts_implementation)
    return model


def step_fn(model: nn.Module, hf: bool, optimizer_kind: str = "fused", bf16: bool = False) -> Callable[[], None]:
    """One training step on a fixed random batch; the same loss and AdamW for every model, the
    forward under CPU bf16 autocast when ``bf16`` (fp32 weights and optimizer, as bf16-mixed).

    Ours is ``moe_lit.lit.throughput.training_step``: its cross-entropy as training computes it
    (``model(idx, targets)``: the chunked head + loss unless ``loss_chunk_tokens`` is 0); OLMoE's
    logits go through ``F.cross_entropy``.
    """
    gen = torch.Generator().manual_seed(0)
    batch_BL1 = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    if not hf:
        return training_step(cast(Transformer, model), batch_BL1, optimizer_kind, bf16=bf16)
    idx_BL, targets_BL = batch_BL1[:, :-1], batch_BL1[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **ADAMW_KERNELS[optimizer_kind])
    model.train()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model(input_ids=idx_BL, use_cache=False)
            logits = out.logits.float().view(-1, VOCAB)
        loss = F.cross_entropy(logits, targets_BL.reshape(-1)) + AUX_COEF * out.aux_loss.float()
        loss.backward()
        optimizer.step()

    return step


GOALS = {
    "speedup_vs_olmoe": 1.5,
    "moe_over_dense_time": {"E16k2F256": 1.1, "E64k8F64": 1.25},
    "moe_floor_fraction": {"E16k2F256": 0.8, "E64k8F64": 0.7},
    "bf16_speedup": 1.8,
}
"""Issue 19's goals (the over-dense goals were 1.15 / 1.3 before it): our MoE step's FLOP-floor
fraction (eager, or compiled with ``--compile``), its time over our dense step, its speedup over
OLMoE (each in fp32 and in bf16); issue 33's: our MoE's bf16 step at least 1.8x its fp32 step."""
GEMM_SHAPES = ((2048, 256, 256), (2048, 256, 512), (2048, 512, 256), (256, 256, 8192), (1024, 1024, 1024))
"""(M, K, N) of plain fp32 matmuls timed beside the steps: the model's own shapes and a square one."""


def gemm_fn(m: int, k: int, n: int, dtype: torch.dtype = torch.float32) -> Callable[[], None]:
    a_MK, b_KN = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    return lambda: torch.mm(a_MK, b_KN)


def flop_floor(
    times: dict[str, list[float]], tag: str, shape: tuple[int, int, int], suffix: str = ""
) -> dict[str, float]:
    """The step time if all its FLOPs ran at the best GEMM rate measured in this run (in the
    precision of ``suffix``: "" fp32, "_bf16" bf16 GEMMs), and the speedup over OLMoE such a step
    would have: no implementation of this math gets past it."""
    peak = max(2 * m * k * n / median(times[f"gemm_{m}x{k}x{n}{suffix}"]) for m, k, n in GEMM_SHAPES)
    config = our_config(shape, shape[1] * shape[2])
    floor_s = training_flops_per_token(config) * BATCH * SEQ / peak
    return {
        "peak_gemm_gflop_per_s": peak / 1e9,
        "flop_floor_s": floor_s,
        "speedup_vs_olmoe_at_floor": median(times[f"olmoe_{tag}{suffix}"]) / floor_s,
    }


def shape_tag(shape: tuple[int, int, int]) -> str:
    return "E{}k{}F{}".format(*shape)


def build_models(
    olmoe_experts: str, loss_chunk_tokens: int, strategy: str, shapes=SHAPES
) -> dict[str, tuple[nn.Module, bool]]:
    """Ours and OLMoE for every MoE shape, and our dense model once per distinct d_ff = k*F (name -> (model, hf))."""
    models: dict[str, tuple[nn.Module, bool]] = {}
    for shape in shapes:
        tag, d_ff = "E{}k{}F{}".format(*shape), shape[1] * shape[2]
        ours = Transformer(our_config(shape, d_ff, loss_chunk_tokens))
        for layer in ours.moe_layers():
            layer.experts.strategy = strategy
        models[f"ours_moe_{tag}"] = (ours, False)
        models[f"olmoe_{tag}"] = (olmoe(shape, olmoe_experts), True)
        models.setdefault(f"ours_dense_dff{d_ff}", (Transformer(our_config(None, d_ff, loss_chunk_tokens)), False))
    return models


def compiled_twin(model: nn.Module, hf: bool) -> nn.Module:
    """A copy of ``model`` with each transformer block (OLMoE: decoder layer) compiled in place."""
    twin = copy.deepcopy(model)
    if hf:
        for layer in twin.model.layers:
            layer.compile()
    else:
        compile_blocks(twin)
    return twin


def shape_ratios(
    times: dict[str, list[float]], models: dict[str, dict], shape: tuple[int, int, int], suffix: str, compiled: bool
) -> dict:
    """One MoE shape's ratios in one precision (``suffix``: "" fp32, "_bf16"): against OLMoE, against
    our dense step of equal active size, the FLOP-floor fractions, compiled speedups."""
    tag = shape_tag(shape)
    moe, olmoe, dense = f"ours_moe_{tag}", f"olmoe_{tag}", f"ours_dense_dff{shape[1] * shape[2]}"
    speedup = paired_ratio(times, olmoe + suffix, moe + suffix)
    over_dense = paired_ratio(times, moe + suffix, dense + suffix)
    ratios = {
        "speedup_vs_olmoe": speedup,
        "speedup_goal_met": speedup >= GOALS["speedup_vs_olmoe"],
        # NOTE: an MoE step does at least the work of the dense step of equal active size, so
        # this is the speedup our MoE would have at zero routing cost: the ceiling of the above.
        "dense_speedup_vs_olmoe": paired_ratio(times, olmoe + suffix, dense + suffix),
        "moe_over_dense_time": over_dense,
        "over_dense_goal_met": over_dense <= GOALS["moe_over_dense_time"][tag],
        **flop_floor(times, tag, shape, suffix),
    }
    floor_s = ratios["flop_floor_s"]
    names = [n for n in models if (tag in n or n.startswith(dense)) and n.endswith("_bf16") == bool(suffix)]
    ratios["floor_fraction"] = {name: floor_s / models[name]["median_s"] for name in names}
    best = max(v for name, v in ratios["floor_fraction"].items() if name.startswith("ours_moe"))
    ratios["moe_floor_goal_met"] = best >= GOALS["moe_floor_fraction"][tag]
    if compiled:
        over = paired_ratio(times, f"{moe}_compiled{suffix}", f"{dense}_compiled{suffix}")
        ratios["compiled_moe_over_dense_time"] = over
        ratios["compiled_over_dense_goal_met"] = over <= GOALS["moe_over_dense_time"][tag]
        eager = [n.removesuffix(suffix) for n in names if "_compiled" not in n]
        ratios["compiled_speedup"] = {n: paired_ratio(times, n + suffix, f"{n}_compiled{suffix}") for n in eager}
    return ratios


def small_blocks(model: Transformer, batch_BL1: torch.Tensor, rows: int) -> dict[str, float]:
    """Over ``model``'s MoE layers on one forward of ``batch_BL1``: the expert blocks (experts given
    tokens) with fewer than ``rows`` slots, all blocks, and the share of routed assignments (of the
    expert FLOPs, the experts being of equal size) in the small ones."""
    counts: list[torch.Tensor] = []

    def record(router: nn.Module, inputs: object, out: object) -> None:
        counts.append(torch.bincount(out.indices_TK.flatten(), minlength=router.num_experts))

    hooks = [layer.router.register_forward_hook(record) for layer in model.moe_layers()]
    with torch.no_grad():
        model(batch_BL1[:, :-1], batch_BL1[:, 1:])
    for hook in hooks:
        hook.remove()
    counts_E = torch.cat(counts)
    small = counts_E[(counts_E > 0) & (counts_E < rows)]
    return {
        "small_blocks": int(small.numel()),
        "blocks": int((counts_E > 0).sum()),
        "assignment_share_in_small": float(small.sum() / counts_E.sum()),
    }


def thread_fix_cost(paths: list[str], rounds: int, warmup: int, clock: str) -> dict[str, object]:
    """The training step of each trained model in ``paths`` and of its config freshly initialised, with
    and without the thread-invariant ops (see the module docstring)."""
    from moe_lit.checkpoint import load_model
    from moe_lit.commands.demo import RUN, prepare_default_data
    from moe_lit.lit.datamodule import MoEDataModule
    from moe_lit.lit.run_config import RunConfig
    from moe_lit.model import invariant
    from moe_lit.model.experts import grouped_swiglu

    run = RunConfig.from_yaml(RUN)
    data = run.replace(data={"data_dir": str(prepare_default_data(run.data.data_dir))}).data
    batch_BL1 = next(iter(MoEDataModule.from_config(data, run.train.seed).train_dataloader()))
    models: dict[str, Transformer] = {}
    for path in paths:
        trained = load_model(path)
        torch.manual_seed(0)
        models |= {f"{Path(path).name}/trained": trained, f"{Path(path).name}/init": Transformer(trained.config)}

    def all_threads(step: Callable[[], None]) -> Callable[[], None]:
        # NOTE: the behaviour before the fix: no block serial, and one_thread a no-op where swiglu looks it up
        def timed() -> None:
            kept = grouped_swiglu.SERIAL_BLOCK_ROWS, invariant.one_thread
            grouped_swiglu.SERIAL_BLOCK_ROWS, invariant.one_thread = 0, contextlib.nullcontext
            try:
                step()
            finally:
                grouped_swiglu.SERIAL_BLOCK_ROWS, invariant.one_thread = kept

        return timed

    serial_rows = grouped_swiglu.SERIAL_BLOCK_ROWS
    cases: dict[str, Callable[[], None]] = {}
    for name, model in models.items():
        cases[f"{name}/invariant"] = training_step(copy.deepcopy(model), batch_BL1)
        cases[f"{name}/threaded"] = all_threads(training_step(copy.deepcopy(model), batch_BL1))
    times = interleaved_times(cases, rounds=rounds, warmup=warmup, clock=clock)
    tokens = batch_BL1[:, :-1].numel()
    return {
        "setup": {
            "models": paths,
            "batch": list(batch_BL1[:, :-1].shape),
            "serial_block_rows": serial_rows,
            "threads": torch.get_num_threads(),
            "rounds": rounds,
            "clock": clock,
        },
        "models": {
            name: {
                "invariant_over_threaded_time": paired_ratio(times, f"{name}/invariant", f"{name}/threaded"),
                **(small_blocks(model, batch_BL1, serial_rows) if model.config.moe else {}),
                **{f"{v}_tokens_per_s": tokens / median(times[f"{name}/{v}"]) for v in ("invariant", "threaded")},
            }
            for name, model in models.items()
        },
        "times_s": times,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall")
    parser.add_argument("--optimizer", choices=tuple(ADAMW_KERNELS), default="fused", help="AdamW implementation")
    parser.add_argument(
        "--olmoe-experts",
        choices=("grouped_mm", "eager", "batched_mm"),
        default="grouped_mm",
        help="transformers' experts implementation for OLMoE (grouped_mm is its default in transformers 5)",
    )
    parser.add_argument(
        "--loss-chunk-tokens",
        type=int,
        default=ModelConfig.loss_chunk_tokens,
        help="our models' fused head + cross-entropy chunk (0 = plain logits + F.cross_entropy, as OLMoE)",
    )
    parser.add_argument("--strategy", choices=STRATEGIES, default="auto", help="our experts' slot geometry")
    parser.add_argument("--compile", action="store_true", help="also time a compiled twin of every model")
    parser.add_argument(
        "--shapes", nargs="+", choices=[shape_tag(s) for s in SHAPES], help="MoE shapes to time (default: all)"
    )
    parser.add_argument(
        "--precision",
        choices=("fp32", "both"),
        default="both",
        help="fp32 steps only, or beside them bf16-autocast steps (every model, OLMoE too, and bf16 GEMMs)",
    )
    parser.add_argument(
        "--thread-fix",
        nargs="+",
        metavar="MODEL",
        help="only time the trained models at MODEL (and their fresh twins) with and without the thread-invariant ops",
    )
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    set_threads(args.threads)
    if args.thread_fix:
        result = thread_fix_cost(args.thread_fix, args.rounds, args.warmup, args.clock)
        report("train_step", result | {"load_avg_1m_after": os.getloadavg()[0]}, save=not args.no_save)
        return
    torch.manual_seed(0)
    shapes = tuple(s for s in SHAPES if args.shapes is None or shape_tag(s) in args.shapes)
    built = build_models(args.olmoe_experts, args.loss_chunk_tokens, args.strategy, shapes)
    if args.compile:
        built.update({f"{name}_compiled": (compiled_twin(m, hf), hf) for name, (m, hf) in list(built.items())})
    suffixes = {"fp32": [""], "both": ["", "_bf16"]}[args.precision]
    if "_bf16" in suffixes:
        built.update({f"{name}_bf16": (copy.deepcopy(m), hf) for name, (m, hf) in list(built.items())})
    cases = {
        name: step_fn(model, hf, args.optimizer, bf16=name.endswith("_bf16")) for name, (model, hf) in built.items()
    }
    for suffix in suffixes:
        dtype = torch.bfloat16 if suffix else torch.float32
        cases.update({f"gemm_{m}x{k}x{n}{suffix}": gemm_fn(m, k, n, dtype) for m, k, n in GEMM_SHAPES})
    times = interleaved_times(cases, rounds=args.rounds, warmup=args.warmup, clock=args.clock)
    tokens = BATCH * SEQ
    models = {
        name: {
            "params": sum(p.numel() for p in built[name][0].parameters()),
            "median_s": median(t),
            "tokens_per_s": tokens / median(t),
            "times_s": t,
        }
        for name, t in times.items()
        if name in built
    }
    ratios = {}
    for suffix in suffixes:
        for shape in shapes:
            ratios[shape_tag(shape) + suffix] = shape_ratios(times, models, shape, suffix, args.compile)
    if "_bf16" in suffixes:
        ratios["bf16_speedup"] = {
            name: paired_ratio(times, name, f"{name}_bf16") for name in models if not name.endswith("_bf16")
        }
        for shape in shapes:
            tag = shape_tag(shape)
            ratios["bf16_speedup"][f"goal_met_{tag}"] = (
                ratios["bf16_speedup"][f"ours_moe_{tag}"] >= GOALS["bf16_speedup"]
            )
    setup = {
        "vocab": VOCAB,
        "d_model": D_MODEL,
        "layers": LAYERS,
        "heads": HEADS,
        "seq": SEQ,
        "batch": BATCH,
        "dtype": "float32" if args.precision == "fp32" else "float32 and bf16 autocast (_bf16)",
        "cpu_bf16_flags": native_bf16_flags(),
        "rounds": args.rounds,
        "clock": args.clock,
        "optimizer": f"AdamW ({args.optimizer})",
        "ours_loss_chunk_tokens": args.loss_chunk_tokens,
        "ours_experts_strategy": args.strategy,
        "olmoe_notes": "q/k RMSNorm (OLMoE only); sdpa attention",
        "olmoe_experts_implementation": args.olmoe_experts,
        "compile": "each block / decoder layer, inductor" if args.compile else "off",
    }
    report("train_step", {"setup": setup, "goals": GOALS, "models": models, "ratios": ratios}, save=not args.no_save)


if __name__ == "__main__":
    main()
