"""``moe-lit data prepare``: build the prepared data directory the datamodule streams from."""

from __future__ import annotations

import argparse
from pathlib import Path

from moe_lit.data.debian import DEFAULT_LANGUAGES
from moe_lit.data.layout import default_cache_dir, default_data_dir
from moe_lit.data.prepare import PrepareConfig, prepare
from moe_lit.data.tokenizer import DEFAULT_VOCAB_SIZE


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    prep = sub.add_parser("prepare", help="corpus -> tokenizer -> litdata token chunks per language and split")
    prep.add_argument(
        "--source",
        default=PrepareConfig.source,
        help="'debian' (LibreOffice help packages via apt-get download), a folder DIR/<lang>/*.txt "
        "(paragraphs separated by blank lines; paragraph N of DIR/<lang>/F.txt is taken as the translation "
        "of paragraph N of every other language's F.txt) or hf:NAME (a Hugging Face dataset, needs the hub)",
    )
    prep.add_argument(
        "--languages",
        nargs="+",
        help=f"language codes (default: {' '.join(DEFAULT_LANGUAGES)} for debian, every folder for a local source)",
    )
    prep.add_argument("--out", type=Path, help=f"output directory (default: $MOE_LIT_DATA or {default_data_dir()})")
    prep.add_argument("--vocab-size", type=int, help=f"BPE vocabulary size (default {DEFAULT_VOCAB_SIZE})")
    prep.add_argument("--tokenizer", type=Path, help="reuse this tokenizer.json instead of training one")
    prep.add_argument("--max-paragraphs", type=int, help="at most N paragraphs per language (same ids everywhere)")
    prep.add_argument(
        "--val-fraction",
        type=float,
        default=PrepareConfig.val_fraction,
        help="fraction of paragraph ids for validation",
    )
    prep.add_argument(
        "--test-fraction", type=float, default=PrepareConfig.test_fraction, help="fraction of paragraph ids for test"
    )
    prep.add_argument(
        "--cache-dir", type=Path, help=f"package cache (default: $MOE_LIT_CACHE or {default_cache_dir()})"
    )
    prep.add_argument("--force", action="store_true", help="rebuild even when --out holds the same preparation")
    prep.add_argument("--quiet", action="store_true", help="no progress bars or messages")


def run(args: argparse.Namespace) -> int:
    prepare(
        PrepareConfig(
            source=args.source,
            languages=args.languages,
            out=args.out,
            vocab_size=args.vocab_size,
            tokenizer=args.tokenizer,
            max_paragraphs=args.max_paragraphs,
            val_fraction=args.val_fraction,
            test_fraction=args.test_fraction,
            cache_dir=args.cache_dir,
            force=args.force,
            progress=not args.quiet,
        )
    )
    return 0
