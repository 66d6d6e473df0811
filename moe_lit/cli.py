"""The ``moe-lit`` console script.

``moe-lit fit|validate|test ...`` goes to LightningCLI (see ``moe_lit.lit.cli``); every other
subcommand is registered in ``COMMANDS`` as ``name -> (module, help)``. A command module exposes
``configure(parser)`` and ``run(args) -> int`` (one of ``PASSTHROUGH_COMMANDS``, another tool's
CLI, exposes ``main(argv) -> int`` instead) and is imported only when it runs, so optional
dependencies of one command never slow down or break another.

Errors the user can fix (:class:`~moe_lit.errors.MoeLitError`, including every config error) are
printed as one line on stderr with exit status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

from typing_extensions import override

from moe_lit.errors import MoeLitError
from moe_lit.resources import packaged_config

# NOTE: no `predict`: the module has no predict step, and `moe-lit generate` is the way to run a model on text.
LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test")
PASSTHROUGH_COMMANDS = ("lm-eval",)
"""Commands whose module's ``main(argv)`` parses the arguments itself (another tool's CLI)."""

COMMANDS: dict[str, tuple[str, str]] = {
    "accounting": ("moe_lit.commands.accounting", "total/active parameters and FLOPs of model configs"),
    "data": ("moe_lit.commands.data", "prepare the multilingual corpus, tokenizer and litdata token chunks"),
    "demo": ("moe_lit.commands.demo", "the main job (make demo) on the bundled default data"),
    "convert": (
        "moe_lit.commands.convert",
        "model transforms: import-hf, upcycle, partition (dense->MoE), expand (E->mE), prune, moe-to-dense",
    ),
    "distill": ("moe_lit.commands.distill", "train a student on a frozen teacher's logits (MoE -> dense, recovery)"),
    "export": ("moe_lit.commands.export", "a checkpoint as a transformers model dir (llama, mixtral, olmoe, qwen)"),
    "study": (
        "moe_lit.commands.study",
        "studies of every kind on one engine: run (resumable, workers, SLURM), report, list",
    ),
    "eval": ("moe_lit.commands.eval", "lm-eval tasks (local multilingual suite, built-in tasks) on a checkpoint"),
    "analyze": ("moe_lit.commands.analyze", "analyze routing: per-language expert usage and similarity"),
    "lm-eval": (
        "moe_lit.evaluation.lm_eval_cli",
        "lm-eval's own CLI (same arguments) with the model moe_lit registered",
    ),
    "generate": ("moe_lit.commands.generate", "continue prompts with a checkpoint (KV cache, greedy or sampled)"),
}


DESCRIPTION = "Pretrain, upcycle, compress, evaluate and export MoE language models (moe-lit COMMAND --help)."


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, unless it has none (None, False) or states it."""

    @override
    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if default is None or default is False or default is argparse.SUPPRESS or default == [] or "default" in text:
            return text
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with :class:`HelpFormatter`; subcommand parsers (``add_subparsers``) inherit it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def package_version() -> str:
    """The installed distribution's version (pyproject.toml's ``version``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("moe_lit")
    except PackageNotFoundError:
        return "unknown (not installed; pip install -e .)"


def _build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="moe-lit", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"moe-lit {package_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in LIGHTNING_SUBCOMMANDS:
        sub.add_parser(name, help=f"LightningCLI {name} (moe-lit {name} --help)", add_help=False)
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _build_parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"moe-lit {package_version()}")
        return 0
    command, rest = argv[0], [packaged_config(arg) for arg in argv[1:]]
    try:
        if command in LIGHTNING_SUBCOMMANDS:
            from moe_lit.lit.cli import run_lightning_cli

            return run_lightning_cli([command, *rest])
        if command not in COMMANDS:
            allowed = ", ".join([*LIGHTNING_SUBCOMMANDS, *COMMANDS])
            raise MoeLitError(f"unknown command {command!r}; allowed: {allowed}")
        module = importlib.import_module(COMMANDS[command][0])
        if command in PASSTHROUGH_COMMANDS:
            return module.main(rest)
        sub = ArgumentParser(prog=f"moe-lit {command}", description=COMMANDS[command][1])
        module.configure(sub)
        return int(module.run(sub.parse_args(rest)) or 0)
    except MoeLitError as exc:
        print(f"moe-lit {command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
