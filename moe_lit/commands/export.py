"""``moe-lit export``: a checkpoint as a transformers model directory of a registered family (``--format``).

The directory loads offline with ``AutoModelForCausalLM.from_pretrained(DIR)`` and
``AutoTokenizer.from_pretrained(DIR)``; a checkpoint with no stored tokenizer (and no
``--tokenizer``) exports the model alone, with a one-line note. A feature the format lacks is
refused in one line naming the formats that have it (see ``moe_lit.convert.hf``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from moe_lit.convert.hf.export import DTYPES, export_hf
from moe_lit.convert.hf.families import FAMILIES
from moe_lit.convert.model_input import load_any_model
from moe_lit.data.tokenizer import find_tokenizer
from moe_lit.io import check_output


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, type=Path, help="model: .ckpt or exported dir")
    parser.add_argument("--format", required=True, choices=FAMILIES.names(), help="transformers model family to write")
    parser.add_argument(
        "--out", required=True, type=Path, help="directory to write (absent or empty, unless --force; never the input)"
    )
    parser.add_argument("--tokenizer", type=Path, help="tokenizer.json (default: the one stored with the checkpoint)")
    parser.add_argument("--eos-token", help="end-of-text token (default: the first known one, e.g. <|endoftext|>)")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES), help="dtype of the written weights")
    parser.add_argument("--max-shard-size", default="5GB", help="split model.safetensors into shards past this size")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out")


def run(args: argparse.Namespace) -> int:
    tokenizer = args.tokenizer or find_tokenizer(args.checkpoint)
    check_output(args.out, {"--checkpoint": args.checkpoint, "--tokenizer": tokenizer}, args.force)
    model = load_any_model(args.checkpoint)
    export_hf(
        model,
        args.format,
        args.out,
        tokenizer,
        eos_token=args.eos_token,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        force=args.force,
    )
    files = sorted(path.name for path in args.out.iterdir())
    print(f"wrote {args.out} ({args.format}, {args.dtype}): {', '.join(files)}")
    if tokenizer is None:
        print(
            f"note: {args.checkpoint} has no stored tokenizer; {args.out} holds the model alone (--tokenizer adds one)"
        )
    return 0
