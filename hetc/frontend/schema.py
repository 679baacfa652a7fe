"""The language schema: each Spec field's type taken apart, with its metadata.

`hetc.ir.spec.param` attaches the metadata, a `FieldMeta` (key aliases, unit,
bounds, block kind, doc); this module reads it back per dataclass for the
converter, the printer and the documentation generator.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any

from hetc.ir.spec import SCHEMA_KEY, Auto, FieldMeta

__all__ = ["FieldInfo", "fields_of", "normalize_key"]


@dataclasses.dataclass(frozen=True)
class FieldInfo:
    """One Spec field, with its type taken apart."""

    name: str
    base: Any          # int, float, str, bool, an enum, a Node class, LayerRange, RankSlice, Routing
    many: bool         # a tuple of `base`
    auto_ok: bool
    none_ok: bool
    required: bool
    meta: FieldMeta

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.name, *self.meta.aliases)


def normalize_key(key: str) -> str:
    return key.replace("-", "_").lower()


def fields_of(cls: type) -> tuple[FieldInfo, ...]:
    """The schema of dataclass `cls`'s fields (its source spans aside)."""
    return _fields_of(cls)


@functools.cache   # behind a typed signature: a cache wrapper takes any hashable arguments
def _fields_of(cls: type) -> tuple[FieldInfo, ...]:
    hints = typing.get_type_hints(cls)
    out: list[FieldInfo] = []
    for f in dataclasses.fields(cls):
        if f.name in ("span", "spans"):
            continue
        base, many, auto_ok, none_ok = _take_apart(hints[f.name])
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        meta = f.metadata.get(SCHEMA_KEY)
        if not isinstance(meta, FieldMeta):   # a field declared without `param`
            meta = FieldMeta()
        out.append(FieldInfo(f.name, base, many, auto_ok, none_ok, required, meta))
    return tuple(out)


def _take_apart(tp: object) -> tuple[Any, bool, bool, bool]:
    """(the base type, a tuple of it, `auto` allowed, None allowed) of a field's type hint `tp`."""
    auto_ok = none_ok = False
    args = [tp]
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = list(typing.get_args(tp))
        auto_ok = Auto in args
        none_ok = type(None) in args
        args = [a for a in args if a not in (Auto, type(None))]
    (inner,) = args
    many = typing.get_origin(inner) is tuple
    if many:
        inner = typing.get_args(inner)[0]
    return inner, many, auto_ok, none_ok
