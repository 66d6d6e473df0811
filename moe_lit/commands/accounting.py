"""``moe-lit accounting``: parameter / FLOP table of one or more models, optionally matched.

A ``--config`` is anything :func:`moe_lit.convert.model_input.load_any_config` resolves: a model YAML, an
experiment YAML, a Lightning ``.ckpt`` or a model directory (one of ours, ``moe-lit convert``
output, or a transformers one: ``moe-lit export`` output or a downloaded checkpoint of a supported
family). FLOPs per token depend on the sequence length (attention); each row states the one it
assumes: ``--seq-len``, else the input's own (an experiment's ``data.seq_len``, a checkpoint's).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from moe_lit.accounting import accounting_rows, markdown_table, matched_moe_config
from moe_lit.config import ModelConfig
from moe_lit.convert.model_input import load_any_config


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        nargs="+",
        required=True,
        type=Path,
        help="model YAML, experiment YAML, .ckpt or model dir (ours or transformers'), one or more",
    )
    parser.add_argument("--seq-len", type=int, help="sequence length of the FLOPs (default: each input's own)")
    parser.add_argument("--match", choices=["active", "total"], help="also build an MoE matched to each (dense) config")
    parser.add_argument("--num-experts", type=int, default=8, help="experts of the matched MoE")
    parser.add_argument("--top-k", type=int, default=2, help="top-k of the matched MoE")
    parser.add_argument("--shared-fraction", type=float, default=0.0, help="d_ff fraction for a shared expert")


def run(args: argparse.Namespace) -> int:
    configs: dict[str, ModelConfig] = {}
    for label, path in zip(row_labels(args.config), args.config, strict=True):
        cfg = load_any_config(path)
        cfg = cfg.replace(seq_len=args.seq_len) if args.seq_len else cfg
        configs[label] = cfg
        if args.match:
            matched = matched_moe_config(
                cfg.replace(moe=None), args.num_experts, args.top_k, args.match, args.shared_fraction
            )
            configs[f"{label}->moe[{args.match}]"] = matched
    rows = [
        {"name": row["name"], "seq_len": cfg.seq_len, **{k: v for k, v in row.items() if k != "name"}}
        for row, cfg in zip(accounting_rows(configs), configs.values(), strict=True)
    ]
    print(markdown_table(rows))
    print("\nfwd_flops/token: forward FLOPs of one token in a sequence of seq_len tokens (attention grows with it).")
    return 0


def row_labels(paths: list[Path]) -> list[str]:
    """A distinct label per input: its name (a file's stem), with as many parent folders as it takes
    to tell it apart from other inputs of the same name (``a/last``, ``b/last``)."""
    parts = [(Path(p).resolve().with_suffix("") if Path(p).is_file() else Path(p).resolve()).parts for p in paths]
    return ["/".join(p[-_depth(p, [q for q in parts if q != p]) :]) for p in parts]


def _depth(path: tuple[str, ...], others: list[tuple[str, ...]]) -> int:
    """The fewest trailing parts of ``path`` that no other path ends with."""
    depth = 1
    while depth < len(path) and any(other[-depth:] == path[-depth:] for other in others):
        depth += 1
    return depth
