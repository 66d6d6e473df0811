"""The one config base: dataclasses built from mappings, changed by dotted keys, written back as data.

A config is a dataclass with a docstring under every field and its checks in ``__post_init__``,
which raise :class:`ConfigError` on one line naming the field (the validators below). The base
(:class:`ConfigBase`, or :func:`build` for any dataclass) adds what every config needs:

* ``from_dict(data, name)``: built by the field types (a dataclass section, a list of them,
  ``X | None``); unknown keys refused; an error inside a section named under it (``train.seed: ...``);
* ``to_dict()``: plain YAML data (tuples become lists), which ``from_dict`` turns back into an equal config;
* ``with_overrides({"train.seed": 1})`` and ``replace(**changes)``: a validated copy; a dotted key or
  a mapping under a section changes its fields only (:meth:`ConfigBase.merge`);
* ``from_yaml`` / ``to_yaml``.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import yaml
from typing_extensions import Self

from moe_lit.errors import MoeLitError

T = TypeVar("T")


class ConfigError(MoeLitError, ValueError):
    """A configuration value is invalid; the message names the field and what is allowed."""


# ---------------------------------------------------------------------- field validators
def refuse_unknown_keys(data: Any, known: Any, section: str, what: str = "key(s)", label: str = "allowed keys") -> None:
    """The one check for unknown keys of a config mapping (or unknown names of any kind): a ConfigError
    ``<section>: unknown <what> [...], <label>: [...]`` (``known``: the allowed names, or a
    dataclass whose fields they are)."""
    allowed = [f.name for f in dataclasses.fields(known)] if dataclasses.is_dataclass(known) else list(known)
    if unknown := sorted(set(data) - set(allowed)):
        raise ConfigError(f"{section}: unknown {what} {unknown}, {label}: {allowed}")


def require(condition: bool, name: str, message: str) -> None:
    """A rule of the field ``name``: ``ConfigError("<name>: <message>")`` unless ``condition``."""
    if not condition:
        raise ConfigError(f"{name}: {message}")


def is_int(value: Any) -> bool:
    """An int, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def require_choice(value: Any, name: str, allowed: tuple[str, ...]) -> None:
    """One of ``allowed``."""
    require(value in allowed, name, f"got {value!r}, allowed values: {', '.join(allowed)}")


def require_number(value: Any, name: str, strictly_positive: bool) -> None:
    """A finite int or float, > 0 (``strictly_positive``) or >= 0."""
    finite = is_number(value) and math.isfinite(value)
    bound = "> 0" if strictly_positive else ">= 0"
    ok = finite and (value > 0 if strictly_positive else value >= 0)
    require(ok, name, f"must be a finite number {bound}, got {value!r}")


def require_bool(value: Any, name: str) -> None:
    """True or false."""
    require(isinstance(value, bool), name, f"must be true or false, got {value!r}")


def require_positive_int(value: Any, name: str) -> None:
    """An integer >= 1."""
    require(is_int(value) and value > 0, name, f"must be a positive integer, got {value!r}")


# ---------------------------------------------------------------------- building
@contextmanager
def named_under(name: str, own: str = "") -> Iterator[None]:
    """A ConfigError raised inside, named under the section ``name`` (``<name>.<field>: ...``); an
    error already named under ``own`` (the section's own name, e.g. ``moe.``) is renamed."""
    try:
        yield
    except ConfigError as exc:
        message = str(exc)
        if name and not message.startswith((f"{name}.", f"{name}:")):
            message = f"{name}.{message.removeprefix(f'{own}.') if own else message}"
        raise ConfigError(message) from None


def build(cls: type[T], data: Any, name: str = "", **context: Any) -> T:
    """``cls`` (a dataclass) from a mapping (null: its defaults) or an instance of it: unknown keys
    refused, each field built by its type (a dataclass section, a list of them, ``X | None``),
    errors named under ``name``; ``context``: what sections take from their surroundings
    (:meth:`ConfigBase.in_context`, e.g. a study's ``seq_len``)."""
    if not isinstance(data, cls):
        label = name or getattr(cls, "section", "")
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"{label}: expected a mapping, got {type(data).__name__}")
        refuse_unknown_keys(data, cls, label)
        hints = typing.get_type_hints(cls)
        values = {key: _field(hints[key], value, _join(name, key), context) for key, value in data.items()}
        with named_under(name, getattr(cls, "section", "")):
            data = cls(**values)
    return data.in_context(context) if isinstance(data, ConfigBase) else data


def _join(name: str, key: str) -> str:
    return f"{name}.{key}" if name else key


def _section_type(hint: Any) -> Any:
    """The dataclass of a field typed ``Section`` or ``Section | None``, else None."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    kinds = [t for t in (typing.get_args(hint) if union else (hint,)) if t is not type(None)]
    return kinds[0] if len(kinds) == 1 and dataclasses.is_dataclass(kinds[0]) else None


def _list_item_type(hint: Any) -> Any:
    """The dataclass of a field typed ``list[Section]`` (or ``| None``), else None."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    for kind in typing.get_args(hint) if union else (hint,):
        args = typing.get_args(kind)
        if typing.get_origin(kind) is list and args and dataclasses.is_dataclass(args[0]):
            return args[0]
    return None


def _field(hint: Any, value: Any, name: str, context: dict[str, Any]) -> Any:
    """A field's value built by its type."""
    if value is None:
        return None
    if (section := _section_type(hint)) is not None:
        return build(section, value, name, **context)
    if (item := _list_item_type(hint)) is not None:
        if not isinstance(value, list) or not value:
            raise ConfigError(f"{name}: must be a non-empty list of mappings, got {value!r}")
        return [build(item, entry, f"{name}[{i}]", **context) for i, entry in enumerate(value)]
    if isinstance(value, list) and _is_tuple(hint):
        return tuple(value)  # NOTE: to_dict writes a tuple as a YAML list
    return value


def _is_tuple(hint: Any) -> bool:
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    return any(typing.get_origin(kind) is tuple for kind in (typing.get_args(hint) if union else (hint,)))


def to_data(value: Any) -> Any:
    """Plain YAML data of a config value: dataclasses as mappings, tuples as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {key: to_data(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_data(item) for item in value]
    return value


class _Fields(dict):
    """Changes gathered from dotted keys (``trainer.precision``): merged into the field, never its value."""


def _nest(changes: Mapping[str, Any]) -> dict[str, Any]:
    """``{"train.seed": 1}`` as ``{"train": _Fields(seed=1)}`` (a key's first dot splits it)."""
    tree: dict[str, Any] = {}
    for key, value in changes.items():
        head, dot, rest = key.partition(".")
        if not dot:
            tree[head] = value
            continue
        fields = tree.get(head)
        if not isinstance(fields, _Fields):
            fields = tree[head] = _Fields(fields if isinstance(fields, Mapping) else {})
        fields[rest] = value
    return tree


def merge(cls: type, data: Mapping[str, Any], changes: Mapping[str, Any], name: str = "") -> dict[str, Any]:
    """``data`` (a mapping of ``cls``, a dataclass) with ``changes``: a dotted key
    (``train.seed``) or a mapping under a section changes its fields only, a dotted key under a
    mapping field (``trainer.precision``) one of its keys, anything else replaces the field.
    Unknown names are refused under their section; values are checked when the result is built."""
    tree = _nest(changes)
    refuse_unknown_keys(tree, cls, name or getattr(cls, "section", ""))
    hints = typing.get_type_hints(cls)
    merged = dict(data)
    if issubclass(cls, ConfigBase):
        merged = cls.overridden(merged, tree)
    for key, value in tree.items():
        section = _section_type(hints[key])
        if section is not None and isinstance(value, Mapping):
            current = to_data(merged.get(key)) or {}
            merged[key] = merge(section, current, value, _join(name, key))
        elif isinstance(value, _Fields):
            current = merged.get(key)
            ok = isinstance(current, Mapping) or current is None
            require(ok, _join(name, key), f"is not a section, cannot set {list(value)}")
            merged[key] = {**(current or {}), **value}
        else:
            merged[key] = value
    return merged


def load_yaml(source: str | Path, what: str) -> dict[str, Any]:
    """The mapping of a YAML file (a Path) or text (a str); a missing file, bad YAML or a
    non-mapping is a one-line ConfigError naming ``what``."""
    if isinstance(source, Path) and not source.is_file():
        raise ConfigError(f"{what}: no such file {source}")
    where = f"{source} " if isinstance(source, Path) else ""
    try:
        data = yaml.safe_load(source.read_text() if isinstance(source, Path) else source)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what}: {where}is not valid YAML ({yaml_problem(exc)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: {where}must hold a mapping, got {type(data).__name__}")
    return data


def yaml_problem(exc: Exception) -> str:
    """``line L, column C: problem`` of a YAML parse error (its first line when it has no position)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark is not None else str(problem)


def dotted(settings: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """``--SECTION.FIELD VALUE`` words (``{section: {field: value}}``, moe_lit.console_script) as dotted keys."""
    return {f"{section}.{key}": value for section, fields in settings.items() for key, value in fields.items()}


# NOTE: a dataclass itself (without fields): jsonargparse (LightningCLI) reads a dataclass whose
# bases are all dataclasses as a section of fields, anything else as a class to name.
@dataclass
class ConfigBase:
    """The base of a config dataclass (``@dataclass class X(ConfigBase)``): see the module docstring."""

    section: ClassVar[str] = ""
    """The name a config built alone goes under in its errors (``model: unknown key(s) ...``); an
    error its own checks name under it is renamed when it is built as a field of another config."""

    @classmethod
    def from_dict(cls, data: Any, name: str = "", **context: Any) -> Self:
        """Built from a mapping, or itself when given one (:func:`build`)."""
        return build(cls, data, name, **context)

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML data (tuples become lists): ``from_dict(to_dict())`` equals ``self``."""
        return to_data(self)

    @classmethod
    def from_yaml(cls, source: str | Path, name: str = "") -> Self:
        """From a YAML file (a Path) or text (a str)."""
        return cls.from_dict(load_yaml(source, name or cls.section), name)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def merge(cls, data: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
        """A mapping of this config with ``changes`` (dotted keys) over it (:func:`merge`)."""
        return merge(cls, data, changes)

    def with_overrides(self, changes: Mapping[str, Any]) -> Self:
        """A validated copy with ``changes`` (``{"train.seed": 1}``; :func:`merge`)."""
        return self.from_dict(self.merge(self.to_dict(), changes))

    def replace(self, **changes: Any) -> Self:
        """A validated copy with fields changed; a mapping under a section changes its fields only
        (``replace(train={"seed": 1})``, ``replace(moe={"top_k": 1})``)."""
        return self.with_overrides(changes)

    @classmethod
    def check_settings(cls, settings: Mapping[str, Mapping[str, Any]]) -> None:
        """``--SECTION.FIELD`` settings (moe_lit.console_script) name sections of this config and
        their fields; anything else is a one-line ConfigError. Values are checked when it is built."""
        refuse_unknown_keys(settings, cls, "settings", what="section(s)", label="allowed sections")
        cls.merge({}, dotted(settings))

    @classmethod
    def overridden(cls, data: dict[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
        """``data`` before ``changes`` go over it: a config whose fields depend on each other clears
        those a change replaces (TrainConfig: a new budget)."""
        return data

    def in_context(self, context: Mapping[str, Any]) -> Self:
        """Itself as a field built with ``context`` (:func:`build`); ModelConfig takes a study's ``seq_len``."""
        return self


__all__ = [
    "ConfigBase",
    "ConfigError",
    "build",
    "dotted",
    "is_int",
    "is_number",
    "load_yaml",
    "merge",
    "named_under",
    "refuse_unknown_keys",
    "require",
    "require_bool",
    "require_choice",
    "require_number",
    "require_positive_int",
    "to_data",
    "yaml_problem",
]
