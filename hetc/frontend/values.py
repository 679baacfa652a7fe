"""Typed values from syntax-tree values: numbers with units and bounds, words, enums, ranges.

`ValueConverter` holds the error list and the value rules; `hetc.frontend.convert.Converter`
adds the block rules on top. Every problem is recorded as a located
diagnostic and the value comes back as None.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from enum import StrEnum
from typing import Any, TypeGuard, TypeVar

from hetc.frontend import syntax
from hetc.ir.errors import Diagnostic, Span, did_you_mean
from hetc.frontend.schema import FieldInfo, fields_of
from hetc.ir.spec import AUTO, ENUM_ALIASES, Auto, FieldMeta, LayerRange, Node, RankSlice, Routing, RoutingKind
from hetc.ir.units import UNITS, Dim, to_base, units_of

__all__ = ["ValueConverter", "is_enum", "words"]

E = TypeVar("E", bound=StrEnum)
Num = TypeVar("Num", int, float)


class ValueConverter:
    def __init__(self) -> None:
        self.errors: list[Diagnostic] = []

    def error(self, span: Span, message: str, notes: tuple[tuple[Span, str], ...] = ()) -> None:
        self.errors.append(Diagnostic(span, message, notes=notes))

    def value(self, info: FieldInfo, node: syntax.Value, what: str) -> Any:
        base = info.base
        if dataclasses.is_dataclass(base) and base not in (LayerRange, RankSlice, Routing):
            return self._shorthand(info, node, what)  # `zero = auto` is the level's auto
        if isinstance(node, syntax.Auto):
            if info.auto_ok:
                return AUTO
            self.error(node.span, f"{what} cannot be auto")
            return None
        if info.many or base in (LayerRange, RankSlice):
            items = node.items if isinstance(node, syntax.ListValue) else (node,)
            if base is LayerRange and isinstance(node, syntax.ListValue) and not items:
                self.error(node.span, f"{what} needs at least one layer range")
                return None
            out = []
            for n in items:  # one mistake repeated along a list is reported once
                value = self.scalar(base, info, n, what)
                if value is None:
                    return None
                out.append(value)
            return tuple(out)
        return self.scalar(base, info, node, what)

    def _shorthand(self, field: FieldInfo, node: syntax.Value, what: str) -> Node | Auto | None:
        cls: type[Node] = field.base   # a block's class (value() sends only those here)
        infos = [i for i in fields_of(cls) if i.meta.shorthand]
        if not infos:
            if isinstance(node, syntax.Auto) and field.auto_ok:   # `stage = auto`: the planner writes the blocks
                return AUTO
            labels = [i for i in fields_of(cls) if i.meta.label]
            kind = field.meta.block or what.strip(chr(39))
            named = " NAME" if any(i.required for i in labels) else ""
            head = kind + (f" {node.name}" if labels and isinstance(node, syntax.Word) else named)
            also = f", or {kind} = auto to let the planner choose" if field.auto_ok else ""
            self.error(node.span, f"{what} is a block: write {head} {{ ... }}{also}")
            return None
        value = self.value(infos[0], node, what)
        if value is None:
            return None
        return cls(**{infos[0].name: value}, span=node.span, spans=((infos[0].name, node.span),))

    def scalar(self, base: Any, info: FieldInfo, node: syntax.Value, what: str) -> Any:
        if isinstance(node, syntax.ListValue) and base is not Routing:
            self.error(node.span, f"{what} takes one value, not a list")
            return None
        if base is bool:
            return self._bool(node, what)
        if base is int:
            return self._int(node, info, what)
        if base is float:
            return self._float(node, info, what)
        if base is str:
            if isinstance(node, (syntax.String, syntax.Word)):
                return node.value if isinstance(node, syntax.String) else node.name
            self.error(node.span, f"{what} expects a name or a string, got {_shown(node)}")
            return None
        if is_enum(base):
            if isinstance(node, (syntax.Word, syntax.String)):
                return self._enum(base, node.name if isinstance(node, syntax.Word) else node.value,
                                  node.span, what)
            if isinstance(node, syntax.Number) and node.unit and not node.spaced:   # `1f1v`: one word to a reader
                return self._enum(base, node.written, node.span, what)
            choices = words([e.value for e in base])
            self.error(node.span, f"{what} expects one of {choices}, got {_shown(node)}")
            return None
        return _SPECIAL[base](self, node, what)

    def _bool(self, node: syntax.Value, what: str) -> bool | None:
        if isinstance(node, syntax.Word) and node.name in ("true", "false"):
            return node.name == "true"
        self.error(node.span, f"{what} expects true or false, got {_shown(node)}")
        return None

    def _int(self, node: syntax.Value, info: FieldInfo, what: str) -> int | None:
        if not isinstance(node, syntax.Number) or not node.is_int() or node.unit is not None:
            self.error(node.span, f"{what} expects a whole number, got {_shown(node)}")
            return None
        return self._bounded(int(node.text), info, node, what)

    def _float(self, node: syntax.Value, info: FieldInfo, what: str) -> float | None:
        unit_dim: Dim | None = info.meta.unit
        if not isinstance(node, syntax.Number):
            need = f"{_NOUN[unit_dim]} such as {_EXAMPLE[unit_dim]}" if unit_dim else "a number"
            self.error(node.span, f"{what} expects {need}, got {_shown(node)}")
            return None
        value = float(node.text)
        if not math.isfinite(value):
            self.error(node.span, f"{what}: {node.text} is too large")
            return None
        if unit_dim is None and node.unit is not None:
            self.error(node.span, f"{what} takes a plain number, without the unit '{node.unit}'")
            return None
        if unit_dim is None:
            return self._bounded(value, info, node, what)
        in_base = self._unit(node, unit_dim, value, what)
        return None if in_base is None else self._bounded(in_base, info, node, what)

    def _unit(self, node: syntax.Number, dim: Dim, value: float, what: str) -> float | None:
        choices = units_of(dim)
        if node.unit is None:
            if value == 0:
                return 0.0
            self.error(node.span, f"{what} needs a unit: write it as {_EXAMPLE[dim]}, for example")
            return None
        if node.unit not in UNITS:
            self.error(node.span, f"unknown unit '{node.unit}'{did_you_mean(node.unit, choices)}")
            return None
        got_dim, base = to_base(value, node.unit)
        if got_dim != dim:
            self.error(node.span, f"{what} is {_NOUN[dim]}, but {node.unit} measures {_NOUN[got_dim]}; "
                                  f"use a unit such as {words(DISPLAY_HINT[dim])}")
            return None
        if not math.isfinite(base):
            self.error(node.span, f"{what}: {node.text} {node.unit} is too large")
            return None
        return base

    def _bounded(self, value: Num, info: FieldInfo, node: syntax.Number, what: str) -> Num | None:
        problem = out_of_bounds(value, info, what, _shown(node))
        if problem:
            self.error(node.span, problem)
            return None
        return value

    def _enum(self, enum: type[E], text: str, span: Span, what: str) -> E | None:
        low = text.lower()
        for member in enum:
            if member.value == low:
                return member
        alias = ENUM_ALIASES.get(enum, {}).get(low.replace("-", "_"))
        if alias is not None:
            return enum(alias)
        choices = [e.value for e in enum]
        hint = did_you_mean(low, choices)
        self.error(span, f"{what}: unknown value '{text}'{hint}; expected {words(choices)}")
        return None


def _layer_range(conv: ValueConverter, node: syntax.Value, what: str) -> LayerRange | None:
    if isinstance(node, syntax.LayerRange):
        return LayerRange(first=node.first, last=node.last, span=node.span)
    if isinstance(node, syntax.Word):
        return LayerRange(first=node.name, last=node.name, span=node.span)
    conv.error(node.span, f"{what} expects layers such as embed..block3, got {_shown(node)}")
    return None


def _rank_slice(conv: ValueConverter, node: syntax.Value, what: str) -> RankSlice | None:
    if isinstance(node, syntax.Word):
        return RankSlice(group=node.name, span=node.span)
    if not isinstance(node, syntax.RankRef):
        conv.error(node.span, f"{what} expects GPUs such as h100[0, 0:4], got {_shown(node)}")
        return None
    n, g = node.node, node.gpu or syntax.Index(None, None, True)
    return RankSlice(group=node.group, node_start=n.start, node_stop=n.stop, gpu_start=g.start,
                     gpu_stop=g.stop, node_is_slice=n.is_slice, gpu_is_slice=g.is_slice, span=node.span)


def _routing(conv: ValueConverter, node: syntax.Value, what: str) -> Routing | None:
    if isinstance(node, syntax.Word):
        kind = _enum_or_none(RoutingKind, node.name)
        if kind is None:
            hint = did_you_mean(node.name.lower(), ["even", "proportional"])
            conv.error(node.span, f"{what}: unknown routing '{node.name}'{hint}; expected even, proportional "
                                  "or a list of microbatch counts per lane such as [3, 1]")
            return None
        if kind is RoutingKind.COUNTS:
            conv.error(node.span, f"{what}: write the counts per lane as a list, e.g. [3, 1]")
            return None
        return Routing(kind=kind, span=node.span)
    if isinstance(node, syntax.ListValue) and node.items:
        info = FieldInfo("count", int, False, False, False, True, FieldMeta(lo=0, hi=1 << 30))
        counts = [conv._int(n, info, "a microbatch count") for n in node.items]
        known = [c for c in counts if c is not None]
        if len(known) != len(counts):
            return None
        return Routing(kind=RoutingKind.COUNTS, counts=tuple(known), span=node.span)
    conv.error(node.span, f"{what} expects even, proportional or a list of counts per lane, got {_shown(node)}")
    return None


# the value types written in their own syntax, each with its converter
_SPECIAL: dict[type, Callable[[ValueConverter, syntax.Value, str], object]] = {
    LayerRange: _layer_range, RankSlice: _rank_slice, Routing: _routing}

# How messages name a dimension, show an example value and suggest units.
_NOUN = {Dim.MEMORY: "a memory size", Dim.BANDWIDTH: "a bandwidth", Dim.COMPUTE: "a compute rate",
         Dim.TIME: "a time", Dim.PRICE_HOUR: "a price per hour", Dim.PRICE_GB: "a price per GB",
         Dim.THROUGHPUT: "a throughput"}
_EXAMPLE = {Dim.MEMORY: "80 GiB", Dim.BANDWIDTH: "25 GB/s", Dim.COMPUTE: "312 TFLOP/s", Dim.TIME: "5 us",
            Dim.PRICE_HOUR: "2.5 $/h", Dim.PRICE_GB: "0.02 $/GB", Dim.THROUGHPUT: "1000 tokens/s"}
DISPLAY_HINT = {Dim.MEMORY: ["GiB", "GB"], Dim.BANDWIDTH: ["GB/s", "Gb/s"], Dim.COMPUTE: ["TFLOP/s"],
                Dim.TIME: ["s", "ms", "us"], Dim.PRICE_HOUR: ["$/h"], Dim.PRICE_GB: ["$/GB"],
                Dim.THROUGHPUT: ["tokens/s"]}


def _enum_or_none(enum: type[E], text: str) -> E | None:
    return next((m for m in enum if m.value == text.lower()), None)


def is_enum(tp: object) -> TypeGuard[type[StrEnum]]:
    return isinstance(tp, type) and issubclass(tp, StrEnum)


def out_of_bounds(value: float, info: FieldInfo, what: str, got: str) -> str:
    """'' where `value` is within the field's bounds, else the rule it breaks (`got`: the value as written)."""
    lo, hi = info.meta.lo, info.meta.hi
    below, above = lo is not None and value < lo, hi is not None and value > hi
    if not (below or above):
        return ""
    if lo is not None and hi is not None and hi - lo <= 16:  # a small closed set: 0..3, 0..1
        return f"{what} must be between {lo:g} and {hi:g}, got {got}"
    if below and lo is not None:
        rules: dict[float, str] = {0: "must not be negative", 1: "must be positive"}
        return f"{what} {rules.get(lo, f'must be at least {lo:g}')}, got {got}"
    return f"{what} must be at most {hi:g}, got {got}"


def _shown(node: syntax.Value) -> str:
    if isinstance(node, syntax.Number):
        return node.written
    if isinstance(node, syntax.Word):
        return f"'{node.name}'"
    if isinstance(node, syntax.String):
        return f'"{node.value}"'
    if isinstance(node, syntax.ListValue):
        return "a list"
    if isinstance(node, syntax.LayerRange):
        return f"{node.first}..{node.last}"
    if isinstance(node, syntax.RankRef):
        return f"{node.group}[...]"
    return "auto"

def words(items: Iterable[object], quote: bool = False) -> str:
    texts = [f"'{i}'" if quote else str(i) for i in items]
    if len(texts) <= 1:
        return "".join(texts)
    return ", ".join(texts[:-1]) + " and " + texts[-1] if quote else ", ".join(texts[:-1]) + " or " + texts[-1]
