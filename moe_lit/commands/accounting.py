"""``moe-lit accounting``: parameter / FLOP table of one or more model configs, optionally matched.

A ``--config`` is a model YAML file or a model directory: one of ours (``moe-lit convert`` output)
or a transformers one (``moe-lit export`` output, or a downloaded checkpoint of a supported family).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moe_lit.accounting import accounting_rows, markdown_table, matched_moe_config
from moe_lit.checkpoint import load_config
from moe_lit.config import ModelConfig
from moe_lit.errors import MoeLitError


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        nargs="+",
        required=True,
        type=Path,
        help="model YAML file(s) or model dir(s) (ours or transformers')",
    )
    parser.add_argument("--match", choices=["active", "total"], help="also build an MoE matched to each (dense) config")
    parser.add_argument("--num-experts", type=int, default=8, help="experts of the matched MoE")
    parser.add_argument("--top-k", type=int, default=2, help="top-k of the matched MoE")
    parser.add_argument("--shared-fraction", type=float, default=0.0, help="d_ff fraction for a shared expert")


def run(args: argparse.Namespace) -> int:
    configs: dict[str, ModelConfig] = {}
    for path in args.config:
        cfg = _read_config(path)
        configs[path.stem] = cfg
        if args.match:
            matched = matched_moe_config(
                cfg.replace(moe=None), args.num_experts, args.top_k, args.match, args.shared_fraction
            )
            configs[f"{path.stem}->moe[{args.match}]"] = matched
    print(markdown_table(accounting_rows(configs)))
    return 0


def _read_config(path: Path) -> ModelConfig:
    """The ModelConfig of a YAML file, of our model directory or of a transformers model directory."""
    if path.is_file():
        return ModelConfig.from_yaml(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise MoeLitError(f"--config: {path} is neither a YAML file nor a model directory with config.json")
    if "model_type" in json.loads(config_file.read_text()):
        from moe_lit.convert.hf import hf_config_dir_to_ours

        return hf_config_dir_to_ours(path)
    return load_config(path)
