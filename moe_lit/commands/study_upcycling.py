"""``moe-lit study upcycling [SPEC]``: the expert-upcycling compute study (see moe_lit.studies.upcycling).

Registered as the ``upcycling`` action of ``moe-lit study``. Finished arms are skipped, so an
interrupted study resumes; ``--report-only`` rewrites the report from the finished arms.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from moe_lit.errors import MoeLitError

DEFAULT_SPEC = Path("configs/studies/upcycling.yaml")
HELP = "expert upcycling E->mE vs fixed E and fixed mE: loss vs FLOPs, gap closure, compute saving"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", type=Path, nargs="?", default=DEFAULT_SPEC, help=f"study YAML (default {DEFAULT_SPEC})")
    parser.add_argument("--out", type=Path, help="results directory (default results/<name>)")
    parser.add_argument("--data", type=Path, help="prepared data directory (default: the spec's, else data_cache/default)")
    parser.add_argument("--report-only", action="store_true", help="rewrite the report from the finished arms")


def run(args: argparse.Namespace) -> int:
    from moe_lit.studies.upcycling import UpcyclingStudySpec, run_study, write_report

    if not args.spec.is_file():
        raise MoeLitError(f"study upcycling: no such spec file {args.spec}")
    spec = UpcyclingStudySpec.from_yaml(args.spec)
    out_dir = args.out or Path("results") / spec.name
    command = " ".join(shlex.quote(w) for w in ["moe-lit", "study", "upcycling", str(args.spec)])
    if args.report_only:
        paths = write_report(spec, out_dir, args.data, command)
    else:
        paths = run_study(spec, out_dir, args.data, command)
    print(paths["summary"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
