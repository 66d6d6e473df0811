"""Markdown tables of saved benchmark results (docs/performance.md).

    .venv/bin/python -m benchmarks.table [RESULT.json ...]

Without arguments, the newest ``train_step``, ``moe_layer`` and ``data_loader`` results under
``benchmarks/results/`` are shown.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import RESULTS_DIR
from moe_lit.accounting import markdown_table


def _conditions(result: dict) -> str:
    env, setup = result["environment"], result.get("setup", {})
    clock = setup.get("clock", "wall")
    olmoe = (
        f", OLMoE experts: {setup['olmoe_experts_implementation']}" if "olmoe_experts_implementation" in setup else ""
    )
    if "ours_experts_strategy" in setup:
        olmoe += f", our experts: {setup['ours_experts_strategy']}, loss chunk {setup['ours_loss_chunk_tokens']}"
    return (
        f"{env['date']}, {env['threads']} thread(s), {clock} clock, OMP_WAIT_POLICY={env.get('omp_wait_policy', '?')}, "
        f"load avg {env['load_avg_1m']:.1f} on {env['cpu_count']} cores, {setup.get('rounds', '?')} interleaved rounds"
        f"{olmoe}"
    )


BF16 = "_bf16"
"""The suffix of a model or shape measured under CPU bf16 autocast (``--precision both``)."""


def shape_ratios(result: dict) -> dict[str, dict]:
    """Each measured shape's ratios (``E16k2F256``, ``E16k2F256_bf16``); not the fp32 -> bf16 speedups."""
    return {tag: ratio for tag, ratio in result["ratios"].items() if tag != "bf16_speedup"}


def train_step_table(result: dict) -> str:
    models, rows = result["models"], []
    for tag, ratio in shape_ratios(result).items():
        shape, suffix = tag.removesuffix(BF16), BF16 if tag.endswith(BF16) else ""
        dense = next(
            name
            for name in models
            if name.startswith("ours_dense") and name.endswith(BF16) == bool(suffix) and "_compiled" not in name
        )
        rows.append(
            {
                "shape": tag,
                "ours tok/s": round(models[f"ours_moe_{tag}"]["tokens_per_s"]),
                "OLMoE tok/s": round(models[f"olmoe_{tag}"]["tokens_per_s"]),
                "dense tok/s": round(models[dense]["tokens_per_s"]),
                "ours / OLMoE speed (goal >= 1.5)": f"{ratio['speedup_vs_olmoe']:.2f}",
                "our dense / OLMoE speed": f"{ratio['dense_speedup_vs_olmoe']:.2f}",
                "MoE / dense time (goal)": f"{ratio['moe_over_dense_time']:.2f} "
                f"(<= {result['goals']['moe_over_dense_time'][shape]})",
            }
        )
    return markdown_table(rows)


def bf16_speedup_table(result: dict) -> str:
    """Each model's fp32 step time over its bf16-autocast twin's (``--precision both``)."""
    speedups = result["ratios"]["bf16_speedup"]
    goal = result["goals"]["bf16_speedup"]
    rows = [
        {"model": name, f"fp32 / bf16 time (goal for ours_moe >= {goal})": f"{speedup:.2f}"}
        for name, speedup in speedups.items()
        if not name.startswith("goal_met_")
    ]
    return markdown_table(rows)


def train_step_floor_table(result: dict) -> str:
    """Every model's fraction of the FLOP floor, and with ``--compile`` its compiled twin's."""
    rows = []
    for tag, ratio in shape_ratios(result).items():
        suffix = BF16 if tag.endswith(BF16) else ""
        fractions, speedups = ratio["floor_fraction"], ratio.get("compiled_speedup", {})
        for name, fraction in fractions.items():
            if "_compiled" in name:
                continue
            eager = name.removesuffix(suffix) if suffix else name
            twin = f"{eager}_compiled{suffix}"
            compiled = fractions.get(twin)
            rows.append(
                {
                    "shape": tag,
                    "model": name,
                    "tok/s": round(result["models"][name]["tokens_per_s"]),
                    "floor fraction": f"{fraction:.2f}",
                    "compiled tok/s": round(result["models"][twin]["tokens_per_s"]) if compiled else "",
                    "compiled floor fraction": f"{compiled:.2f}" if compiled else "",
                    "compiled speedup": f"{speedups[eager]:.3f}" if eager in speedups else "",
                }
            )
    return markdown_table(rows)


def profile_step_table(result: dict) -> str:
    """Per model: step time, floor fraction and each category's ms per step (share of the step)."""
    rows = []
    for name, row in result["models"].items():
        cells = {
            "model": name,
            "step ms": f"{row['step_s'] * 1e3:.0f}",
            "floor fraction": f"{row['floor_fraction']:.2f}",
        }
        for cat, seconds in row["seconds"].items():
            cells[cat] = f"{seconds * 1e3:.0f} ({row['share'][cat]:.0%})"
        cells["GEMM rate / peak"] = f"{row['gemm_rate_fraction_of_peak']:.2f}"
        rows.append(cells)
    return markdown_table(rows)


def moe_layer_table(result: dict) -> str:
    rows = []
    for tag, row in result["shapes"].items():
        fraction = row["flops_fraction_of_matmul"]
        for case, tokens_per_s in row["tokens_per_s"].items():
            geometry = case.removeprefix("moe_")
            rows.append(
                {
                    "shape": tag,
                    "case": f"MoE, {geometry}" + (" (auto)" if geometry == row["auto_geometry"] else "")
                    if case.startswith("moe_")
                    else "dense SwiGLU",
                    "tok/s": round(tokens_per_s),
                    "time / dense": f"{row['moe_over_dense_time'][geometry]:.2f}" if case.startswith("moe_") else "1",
                    "FLOP/s / matmul FLOP/s": f"{fraction[case]:.2f}",
                }
            )
    return markdown_table(rows)


def data_loader_table(result: dict) -> str:
    rows = [
        {
            "consumer": name,
            "loader tok/s": round(result["loader_tokens_per_s"]),
            "step tok/s": round(row["tokens_per_s"]),
            "loader / step (goal >= 20)": f"{row['loader_over_step_rate']:.0f}",
        }
        for name, row in result["train_steps"].items()
    ]
    return markdown_table(rows)


def head_loss_table(result: dict) -> str:
    rows = [
        {"case": name, "ms": f"{ms:.1f}", "time / plain": f"{result['time_over_plain'][name]:.3f}"}
        for name, ms in result["median_ms"].items()
    ]
    return markdown_table(rows)


def train_step_tables(result: dict) -> str:
    tables = train_step_table(result)
    if any("floor_fraction" in ratio for ratio in shape_ratios(result).values()):
        tables += "\n\n" + train_step_floor_table(result)
    if "bf16_speedup" in result["ratios"]:
        tables += "\n\n" + bf16_speedup_table(result)
    return tables


TABLES = {
    "train_step": train_step_tables,
    "profile_step": profile_step_table,
    "moe_layer": moe_layer_table,
    "head_loss": head_loss_table,
    "data_loader": data_loader_table,
}


def newest(name: str) -> Path | None:
    found = sorted(RESULTS_DIR.glob(f"{name}-*.json"))
    return found[-1] if found else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="*", type=Path)
    args = parser.parse_args()
    paths = args.results or [path for path in map(newest, TABLES) if path is not None]
    for path in paths:
        result = json.loads(path.read_text())
        print(f"**{result['benchmark']}** ({path.name}: {_conditions(result)})\n")
        print(TABLES[result["benchmark"]](result) + "\n")


if __name__ == "__main__":
    main()
