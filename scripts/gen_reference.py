"""Writes the generated reference pages, docs/reference/config.md and docs/reference/cli.md (`make reference`).

* config.md: every field of every config dataclass of :data:`CONFIGS`: its name, type and default as the
  source writes them, the allowed values of a ``Literal`` type, and its docstring, read as ``moe-lit fit
  --help`` reads it (jsonargparse's parser of attribute docstrings, ``docstring_parser.parse_from_object``);
* cli.md: the ``--help`` of every ``moe-lit`` command and subcommand, as ``moe-lit`` prints it, at a fixed
  width (:data:`COLUMNS`).

tests/test_reference.py regenerates both in memory and fails, naming this command, when a committed page
differs: a changed field or option needs ``make reference``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import io
import os
import sys
import typing
from collections.abc import Callable, Iterator
from pathlib import Path

import docstring_parser

from moe_lit import console_script as cli

REPO = Path(__file__).resolve().parent.parent
COLUMNS = 100
"""The terminal width of the generated ``--help`` texts (argparse reads ``$COLUMNS``)."""
CONFIGS = (
    "moe_lit.config.ModelConfig",
    "moe_lit.config.MoEConfig",
    "moe_lit.lit.optim.OptimConfig",
    "moe_lit.lit.run_config.RunConfig",
    "moe_lit.lit.run_config.DataConfig",
    "moe_lit.lit.run_config.TrainConfig",
    "moe_lit.lit.distill.DistillConfig",
    "moe_lit.data.prepare.PrepareConfig",
    "moe_lit.evaluation.tasks.SuiteConfig",
    "moe_lit.analysis.routing.RoutingAnalysisConfig",
    "moe_lit.inference.sparsity.SparsityConfig",
    "moe_lit.convert.dot_moe.DotMoEConfig",
    "moe_lit.convert.dense_to_moe.UpcyclingConfig",
    "moe_lit.convert.expand.ExpansionConfig",
    "moe_lit.convert.moe_to_dense.MoeToDenseConfig",
    "moe_lit.convert.importance.MaestroConfig",
    "moe_lit.studies.executors.ExecutorConfig",
)
"""Every config dataclass of moe_lit (a test keeps this equal to the ``@dataclass class *Config`` of the source)."""
COMMAND = "make reference"


def config_page() -> str:
    lines = [
        "# Reference: config fields",
        "",
        f"Generated from the code by `{COMMAND}` (scripts/gen_reference.py); do not edit. Each field's",
        "text is its docstring in the source, the same text `moe-lit fit --help` prints. Validation",
        "beyond a `Literal`'s values lives in each class's `__post_init__` (a bad value: one line, exit 2).",
        "",
    ]
    for path in CONFIGS:
        lines += _config_section(_resolve(path))
    return "\n".join(lines)


def _resolve(path: str) -> type:
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def _config_section(cls: type) -> list[str]:
    doc = docstring_parser.parse_from_object(cls)
    params = {param.arg_name: param for param in doc.params}
    hints = typing.get_type_hints(cls)
    lines = [
        f"## {cls.__name__}",
        "",
        f"`{cls.__module__}.{cls.__name__}`: {_flat(doc.short_description or '')}",
        "",
        "| field | type | default | allowed | description |",
        "|---|---|---|---|---|",
    ]
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        param = params.get(field.name)
        kind = param.type_name if param and param.type_name else str(field.type)
        default = param.default if param and param.default is not None else _default(field)
        allowed = ", ".join(f"`{value}`" for value in _literal_values(hints[field.name]))
        text = _flat(param.description or "") if param else ""
        lines.append(f"| `{field.name}` | `{_cell(kind)}` | `{_cell(default)}` | {allowed} | {_cell(text)} |")
    return [*lines, ""]


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        return repr(field.default)
    if field.default_factory is not dataclasses.MISSING:
        return repr(field.default_factory())
    return "required"


def _literal_values(hint: object) -> list[object]:
    """The values of a ``Literal`` type, also inside ``X | None`` and ``list[...]``."""
    if typing.get_origin(hint) is typing.Literal:
        return list(typing.get_args(hint))
    return [value for arg in typing.get_args(hint) for value in _literal_values(arg)]


def _flat(text: str) -> str:
    return " ".join(text.split())


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def cli_page() -> str:
    lines = [
        "# Reference: `moe-lit` commands",
        "",
        f"Generated from the code by `{COMMAND}` (scripts/gen_reference.py); do not edit. Each block is",
        f"what `moe-lit COMMAND --help` prints at {COLUMNS} columns; the first line is an example.",
        "",
        "## fit, validate, test",
        "",
        "LightningCLI's commands take an experiment YAML (`--config`) and `--SECTION.FIELD VALUE`",
        "overrides: `model.model` is [ModelConfig](config.md#modelconfig) (`moe` its",
        "[MoEConfig](config.md#moeconfig)), `model.optim` [OptimConfig](config.md#optimconfig), `data`",
        "[DataConfig](config.md#dataconfig), `train` [TrainConfig](config.md#trainconfig), `trainer`",
        "Lightning's `Trainer` arguments. `moe-lit fit --help` lists every one of them.",
        "",
        "```",
        *(cli.EXAMPLES[name] for name in cli.LIGHTNING_SUBCOMMANDS),
        "```",
        "",
    ]
    with _fixed_width():
        for command in cli.COMMANDS:
            lines += [f"## {command}", "", "```", *_help([command]), "```", ""]
            actions = () if command in cli.PASSTHROUGH_COMMANDS else cli.ACTIONS.get(command, ())
            for action in actions:
                lines += [f"### {command} {action}", "", "```", *_help([command, action]), "```", ""]
    return "\n".join(lines)


@contextlib.contextmanager
def _fixed_width() -> Iterator[None]:
    """``$COLUMNS`` at :data:`COLUMNS`, and the default data folder printed as one fixed string.

    NOTE: argparse wraps a help line before any later replacement could shorten it, so a path that
    depends on where the checkout lies would wrap differently on every machine.
    """
    fixed = {"COLUMNS": str(COLUMNS), "MOE_LIT_DATA": "<checkout>/data_cache/default"}
    before = {name: os.environ.get(name) for name in fixed}
    os.environ.update(fixed)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def _help(words: list[str]) -> list[str]:
    """What ``moe-lit WORDS --help`` prints, as lines without trailing spaces."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        cli.main([*words, "--help"])
    # NOTE: a default under the checkout (data_cache/default) prints as this machine's path.
    text = out.getvalue().replace(str(REPO), "<checkout>")
    return [line.rstrip() for line in text.rstrip("\n").splitlines()]


PAGES: dict[str, Callable[[], str]] = {"docs/reference/config.md": config_page, "docs/reference/cli.md": cli_page}
"""Each generated page (relative to the repository) and what writes it."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    for page, render in PAGES.items():
        (REPO / page).parent.mkdir(parents=True, exist_ok=True)
        (REPO / page).write_text(render() + "\n")
        print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
