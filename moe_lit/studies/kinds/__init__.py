"""Study kinds: each a short declaration the one engine runs (:mod:`moe_lit.studies.identity`,
:mod:`moe_lit.studies.run`, :mod:`moe_lit.studies.schedule`), registered by name in
:data:`moe_lit.studies.plugins.KINDS`.

A kind module is a :class:`StudyKind`: its spec (``parse``: the study file's own fields, built
and validated by :func:`moe_lit.studies.spec.parser`), its plan (``expand``: the points, with
parent links where they fork) and its analysis (``analyse``: the claims it tests, its tables and
at most one plot of its own). The claims are judged together by
:func:`moe_lit.studies.verdicts.judge` in the report; records are read through
:mod:`moe_lit.studies.records`; shared measurements are in :mod:`moe_lit.studies.measures`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

from moe_lit.config import ConfigError
from moe_lit.studies.identity import Point
from moe_lit.studies.verdicts import Evidence


@dataclass
class Analysis:
    """What a kind computes from its records: the report's body."""

    claims: list[Evidence] = field(default_factory=list)
    """Each declared claim tested on the records (the report judges them together)."""
    findings: list[str] = field(default_factory=list)
    """Markdown bullets: what the numbers show beyond the claims (no verdict words)."""
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Title -> rows (markdown tables, in order)."""
    plots: list[Path] = field(default_factory=list)
    """PNG files written under the plots directory."""


class StudyKind(Protocol):
    """The plug-in interface of a kind (a module)."""

    DEFAULT_RUN: Mapping[str, Any]
    """The base run config sections it assumes (the study's ``run`` overrides them)."""

    def parse(self, fields: dict[str, Any], header: Any) -> Any:
        """Its own YAML fields as its spec dataclass, validated."""
        ...

    def expand(self, spec: Any, header: Any) -> list[Point]:
        """The points of the study."""
        ...

    def analyse(self, plan: dict[str, Any], records: list[dict[str, Any]], plots_dir: Path) -> Analysis:
        """Claims, findings, tables and plots from the records."""
        ...


def kind_module(name: Any) -> StudyKind:
    """The kind registered as ``name`` in :data:`moe_lit.studies.plugins.KINDS`."""
    from moe_lit.studies.plugins import KINDS

    if name not in KINDS:
        raise ConfigError(f"kind: got {name!r}, allowed values: {', '.join(KINDS)}")
    return cast(StudyKind, KINDS[name])


__all__ = ["Analysis", "StudyKind", "kind_module"]
