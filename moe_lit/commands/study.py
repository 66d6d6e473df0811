"""``moe-lit study ACTION``: declarative sweeps.

* ``moe-lit study run configs/studies/<name>.yaml [--parallel N] [--out DIR] [--data DIR] [--dry-run]``
  runs every unfinished point, then writes the report;
* ``moe-lit study report configs/studies/<name>.yaml | --out DIR`` rebuilds runs.csv, summary.md
  and the plots from the records (also while a sweep runs).

Both take ``--readme README.md`` to fill the study's ``<!-- study:NAME -->`` block of a README.

Actions live in ``ACTIONS`` (name -> (configure, run, help)); a new study kind adds one entry.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Callable

from moe_lit.commands import study_upcycling
from moe_lit.errors import MoeLitError

RESULTS_ROOT = Path("results")


def _load_spec(path: Path):
    from moe_lit.studies.spec import StudySpec

    return StudySpec.from_yaml(path)


def _out_dir(args: argparse.Namespace, spec) -> Path:
    return Path(args.out) if args.out else RESULTS_ROOT / spec.name


def _configure_run(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", type=Path, help="study YAML (configs/studies/<name>.yaml)")
    parser.add_argument("--parallel", type=int, default=1, help="points trained at the same time (processes)")
    parser.add_argument("--out", type=Path, help="results directory (default results/<study name>)")
    parser.add_argument(
        "--data", help="prepared data directory (default: the study's data_dir, else data_cache/default)"
    )
    parser.add_argument("--retry-failed", action="store_true", help="run failed points again (default: skip them)")
    parser.add_argument("--dry-run", action="store_true", help="list the points with their status and exit")
    _add_readme(parser)


def _add_readme(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--readme", type=Path, help="also fill the block <!-- study:NAME --> ... <!-- /study:NAME --> of this file"
    )


def _run_run(args: argparse.Namespace) -> int:
    from moe_lit.studies.report import write_report
    from moe_lit.studies.runner import run_study

    spec = _load_spec(args.spec)
    out_dir = _out_dir(args, spec)
    if args.dry_run:
        print(_points_table(spec, out_dir))
        return 0
    run_study(
        spec,
        out_dir,
        data_dir=args.data,
        parallel=args.parallel,
        retry_failed=args.retry_failed,
        command=_command_line(args),
    )
    _print_report(write_report(out_dir, readme=args.readme))
    return 0


def _points_table(spec, out_dir: Path) -> str:
    from moe_lit.accounting import markdown_table
    from moe_lit.studies.runner import point_record, point_status
    from moe_lit.studies.spec import expand

    rows = []
    for point in expand(spec):
        info = point_record(point)
        rows.append(
            {
                "point": point.name,
                "hash": point.hash,
                "groups": ",".join(point.groups),
                "E": point.num_experts,
                "k": point.top_k,
                "expert F": round(point.expert_size, 1),
                "total": info["total_params"],
                "active": info["active_params"],
                "fwd FLOPs/tok": info["flops_per_token"],
                "status": point_status(out_dir, point),
            }
        )
    tokens = spec.training.max_tokens * len(rows)
    return f"{markdown_table(rows)}\n\n{len(rows)} points, {tokens:,} training tokens in all -> {out_dir}"


def _configure_report(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", type=Path, nargs="?", help="study YAML (to find results/<study name>)")
    parser.add_argument("--out", type=Path, help="results directory (default results/<study name>)")
    _add_readme(parser)


def _run_report(args: argparse.Namespace) -> int:
    from moe_lit.studies.report import write_report

    if args.spec is None and args.out is None:
        raise MoeLitError("study report: give the study YAML or --out DIR")
    out_dir = Path(args.out) if args.out else _out_dir(args, _load_spec(args.spec))
    _print_report(write_report(out_dir, readme=args.readme))
    return 0


def _print_report(paths: dict[str, Path]) -> None:
    print(paths["summary"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))


def _command_line(args: argparse.Namespace) -> str:
    """The run command (kept in study.json, shown in summary.md)."""
    words = ["moe-lit", "study", "run", str(args.spec)]
    for flag, value in (
        ("--parallel", args.parallel if args.parallel != 1 else None),
        ("--out", args.out),
        ("--data", args.data),
    ):
        if value is not None:
            words += [flag, str(value)]
    return " ".join(shlex.quote(w) for w in words)


Action = tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int], str]
ACTIONS: dict[str, Action] = {
    "run": (_configure_run, _run_run, "run every unfinished point of a sweep, then write the report"),
    "report": (_configure_report, _run_report, "rebuild runs.csv, summary.md and plots from the records"),
    "upcycling": (study_upcycling.configure, study_upcycling.run, study_upcycling.HELP),
}


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, (configure_action, _, help_text) in ACTIONS.items():
        configure_action(sub.add_parser(name, help=help_text, description=help_text))


def run(args: argparse.Namespace) -> int:
    return ACTIONS[args.action][1](args)
