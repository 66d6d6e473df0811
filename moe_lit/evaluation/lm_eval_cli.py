"""lm-eval's own command line with the ``moe_lit`` model registered.

``moe-lit lm-eval ARGS...`` and ``python -m moe_lit.evaluation.lm_eval_cli ARGS...`` take exactly
``lm_eval``'s arguments::

    moe-lit lm-eval run --model moe_lit --model_args checkpoint=CKPT --tasks xnli_de --limit 20 --batch_size 8

Without ``--device`` the model runs on ``auto`` (CUDA when available, else CPU) instead of lm-eval's
``cuda:0`` default, as every other ``moe-lit`` command. A task whose dataset cannot be reached
(offline) is one line naming ``moe-lit eval --task-data``, exit 2, not lm-eval's traceback.

NOTE: lm-eval 0.4.13 finds models only in its registry, which third-party packages fill on import
(``lm_eval.api.registry`` has no entry-point discovery), so a plain ``lm_eval --model moe_lit`` cannot
see us. This wrapper imports our registration, then runs lm-eval's own ``cli_evaluate`` unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from moe_lit.errors import MoeLitError


def main(argv: Sequence[str] | None = None) -> int:
    """Run lm-eval's CLI on ``argv`` (default: ``sys.argv[1:]``); returns its exit status."""
    from lm_eval.__main__ import cli_evaluate

    from moe_lit.evaluation.harness import reachable_datasets  # importing it registers the model "moe_lit"

    args = list(sys.argv[1:] if argv is None else argv)
    if _runs_evaluation(args) and not any(a == "--device" or a.startswith("--device=") for a in args):
        args += ["--device", "auto"]
    # NOTE: cli_evaluate reads sys.argv itself (and edits it to insert its default `run`).
    saved, sys.argv = sys.argv, ["lm-eval", *args]
    try:
        with reachable_datasets():
            cli_evaluate()
    except SystemExit as exc:  # --help, and argparse errors (status 2)
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv = saved
    return 0


def _runs_evaluation(args: list[str]) -> bool:
    """True for ``run ...`` and for lm-eval's legacy form (options without a subcommand)."""
    return bool(args) and (args[0] == "run" or (args[0].startswith("-") and args[0] not in ("-h", "--help")))


if __name__ == "__main__":
    try:
        sys.exit(main())
    except MoeLitError as exc:  # as moe_lit.console_script prints it (a command module never imports the CLI above it)
        print(f"python -m moe_lit.evaluation.lm_eval_cli: error: {exc}", file=sys.stderr)
        sys.exit(2)
