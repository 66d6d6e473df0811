"""Record selection and seed pairing: the one place a kind's analysis reads its records through.

A kind's claims and tables compare arms over seeds. :func:`select` picks the finished (status
ok) records whose fields match; :func:`by_seed` maps them to ``{seed: value}``, the form
:meth:`~moe_lit.studies.verdicts.Claim.on` pairs by seed; :func:`paired` and :func:`minus` line two
such maps up on the seeds both finished (the differences the plots draw); :func:`collect` gathers
``{arm: {measure: {seed: value}}}``, :func:`cells` formats them for a table, :func:`best` picks an arm.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any

from moe_lit.errors import MoeLitError
from moe_lit.stats import format_values, summarize

STATUS_OK = "ok"
# NOTE: the engine's STATUS_OK; spelled here so that the analysis imports nothing of the runner.
Record = dict[str, Any]
Value = str | Callable[[Record], Any]


def select(records: Iterable[Record], **where: Any) -> list[Record]:
    """The ok records whose fields equal ``where`` (a missing field never matches), in order."""
    return [r for r in records if r.get("status") == STATUS_OK and all(r.get(k) == v for k, v in where.items())]


def value_of(record: Record, value: Value) -> float:
    """``record[value]`` (a field name) or ``value(record)``; None becomes NaN. An ok record
    without the field is refused: the field name is wrong."""
    if callable(value):
        raw = value(record)
    elif value in record:
        raw = record[value]
    else:
        raise MoeLitError(f"{value!r}: not a field of the study records (has: {', '.join(sorted(record))})")
    return math.nan if raw is None else float(raw)


def by_seed(records: Iterable[Record], value: Value, **where: Any) -> dict[int, float]:
    """``{seed: value}`` of the ok records matching ``where`` (seed 0 when a record has none)."""
    return {r.get("seed", 0): value_of(r, value) for r in select(records, **where)}


def group(records: Iterable[Record], key: Callable[[Record], Hashable]) -> dict[Hashable, list[Record]]:
    """The ok records by ``key(record)``, in first-seen key order (None keys left out)."""
    out: dict[Hashable, list[Record]] = {}
    for record in select(records):
        k = key(record)
        if k is not None:
            out.setdefault(k, []).append(record)
    return out


def collect(items: Iterable[tuple[Hashable, int, Mapping[str, Any]]]) -> dict[Hashable, dict[str, dict[int, Any]]]:
    """``{key: {measure: {seed: value}}}`` from ``(key, seed, {measure: value})`` items, keys in
    first-seen order: the values a kind's claims and tables compare, one map per arm and measure."""
    out: dict[Hashable, dict[str, dict[int, Any]]] = {}
    for key, seed, values in items:
        entry = out.setdefault(key, {})
        for measure, value in values.items():
            entry.setdefault(measure, {})[seed] = value
    return out


def cells(values: Mapping[str, Mapping[int, float]], columns: Mapping[str, str], digits: int = 4) -> dict[str, str]:
    """Table cells: title -> mean ± std (n) over the seeds of ``values[key]`` for each ``title: key``
    of ``columns`` (empty where not measured)."""
    return {title: format_values(list(values.get(key, {}).values()), digits) for title, key in columns.items()}


def language_means(
    per_seed: Mapping[int, Mapping[str, float]], digits: int = 4, languages: Iterable[str] | None = None
) -> dict[str, str]:
    """Table cells ``{language: mean over the seeds}`` of ``{seed: {language: value}}``: ``languages``
    in that order (default: every one, first seen first), blank where no seed has a value."""
    languages = languages or dict.fromkeys(lang for by in per_seed.values() for lang in by)
    means = {lang: summarize([by[lang] for by in per_seed.values() if lang in by]).mean for lang in languages}
    return {lang: "" if math.isnan(mean) else f"{mean:.{digits}f}" for lang, mean in means.items()}


def best(candidates: Mapping[str, Mapping[int, float]], lowest: bool = True) -> str | None:
    """The candidate with the lowest (``lowest=False``: highest) mean over its seeds; None without one."""
    means = {name: summarize(list(by.values())).mean for name, by in candidates.items()}
    means = {name: mean for name, mean in means.items() if not math.isnan(mean)}
    return (min if lowest else max)(means, key=means.__getitem__) if means else None


def paired(a: Mapping[int, float], b: Mapping[int, float]) -> tuple[list[float], list[float]]:
    """The values of ``a`` and ``b`` on the seeds both have, seed by seed."""
    seeds = sorted(set(a) & set(b))
    return [a[s] for s in seeds], [b[s] for s in seeds]


def minus(a: Mapping[int, float], b: Mapping[int, float]) -> dict[int, float]:
    """``{seed: a - b}`` on the seeds both have."""
    return {s: a[s] - b[s] for s in sorted(set(a) & set(b))}


__all__ = ["best", "by_seed", "cells", "collect", "group", "language_means", "minus", "paired", "select", "value_of"]
