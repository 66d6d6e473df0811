"""Plug-ins by registered name: the one registry every kind of plug-in uses.

Transforms, measurements, callbacks, study kinds, experts backends and HF families each have one
:class:`Registry`. An entry has a stable ``name`` (what configs, records and point hashes use, so
code can move between modules without orphaning a result) and a ``version`` the plug-in declares
(bump it when its output changes for the same inputs). A name registered twice is refused, as
MegaBlocks' ``dmlp_registry`` and torchtitan's ``register_train_spec`` do; an unknown name is a
one-line error listing the registered ones.

    TRANSFORMS = Registry("transform")

    @TRANSFORMS.register("prune", version=2)
    def prune(model, ...): ...

    TRANSFORMS["prune"]           # the function
    TRANSFORMS.entry("prune")     # Entry(name="prune", version=2, obj=prune)
    TRANSFORMS.name_of(prune)     # "prune"
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from moe_lit.errors import MoeLitError

T = TypeVar("T")


class UnknownName(MoeLitError, LookupError):
    """A name that no plug-in of the registry has; the message lists the registered names."""


@dataclass(frozen=True)
class Entry(Generic[T]):
    """One registered plug-in."""

    name: str
    """The stable name configs and records use."""
    version: int
    """The plug-in's declared version (part of a study point's identity)."""
    obj: T
    """The function or class registered."""


class Registry(Generic[T]):
    """Named plug-ins of one kind, in registration order; a duplicate name is refused."""

    def __init__(self, kind: str, reserved: tuple[str, ...] = ()) -> None:
        self.kind = kind
        """What the plug-ins are, for messages ("experts backend", "transform")."""
        self.reserved = reserved
        """Names no plug-in may take (e.g. ``auto``, which means "choose one")."""
        self._entries: dict[str, Entry[T]] = {}

    def register(self, name: str, obj: T | None = None, *, version: int = 1) -> Callable[[T], T] | T:
        """Register ``obj`` under ``name``; without ``obj``, a decorator that does (and returns it)."""
        if obj is None:
            return lambda target: self._add(name, target, version)
        return self._add(name, obj, version)

    def _add(self, name: str, obj: T, version: int) -> T:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ValueError(f"{self.kind} {name!r}: version must be an integer >= 1, got {version!r}")
        if name in self.reserved:
            raise ValueError(f"{self.kind} name {name!r} of {_label(obj)} is reserved")
        if name in self._entries:
            raise ValueError(
                f"{self.kind} name {name!r} of {_label(obj)} is taken by {_label(self._entries[name].obj)}"
            )
        self._entries[name] = Entry(name, version, obj)
        return obj

    def entry(self, name: str) -> Entry[T]:
        """The entry of ``name``; an unknown name is an :class:`UnknownName` listing the known ones."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise UnknownName(f"{self.kind}: unknown name {name!r}, registered: {', '.join(self._entries)}") from None

    def __getitem__(self, name: str) -> T:
        return self.entry(name).obj

    def name_of(self, obj: T) -> str:
        """The name ``obj`` is registered under (a ValueError when it is not registered)."""
        for entry in self._entries.values():
            if entry.obj is obj:
                return entry.name
        raise ValueError(f"{_label(obj)} is not a registered {self.kind}")

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def items(self) -> Iterator[tuple[str, T]]:
        return ((name, entry.obj) for name, entry in self._entries.items())

    def values(self) -> Iterator[T]:
        return (entry.obj for entry in self._entries.values())

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def _label(obj: object) -> str:
    return getattr(obj, "__name__", None) or type(obj).__name__


__all__ = ["Entry", "Registry", "UnknownName"]
