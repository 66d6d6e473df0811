"""MoE layer forward+backward tokens/s next to a dense SwiGLU FFN of equal active parameters.

    .venv/bin/python -m benchmarks.moe_layer [--rounds 15] [--threads 2] [--clock wall] [--compile] [--precision bf16]

For each shape (E, k, F) at d_model 256 and 2048 tokens, one process times, INTERLEAVED: the MoE
layer (router + experts + auxiliary loss) once per slot geometry of the torch backend (grouped,
batched, looped: ``moe_<geometry>``; ``auto_geometry`` names the one ``strategy: auto`` takes), the
dense SwiGLU with d_ff = k*F, and a plain matmul ``(T, D) @ (D, k*F)`` (one of the three
matmuls of that dense FFN); ``--compile`` adds compiled twins (``nn.Module.compile``, inductor) of
the auto-geometry MoE layer and of the dense FFN (``moe_auto_compiled``, ``dense_compiled``; the
warmup rounds hold the compile). FLOP/s count useful work only (no padding, no routing bookkeeping):
18*T*k*D*F for the experts' forward+backward plus 6*T*D*E for the router; 18*T*D*d_ff for the
dense FFN; 2*T*D*d_ff for the matmul. ``--precision bf16`` runs every layer step under CPU bf16
autocast (fp32 weights, as ``bf16-mixed``), the matmul and the auto geometry in bf16.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable

import torch

from benchmarks.common import CLOCKS, interleaved_times, median, paired_ratio, report, set_threads
from moe_lit.config import MoEConfig
from moe_lit.model.experts.torch_backend import choose_geometry
from moe_lit.model.mlp import SwiGLU
from moe_lit.model.moe import MoELayer

D_MODEL, TOKENS = 256, 2048
SHAPES = ((16, 2, 256), (64, 8, 64))
GEOMETRIES = ("grouped", "batched", "looped")


def random_init(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return module


def moe_step(layer: MoELayer, x_BLD: torch.Tensor, dy_BLD: torch.Tensor, bf16: bool) -> Callable[[], None]:
    def step() -> None:
        layer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            y_BLD, losses = layer(x_BLD)
        torch.autograd.backward([y_BLD, *losses.values()], [dy_BLD.to(y_BLD.dtype), *(torch.ones(()) for _ in losses)])

    return step


def dense_step(ffn: SwiGLU, x_BLD: torch.Tensor, dy_BLD: torch.Tensor, bf16: bool) -> Callable[[], None]:
    def step() -> None:
        ffn.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            y_BLD = ffn(x_BLD)
        y_BLD.backward(dy_BLD.to(y_BLD.dtype))

    return step


def matmul_step(d_ff: int, dtype: torch.dtype) -> Callable[[], None]:
    a_TD, b_DF = torch.randn(TOKENS, D_MODEL, dtype=dtype), torch.randn(D_MODEL, d_ff, dtype=dtype)
    return lambda: torch.mm(a_TD, b_DF)


def bench_shape(shape: tuple[int, int, int], rounds: int, warmup: int, clock: str, compiled: bool, bf16: bool) -> dict:
    num_experts, top_k, size = shape
    d_ff = top_k * size
    layers = {}
    for geometry in GEOMETRIES:
        cfg = MoEConfig(num_experts=num_experts, expert_size=size, top_k=top_k)
        layers[geometry] = random_init(MoELayer(D_MODEL, cfg, 1), 0)
        layers[geometry].experts.strategy = geometry
    dense = random_init(SwiGLU(D_MODEL, d_ff), 0)
    gen = torch.Generator().manual_seed(1)
    x_BLD = torch.randn(1, TOKENS, D_MODEL, generator=gen).requires_grad_(True)
    dy_BLD = torch.randn(1, TOKENS, D_MODEL, generator=gen)
    dtype = torch.bfloat16 if bf16 else torch.float32
    cases = {f"moe_{g}": moe_step(layer, x_BLD, dy_BLD, bf16) for g, layer in layers.items()}
    cases.update(dense=dense_step(dense, x_BLD, dy_BLD, bf16), matmul=matmul_step(d_ff, dtype))
    auto = choose_geometry("auto", layers["looped"].experts.layout, D_MODEL, dtype, x_BLD.device)
    if compiled:
        moe_twin, dense_twin = copy.deepcopy(layers[auto]), copy.deepcopy(dense)
        moe_twin.compile()
        dense_twin.compile()
        cases.update(
            moe_auto_compiled=moe_step(moe_twin, x_BLD, dy_BLD, bf16),
            dense_compiled=dense_step(dense_twin, x_BLD, dy_BLD, bf16),
        )
    times = interleaved_times(cases, rounds=rounds, warmup=warmup, clock=clock)
    moe_flops = 18 * TOKENS * top_k * D_MODEL * size + 6 * TOKENS * D_MODEL * num_experts
    flops = {name: moe_flops for name in cases if name.startswith("moe_")}
    flops.update({name: 18 * TOKENS * D_MODEL * d_ff for name in cases if name.startswith("dense")})
    flops.update(matmul=2 * TOKENS * D_MODEL * d_ff)
    flops_per_s = {name: flops[name] / median(times[name]) for name in cases}
    counts = layers["grouped"].router.pending_tokens_per_expert()  # summed over the rounds
    compiled_ratios = {}
    if compiled:
        compiled_ratios = {
            "moe_over_dense_time_compiled": paired_ratio(times, "moe_auto_compiled", "dense_compiled"),
            "compiled_speedup": {
                "moe": paired_ratio(times, f"moe_{auto}", "moe_auto_compiled"),
                "dense": paired_ratio(times, "dense", "dense_compiled"),
            },
        }
    return {
        "auto_geometry": auto,
        "routing_max_over_mean": (counts.max() / counts.mean()).item(),
        "tokens_per_s": {
            name: TOKENS / median(t) for name, t in times.items() if name != "matmul" and "compiled" not in name
        },
        "compiled_tokens_per_s": {name: TOKENS / median(t) for name, t in times.items() if "compiled" in name},
        "moe_over_dense_time": {g: paired_ratio(times, f"moe_{g}", "dense") for g in GEOMETRIES},
        **compiled_ratios,
        "median_ms": {name: 1e3 * median(t) for name, t in times.items()},
        "gflop_per_s": {name: value / 1e9 for name, value in flops_per_s.items()},
        "flops_fraction_of_matmul": {
            name: value / flops_per_s["matmul"] for name, value in flops_per_s.items() if name != "matmul"
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall")
    parser.add_argument(
        "--compile", action="store_true", help="also time compiled twins of the MoE layer and dense FFN"
    )
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    set_threads(args.threads)
    bf16 = args.precision == "bf16"
    shapes = {
        "E{}k{}F{}".format(*shape): bench_shape(shape, args.rounds, args.warmup, args.clock, args.compile, bf16)
        for shape in SHAPES
    }
    setup = {
        "d_model": D_MODEL,
        "tokens": TOKENS,
        "rounds": args.rounds,
        "clock": args.clock,
        "compile": args.compile,
        "precision": args.precision,
    }
    report("moe_layer", {"setup": setup, "shapes": shapes}, save=not args.no_save)


if __name__ == "__main__":
    main()
