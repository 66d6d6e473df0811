"""Training throughput on one GPU: MegaBlocks vs the torch backend's grouped GEMMs vs its padded bmm.

    python -m benchmarks.gpu_throughput [--out FILE] [--steps 10] [--warmup 3] [--models moe-180m,moe-720m]
        [--compiled moe-180m:megablocks,moe-180m:grouped]

For each model (~180M and ~720M total parameters, bf16 autocast over fp32 master weights, fused
AdamW, built on the GPU) and each expert backend, times full training steps (forward, backward,
optimizer) with CUDA events and reports tokens/s, step time, peak memory and MFU = training
FLOPs/token * tokens/s over the bf16 peak (the datasheet's dense 989 TFLOP/s and, beside it, a
measured 8192^3 bf16 matmul). Backends: ``megablocks`` (MegaBlocksExperts), ``grouped``
(TorchExperts, ``torch._grouped_mm`` over packed slots) and ``batched`` (TorchExperts, one ``bmm``
over padded chunks). ``--compiled`` names the (model, backend) pairs also timed with their
transformer blocks compiled (``moe_lit.model.compile.compile_blocks``, inductor/Triton; the warmup
steps hold the compile; ``compiled_speedup`` in the summary), after every eager case.

Writes JSON lines to ``--out`` (default ``benchmarks/results/gpu-<date>.jsonl``) as it goes, so a
run stopped by a time limit keeps every case that finished: first ``{"benchmark", "environment",
"measured_bf16_matmul_tflops"}``, then one row per case as it ends (``error`` where it could not
run), then ``{"summary": ...}``: per model, each backend's tokens/s over ``batched``'s.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from moe_lit.accounting import count_config_params, training_flops_per_token
from moe_lit.config import ModelConfig, MoEConfig
from moe_lit.model import Transformer
from moe_lit.model.compile import compile_blocks
from moe_lit.model.experts import TorchExperts

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DATASHEET_BF16_FLOPS = 989e12
"""Dense bf16 peak of an H100/H200 SXM (vendor datasheet)."""
BACKENDS = ("megablocks", "grouped", "batched")

MODELS: dict[str, tuple[ModelConfig, int]] = {
    # name: (config, batch size in sequences)
    "moe-180m": (
        ModelConfig(
            vocab_size=32768,
            d_model=768,
            n_layers=8,
            n_heads=12,
            seq_len=1024,
            d_ff=2048,
            moe=MoEConfig(num_experts=8, expert_size=768, top_k=2),
        ),
        16,
    ),
    "moe-720m": (
        ModelConfig(
            vocab_size=32768,
            d_model=1024,
            n_layers=12,
            n_heads=16,
            seq_len=1024,
            d_ff=2816,
            moe=MoEConfig(num_experts=16, expert_size=1024, top_k=2),
        ),
        8,
    ),
}


def build(cfg: ModelConfig, backend: str, compiled: bool = False) -> Transformer:
    """The model built on CUDA with the requested expert backend, its blocks compiled if
    ``compiled`` (raises when it cannot run here)."""
    # NOTE: built on the device: initialising a 720M model on the CPU takes longer than its timed steps.
    with torch.device("cuda"):
        model = Transformer(cfg.replace(moe={"backend": "megablocks" if backend == "megablocks" else "torch"}))
    for layer in model.moe_layers():
        if backend != "megablocks":
            if not isinstance(layer.experts, TorchExperts):
                raise RuntimeError(f"expected TorchExperts for backend {backend}, got {type(layer.experts).__name__}")
            layer.experts.strategy = backend
    if compiled:
        compile_blocks(model)
    return model


def time_steps(step: Callable[[], None], warmup: int, steps: int) -> list[float]:
    """Seconds per call, timed with CUDA events after ``warmup`` calls."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def train_step(model: Transformer, batch_BL1: torch.Tensor) -> Callable[[], None]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(batch_BL1[:, :-1], batch_BL1[:, 1:])
            loss = out.ce + out.aux_loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def measured_matmul_flops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    seconds = statistics.median(time_steps(lambda: a @ b, warmup=3, steps=10))
    return 2 * 8192**3 / seconds


def run_case(name: str, backend: str, warmup: int, steps: int, peak: float, compiled: bool = False) -> dict[str, Any]:
    cfg, batch = MODELS[name]
    counts = count_config_params(cfg)
    row: dict[str, Any] = {
        "model": name,
        "backend": backend,
        "compiled": compiled,
        "params_total": counts.total,
        "params_active": counts.active,
        "batch": batch,
        "seq_len": cfg.seq_len,
    }
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        model = build(cfg, backend, compiled)
    except Exception as exc:  # noqa: BLE001 - a backend that cannot run here is a result, not a crash
        return {**row, "error": f"{type(exc).__name__}: {exc}"}
    torch.manual_seed(0)
    batch_BL1 = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), device="cuda")
    try:
        seconds = statistics.median(time_steps(train_step(model, batch_BL1), warmup, steps))
    except Exception as exc:  # noqa: BLE001 - e.g. a compile failure on this machine's toolchain
        return {**row, "error": f"{type(exc).__name__}: {exc}"[:500]}
    tokens_per_s = batch * cfg.seq_len / seconds
    flops_per_s = training_flops_per_token(cfg) * tokens_per_s
    del model
    return {
        **row,
        "step_ms": round(seconds * 1e3, 2),
        "tokens_per_s": round(tokens_per_s),
        "mfu": round(flops_per_s / DATASHEET_BF16_FLOPS, 4),
        "mfu_vs_measured_matmul": round(flops_per_s / peak, 4),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    }


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per model: tokens/s of each backend over the padded-bmm ``batched`` one's, and the fastest backend."""
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r["model"] for r in rows):
        ran = [r for r in rows if r["model"] == name and "tokens_per_s" in r]
        speeds = {r["backend"]: r["tokens_per_s"] for r in ran if not r.get("compiled")}
        compiled = {r["backend"]: r["tokens_per_s"] for r in ran if r.get("compiled")}
        summary: dict[str, Any] = {
            f"{b}_vs_batched": round(s / speeds["batched"], 3)
            for b, s in speeds.items()
            if "batched" in speeds and b != "batched"
        }
        summary["fastest"] = max(speeds, key=speeds.get) if speeds else None
        summary["compiled_speedup"] = {b: round(s / speeds[b], 3) for b, s in compiled.items() if b in speeds}
        out[name] = summary
    return out


def append_line(path: Path, record: dict[str, Any]) -> None:
    """One JSON line at the end of ``path``, printed too."""
    with path.open("a") as handle:
        handle.write(json.dumps(record) + "\n")
    print(json.dumps(record), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    stamp = _dt.date.today().isoformat()
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / f"gpu-{stamp}.jsonl")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument(
        "--compiled", default="moe-180m:megablocks,moe-180m:grouped", help="model:backend pairs also run compiled"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_throughput needs a CUDA device")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("")
    peak = measured_matmul_flops()
    environment = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
    }
    append_line(
        args.out,
        {
            "benchmark": "gpu_throughput",
            "environment": environment,
            "measured_bf16_matmul_tflops": round(peak / 1e12, 1),
        },
    )
    cases = [(name, backend, False) for name in args.models.split(",") for backend in args.backends.split(",")]
    for pair in filter(None, args.compiled.split(",")):
        name, backend = pair.split(":")
        cases.append((name, backend, True))
    rows = []
    for name, backend, compiled in cases:
        rows.append(run_case(name, backend, args.warmup, args.steps, peak, compiled=compiled))
        append_line(args.out, rows[-1])
    append_line(args.out, {"summary": summarize(rows)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
