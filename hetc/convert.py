"""Build typed Spec nodes from syntax trees, driven by the fields' metadata.

Errors are collected, not raised one at a time: a block with a bad value
still reports its other bad values and its missing keys. `Converter.errors`
ends up holding every diagnostic; `to_spec` raises them together.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from enum import StrEnum
from typing import Any

from hetc import syntax as ast
from hetc.errors import Diagnostic, Span, SpecError, did_you_mean
from hetc.spec import (AUTO, ENUM_ALIASES, Auto, LayerRange, Node, RankSlice, Routing, RoutingKind,
                       Spec)
from hetc.units import UNITS, Dim, to_base, units_of

__all__ = ["to_spec", "FieldInfo", "fields_of", "normalize_key"]


@dataclasses.dataclass(frozen=True)
class FieldInfo:
    """One Spec field, with its type taken apart."""

    name: str
    base: Any          # int, float, str, bool, an enum, a Node class, LayerRange, RankSlice, Routing
    many: bool         # a tuple of `base`
    auto_ok: bool
    none_ok: bool
    required: bool
    meta: dict

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.name, *self.meta["aliases"])


def normalize_key(key: str) -> str:
    return key.replace("-", "_").lower()


@functools.cache
def fields_of(cls: type) -> tuple[FieldInfo, ...]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.name in ("span", "spans"):
            continue
        base, many, auto_ok, none_ok = _take_apart(hints[f.name])
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        meta = dict(f.metadata) or dict(doc="", aliases=(), unit=None, lo=None, hi=None, block=None,
                                        label=False, shorthand=False)
        out.append(FieldInfo(f.name, base, many, auto_ok, none_ok, required, meta))
    return tuple(out)


def _take_apart(tp) -> tuple[Any, bool, bool, bool]:
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


class Converter:
    def __init__(self) -> None:
        self.errors: list[Diagnostic] = []

    def error(self, span: Span, message: str, notes: tuple = ()) -> None:
        self.errors.append(Diagnostic(span, message, notes=notes))

    # ------------------------------------------------------------ blocks

    def block(self, cls: type, items: tuple, span: Span, labels: tuple[str | None, ...] = (),
              what: str = "") -> Node | None:
        infos = fields_of(cls)
        values: dict[str, Any] = {}
        spans: dict[str, Span] = {}
        failed = False
        failed |= not self._labels(cls, infos, labels, span, what, values)
        seen: dict[str, Span] = {}
        for item in items:
            if isinstance(item, ast.Comment):
                continue
            if isinstance(item, ast.Use):
                self.error(item.span, "'use' is only allowed at the top of a file")
                continue
            info = self._find(infos, item, what)
            if info is None:
                failed = True
                continue
            key = info.name if not (isinstance(item, ast.Block) and info.many) else None
            if key is not None and key in seen:
                self.error(item.span if isinstance(item, ast.Block) else item.key_span,
                           f"duplicate '{_item_name(item)}' in {what}",
                           notes=((seen[key], "first defined here"),))
                failed = True
                continue
            if key is not None:
                seen[key] = item.span
            ok = self._assign(info, item, values, spans)
            failed |= not ok
        failed |= not self._required(infos, values, span, what)
        if failed:
            return None
        return cls(**values, span=span, spans=tuple(spans.items()))

    def _labels(self, cls, infos, labels, span, what, values) -> bool:
        label_infos = [i for i in infos if i.meta["label"]]
        given = [lab for lab in labels if lab is not None]
        if len(given) > len(label_infos):
            self.error(span, f"{what} takes {_count(len(label_infos), 'name')}, got {len(given)}")
            return False
        for info, text in zip(label_infos, given):
            value = self._enum(info.base, text, span, what) if _is_enum(info.base) else text
            if value is None:
                return False
            values[info.name] = value
        for info in label_infos[len(given):]:
            if info.required:
                form = "A <-> B" if len(label_infos) == 2 else "NAME"
                self.error(span, f"{what} needs {'two ends' if len(label_infos) == 2 else 'a name'}: "
                                 f"{what.strip(chr(39))} {form} {{ ... }}")
                return False
        return True

    def _find(self, infos, item, what) -> FieldInfo | None:
        if isinstance(item, ast.Block):
            kind = normalize_key(item.kind)
            for info in infos:
                if info.meta["block"] and kind in (info.meta["block"], *info.meta["aliases"]):
                    return info
            blocks = [i.meta["block"] for i in infos if i.meta["block"]]
            if any(kind in i.keys for i in infos):
                self.error(item.kind_span, f"'{item.kind}' is a value here: write {item.kind} = ...")
                return None
            hint = did_you_mean(kind, blocks)
            allowed = f"; {what} holds {_words(blocks)}" if blocks and not hint else ""
            self.error(item.kind_span, f"unknown block '{item.kind}' in {what}{hint}{allowed}")
            return None
        key = normalize_key(item.key)
        for info in infos:
            if key in info.keys and not info.meta["label"]:
                return info
        names = [i.name for i in infos if not i.meta["label"]]
        every = [k for i in infos if not i.meta["label"] for k in i.keys]
        hint = did_you_mean(key, every)
        self.error(item.key_span, f"unknown key '{item.key}' in {what}{hint}"
                   + ("" if hint else f"; known keys: {_words(names)}"))
        return None

    def _required(self, infos, values, span, what) -> bool:
        missing = [i.name for i in infos if i.required and i.name not in values and not i.meta["label"]]
        if missing:
            self.error(span, f"{what} is missing {_words(missing, quote=True)}")
            return False
        return True

    def _assign(self, info: FieldInfo, item, values, spans) -> bool:
        if isinstance(item, ast.Block):
            sub = self.block(info.base, item.items, item.span, (item.label, item.peer),
                             what=_describe(item))
            if sub is None:
                return False
            if info.many:
                prior = values.get(info.name)
                values[info.name] = (prior if isinstance(prior, tuple) else ()) + (sub,)
            else:
                values[info.name] = sub
            spans.setdefault(info.name, item.span)
            return True
        spans[info.name] = item.value.span
        value = self.value(info, item.value, f"'{item.key}'")
        if value is None:
            return False
        values[info.name] = value
        return True

    # ------------------------------------------------------------ values

    def value(self, info: FieldInfo, node: ast.Value, what: str) -> Any:
        if isinstance(node, ast.Auto):
            if info.auto_ok:
                return AUTO
            self.error(node.span, f"{what} cannot be auto")
            return None
        base = info.base
        if dataclasses.is_dataclass(base) and base not in (LayerRange, RankSlice, Routing):
            return self._shorthand(base, node, what)
        if info.many or base in (LayerRange, RankSlice):
            items = node.items if isinstance(node, ast.ListValue) else (node,)
            if base is LayerRange and isinstance(node, ast.ListValue) and not items:
                self.error(node.span, f"{what} needs at least one layer range")
                return None
            out = [self.scalar(base, info, n, what) for n in items]
            return None if any(o is None for o in out) else tuple(out)
        return self.scalar(base, info, node, what)

    def _shorthand(self, cls, node, what):
        infos = [i for i in fields_of(cls) if i.meta["shorthand"]]
        if not infos:
            self.error(node.span, f"{what} is a block: write {what.strip(chr(39))} {{ ... }}")
            return None
        value = self.value(infos[0], node, what)
        if value is None:
            return None
        return cls(**{infos[0].name: value}, span=node.span, spans=((infos[0].name, node.span),))

    def scalar(self, base, info: FieldInfo, node: ast.Value, what: str) -> Any:
        if isinstance(node, ast.ListValue) and base is not Routing:
            self.error(node.span, f"{what} takes one value, not a list")
            return None
        if base is bool:
            return self._bool(node, what)
        if base is int:
            return self._int(node, info, what)
        if base is float:
            return self._float(node, info, what)
        if base is str:
            if isinstance(node, (ast.String, ast.Word)):
                return node.value if isinstance(node, ast.String) else node.name
            self.error(node.span, f"{what} expects a name or a string")
            return None
        if _is_enum(base):
            if isinstance(node, (ast.Word, ast.String)):
                return self._enum(base, node.name if isinstance(node, ast.Word) else node.value,
                                  node.span, what)
            self.error(node.span, f"{what} expects one of {_words([e.value for e in base])}")
            return None
        return _SPECIAL[base](self, node, what)

    def _bool(self, node, what):
        if isinstance(node, ast.Word) and node.name in ("true", "false"):
            return node.name == "true"
        self.error(node.span, f"{what} expects true or false")
        return None

    def _int(self, node, info, what):
        if not isinstance(node, ast.Number) or not node.is_int() or node.unit is not None:
            shown = _shown(node)
            self.error(node.span, f"{what} expects a whole number, got {shown}")
            return None
        return self._bounded(int(node.text), info, node.span, what)

    def _float(self, node, info, what):
        unit_dim: Dim | None = info.meta["unit"]
        if not isinstance(node, ast.Number):
            need = f"a {unit_dim.value} such as 1 {units_of(unit_dim)[0]}" if unit_dim else "a number"
            self.error(node.span, f"{what} expects {need}, got {_shown(node)}")
            return None
        value = float(node.text)
        if not math.isfinite(value):
            self.error(node.span, f"{what}: {node.text} is too large")
            return None
        if unit_dim is None and node.unit is not None:
            self.error(node.span, f"{what} takes a plain number, without the unit '{node.unit}'")
            return None
        if unit_dim is not None:
            value = self._unit(node, unit_dim, value, what)
            if value is None:
                return None
        return self._bounded(value, info, node.span, what)

    def _unit(self, node: ast.Number, dim: Dim, value: float, what: str) -> float | None:
        choices = units_of(dim)
        if node.unit is None:
            if value == 0:
                return 0.0
            self.error(node.span, f"{what} needs a unit of {dim.value}: {_words(choices)}")
            return None
        if node.unit not in UNITS:
            self.error(node.span, f"unknown unit '{node.unit}'{did_you_mean(node.unit, choices)}")
            return None
        got_dim, base = to_base(value, node.unit)
        if got_dim != dim:
            self.error(node.span, f"{what} is a {dim.value}, but '{node.unit}' measures {got_dim.value}; "
                                  f"use {_words(choices)}")
            return None
        if not math.isfinite(base):
            self.error(node.span, f"{what}: {node.text} {node.unit} is too large")
            return None
        return base

    def _bounded(self, value, info, span, what):
        lo, hi = info.meta["lo"], info.meta["hi"]
        if lo is not None and value < lo:
            rule = {0: "must not be negative", 1: "must be positive"}.get(lo, f"must be at least {lo:g}")
            self.error(span, f"{what} {rule}, got {value:g}")
            return None
        if hi is not None and value > hi:
            self.error(span, f"{what} must be at most {hi:g}, got {value:g}")
            return None
        return value

    def _enum(self, enum: type[StrEnum], text: str, span: Span, what: str):
        low = text.lower()
        for member in enum:
            if member.value == low:
                return member
        alias = ENUM_ALIASES.get(enum, {}).get(low.replace("-", "_"))
        if alias is not None:
            return enum(alias)
        choices = [e.value for e in enum]
        hint = did_you_mean(low, choices)
        self.error(span, f"{what}: unknown value '{text}'{hint}; expected {_words(choices)}")
        return None


def _layer_range(conv: Converter, node: ast.Value, what: str):
    if isinstance(node, ast.LayerRange):
        return LayerRange(first=node.first, last=node.last, span=node.span)
    if isinstance(node, ast.Word):
        return LayerRange(first=node.name, last=node.name, span=node.span)
    conv.error(node.span, f"{what} expects layers such as embed..block3, got {_shown(node)}")
    return None


def _rank_slice(conv: Converter, node: ast.Value, what: str):
    if isinstance(node, ast.Word):
        return RankSlice(group=node.name, span=node.span)
    if not isinstance(node, ast.RankRef):
        conv.error(node.span, f"{what} expects GPUs such as h100[0, 0:4], got {_shown(node)}")
        return None
    gpu = node.gpu or ast.Index(None, None, True)
    n, g = node.node, gpu
    return RankSlice(group=node.group, node_start=n.start, node_stop=n.stop, gpu_start=g.start,
                     gpu_stop=g.stop, node_is_slice=n.is_slice, gpu_is_slice=g.is_slice, span=node.span)


def _routing(conv: Converter, node: ast.Value, what: str):
    if isinstance(node, ast.Word):
        kind = conv._enum(RoutingKind, node.name, node.span, what)
        if kind is RoutingKind.COUNTS:
            conv.error(node.span, f"{what}: write the counts per lane as a list, e.g. [3, 1]")
            return None
        return None if kind is None else Routing(kind=kind, span=node.span)
    if isinstance(node, ast.ListValue) and node.items:
        info = FieldInfo("count", int, False, False, False, True, dict(lo=0, hi=1 << 30))
        counts = [conv._int(n, info, "a microbatch count") for n in node.items]
        if any(c is None for c in counts):
            return None
        return Routing(kind=RoutingKind.COUNTS, counts=tuple(counts), span=node.span)
    conv.error(node.span, f"{what} expects even, proportional or a list of counts per lane")
    return None


_SPECIAL = {LayerRange: _layer_range, RankSlice: _rank_slice, Routing: _routing}


def _is_enum(tp) -> bool:
    return isinstance(tp, type) and issubclass(tp, StrEnum)


def _shown(node) -> str:
    if isinstance(node, ast.Number):
        return f"{node.text} {node.unit}" if node.unit else node.text
    if isinstance(node, ast.Word):
        return f"'{node.name}'"
    if isinstance(node, ast.String):
        return f'"{node.value}"'
    if isinstance(node, ast.ListValue):
        return "a list"
    if isinstance(node, ast.LayerRange):
        return f"{node.first}..{node.last}"
    if isinstance(node, ast.RankRef):
        return f"{node.group}[...]"
    return "auto"


def _words(items, quote: bool = False) -> str:
    items = [f"'{i}'" if quote else str(i) for i in items]
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1] if quote else ", ".join(items[:-1]) + " or " + items[-1]


def _count(n: int, noun: str) -> str:
    return "no name" if n == 0 else f"{n} {noun}{'s' if n > 1 else ''}"


def _describe(block: ast.Block) -> str:
    if block.label is None:
        return f"'{block.kind}'"
    if block.peer is None:
        return f"{block.kind} '{block.label}'"
    return f"{block.kind} '{block.label}' <-> '{block.peer}'"


def _item_name(item) -> str:
    return item.kind if isinstance(item, ast.Block) else item.key


def to_spec(items: list, span: Span) -> Spec:
    """Convert the merged top-level items of a spec and its imports."""
    conv = Converter()
    spec = conv.block(Spec, tuple(items), span, what="the spec")
    if conv.errors or spec is None:
        raise SpecError(conv.errors or [Diagnostic(span, "empty spec")])
    return spec
