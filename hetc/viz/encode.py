"""A Timeline packed for the page: a string table and flat integer arrays.

Note [compact page data]: a 1024-rank plan has 10^5 to 10^6 events. As
objects (`{"rank": 3, "text": ...}`) they would cost ~150 bytes each. Here
they are columns of small integers. Instruction texts are mostly unique
(peers, microbatches, handles differ) but share few shapes, so a text is
stored as a template (its text split around its numbers: `["fwd ms=",
" mb=", ""]`) and the numbers (`3, 17`); a send line costs ~15 bytes
instead of ~45. Events are grouped by rank in display order (stage, lane,
rank) through an offsets array, sorted by stream then start, so the page
draws one rank's track from one contiguous slice. Times are integers in
`unit` seconds, chosen so that a step spans about 10^6 ticks.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from hetc.ir.jsontypes import JsonObject
from hetc.ir.timeline import EventKind, MemorySample, RankInfo, Stream, Timeline, Event

__all__ = [
    "KIND_ORDER",
    "STREAM_ORDER",
    "StageSummary",
    "decode_text",
    "encode_timeline",
    "stage_summaries",
    "tokens_per_s",
]

KIND_ORDER = tuple(EventKind)
STREAM_ORDER = tuple(Stream)
_KIND_RANK = {k: i for i, k in enumerate(KIND_ORDER)}
_STREAM_RANK = {s: i for i, s in enumerate(STREAM_ORDER)}
_TICKS_PER_STEP = 1e6
K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
# a number that prints back the same: no leading zeros, exact as a JS double
_NUMBER = re.compile(r"(?<!\d)(?:0|[1-9]\d{0,14})(?!\d)")


def tokens_per_s(timeline: Timeline) -> float | None:
    """Throughput from the plan facts: `tokens_per_s` itself, or `tokens_per_step` over the step time."""
    facts = dict(timeline.plan)
    for key in ("tokens_per_s", "tokens/s"):
        if key in facts:
            return _number(facts[key])
    per_step = _number(facts.get("tokens_per_step", ""))
    if per_step is None or timeline.step_time <= 0:
        return None
    return per_step / timeline.step_time


def _number(text: str) -> float | None:
    try:
        return float(str(text).replace(",", "").replace("_", ""))
    except ValueError:
        return None


def _time_unit(step_time: float) -> float:
    if step_time <= 0:
        return 1e-9
    return max(1e-9, 10.0 ** math.floor(math.log10(step_time / _TICKS_PER_STEP)))


class _Table(Generic[K, V]):
    """Deduplicating table: value -> its index; the table holds `item_of(value)` at that index."""

    def __init__(self, item_of: Callable[[K], V]) -> None:
        self.items: list[V] = []
        self._index: dict[K, int] = {}
        self._item_of = item_of

    def __call__(self, key: K) -> int:
        index = self._index.get(key)
        if index is None:
            index = self._index[key] = len(self.items)
            self.items.append(self._item_of(key))
        return index


def _split_numbers(text: str) -> tuple[tuple[str, ...], list[int]]:
    """'fwd ms=3 mb=17' -> (('fwd ms=', ' mb=', ''), [3, 17])."""
    return tuple(_NUMBER.split(text)), [int(n) for n in _NUMBER.findall(text)]


def decode_text(parts: list[str], numbers: list[int]) -> str:
    """The inverse of the template split (what the page's script does)."""
    return "".join(p + (str(numbers[k]) if k < len(numbers) else "") for k, p in enumerate(parts))


def encode_timeline(timeline: Timeline) -> JsonObject:
    """The page's view of one timeline (see Note [compact page data])."""
    unit = _time_unit(timeline.step_time)
    strings: _Table[str, str] = _Table(str)
    templates: _Table[tuple[str, ...], list[str]] = _Table(list)
    ranks = sorted(timeline.ranks, key=lambda r: (r.stage, r.lane, r.rank))
    events_of: defaultdict[int, list[Event]] = defaultdict(list)
    memory_of: defaultdict[int, list[MemorySample]] = defaultdict(list)
    for e in timeline.events:
        events_of[e.rank].append(e)
    for m in timeline.memory:
        memory_of[m.rank].append(m)
    ev: dict[str, list[int]] = {"offsets": [0], "index": [], "template": [], "numbers": [], "kind": [],
                                "stream": [], "start": [], "dur": []}
    mem: dict[str, list[int]] = {"offsets": [0], "time": [], "bytes": []}
    position: dict[tuple[int, int], int] = {}
    for info in ranks:
        for e in sorted(events_of[info.rank], key=lambda e: (_STREAM_RANK[e.stream], e.start, e.index)):
            position[e.rank, e.index] = len(ev["index"])
            parts, numbers = _split_numbers(e.text)
            start = round(e.start / unit)
            ev["index"].append(e.index)
            ev["template"].append(templates(parts))
            ev["numbers"] += numbers
            ev["kind"].append(_KIND_RANK[e.kind])
            ev["stream"].append(_STREAM_RANK[e.stream])
            ev["start"].append(start)
            ev["dur"].append(max(0, round(e.end / unit) - start))
        ev["offsets"].append(len(ev["index"]))
        for m in sorted(memory_of[info.rank], key=lambda m: m.time):
            mem["time"].append(round(m.time / unit))
            mem["bytes"].append(round(m.nbytes))
        mem["offsets"].append(len(mem["time"]))
    return {
        "source": timeline.source, "step_time": timeline.step_time, "unit": unit,
        "tokens_per_s": tokens_per_s(timeline), "plan": [list(p) for p in timeline.plan],
        "templates": templates.items, "strings": strings.items,
        "ranks": _rank_columns(timeline, ranks, strings),
        "events": ev, "flows": _flow_triples(timeline, position), "memory": mem,
    }


def _rank_columns(timeline: Timeline, ranks: list[RankInfo], strings: _Table[str, str]) -> JsonObject:
    bubbles = timeline.bubble_fractions()
    return {"rank": [r.rank for r in ranks], "stage": [r.stage for r in ranks],
            "lane": [r.lane for r in ranks], "device": [strings(r.device) for r in ranks],
            "gpu": [strings(r.gpu) for r in ranks], "capacity": [round(r.capacity) for r in ranks],
            "bubble": [round(bubbles.get(r.rank, 0.0), 4) for r in ranks]}


def _flow_triples(timeline: Timeline, position: dict[tuple[int, int], int]) -> list[int]:
    """Flat (send position, receive position, bytes); a flow whose ends were not traced has nothing to join."""
    flows: list[int] = []
    for f in timeline.flows:
        src, dst = position.get((f.src_rank, f.src_index)), position.get((f.dst_rank, f.dst_index))
        if src is not None and dst is not None:
            flows += [src, dst, round(f.nbytes)]
    return flows


@dataclass(frozen=True, slots=True)
class StageSummary:
    """One line of the side panel's stage table."""

    stage: int
    num_ranks: int
    num_lanes: int
    devices: tuple[str, ...]  # device kinds, sorted
    mean_bubble: float
    peak_memory: float        # the highest any rank of the stage reaches, bytes
    capacity: float           # the smallest capacity among those ranks, bytes


def stage_summaries(timeline: Timeline) -> list[StageSummary]:
    bubbles = timeline.bubble_fractions()
    peak: dict[int, float] = defaultdict(float)
    for m in timeline.memory:
        peak[m.rank] = max(peak[m.rank], m.nbytes)
    by_stage: defaultdict[int, list[RankInfo]] = defaultdict(list)
    for r in timeline.ranks:
        by_stage[r.stage].append(r)
    return [StageSummary(stage, len(rs), len({r.lane for r in rs}), tuple(sorted({r.device for r in rs})),
                         sum(bubbles.get(r.rank, 0.0) for r in rs) / len(rs),
                         max(peak[r.rank] for r in rs), min(r.capacity for r in rs))
            for stage, rs in sorted(by_stage.items())]
