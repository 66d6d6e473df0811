"""The study kinds' spec parser, and the validators their fields share.

A kind's own fields are a dataclass (its spec). :func:`parser` turns the study file's mapping
into it with the one config builder (:func:`moe_lit.configbase.build`, also here as :func:`build`):
unknown and missing keys are one-line errors, nested sections are built from the field types (a
dataclass, a list of them, ``X | None``), every :class:`~moe_lit.config.ModelConfig` field gets the
run's ``seq_len``, and an error inside a section names it (``recovery.warmup: ...``).
Values are checked in each spec's ``__post_init__`` with the validators below, which all raise
``ConfigError("<field>: <what is allowed>, got <value>")``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from moe_lit.configbase import ConfigError, build, is_int, is_number, refuse_unknown_keys, require
from moe_lit.configbase import require_bool as boolean

T = TypeVar("T")
SPLITS = ("train", "val", "test")
"""Splits of the parallel text a calibration or evaluation reads."""


@contextmanager
def errors_under(prefix: str, strip: str = "") -> Iterator[None]:
    """A ConfigError raised inside, named under a section: ``<prefix><error>`` (``strip``: a prefix
    of the error's own name dropped first, e.g. ``distill.`` of a config validated as a field)."""
    try:
        yield
    except ConfigError as exc:
        raise ConfigError(f"{prefix}{str(exc).removeprefix(strip)}") from None


def known_keys(
    keys: Iterable[str], name: str, allowed: list[str], what: str = "key(s)", label: str = "allowed keys"
) -> None:
    """Every one of ``keys`` in ``allowed``: ``<name>: unknown <what> [...], <label>: [...]``
    (:func:`moe_lit.config.refuse_unknown_keys`)."""
    refuse_unknown_keys(keys, allowed, name, what, label)


def positive_int(value: Any, name: str, optional: bool = False) -> None:
    """An integer >= 1 (or null when ``optional``)."""
    if optional and value is None:
        return
    require(is_int(value) and value >= 1, name, f"must be {'null or ' * optional}a positive integer, got {value!r}")


def positive_fields(spec: Any, *names: str, optional: bool = False) -> None:
    """Each of the fields ``names`` of ``spec`` an integer >= 1, or null when ``optional`` (:func:`positive_int`)."""
    for name in names:
        positive_int(getattr(spec, name), name, optional)


def integer(value: Any, name: str, low: int) -> None:
    """An integer >= ``low``."""
    require(is_int(value) and value >= low, name, f"must be an integer >= {low}, got {value!r}")


def int_in(value: Any, name: str, low: int, high: int, high_name: str | None = None, closed: bool = False) -> None:
    """An integer in ``[low, high)`` (``[low, high]`` when ``closed``); ``high_name`` names the bound."""
    ok = is_int(value) and low <= value and (value <= high if closed else value < high)
    require(ok, name, f"must be an integer in [{low}, {high_name or high}{']' if closed else ')'}, got {value!r}")


def number(
    value: Any, name: str, low: float | None = None, high: float | None = None, closed: str = "", optional: bool = False
) -> None:
    """A number above ``low`` and below ``high`` (or null when ``optional``); ``closed`` (``low``,
    ``high``) allows a bound itself."""
    if optional and value is None:
        return
    above = low is None or (is_number(value) and (value >= low if "low" in closed else value > low))
    below = high is None or (is_number(value) and (value <= high if "high" in closed else value < high))
    if low is not None and high is not None:
        left, right = "[" if "low" in closed else "(", "]" if "high" in closed else ")"
        allowed = f" in {left}{low:g}, {high:g}{right}"
    elif low is not None:
        allowed = f" {'>=' if 'low' in closed else '>'} {low:g}"
    else:
        allowed = f" <{'=' if 'high' in closed else ''} {high:g}" if high is not None else ""
    require(is_number(value) and above and below, name, f"must be a number{allowed}, got {value!r}")


def choice(value: Any, name: str, allowed: Iterable[Any]) -> None:
    """One of ``allowed``."""
    allowed = tuple(allowed)
    require(value in allowed, name, f"got {value!r}, allowed values: {', '.join(map(str, allowed))}")


def choices(values: Any, name: str, allowed: Iterable[Any]) -> None:
    """Every one of ``values`` one of ``allowed`` (each checked by :func:`choice`)."""
    for value in values:
        choice(value, name, allowed)


def label(value: Any, name: str) -> None:
    """A name used in point names: a non-empty string without '/'."""
    require(
        isinstance(value, str) and bool(value) and "/" not in value,
        name,
        f"must be a non-empty string without '/', got {value!r}",
    )


def distinct(
    values: Any,
    name: str,
    allowed: Iterable[Any] | None = None,
    each: Callable[[Any], bool] | None = None,
    what: str = "values",
    optional: bool = False,
    empty: bool = False,
    must: str | None = None,
) -> None:
    """A list of distinct ``what`` (non-empty unless ``empty``; null when ``optional``); each one of
    ``allowed`` (``unknown [...]``) and/or passing ``each`` (``[...] not allowed, each must be {must}``)."""
    if optional and values is None:
        return
    ok = isinstance(values, list) and (empty or bool(values)) and len(set(map(repr, values))) == len(values)
    nonempty = "" if empty else "non-empty "
    require(ok, name, f"must be {'null or ' * optional}a {nonempty}list of distinct {what}, got {values!r}")
    if allowed is not None:
        allowed = tuple(allowed)
        unknown = [v for v in values if v not in allowed]
        require(not unknown, name, f"unknown {unknown}, allowed values: {', '.join(map(str, allowed))}")
    if each is not None:
        bad = [v for v in values if isinstance(v, bool) or not each(v)]
        require(not bad, name, f"{bad} not allowed, each must be {must or what}")


def numbers(values: Any, name: str, low: float) -> None:
    """A non-empty list of numbers > ``low``."""
    ok = isinstance(values, list) and bool(values) and all(is_number(v) and v > low for v in values)
    require(ok, name, f"must be a non-empty list of numbers > {low:g}, got {values!r}")


def ints(values: Any, name: str, low: int, empty: bool = False) -> None:
    """A list of distinct integers >= ``low`` (non-empty unless ``empty``)."""
    distinct(values, name, each=lambda v: is_int(v) and v >= low, what="integers", must=f">= {low}", empty=empty)


def fractions(values: Any, name: str, zero: bool = False, empty: bool = False) -> None:
    """A list of distinct numbers in (0, 1) (``zero``: in [0, 1)), non-empty unless ``empty``."""
    inside = (lambda v: is_number(v) and 0 <= v < 1) if zero else (lambda v: is_number(v) and 0 < v < 1)
    distinct(values, name, each=inside, what="numbers", must=f"in {'[' if zero else '('}0, 1)", empty=empty)


def positives(values: Any, name: str, empty: bool = False) -> None:
    """A list of distinct numbers > 0 (non-empty unless ``empty``)."""
    distinct(values, name, each=lambda v: is_number(v) and v > 0, what="numbers", must="> 0", empty=empty)


def languages(value: Any, name: str) -> None:
    """Null (every language of the data) or a non-empty list of distinct language codes."""
    distinct(value, name, each=lambda v: isinstance(v, str) and bool(v), what="language codes", optional=True)


@dataclass
class FineTune:
    """A short run from a point's weights on a fresh optimizer and schedule (a recovery, a distillation)."""

    steps: int = 200
    """Optimizer steps (batch and sequence: run.data), validated once at the end."""
    lr: float = 1e-3
    """Peak learning rate of the fresh schedule."""
    warmup: int = 20
    """Warmup steps of the fresh schedule."""

    def __post_init__(self) -> None:
        positive_int(self.steps, "steps")
        int_in(self.warmup, "warmup", 0, self.steps, "steps")
        number(self.lr, "lr", 0)

    def run(self, base: Any) -> Any:
        """The RunConfig ``base`` with this budget and schedule."""
        train, optim = {"max_steps": self.steps, "val_every": self.steps}, {"lr": self.lr, "warmup_steps": self.warmup}
        return base.replace(train=train, optim=optim)


def parser(cls: type[T], required: tuple[str, ...] = ()) -> Callable[[dict[str, Any], Any], T]:
    """A kind's ``parse(fields, header)``: the study file's own fields into ``cls`` (the header's
    fields are the study's; model configs take ``run.data.seq_len``)."""

    def parse(fields: dict[str, Any], header: Any) -> T:
        names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        refuse_unknown_keys(fields, names, "study", label="allowed keys (besides the header's)")
        for key in required:
            if key not in fields:
                raise ConfigError(f"{key}: is required")
        return build(cls, fields, "", seq_len=header.run.data.seq_len)

    return parse


__all__ = [
    "SPLITS",
    "FineTune",
    "boolean",
    "build",
    "choice",
    "choices",
    "distinct",
    "errors_under",
    "int_in",
    "known_keys",
    "is_int",
    "is_number",
    "fractions",
    "integer",
    "ints",
    "label",
    "languages",
    "number",
    "numbers",
    "parser",
    "positive_fields",
    "positive_int",
    "positives",
    "require",
]
