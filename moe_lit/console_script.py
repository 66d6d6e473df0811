"""The ``moe-lit`` console script.

``moe-lit fit|validate|test ...`` goes to LightningCLI (see ``moe_lit.lit.lightning_cli``); every other
subcommand is registered in ``COMMANDS`` as ``name -> (module, help)``. A command module exposes
``configure(parser)`` and ``run(args) -> int`` (one of ``PASSTHROUGH_COMMANDS``, another tool's
CLI, exposes ``main(argv) -> int`` instead) and is imported only when it runs, so optional
dependencies of one command never slow down or break another.

Errors the user can fix (:class:`~moe_lit.errors.MoeLitError`, including every config error) are
printed as one line on stderr with exit status 2, never as a traceback, prefixed by the full
subcommand (``moe-lit convert prune: error: ...``). No parser accepts an abbreviated option
(``allow_abbrev=False``): ``--train.max_step`` is an unknown key, never ``--train.max_steps``.
A command module with a ``SETTINGS_CHECK`` (``demo``, ``distill``: a run YAML's sections) also
takes ``--SECTION.FIELD VALUE`` words, as ``args.settings`` (:func:`split_settings`).
``moe-lit COMMAND [ACTION] --help`` starts with its line of ``EXAMPLES``.
"""

from __future__ import annotations

import argparse
import importlib
import re
import signal
import sys
from collections.abc import Callable, Sequence
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
    "data": ("moe_lit.commands.data", "the multilingual corpus, tokenizer and litdata token chunks"),
    "demo": ("moe_lit.commands.demo", "the main job (make demo) on the bundled default data"),
    "convert": (
        "moe_lit.commands.convert",
        "pure model transforms (transformers import, dense->MoE, E->mE, pruning, MoE->dense)",
    ),
    "distill": ("moe_lit.commands.distill", "train a student on a frozen teacher's logits (MoE -> dense, recovery)"),
    "export": ("moe_lit.commands.export", "a checkpoint as a transformers model dir of a supported family (--format)"),
    "study": (
        "moe_lit.commands.study",
        "studies of every kind on one engine (resumable, workers, SLURM), their reports and points",
    ),
    "eval": ("moe_lit.commands.eval", "lm-eval tasks (local multilingual suite, built-in tasks) on a checkpoint"),
    "analyze": (
        "moe_lit.commands.analyze",
        "per-language expert usage and similarity (routing), each token's experts per layer (text)",
    ),
    "lm-eval": (
        "moe_lit.evaluation.lm_eval_cli",
        "lm-eval's own CLI (same arguments) with the model moe_lit registered",
    ),
    "generate": ("moe_lit.commands.generate", "continue prompts with a checkpoint (KV cache, greedy or sampled)"),
}
EXAMPLES: dict[str, str] = {
    "fit": "moe-lit fit --config configs/experiments/tiny-moe.yaml --trainer.max_steps 50",
    "validate": "moe-lit validate --ckpt_path runs/tiny-moe/checkpoints/last.ckpt --data.data_dir data_cache/default",
    "test": "moe-lit test --ckpt_path runs/tiny-moe/checkpoints/last.ckpt --data.data_dir data_cache/default",
    "accounting": "moe-lit accounting --config configs/model/tiny-dense.yaml configs/model/tiny-moe.yaml",
    "data": "moe-lit data prepare --source my_corpus/ --vocab-size 4096 --out data_cache/mine",
    "demo": "moe-lit demo --seeds 3 --train.max_tokens 200000",
    "convert": "moe-lit convert upcycle --checkpoint runs/tiny-dense/checkpoints/last.ckpt --recipe copy "
    "--num-experts 8 --top-k 2 --out moe/",
    "convert import-hf": "moe-lit convert import-hf --model hf-llama/ --seq-len 512 --out imported/",
    "convert expand": "moe-lit convert expand --checkpoint moe/ --factor 2 --out moe16/",
    "convert partition": "moe-lit convert partition --checkpoint dense/ --method kmeans --experts 8 --top-k 4 "
    "--router centroid --out part/",
    "convert prune": "moe-lit convert prune --checkpoint moe/ --method maestro --fraction 0.5 --out pruned/",
    "convert moe-to-dense": "moe-lit convert moe-to-dense --checkpoint moe/ --score do_acp --keep 2 --out dense/",
    "distill": "moe-lit distill --teacher moe/ --student dense/ --train.max_tokens 262144 --out runs/distill/",
    "export": "moe-lit export --checkpoint runs/tiny-moe/checkpoints/last.ckpt --format mixtral --out hf/",
    "study": "moe-lit study run configs/studies/upcycling-e8-e32.yaml --parallel 2",
    "study report": "moe-lit study report configs/studies/upcycling-e8-e32.yaml",
    "study list": "moe-lit study list configs/studies/upcycling-e8-e32.yaml",
    "eval": "moe-lit eval --checkpoint runs/tiny-moe/checkpoints/last.ckpt --tasks moe_lit_suite --limit 50",
    "analyze": "moe-lit analyze routing --checkpoint runs/tiny-moe/checkpoints/last.ckpt --out results/analysis/tiny",
    "analyze text": "moe-lit analyze text --checkpoint runs/tiny-moe/checkpoints/last.ckpt --text 'Der Hund schläft'",
    "lm-eval": "moe-lit lm-eval run --model moe_lit --model_args checkpoint=hf/ --tasks xnli_de --limit 20",
    "generate": "moe-lit generate --checkpoint runs/tiny-moe/checkpoints/last.ckpt --prompt 'Der Hund' --top-k 50",
}
"""One command line per command (and per subcommand where the command's own line shows another one): the first
line of its ``--help`` (a test parses each one)."""
ACTIONS: dict[str, tuple[str, ...]] = {
    "data": ("prepare",),
    "convert": ("import-hf", "upcycle", "expand", "partition", "prune", "moe-to-dense"),
    "study": ("run", "report", "list"),
    "analyze": ("routing", "text"),
    "lm-eval": ("run", "ls", "validate"),
}
"""The subcommands of each command that has them, named in ``moe-lit --help`` (a test keeps them equal
to the command's parser; the modules are not imported for the top-level help)."""


SETTING = re.compile(r"--([A-Za-z_]\w*)\.([A-Za-z_][\w.]*)(?:=(.*))?", re.DOTALL)
"""A ``--SECTION.FIELD`` (or ``--SECTION.FIELD=VALUE``) word of a parser that accepts settings."""
Settings = dict[str, dict[str, Any]]
"""``--SECTION.FIELD VALUE`` words as ``{section: {field: value}}``, each value read as YAML."""

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
    """argparse with :class:`HelpFormatter` and no abbreviated options; subcommand parsers
    (``add_subparsers``) inherit both."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.check_settings: Callable[[Settings], None] | None = None
        """When set (a command's ``SETTINGS_CHECK``), ``--SECTION.FIELD VALUE`` words are taken besides
        the declared options, as ``args.settings``; it refuses unknown sections and fields (one line)."""

    @override
    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if self.check_settings is None:
            return super().parse_known_args(args, namespace)
        rest, settings = split_settings(list(sys.argv[1:] if args is None else args))
        self.check_settings(settings)
        namespace, extra = super().parse_known_args(rest, namespace)
        namespace.settings = settings
        return namespace, extra


def split_settings(argv: Sequence[str]) -> tuple[list[str], Settings]:
    """(the other words, the settings) of a command line: every ``--SECTION.FIELD VALUE`` or
    ``--SECTION.FIELD=VALUE``, the value read as YAML (``50``, ``1e-3``, ``true``, ``[en, de]``)."""
    import yaml

    rest: list[str] = []
    settings: Settings = {}
    words = iter(argv)
    for word in words:
        match = SETTING.fullmatch(word)
        if match is None:
            rest.append(word)
            continue
        section, field, value = match.groups()
        if value is None:
            value = next(words, None)
            if value is None:
                raise MoeLitError(f"--{section}.{field}: needs a value (--{section}.{field} VALUE)")
        try:
            settings.setdefault(section, {})[field] = _setting_value(yaml.safe_load(value))
        except yaml.YAMLError as exc:
            raise MoeLitError(
                f"--{section}.{field}: {value!r} is not a YAML value ({str(exc).splitlines()[0]})"
            ) from None
    return rest, settings


def _setting_value(value: Any) -> Any:
    """A YAML value, with a number YAML 1.1 reads as text (``1e-3``, no dot) as the float it names."""
    is_number = isinstance(value, str) and re.fullmatch(r"[-+]?\d+(?:\.\d*)?[eE][-+]?\d+", value)
    return float(value) if is_number else value


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
        actions = " | ".join(ACTIONS.get(name, ()))
        sub.add_parser(name, help=f"{actions}: {help_text}" if actions else help_text, add_help=False)
    return parser


def command_name(command: str, rest: Sequence[str]) -> str:
    """The full subcommand of a command line, as its errors name it (``moe-lit convert prune``)."""
    action = rest[0] if rest and rest[0] in ACTIONS.get(command, ()) else None
    return " ".join(["moe-lit", command, *([action] if action else [])])


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
        if command not in COMMANDS and command not in LIGHTNING_SUBCOMMANDS:
            allowed = ", ".join([*LIGHTNING_SUBCOMMANDS, *COMMANDS])
            raise MoeLitError(f"unknown command {command!r}; allowed: {allowed}")
        if "-h" in rest or "--help" in rest:
            full = command_name(command, rest).removeprefix("moe-lit ")
            print(f"example: {EXAMPLES.get(full, EXAMPLES[command])}\n", flush=True)
        if command in LIGHTNING_SUBCOMMANDS:
            from moe_lit.lit.lightning_cli import run_lightning_cli

            return run_lightning_cli([command, *rest])
        module = importlib.import_module(COMMANDS[command][0])
        if command in PASSTHROUGH_COMMANDS:
            return module.main(rest)
        sub = ArgumentParser(prog=f"moe-lit {command}", description=COMMANDS[command][1])
        sub.check_settings = getattr(module, "SETTINGS_CHECK", None)
        module.configure(sub)
        return int(module.run(sub.parse_args(rest)) or 0)
    except MoeLitError as exc:
        print(f"{command_name(command, rest)}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        # NOTE: a Ctrl-C outside training (inside it, moe_lit.callbacks.preemption saves a
        # checkpoint first and exits itself): one line and the shell's status for SIGINT.
        print(f"{command_name(command, rest)}: interrupted{f' ({exc})' if str(exc) else ''}", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
