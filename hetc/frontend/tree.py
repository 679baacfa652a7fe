"""The syntax tree of a .het file: plain frozen dataclasses with spans.

`hetc.frontend.syntax` builds it from lark's parse tree (and re-exports every name
here); `hetc.frontend.convert` turns it into the typed Spec; `hetc.frontend.printer` prints it.
No lark object appears in it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hetc.ir.errors import Span

__all__ = [
    "Attr", "Auto", "Block", "Comment", "File", "Index", "Item", "LayerRange", "ListValue", "Number",
    "RankRef", "String", "Use", "Value", "Word",
]


@dataclass(frozen=True, slots=True)
class Auto:
    span: Span = field(compare=False)


@dataclass(frozen=True, slots=True)
class Number:
    text: str
    unit: str | None
    span: Span = field(compare=False)
    spaced: bool = field(default=True, compare=False)   # a space between number and unit, as written

    @property
    def written(self) -> str:
        """The value as the user wrote it (`1f1v` stays one word in messages)."""
        return self.text + (" " if self.spaced else "") + self.unit if self.unit else self.text

    @property
    def value(self) -> float:
        return float(self.text)

    def is_int(self) -> bool:
        return self.text.lstrip("+-").isdigit()


@dataclass(frozen=True, slots=True)
class String:
    value: str
    span: Span = field(compare=False)


@dataclass(frozen=True, slots=True)
class Word:
    name: str
    span: Span = field(compare=False)


@dataclass(frozen=True, slots=True)
class LayerRange:
    first: str
    last: str
    span: Span = field(compare=False)


@dataclass(frozen=True, slots=True)
class Index:
    """`i` (start=i, stop=None, is_slice=False) or `a:b` (either side optional)."""

    start: int | None
    stop: int | None
    is_slice: bool


@dataclass(frozen=True, slots=True)
class RankRef:
    group: str
    node: Index
    gpu: Index | None
    span: Span = field(compare=False)


@dataclass(frozen=True, slots=True)
class ListValue:
    items: tuple[Value, ...]
    span: Span = field(compare=False)


Value = Auto | Number | String | Word | LayerRange | RankRef | ListValue


@dataclass(frozen=True, slots=True)
class Comment:
    """A comment, kept so `hetc fmt` does not lose it."""

    text: str
    trailing: bool
    span: Span = field(compare=False)


@dataclass(frozen=True, slots=True)
class Attr:
    key: str
    value: Value
    span: Span = field(compare=False)
    key_span: Span = field(compare=False)


@dataclass(frozen=True, slots=True)
class Block:
    kind: str
    label: str | None
    peer: str | None
    items: tuple[Item, ...]
    span: Span = field(compare=False)
    kind_span: Span = field(compare=False)
    label_spans: tuple[Span, ...] = field(default=(), compare=False)  # of label, then peer


@dataclass(frozen=True, slots=True)
class Use:
    path: str
    span: Span = field(compare=False)


Item = Attr | Block | Use | Comment


@dataclass(frozen=True, slots=True)
class File:
    path: str
    items: tuple[Item, ...]
