"""The one JSON reader of every measurement file: `hetc profile`'s, Sailor's and Zorse's.

Note [finite measurements]
Python's json reads the tokens NaN, Infinity and -Infinity (and turns a
literal like 1e999 into inf), none of which JSON allows. A non-finite time
or rate in a profile does not fail loudly downstream: a line fitted through
it is NaN, every prediction that touches the layer is NaN, and the schedule
simulation waits for an event at time NaN for ever (finding 10 of issue 28).
So every file of measurements is read here, and any non-finite number in
it, wherever it sits, is refused with the path of the field that holds it
(`layers[2].forward_s`). Which numbers must also be positive depends on the
format (a Sailor profile records 0 for work a layer does not do; a fitted
line may have a negative intercept), so each reader checks its own times
with `positive`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from hetc.ir.jsontypes import RawJson
from hetc.passes.cost.profiles import ProfileError

__all__ = ["positive", "read_measurements"]


@dataclass(frozen=True, slots=True)
class _NonFinite:
    """Stands in, while parsing, for a number that is not finite; `token` is its text in the file."""

    token: str


def read_measurements(path: Path) -> RawJson:
    """The parsed JSON of `path`; ProfileError (naming the file and field) for a non-finite number."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ProfileError(f"cannot find '{path}'") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ProfileError(f"cannot read '{path}': {err}") from None
    try:
        data = json.loads(text, parse_constant=_NonFinite, parse_float=_finite_float)
    except json.JSONDecodeError as err:
        raise ProfileError(f"'{path}' is not valid JSON: {err}") from None
    found = _first_non_finite(data, "")
    if found is not None:
        field, token = found
        raise ProfileError(f"{field or 'the value'} is {token}; measured times and rates must be finite "
                           "numbers", file=str(path))
    return data


def positive(value: float, field: str, source: str) -> float:
    """`value`, a time or size that must be above 0; ProfileError naming `field` of `source` otherwise."""
    if not value > 0:
        raise ProfileError(f"{field} is {value}; profile times must be finite and positive", file=source)
    return value


def _finite_float(token: str) -> float | _NonFinite:
    value = float(token)
    return value if math.isfinite(value) else _NonFinite(token)


def _first_non_finite(value: RawJson, where: str) -> tuple[str, str] | None:
    """(the field's path, its token) of the first non-finite number in document order, else None."""
    if isinstance(value, _NonFinite):
        return where, value.token
    if isinstance(value, dict):
        items = ((f"{where}.{key}" if where else str(key), item) for key, item in value.items())
    elif isinstance(value, list):
        items = ((f"{where}[{i}]", item) for i, item in enumerate(value))
    else:
        return None
    return next((found for path, item in items if (found := _first_non_finite(item, path)) is not None), None)
