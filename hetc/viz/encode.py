"""A Timeline packed for the page: a string table and flat integer arrays.

Note [compact page data]: a 1024-rank plan has ~10^5 events. As objects
(`{"rank": 3, "text": ...}`) they would cost ~150 bytes each; packed as
columns of small integers with instruction texts in a deduplicated string
table they cost ~30, and the browser parses them as plain JSON arrays in
tens of milliseconds. Events are grouped by rank in display order (stage,
lane, rank) through an offsets array, sorted by stream then start, so the
page draws one rank's track from one contiguous slice. Times are integers
in `unit` seconds, chosen so that a step spans about 10^6 ticks.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from hetc.timeline import EventKind, Stream, Timeline

__all__ = ["encode_timeline", "tokens_per_s", "StageSummary", "stage_summaries", "KIND_ORDER", "STREAM_ORDER"]

KIND_ORDER = tuple(EventKind)
STREAM_ORDER = tuple(Stream)
_TICKS_PER_STEP = 1e6


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


class _Strings:
    def __init__(self) -> None:
        self.table: list[str] = []
        self._index: dict[str, int] = {}

    def __call__(self, text: str) -> int:
        index = self._index.get(text)
        if index is None:
            index = self._index[text] = len(self.table)
            self.table.append(text)
        return index


def encode_timeline(timeline: Timeline) -> dict:
    """The page's view of one timeline (see Note [compact page data])."""
    unit = _time_unit(timeline.step_time)
    strings = _Strings()
    ranks = sorted(timeline.ranks, key=lambda r: (r.stage, r.lane, r.rank))
    bubbles = timeline.bubble_fractions()
    events_of, memory_of = defaultdict(list), defaultdict(list)
    for e in timeline.events:
        events_of[e.rank].append(e)
    for m in timeline.memory:
        memory_of[m.rank].append(m)
    stream_rank = {s: i for i, s in enumerate(STREAM_ORDER)}
    kind_rank = {k: i for i, k in enumerate(KIND_ORDER)}
    ev = {"offsets": [0], "index": [], "text": [], "kind": [], "stream": [], "start": [], "dur": []}
    mem = {"offsets": [0], "time": [], "bytes": []}
    position: dict[tuple[int, int], int] = {}
    for info in ranks:
        for e in sorted(events_of[info.rank], key=lambda e: (stream_rank[e.stream], e.start, e.index)):
            position[e.rank, e.index] = len(ev["index"])
            start = round(e.start / unit)
            ev["index"].append(e.index)
            ev["text"].append(strings(e.text))
            ev["kind"].append(kind_rank[e.kind])
            ev["stream"].append(stream_rank[e.stream])
            ev["start"].append(start)
            ev["dur"].append(max(0, round(e.end / unit) - start))
        ev["offsets"].append(len(ev["index"]))
        for m in sorted(memory_of[info.rank], key=lambda m: m.time):
            mem["time"].append(round(m.time / unit))
            mem["bytes"].append(round(m.nbytes))
        mem["offsets"].append(len(mem["time"]))
    flows: list[int] = []
    for f in timeline.flows:
        src, dst = position.get((f.src_rank, f.src_index)), position.get((f.dst_rank, f.dst_index))
        if src is not None and dst is not None:  # a flow whose ends were not traced has nothing to join
            flows += [src, dst, round(f.nbytes)]
    return {
        "source": timeline.source, "step_time": timeline.step_time, "unit": unit,
        "tokens_per_s": tokens_per_s(timeline), "plan": [list(p) for p in timeline.plan],
        "strings": strings.table,
        "ranks": {"rank": [r.rank for r in ranks], "stage": [r.stage for r in ranks],
                  "lane": [r.lane for r in ranks], "device": [strings(r.device) for r in ranks],
                  "gpu": [strings(r.gpu) for r in ranks], "capacity": [round(r.capacity) for r in ranks],
                  "bubble": [round(bubbles.get(r.rank, 0.0), 4) for r in ranks]},
        "events": ev, "flows": flows, "memory": mem,
    }


@dataclass(frozen=True, slots=True)
class StageSummary:
    """One line of the side panel's stage table."""

    stage: int
    num_ranks: int
    num_lanes: int
    devices: str
    mean_bubble: float
    peak_memory: float        # the highest any rank of the stage reaches, bytes
    capacity: float           # the smallest capacity among those ranks, bytes


def stage_summaries(timeline: Timeline) -> list[StageSummary]:
    bubbles = timeline.bubble_fractions()
    peak: dict[int, float] = defaultdict(float)
    for m in timeline.memory:
        peak[m.rank] = max(peak[m.rank], m.nbytes)
    by_stage = defaultdict(list)
    for r in timeline.ranks:
        by_stage[r.stage].append(r)
    return [StageSummary(stage, len(rs), len({r.lane for r in rs}), ", ".join(sorted({r.device for r in rs})),
                         sum(bubbles.get(r.rank, 0.0) for r in rs) / len(rs),
                         max(peak[r.rank] for r in rs), min(r.capacity for r in rs))
            for stage, rs in sorted(by_stage.items())]
