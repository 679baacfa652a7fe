"""The types of JSON values hetc writes and reads.

`JsonValue` is what `json.dumps` turns into text: the to_json methods of the
IRs return it, so a value JSON cannot hold (a Path, an enum member) is a type
error, not a TypeError at write time. Read-only views (`Mapping`, `Sequence`)
keep it covariant: a `list[int]` is a JSON array.

`RawJson` is a value `json.load` returned, before anything checked its shape:
dynamic by nature, so readers narrow it (isinstance, or a typed constructor
that raises on a bad field) right where they read it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeAlias

__all__ = ["JsonObject", "JsonValue", "RawJson", "read_by_layout"]

JsonValue: TypeAlias = "Mapping[str, JsonValue] | Sequence[JsonValue] | str | int | float | bool | None"
JsonObject: TypeAlias = dict[str, JsonValue]   # a JSON object being built
RawJson: TypeAlias = Any                       # parsed JSON whose shape is not checked yet


@contextmanager
def read_by_layout(fail: Callable[[str], Exception], keep: tuple[type[Exception], ...] = ()) -> Iterator[None]:
    """Narrowing `RawJson` by another system's layout (Sailor's and Zorse's files): a value of another type or
    shape (a list where it writes an object, a word where a number) or a missing key raises `fail(what was
    wrong)`, not an internal error. `keep`: the reader's own errors, which pass through."""
    try:
        yield
    except keep:
        raise
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as err:
        raise fail(f"no {err}" if isinstance(err, KeyError) else str(err)) from None
