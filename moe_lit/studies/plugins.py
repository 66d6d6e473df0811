"""The plug-ins of studies, by registered name (:class:`moe_lit.registry.Registry`).

A study point calls its transform, measurement, callbacks and module factory by the name each is
registered under here (:class:`moe_lit.studies.identity.Call`); its hash covers that name and the
plug-in's declared version, never an import path, so a function can move or be renamed without
orphaning a record. Bump a plug-in's ``version`` when its output changes for the same arguments:
its points run again. A study YAML's ``kind`` names a module of :data:`KINDS`.

Every plug-in is registered in this one module (its code stays where it is), so a new one is one
line here; the names of :data:`TRANSFORMS`, :data:`MEASUREMENTS`, :data:`CALLBACKS` and
:data:`MODULES` are distinct, so that a point's call names exactly one plug-in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moe_lit.callbacks.expert_upcycling import ExpertUpcycling
from moe_lit.callbacks.study import CopySeparation, ValidationProbe
from moe_lit.convert import recipes
from moe_lit.convert.common import dropless
from moe_lit.convert.expand import expand_experts
from moe_lit.registry import Entry, Registry, UnknownName
from moe_lit.studies import measures
from moe_lit.studies.kinds import (
    dense_vs_sparse,
    language_expansion,
    lifecycle,
    moe_to_dense,
    partition,
    pruning,
    sparsity,
    upcycling,
)

Plugin = Callable[..., Any]
TRANSFORMS: Registry[Plugin] = Registry("transform")
"""``fn(model, **kwargs) -> model``: a point's start weights transformed (``Point.transform``)."""
MEASUREMENTS: Registry[Plugin] = Registry("measurement")
"""``fn(point, result, run_dir, **kwargs) -> dict``: run after training; the dict joins the record."""
CALLBACKS: Registry[Plugin] = Registry("callback")
"""Lightning callback classes of a point's run (``Point.callbacks``)."""
MODULES: Registry[Plugin] = Registry("module factory")
"""``fn(model_cfg, optim, parent, **kwargs) -> MoELitModule``: a point's own LightningModule."""
KINDS: Registry[Any] = Registry("study kind")
"""Study kind modules (:class:`moe_lit.studies.kinds.StudyKind`), by a study YAML's ``kind``."""
POINT_PLUGINS = (TRANSFORMS, MEASUREMENTS, CALLBACKS, MODULES)

TRANSFORMS.register("expand_experts", expand_experts)
TRANSFORMS.register("dropless", dropless)
TRANSFORMS.register("partition_on_stream", measures.partition_on_stream)
TRANSFORMS.register("prune_by_importance", recipes.prune_by_importance)
TRANSFORMS.register("moe_to_dense_on_text", recipes.moe_to_dense_on_text)
TRANSFORMS.register("prune_dense_to_width", recipes.prune_dense_to_width)

MEASUREMENTS.register("local_suite", measures.local_suite)
MEASUREMENTS.register("measure_sparsity", measures.measure_sparsity)
MEASUREMENTS.register("measure_routing", language_expansion.measure_routing)
MEASUREMENTS.register("measure_model", lifecycle.measure_model)
MEASUREMENTS.register("measure_distilled", moe_to_dense.measure_distilled)
MEASUREMENTS.register("measure_screen", moe_to_dense.measure_screen)
MEASUREMENTS.register("measure_converted", partition.measure_converted)
MEASUREMENTS.register("measure_tasks", pruning.measure_tasks)
MEASUREMENTS.register("measure_memory", pruning.measure_memory)
MEASUREMENTS.register("measure_step_times", upcycling.measure_step_times)

CALLBACKS.register("validation_probe", ValidationProbe)
CALLBACKS.register("expert_upcycling", ExpertUpcycling)
CALLBACKS.register("copy_separation", CopySeparation)

MODULES.register("distill_module", lifecycle.distill_module)
MODULES.register("teacher_module", moe_to_dense.teacher_module)

for _kind in (dense_vs_sparse, upcycling, language_expansion, partition, pruning, moe_to_dense, sparsity, lifecycle):
    KINDS.register(_kind.__name__.rsplit(".", 1)[-1], _kind)


def plugin(name: str) -> Entry[Plugin]:
    """The transform, measurement, callback or module factory registered as ``name``."""
    for registry in POINT_PLUGINS:
        if name in registry:
            return registry.entry(name)
    known = ", ".join(n for registry in POINT_PLUGINS for n in registry.names())
    raise UnknownName(f"study plug-in: unknown name {name!r}, registered: {known}")


def name_of(obj: Plugin) -> str:
    """The name ``obj`` is registered under in one of the point plug-in registries."""
    for registry in POINT_PLUGINS:
        if obj in registry.values():
            return registry.name_of(obj)
    label = getattr(obj, "__qualname__", type(obj).__name__)
    raise ValueError(f"{label} is not a registered study plug-in (moe_lit.studies.plugins)")


def _refuse_shared_names() -> None:
    names = [name for registry in POINT_PLUGINS for name in registry.names()]
    shared = sorted({name for name in names if names.count(name) > 1})
    if shared:
        raise ValueError(f"study plug-in names registered twice: {', '.join(shared)}")


_refuse_shared_names()

__all__ = ["CALLBACKS", "KINDS", "MEASUREMENTS", "MODULES", "POINT_PLUGINS", "TRANSFORMS", "name_of", "plugin"]
