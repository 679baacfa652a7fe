"""Regenerate the tables of docs/language.md from the Spec's field metadata.

The prose of language.md is written by hand; every region between
`<!-- generated: WHAT -->` and `<!-- end generated -->` is rebuilt from the
schema (hetc/ir/spec.py), the unit table (hetc/ir/units.py) and the enum aliases,
so the key tables cannot drift from what the parser accepts.

    python docs/gen_language.py          # rewrite docs/language.md
    python docs/gen_language.py --check  # exit 1 if it is out of date

WHAT is `keys CLASS` (one block's keys), `units` or `enum-aliases`.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from enum import StrEnum
from pathlib import Path

from hetc.ir import spec as spec_module
from hetc.frontend.schema import FieldInfo, fields_of
from hetc.ir.spec import AUTO, ENUM_ALIASES, LayerRange, RankSlice, Routing
from hetc.ir.units import DISPLAY, UNITS, Dim, format_quantity

__all__ = ["LANGUAGE_MD", "main", "render", "write_or_check"]

LANGUAGE_MD = Path(__file__).resolve().parent / "language.md"
_REGION = re.compile(r"(<!-- generated: ([^>]+?) -->\n).*?(<!-- end generated -->)", re.DOTALL)


def render(text: str) -> str:
    """`text` with every generated region rebuilt."""
    return _REGION.sub(lambda m: m.group(1) + _generate(m.group(2).strip()) + m.group(3), text)


def _generate(what: str) -> str:
    if what == "units":
        return units_table()
    if what == "enum-aliases":
        return enum_aliases_table()
    kind, _, name = what.partition(" ")
    if kind == "keys":
        return key_table(getattr(spec_module, name))
    raise ValueError(f"unknown generated region {what!r}")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def key_table(cls: type) -> str:
    infos = fields_of(cls)
    rows = ["| key | also accepted | value | default | meaning |", "|---|---|---|---|---|"]
    for info in infos:
        key = "*(name after the kind)*" if info.meta.label else f"`{info.meta.block or info.name}`"
        aliases = ", ".join(f"`{a}`" for a in info.meta.aliases)
        cells = [key, aliases, value_kind(info), default_of(cls, info), info.meta.doc]
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(rows) + "\n"


def value_kind(info: FieldInfo) -> str:
    base, lo, hi = info.base, info.meta.lo, info.meta.hi
    if info.meta.block:
        text = f"`{_block_head(info)} {{ }}` block" + ("s, repeatable" if info.many else "")
        short = [i for i in fields_of(base) if i.meta.shorthand]
        if short:
            text += f", or `{info.name} = <{short[0].name}>`"
    elif base is bool:
        text = "`true` or `false`"
    elif base is int:
        text = "whole number" + _bounds(lo, hi)
    elif base is float and info.meta.unit is not None:
        text = f"{info.meta.unit.value} ({', '.join(DISPLAY[info.meta.unit][:3])}, ...)" + _bounds(lo, hi)
    elif base is float:
        text = "number" + _bounds(lo, hi)
    elif base is str:
        text = "name or \"string\""
    elif isinstance(base, type) and issubclass(base, StrEnum):
        text = " | ".join(f"`{m.value}`" for m in base)
    elif base is LayerRange:
        text = "layer range `first..last`, or a list of them"
    elif base is RankSlice:
        text = "rank set `group[node, gpu]`, or a list of them"
    elif base is Routing:
        text = "`even`, `proportional` or `[count, ...]` per lane"
    else:
        text = base.__name__
    if info.auto_ok and info.meta.block:   # the one way to write it (hetc.frontend.values accepts both spellings)
        text += f", or `{info.meta.block} = auto`"
    elif info.auto_ok:
        text += ", or `auto`"
    return text


def _block_head(info: FieldInfo) -> str:
    """`device NAME`, `link A <-> B`, `optimizer KIND`: a block kind with its labels."""
    labels = [i.name.upper() for i in fields_of(info.base) if i.meta.label]
    return " ".join([info.meta.block, " <-> ".join(labels)]).strip()


def _bounds(lo, hi) -> str:
    if lo is None and hi is None:
        return ""
    if hi is None:
        return f", at least {_number(lo)}"
    return f", {_number(lo)} to {_number(hi)}"


def _number(x: float) -> str:
    """Bounds as people write them: 2^20, 2^63 - 1, 1,000,000,000, 0.01."""
    if x != int(x) or abs(x) < 2**20:
        return f"{x:g}"
    n = int(x)
    if n & (n - 1) == 0:
        return f"2^{n.bit_length() - 1}"
    if (n + 1) & n == 0:
        return f"2^{n.bit_length()} - 1"
    return f"{n:,}"


def default_of(cls: type, info: FieldInfo) -> str:
    if info.required:
        return "required"
    f = next(f for f in dataclasses.fields(cls) if f.name == info.name)
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if value is AUTO:
        return "`auto`"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, StrEnum):
        return f"`{value.value}`"
    if isinstance(value, float) and info.meta.unit is not None:
        return f"`{format_quantity(value, info.meta.unit)}`"
    if isinstance(value, (int, float, str)):
        return f"`{value}`" if value != "" else "empty"
    if isinstance(value, tuple):
        return "none"
    if isinstance(value, Routing):
        return f"`{value.kind.value}`"
    return "its defaults"


def units_table() -> str:
    rows = ["| quantity | units |", "|---|---|"]
    for dim in Dim:
        units = [u for u, (d, _) in UNITS.items() if d is dim]
        rows.append(f"| {dim.value} | {', '.join(f'`{u}`' for u in units)} |")
    return "\n".join(rows) + "\n"


def enum_aliases_table() -> str:
    rows = ["| value of | also accepted (→ canonical) |", "|---|---|"]
    for enum, aliases in ENUM_ALIASES.items():
        pairs = [f"`{a}` → `{c}`" for a, c in aliases.items() if a != c]
        rows.append(f"| {enum.__name__} | {_cell(', '.join(pairs))} |")
    return "\n".join(rows) + "\n"


def write_or_check(path: Path, fresh: str, argv: list[str]) -> int:
    """Write `fresh` to `path`, or with --check only report (exit 1) whether it differs."""
    if "--check" not in argv:
        path.write_text(fresh)
        return 0
    if path.is_file() and path.read_text() == fresh:
        return 0
    print(f"{path} is out of date: run python docs/{Path(sys.argv[0]).name}", file=sys.stderr)
    return 1


def main(argv: list[str]) -> int:
    return write_or_check(LANGUAGE_MD, render(LANGUAGE_MD.read_text()), argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
