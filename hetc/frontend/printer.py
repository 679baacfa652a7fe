"""Print syntax trees as canonical .het text, and Specs back as syntax trees.

`format_file` is `hetc fmt`: one statement per line, two-space indent,
comments kept, at most one blank line kept between statements, a blank line
between top-level blocks. It is idempotent. `spec_to_items` turns a Spec
into syntax (defaults left out) so `format_items(spec_to_items(s))` parses
back to a Spec equal to `s`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from enum import StrEnum
from typing import Any

from hetc.frontend import syntax
from hetc.ir.errors import NO_SPAN
from hetc.frontend.schema import FieldInfo, fields_of
from hetc.ir.spec import AUTO, LayerRange, Node, RankSlice, Routing, RoutingKind, Spec
from hetc.ir.units import format_quantity

__all__ = ["format_file", "format_items", "format_spec", "spec_to_items"]

INDENT = "  "
WIDTH = 96
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*\Z")
_KEYWORDS = {"auto", "use"}


def format_file(file: syntax.File) -> str:
    return format_items(file.items)


def format_items(items: Sequence[syntax.Item]) -> str:
    lines: list[str] = []
    _items(items, 0, lines, top=True)
    return "\n".join(lines).rstrip() + "\n"


def format_spec(spec: Spec) -> str:
    return format_items(spec_to_items(spec))


# ------------------------------------------------------------------ text


def _items(items: Sequence[syntax.Item], depth: int, out: list[str], top: bool = False) -> None:
    prev: syntax.Item | None = None
    for item in items:
        # A trailing comment ends the line before it: the previous statement's, or the block's head.
        if isinstance(item, syntax.Comment) and item.trailing and out and (prev is not None or depth > 0):
            out[-1] += "  " + item.text
            continue
        if prev is not None and _blank_between(prev, item, top):
            out.append("")
        _item(item, depth, out)
        prev = item


def _blank_between(prev: syntax.Item, item: syntax.Item, top: bool) -> bool:
    if top and not (isinstance(prev, syntax.Use) and isinstance(item, syntax.Use)):
        if isinstance(prev, syntax.Block) or isinstance(item, syntax.Block) and not isinstance(prev, syntax.Comment):
            return True
        if isinstance(prev, syntax.Use) and not isinstance(item, syntax.Use):
            return True
    start = item.span.line
    return prev.span.line > 0 and start > 0 and start > prev.span.end_line + 1


def _item(item: syntax.Item, depth: int, out: list[str]) -> None:
    pad = INDENT * depth
    if isinstance(item, syntax.Comment):
        out.append(pad + item.text)
    elif isinstance(item, syntax.Use):
        out.append(f"{pad}use {_quote(item.path)}")
    elif isinstance(item, syntax.Attr):
        out.append(f"{pad}{item.key} = {_value(item.value, depth)}")
    else:
        head = pad + item.kind
        if item.label is not None:
            head += " " + _label(item.label)
        if item.peer is not None:
            head += " <-> " + _label(item.peer)
        if not item.items:
            out.append(head + " {}")
            return
        out.append(head + " {")
        _items(item.items, depth + 1, out)
        out.append(pad + "}")


def _label(text: str) -> str:
    return text if _NAME.match(text) and text not in _KEYWORDS else _quote(text)


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _value(v: syntax.Value, depth: int) -> str:
    if isinstance(v, syntax.Auto):
        return "auto"
    if isinstance(v, syntax.Number):
        return v.text if v.unit is None else f"{v.text} {v.unit}"
    if isinstance(v, syntax.String):
        return _quote(v.value)
    if isinstance(v, syntax.Word):
        return v.name
    if isinstance(v, syntax.LayerRange):
        return f"{v.first}..{v.last}"
    if isinstance(v, syntax.RankRef):
        idx = _index(v.node) + ("" if v.gpu is None else ", " + _index(v.gpu))
        return f"{v.group}[{idx}]"
    parts = [_value(i, depth + 1) for i in v.items]
    one_line = "[" + ", ".join(parts) + "]"
    if len(one_line) + len(INDENT) * depth < WIDTH - 20:
        return one_line
    inner = INDENT * (depth + 1)
    return "[\n" + "".join(f"{inner}{row},\n" for row in _fill(parts, WIDTH - len(inner))) + INDENT * depth + "]"


def _fill(parts: list[str], width: int) -> list[str]:
    """Rows of comma-separated parts, each row as full as `width` allows (a long list of counts)."""
    rows: list[str] = []
    for part in parts:
        if rows and len(rows[-1]) + 2 + len(part) + 1 <= width and "\n" not in part + rows[-1]:
            rows[-1] += ", " + part
        else:
            rows.append(part)
    return rows


def _index(i: syntax.Index) -> str:
    if not i.is_slice:
        return str(i.start)
    return f"{'' if i.start is None else i.start}:{'' if i.stop is None else i.stop}"


# ------------------------------------------------------------------ Spec -> syntax


def spec_to_items(node: Node) -> list[syntax.Item]:
    """The items of `node`'s block body (for Spec: the top-level blocks)."""
    items: list[syntax.Item] = []
    for info in fields_of(type(node)):
        if info.meta.label:
            continue
        value = getattr(node, info.name)
        default = _default(type(node), info.name)
        if value == default and not info.required:
            continue
        if info.meta.block and value is not AUTO and value is not None:
            items += _blocks(info, info.meta.block, value)
        else:
            items.append(syntax.Attr(info.name, _syntax(info, value), NO_SPAN, NO_SPAN))
    return items


def _default(cls: type, name: str) -> object:
    """Field `name`'s default value in dataclass `cls` (dataclasses.MISSING: it has none)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _blocks(info: FieldInfo, kind: str, value: Any) -> list[syntax.Item]:
    """Field `info`'s `value` (a node, or a tuple of nodes) as blocks of `kind`, or as shorthand attributes."""
    values = value if info.many else (value,)
    out: list[syntax.Item] = []
    for v in values:
        shorthand = _as_shorthand(v)
        if shorthand is not None:
            out.append(syntax.Attr(info.name, shorthand, NO_SPAN, NO_SPAN))
            continue
        raw = [getattr(v, i.name) for i in fields_of(type(v)) if i.meta.label]
        labels: list[str | None] = [str(lab.value if isinstance(lab, StrEnum) else lab) for lab in raw]
        labels += [None] * (2 - len(labels))
        out.append(syntax.Block(kind, labels[0], labels[1], tuple(spec_to_items(v)),
                             NO_SPAN, NO_SPAN))
    return out


def _as_shorthand(node: Node) -> syntax.Value | None:
    infos = fields_of(type(node))
    short = [i for i in infos if i.meta.shorthand]
    if not short or any(i is not short[0] and getattr(node, i.name) != _default(type(node), i.name)
                        for i in infos):
        return None
    return _syntax(short[0], getattr(node, short[0].name))


def _syntax(info: FieldInfo, value: object) -> syntax.Value:
    if value is AUTO:
        return syntax.Auto(NO_SPAN)
    if isinstance(value, tuple):
        parts = [_scalar(info, v) for v in value]
        if len(parts) == 1 and info.base in (LayerRange, RankSlice):
            return parts[0]
        return syntax.ListValue(tuple(parts), NO_SPAN)
    return _scalar(info, value)


def _scalar(info: FieldInfo, value: object) -> syntax.Value:
    if isinstance(value, bool):
        return syntax.Word("true" if value else "false", NO_SPAN)
    if isinstance(value, StrEnum):
        return syntax.Word(value.value, NO_SPAN)
    if isinstance(value, int):
        return syntax.Number(str(value), None, NO_SPAN)
    if isinstance(value, float):
        if info.meta.unit is not None:
            text, unit = format_quantity(value, info.meta.unit).split(" ", 1)
            return syntax.Number(text, unit, NO_SPAN)
        return syntax.Number(repr(value), None, NO_SPAN)
    if isinstance(value, str):
        if _NAME.match(value) and value not in _KEYWORDS | {"true", "false"}:
            return syntax.Word(value, NO_SPAN)
        return syntax.String(value, NO_SPAN)
    if isinstance(value, LayerRange):
        if value.first == value.last:
            return syntax.Word(value.first, NO_SPAN)
        return syntax.LayerRange(value.first, value.last, NO_SPAN)
    if isinstance(value, RankSlice):
        return _rank_ref(value)
    if isinstance(value, Routing):
        if value.kind is RoutingKind.COUNTS:
            return syntax.ListValue(tuple(syntax.Number(str(c), None, NO_SPAN) for c in value.counts), NO_SPAN)
        return syntax.Word(value.kind.value, NO_SPAN)
    raise TypeError(f"cannot print {value!r}")


def _rank_ref(r: RankSlice) -> syntax.Word | syntax.RankRef:
    whole_node = r.node_is_slice and r.node_start is None and r.node_stop is None
    whole_gpu = r.gpu_is_slice and r.gpu_start is None and r.gpu_stop is None
    if whole_node and whole_gpu:
        return syntax.Word(r.group, NO_SPAN)
    node = syntax.Index(r.node_start, r.node_stop, r.node_is_slice)
    gpu = None if whole_gpu else syntax.Index(r.gpu_start, r.gpu_stop, r.gpu_is_slice)
    return syntax.RankRef(r.group, node, gpu, NO_SPAN)
