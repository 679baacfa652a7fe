"""Specs printed by `hetc fmt` parse back to equal Specs.

Hypothesis builds Spec dataclasses directly (not text), field by field from
the schema in the fields' metadata: bounds, units, enums, blocks, `auto` and
optional values, so a new field is covered without touching this file.
Every generated value is one the converter can produce; the printer must
find text for each that reads back unchanged.
"""

from __future__ import annotations

import dataclasses
from enum import StrEnum

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetc.frontend.convert import FieldInfo, fields_of, to_spec
from hetc.ir.errors import Span
from hetc.frontend.printer import format_file, format_spec
from hetc.ir.spec import AUTO, LayerRange, Node, RankSlice, Routing, RoutingKind, Spec
from hetc.frontend.syntax import parse_text

_KEYWORDS = {"auto", "use"}
# Names as the grammar's NAME token spells them (layer names, node groups).
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_\-]{0,8}", fullmatch=True).filter(lambda s: s not in _KEYWORDS)
# Any text a string can hold: no line breaks, no lone surrogates.
texts = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\n"), max_size=10)
small = st.integers(0, 64)


@st.composite
def indices(draw) -> tuple[int | None, int | None, bool]:
    """(start, stop, is_slice) of one side of `group[node, gpu]`."""
    if draw(st.booleans()):
        return draw(small), None, False
    return draw(st.none() | small), draw(st.none() | small), True


@st.composite
def rank_slices(draw) -> RankSlice:
    (n0, n1, nsl), (g0, g1, gsl) = draw(indices()), draw(indices())
    return RankSlice(group=draw(names), node_start=n0, node_stop=n1, node_is_slice=nsl,
                     gpu_start=g0, gpu_stop=g1, gpu_is_slice=gsl)


layer_ranges = st.builds(lambda a, b: LayerRange(first=a, last=b), names, names)
routings = st.one_of(
    st.sampled_from([RoutingKind.EVEN, RoutingKind.PROPORTIONAL]).map(lambda k: Routing(kind=k)),
    st.lists(st.integers(0, 1 << 30), min_size=1, max_size=4).map(
        lambda c: Routing(kind=RoutingKind.COUNTS, counts=tuple(c))),
)


def scalar_strategy(info: FieldInfo) -> st.SearchStrategy:
    base, lo, hi = info.base, info.meta.lo, info.meta.hi
    if base is bool:
        return st.booleans()
    if base is int:
        return st.integers(int(lo if lo is not None else -(2**63)), int(hi if hi is not None else 2**63))
    if base is float:
        return st.floats(lo, hi, allow_nan=False, allow_infinity=False)
    if base is str:
        return texts
    if isinstance(base, type) and issubclass(base, StrEnum):
        return st.sampled_from(list(base))
    special = {LayerRange: layer_ranges, RankSlice: rank_slices(), Routing: routings}
    if base in special:
        return special[base]
    assert dataclasses.is_dataclass(base) and issubclass(base, Node), base
    return st.deferred(lambda: nodes(base))


def field_strategy(cls: type, info: FieldInfo) -> st.SearchStrategy:
    if cls.__name__ == "ModelSpec" and info.name == "hf":
        return st.just("")   # a random directory has no config.json; tests/test_hf.py round-trips hf models
    one = scalar_strategy(info)
    if info.many:
        # An empty list of layer ranges or stages has no spelling (stages: none written is auto).
        least = 1 if info.base is LayerRange or (cls.__name__ == "ParallelSpec" and info.name == "stages") else 0
        one = st.lists(one, min_size=least, max_size=3).map(tuple)
    if info.auto_ok:
        one = one | st.just(AUTO)
    if info.none_ok:
        one = one | st.none()
    return one


def nodes(cls: type) -> st.SearchStrategy:
    return st.builds(cls, **{i.name: field_strategy(cls, i) for i in fields_of(cls)})


def reparse(spec: Spec) -> Spec:
    text = format_spec(spec)
    return to_spec(list(parse_text(text, "<fmt>").items), Span("<fmt>", 1, 1, 1, 1))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes(Spec))
def test_printed_spec_parses_back_equal(spec: Spec):
    assert reparse(spec) == spec


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes(Spec))
def test_printing_is_canonical(spec: Spec):
    """One canonical printing: printing the reparsed Spec, or formatting the
    printed text as `hetc fmt` does, gives the same text again."""
    text = format_spec(spec)
    assert format_spec(reparse(spec)) == text
    assert format_file(parse_text(text, "<fmt>")) == text


@st.composite
def commented(draw) -> tuple[Spec, str, list[str]]:
    """A printed Spec with comments added at random: own-line ones and trailing ones."""
    spec = draw(nodes(Spec))
    lines, notes = [], []
    for number, line in enumerate(format_spec(spec).split("\n")[:-1]):  # strings may hold \x0c, \u2028
        where = draw(st.sampled_from(["none", "none", "above", "after"]))
        note = f"# note {number}"
        if where == "above":
            lines.append(note)
        lines.append(line + (f"  {note}" if where == "after" else ""))
        notes += [note] if where != "none" else []
    return spec, "\n".join(lines) + "\n", notes


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(commented())
def test_fmt_keeps_every_comment_and_is_idempotent(case):
    spec, text, notes = case
    once = format_file(parse_text(text, "<fmt>"))
    assert all(once.count(note + "\n") + once.count(note + "  ") == 1 for note in notes), once
    assert format_file(parse_text(once, "<fmt>")) == once
    assert to_spec(list(parse_text(once, "<fmt>").items), Span("<fmt>", 1, 1, 1, 1)) == spec
