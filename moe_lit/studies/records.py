"""Record selection and seed pairing: the one place a kind's analysis reads its records through.

A kind's claims and tables compare arms over seeds. :func:`select` picks the finished (status
ok) records whose fields match; :func:`by_seed` maps them to ``{seed: value}``, the form
:meth:`~moe_lit.studies.verdicts.Claim.on` pairs by seed; :func:`paired` and :func:`minus` line two
such maps up on the seeds both finished (the differences the plots draw).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any

from moe_lit.errors import MoeLitError

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


def paired(a: Mapping[int, float], b: Mapping[int, float]) -> tuple[list[float], list[float]]:
    """The values of ``a`` and ``b`` on the seeds both have, seed by seed."""
    seeds = sorted(set(a) & set(b))
    return [a[s] for s in seeds], [b[s] for s in seeds]


def minus(a: Mapping[int, float], b: Mapping[int, float]) -> dict[int, float]:
    """``{seed: a - b}`` on the seeds both have."""
    return {s: a[s] - b[s] for s in sorted(set(a) & set(b))}


__all__ = ["by_seed", "group", "minus", "paired", "select", "value_of"]
