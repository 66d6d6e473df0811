"""Study kinds: each a small plug-in module of the one engine (:mod:`moe_lit.studies.engine`).

A kind module provides

* ``default_run() -> dict``: the base run config sections it assumes (the study's ``run`` overrides them);
* ``parse(fields: dict, header: StudyHeader) -> spec``: its own YAML fields, validated;
* ``expand(spec, header) -> list[Point]``: the points (with parent links where they fork);
* ``analyse(plan, records, plots_dir) -> Analysis``: tables, findings and plots from the records.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from moe_lit.config import ConfigError

KINDS = {
    "dense_vs_sparse": "moe_lit.studies.kinds.dense_vs_sparse",
    "upcycling": "moe_lit.studies.kinds.upcycling",
    "language_expansion": "moe_lit.studies.kinds.language_expansion",
    "partition": "moe_lit.studies.kinds.partition",
    "pruning": "moe_lit.studies.kinds.pruning",
    "moe_to_dense": "moe_lit.studies.kinds.moe_to_dense",
    "sparsity": "moe_lit.studies.kinds.sparsity",
}


@dataclass
class Analysis:
    """What a kind computes from its records: the report's body."""

    findings: list[str] = field(default_factory=list)
    """Markdown bullets: each claim checked, with its numbers, the seed noise and a verdict."""
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Title -> rows (markdown tables, in order)."""
    plots: list[Path] = field(default_factory=list)
    """PNG files written under the plots directory."""


def check_fields(spec_cls: type, fields: dict[str, Any], required: tuple[str, ...] = ()) -> None:
    """A kind's own fields: unknown keys and missing required ones are one-line errors."""
    known = [f.name for f in dataclasses.fields(spec_cls)]
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise ConfigError(f"study: unknown key(s) {unknown}, allowed keys: {known} (and the header's)")
    for name in required:
        if name not in fields:
            raise ConfigError(f"{name}: is required")


def kind_module(name: Any) -> ModuleType:
    if name not in KINDS:
        raise ConfigError(f"kind: got {name!r}, allowed values: {', '.join(KINDS)}")
    return importlib.import_module(KINDS[name])


__all__ = ["Analysis", "KINDS", "check_fields", "kind_module"]
