"""``moe-lit accounting``: parameter / FLOP table of one or more model configs, optionally matched."""

from __future__ import annotations

import argparse
from pathlib import Path

from moe_lit.accounting import accounting_rows, markdown_table, matched_moe_config
from moe_lit.config import ModelConfig
from moe_lit.errors import MoeLitError


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", nargs="+", required=True, type=Path, help="model YAML file(s)")
    parser.add_argument(
        "--match", choices=["active", "total"], help="also build an MoE matched to each (dense) config"
    )
    parser.add_argument("--num-experts", type=int, default=8, help="experts of the matched MoE")
    parser.add_argument("--top-k", type=int, default=2, help="top-k of the matched MoE")
    parser.add_argument("--shared-fraction", type=float, default=0.0, help="d_ff fraction for a shared expert")


def run(args: argparse.Namespace) -> int:
    configs: dict[str, ModelConfig] = {}
    for path in args.config:
        if not path.is_file():
            raise MoeLitError(f"--config: no such file {path}")
        cfg = ModelConfig.from_yaml(path)
        configs[path.stem] = cfg
        if args.match:
            matched = matched_moe_config(
                cfg.replace(moe=None), args.num_experts, args.top_k, args.match, args.shared_fraction
            )
            configs[f"{path.stem}->moe[{args.match}]"] = matched
    print(markdown_table(accounting_rows(configs)))
    return 0
