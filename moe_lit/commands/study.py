"""``moe-lit study ACTION SPEC``: every study kind through the one engine (moe_lit.studies).

* ``run SPEC [--parallel N] [--out DIR] [--data DIR] [--retry-failed] [--dry-run]`` runs every
  unfinished point (parents first), then writes the report;
* ``report SPEC | --out DIR`` rebuilds runs.csv, summary.md and the plots from the records (also
  while a study runs); refuses to replace a report built from more finished points unless ``--force``;
* ``list SPEC`` prints the points with their parameters, FLOPs and status (= ``run --dry-run``).

``run`` and ``report`` take ``--readme README.md`` to fill the study's ``<!-- study:NAME -->`` block.
"""

from __future__ import annotations

import argparse
import json
import shlex
from collections.abc import Callable
from pathlib import Path

from moe_lit.errors import MoeLitError

RESULTS_ROOT = Path("results")


def _out_dir(args: argparse.Namespace, study) -> Path:
    return Path(args.out) if args.out else RESULTS_ROOT / study.name


def _load(args: argparse.Namespace):
    from moe_lit.studies.study import load_study

    return load_study(args.spec, getattr(args, "data", None))


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", type=Path, help="study YAML (configs/studies/<name>.yaml)")
    parser.add_argument("--out", type=Path, help="results directory (default results/<study name>)")
    parser.add_argument("--data", help="prepared data directory (default: the study's run.data.data_dir)")


def _add_report_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--readme", type=Path, help="also fill the block <!-- study:NAME --> ... <!-- /study:NAME --> of this file"
    )
    parser.add_argument(
        "--force", action="store_true", help="replace a report built from more finished points than are here"
    )


def _configure_run(parser: argparse.ArgumentParser) -> None:
    _add_common(parser)
    parser.add_argument(
        "--parallel", type=int, help="points trained at the same time, local processes (default: executor.parallel, 1)"
    )
    parser.add_argument("--retry-failed", action="store_true", help="run failed points again (default: skip them)")
    parser.add_argument(
        "--only", action="append", metavar="PATTERN", help="run only the points whose names match (fnmatch; repeatable)"
    )
    parser.add_argument("--dry-run", action="store_true", help="list the points with their status and exit")
    _add_report_flags(parser)


def _run_run(args: argparse.Namespace) -> int:
    from moe_lit.studies.report import write_report
    from moe_lit.studies.study import run_study

    study = _load(args)
    out_dir = _out_dir(args, study)
    if args.dry_run:
        print(_points_table(study, out_dir))
        return 0
    options = {"parallel": args.parallel, "retry_failed": args.retry_failed, "only": args.only}
    run_study(study, out_dir, **options, command=_recorded_command(args, out_dir, keep=bool(args.only)))
    check_records(out_dir)
    _print_report(write_report(out_dir, readme=args.readme, force=args.force))
    return 0


def _start_label(start) -> str:
    if start is None:
        return ""
    return start.path if start.path is not None else f"{start.parent}@{start.step or 'final'}"


def _points_table(study, out_dir: Path) -> str:
    from moe_lit.accounting import markdown_table, training_flops_per_token
    from moe_lit.studies.identity import point_record, point_status

    rows, flops = [], 0
    for point in study.points:
        info = point_record(point)
        resumed = point.start is not None and point.start.mode == "resume"
        steps = point.run.steps - ((point.start.step or 0) if resumed else 0)
        flops += training_flops_per_token(point.model) * steps * point.run.data.tokens_per_step
        rows.append(
            {
                "point": point.name,
                "hash": point.hash,
                "from": _start_label(point.start),
                "E": info["num_experts"],
                "k": info["top_k"],
                "total": info["total_params"],
                "active": info["active_params"],
                "fwd FLOPs/tok": info["flops_per_token"],
                "steps": steps,
                "status": point_status(out_dir, point),
            }
        )
    return f"{markdown_table(rows)}\n\n{len(rows)} points, {flops:.3g} training FLOPs in all -> {out_dir}"


def _configure_list(parser: argparse.ArgumentParser) -> None:
    _add_common(parser)


def _run_list(args: argparse.Namespace) -> int:
    study = _load(args)
    print(_points_table(study, _out_dir(args, study)))
    return 0


def _configure_report(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", type=Path, nargs="?", help="study YAML (to find results/<study name>)")
    parser.add_argument("--out", type=Path, help="results directory (default results/<study name>)")
    _add_report_flags(parser)


def _run_report(args: argparse.Namespace) -> int:
    from moe_lit.studies.report import write_report

    if args.spec is None and args.out is None:
        raise MoeLitError("study report: give the study YAML or --out DIR")
    if args.spec is not None:  # the plan follows the study file (its points may have new hashes)
        from moe_lit.studies.study import write_plan

        study = _load(args)
        out_dir = _out_dir(args, study)
        write_plan(study, out_dir, _recorded_command(args, out_dir, keep=True))
    else:
        out_dir = Path(args.out)
    check_records(out_dir)
    _print_report(write_report(out_dir, readme=args.readme, force=args.force))
    return 0


def check_records(out_dir: Path) -> None:
    """A point's record that is there but unreadable (cut short, edited by hand) is one line naming
    it, instead of a report that counts the point as missing."""
    from moe_lit.studies.identity import RUNS_DIR

    for path in sorted((Path(out_dir) / RUNS_DIR).glob("*.json")):
        try:
            json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise MoeLitError(
                f"{path}: not a readable study record ({exc}); restore it, or delete it and rerun "
                "moe-lit study run to train that point again"
            ) from exc


def _print_report(paths: dict[str, Path]) -> None:
    print(paths["summary"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))


def _recorded_command(args: argparse.Namespace, out_dir: Path, *, keep: bool) -> str:
    """The command study.json keeps. ``keep``: the one already there, if any (a report, or a slice
    run with ``--only``: slices share the results directory of the run that the command names)."""
    from moe_lit.studies.identity import STUDY_FILE, read_record

    previous = (read_record(out_dir / STUDY_FILE) or {}).get("command") if keep else None
    return previous or _command_line(args)


def _command_line(args: argparse.Namespace) -> str:
    """The run command (kept in study.json, shown in summary.md)."""
    words = ["moe-lit", "study", "run", str(args.spec)]
    for flag, value in (
        ("--parallel", getattr(args, "parallel", None)),
        ("--out", args.out),
        ("--data", getattr(args, "data", None)),
    ):
        if value is not None:
            words += [flag, str(value)]
    return " ".join(shlex.quote(w) for w in words)


Action = tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int], str]
ACTIONS: dict[str, Action] = {
    "run": (_configure_run, _run_run, "run every unfinished point of a study, then write the report"),
    "report": (_configure_report, _run_report, "rebuild runs.csv, summary.md and plots from the records"),
    "list": (_configure_list, _run_list, "list the points of a study: params, FLOPs, status"),
}


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, (configure_action, _, help_text) in ACTIONS.items():
        configure_action(sub.add_parser(name, help=help_text, description=help_text))


def run(args: argparse.Namespace) -> int:
    return ACTIONS[args.action][1](args)
