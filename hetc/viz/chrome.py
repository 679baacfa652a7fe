"""Timelines in the Trace Event format, for Perfetto and chrome://tracing.

A process per rank (named by rank, device, stage and lane), a thread per
stream, a complete event ("X") per instruction named by its text, a flow
("s" -> "f") per point-to-point message and a counter ("C") for device
memory. Trace viewers require that the complete events of one thread nest
(a later event lies inside or after an earlier one); a measured stream may
overlap itself (an async send still in flight when the next starts), so
`_pack` spreads such events over extra threads of the same stream.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence

from hetc.ir.jsontypes import JsonObject
from hetc.ir.timeline import Event, Stream, Timeline

__all__ = ["chrome_trace", "chrome_trace_json"]

_US = 1e6                 # the format's timestamps are microseconds
_TIDS_PER_STREAM = 100    # room for overflow threads of one stream
_STREAM_TID = {s: i * _TIDS_PER_STREAM for i, s in enumerate(Stream)}


def _pack(events: list[Event]) -> list[int]:
    """For events of one stream sorted by start: the overflow slot of each, so that every slot nests."""
    stacks: list[list[float]] = []    # per slot: ends of the events still open
    slots: list[int] = []
    for e in events:
        for slot, stack in enumerate(stacks):
            while stack and stack[-1] <= e.start:
                stack.pop()
            if not stack or e.end <= stack[-1]:
                stack.append(e.end)
                slots.append(slot)
                break
        else:
            stacks.append([e.end])
            slots.append(len(stacks) - 1)
    return slots


def _process_events(timeline: Timeline, pid_base: int, prefix: str) -> list[JsonObject]:
    out: list[JsonObject] = []
    for info in timeline.ranks:
        pid = pid_base + info.rank
        name = f"{prefix}rank {info.rank} · {info.device} {info.gpu} · stage {info.stage} lane {info.lane}"
        out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "ts": 0, "args": {"name": name}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "ts": 0,
                    "args": {"sort_index": pid}})
    return out


# where each (rank, instruction index) landed in the trace: (thread id, start in microseconds)
_Where = dict[tuple[int, int], tuple[int, float]]


def _slices(timeline: Timeline, pid_base: int) -> tuple[list[JsonObject], _Where]:
    """Complete events and thread names; and where each (rank, index) landed: (tid, start us)."""
    by_track: dict[tuple[int, Stream], list[Event]] = defaultdict(list)
    for e in timeline.events:
        by_track[e.rank, e.stream].append(e)
    out: list[JsonObject] = []
    where: _Where = {}
    for (rank, stream), events in sorted(by_track.items(), key=lambda kv: (kv[0][0], _STREAM_TID[kv[0][1]])):
        events.sort(key=lambda e: (e.start, -e.end))
        slots = _pack(events)
        for slot in sorted(set(slots)):
            label = stream.value if slot == 0 else f"{stream.value} #{slot + 1}"
            tid = _STREAM_TID[stream] + slot
            out.append({"ph": "M", "name": "thread_name", "pid": pid_base + rank, "tid": tid, "ts": 0,
                        "args": {"name": label}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": pid_base + rank, "tid": tid, "ts": 0,
                        "args": {"sort_index": tid}})
        for e, slot in zip(events, slots):
            tid = _STREAM_TID[stream] + slot
            out.append({"ph": "X", "name": e.text, "cat": e.kind.value, "pid": pid_base + rank, "tid": tid,
                        "ts": e.start * _US, "dur": max(0.0, e.end - e.start) * _US,
                        "args": {"index": e.index, "kind": e.kind.value}})
            where[rank, e.index] = (tid, e.start * _US)
    return out, where


def _flows(timeline: Timeline, pid_base: int, where: _Where, first_id: int) -> list[JsonObject]:
    out: list[JsonObject] = []
    for n, f in enumerate(timeline.flows):
        src, dst = where.get((f.src_rank, f.src_index)), where.get((f.dst_rank, f.dst_index))
        if src is None or dst is None:
            continue
        common: JsonObject = {"name": "p2p", "cat": "p2p", "id": first_id + n}
        out.append({**common, "ph": "s", "pid": pid_base + f.src_rank, "tid": src[0], "ts": src[1],
                    "args": {"bytes": f.nbytes}})
        # "bp": "e" binds the arrow's head to the receive slice that encloses its time
        out.append({**common, "ph": "f", "bp": "e", "pid": pid_base + f.dst_rank, "tid": dst[0], "ts": dst[1]})
    return out


def _counters(timeline: Timeline, pid_base: int) -> list[JsonObject]:
    return [{"ph": "C", "name": "device memory", "pid": pid_base + m.rank, "tid": 0, "ts": m.time * _US,
             "args": {"bytes": m.nbytes}} for m in sorted(timeline.memory, key=lambda m: (m.rank, m.time))]


def chrome_trace(timelines: Sequence[Timeline]) -> JsonObject:
    """One trace for one or more timelines; the second and later get their own process ids."""
    events: list[JsonObject] = []
    pid_base, flow_id = 0, 0
    for timeline in timelines:
        events += _process_events(timeline, pid_base, f"{timeline.source} " if len(timelines) > 1 else "")
        slices, where = _slices(timeline, pid_base)
        events += slices
        events += _flows(timeline, pid_base, where, flow_id)
        events += _counters(timeline, pid_base)
        flow_id += len(timeline.flows)
        pid_base += max((r.rank for r in timeline.ranks), default=0) + 1
        pid_base = -(-pid_base // 1000) * 1000   # a round offset reads better in the viewer
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"generator": "hetc viz", "sources": [t.source for t in timelines],
                          "step_time_s": [t.step_time for t in timelines]}}


def chrome_trace_json(timelines: Sequence[Timeline]) -> str:
    return json.dumps(chrome_trace(timelines), separators=(",", ":"))
