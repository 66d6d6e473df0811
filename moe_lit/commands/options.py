"""Command-line options derived from a transform's config dataclass or signature, never restated.

:func:`add_options` adds one ``--kebab-name`` option per field of a config dataclass (or parameter
of a function): its type and default from the annotation and the default, the allowed values of a
``Literal`` as its metavar, and its help from the field's docstring (a parameter's ``Args:`` entry),
as jsonargparse's ``add_class_arguments`` / ``add_function_arguments`` do for litgpt's CLI; the
parsers stay ``moe-lit``'s argparse ones. :meth:`Options.values` reads the fields back from the
parsed arguments. A new field is a new option, with its docstring as the help.

NOTE: no argparse ``choices``: the config's ``__post_init__`` (or the transform) refuses a bad value
in one line naming the field, where argparse would print its usage too.
"""

from __future__ import annotations

import argparse
import inspect
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docstring_parser

NULL = "null"
"""The word that sets a field whose type allows None and whose default is not None to None."""
SCALARS = (int, float, str, Path)
"""Field types an option reads as they are (``bool`` is a flag, ``list[int]`` comma-separated)."""


@dataclass(frozen=True)
class Options:
    """The options :func:`add_options` added: field name -> the ``argparse`` dest holding its value."""

    dests: dict[str, str]

    def values(self, args: argparse.Namespace) -> dict[str, Any]:
        """The fields' values in ``args`` (by field name), to build the config or call the transform."""
        return {name: getattr(args, dest) for name, dest in self.dests.items()}


def add_options(
    parser: argparse.ArgumentParser | Any,
    source: type | Callable[..., Any],
    only: Sequence[str] | None = None,
    skip: Sequence[str] = (),
    *,
    rename: Mapping[str, str] | None = None,
    required: Sequence[str] = (),
    defaults: Mapping[str, Any] | None = None,
    helps: Mapping[str, str] | None = None,
    one_of: Sequence[str] = (),
    prefix: str = "",
) -> Options:
    """Add an option for each field of ``source`` (a dataclass, or a function's parameters).

    ``only`` / ``skip``: which fields, in that order (default: every field with a default, in the
    source's order); ``rename``: field -> option name (``max_tokens`` -> ``feature-tokens``, also
    its dest); ``required``: fields without a default on the command line; ``defaults``: other
    defaults than the source's; ``helps``: the help of a field instead of its docstring (where it
    has none, or where the command's default differs);
    ``one_of``: fields of which exactly one must be given (a required mutually exclusive group);
    ``prefix``: put before every help (``MAESTRO: ``).
    """
    rename, defaults, helps = dict(rename or {}), dict(defaults or {}), dict(helps or {})
    parameters = _parameters(source)
    names = list(only) if only is not None else [n for n, p in parameters.items() if p.default is not p.empty]
    docs = _docs(source)
    hints = typing.get_type_hints(source)
    exclusive = parser.add_mutually_exclusive_group(required=True) if one_of else None
    dests = {}
    for name in (n for n in names if n not in skip):
        if name not in parameters:
            raise TypeError(f"{_label(source)} has no field {name!r}")
        word = rename.get(name, name).replace("_", "-")
        default = defaults.get(name, parameters[name].default)
        text = _one_line(helps.get(name) or docs.get(name) or "")
        if not text:
            raise TypeError(f"{_label(source)}.{name} has no docstring; pass its help")
        kwargs = _kind(hints[name], name in required, None if name in one_of else default)
        target = exclusive if name in one_of else parser
        action = target.add_argument(f"--{word}", help=prefix + text, **kwargs)
        dests[name] = action.dest
    return Options(dests)


def _parameters(source: type | Callable[..., Any]) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(source).parameters)


def _docs(source: type | Callable[..., Any]) -> dict[str, str]:
    """Field -> its docstring (a dataclass's attribute docstrings, a function's ``Args:``)."""
    parsed = docstring_parser.parse_from_object(source)
    return {param.arg_name: param.description or "" for param in parsed.params}


def field_help(source: type | Callable[..., Any], name: str) -> str:
    """The help :func:`add_options` gives field ``name`` of ``source``: for an option it cannot type."""
    return _one_line(_docs(source)[name])


def _one_line(text: str) -> str:
    """A docstring as a help line: whitespace collapsed, no final period (argparse adds the default)."""
    return " ".join(text.split()).removesuffix(".")


def _label(source: type | Callable[..., Any]) -> str:
    return getattr(source, "__qualname__", repr(source))


def _kind(hint: Any, required: bool, default: Any) -> dict[str, Any]:
    """``add_argument`` keywords (type, action, metavar, default) of a field of type ``hint``."""
    nullable, hint = _without_none(hint) is not hint, _without_none(hint)
    if required:
        default = None
    if default is inspect.Parameter.empty:
        raise TypeError(f"a field of type {hint} without a default must be required")
    if hint is bool:
        if default not in (False, None) and not required:
            return {"action": argparse.BooleanOptionalAction, "default": default}
        return {"action": "store_true", "default": False}
    base = {"default": default, "required": required} if required else {"default": default}
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        values = typing.get_args(hint)
        words = [str(value) for value in values]
        if nullable and default is not None:  # NOTE: the config's null ("keep the source's") as a word
            return {**base, "type": _null_or_text, "metavar": "{" + ",".join([*words, NULL]) + "}"}
        return {**base, "type": type(values[0]), "metavar": "{" + ",".join(words) + "}"}
    if origin in (list, tuple) and typing.get_args(hint)[0] in SCALARS:
        item = typing.get_args(hint)[0]
        return {**base, "type": _comma_list(item), "metavar": f"{item.__name__.upper()},..."}
    if hint in SCALARS:
        return {**base, "type": hint}
    raise TypeError(f"no command-line option for a field of type {hint}")


def _without_none(hint: Any) -> Any:
    """``X`` of ``X | None`` (a null default: the option is simply left out; else see :data:`NULL`)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return hint


def _null_or_text(text: str) -> str | None:
    return None if text == NULL else text


def _comma_list(item: type) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        try:
            return [item(part) for part in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {item.__name__} values, got {text!r}") from None

    return parse


__all__ = ["Options", "add_options", "field_help"]
