"""The one plug-in registry: stable names, declared versions, duplicates refused."""

import pytest

from moe_lit.errors import MoeLitError
from moe_lit.registry import Entry, Registry, UnknownName


def test_register_by_decorator_and_call_and_look_up_both_ways():
    registry: Registry = Registry("transform")

    @registry.register("prune", version=2)
    def prune():
        return "pruned"

    def expand():
        return "expanded"

    assert registry.register("expand", expand) is expand
    assert registry["prune"]() == "pruned" and registry.entry("prune") == Entry("prune", 2, prune)
    assert registry.entry("expand").version == 1
    assert registry.name_of(expand) == "expand" and list(registry) == ["prune", "expand"]
    assert "prune" in registry and "other" not in registry and len(registry) == 2
    assert dict(registry.items()) == {"prune": prune, "expand": expand}
    with pytest.raises(ValueError, match=r"^lambda.* is not a registered transform$|is not a registered transform"):
        registry.name_of(lambda: None)


def test_duplicates_reserved_names_and_bad_versions_are_refused():
    registry: Registry = Registry("study kind", reserved=("auto",))
    registry.register("a", int)
    with pytest.raises(ValueError, match=r"^study kind name 'a' of float is taken by int$"):
        registry.register("a", float)
    with pytest.raises(ValueError, match=r"^study kind name 'auto' of float is reserved$"):
        registry.register("auto", float)
    for version in (0, True, 1.5):
        with pytest.raises(ValueError, match=r"version must be an integer >= 1"):
            registry.register("b", float, version=version)
    with pytest.raises(ValueError, match=r"name must be a non-empty string"):
        registry.register("", float)
    assert registry.names() == ("a",)


def test_an_unknown_name_is_one_user_facing_line():
    registry: Registry = Registry("HF family")
    registry.register("llama", dict)
    registry.register("olmoe", list)
    with pytest.raises(UnknownName, match=r"^HF family: unknown name 'mixtral', registered: llama, olmoe$") as info:
        registry["mixtral"]
    assert isinstance(info.value, MoeLitError) and "\n" not in str(info.value)
    with pytest.raises(UnknownName):
        registry.entry(["unhashable"])  # type: ignore[arg-type]
