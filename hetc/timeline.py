"""A timeline of one training step: what each rank did when, on which stream.

The compiler's simulator predicts one (`timeline.json` in a plan directory)
and `hetc run --trace` measures one; both use this format, so `hetc viz`
draws either, or both side by side.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import StrEnum

from hetc.program import (AllGather, AllReduce, AllToAll, Backward, BackwardInput, BackwardWeight, Forward,
                          Free, Instr, Load, Offload, Prefetch, Recv, ReduceScatter, Send, Step, Wait)

__all__ = ["Event", "EventKind", "Flow", "MemorySample", "RankInfo", "Stream", "Timeline", "classify"]

FORMAT_VERSION = 1


class Stream(StrEnum):
    COMPUTE = "compute"
    P2P = "p2p"
    COLLECTIVE = "collective"
    COPY = "copy"        # host <-> device


class EventKind(StrEnum):
    FORWARD = "forward"
    BACKWARD = "backward"
    BACKWARD_INPUT = "backward_input"
    BACKWARD_WEIGHT = "backward_weight"
    OPTIMIZER = "optimizer"
    LOAD = "load"
    SEND = "send"
    RECV = "recv"
    COLLECTIVE = "collective"
    OFFLOAD = "offload"
    PREFETCH = "prefetch"
    FREE = "free"
    WAIT = "wait"


_KIND_OF = {
    Forward: (EventKind.FORWARD, Stream.COMPUTE), Backward: (EventKind.BACKWARD, Stream.COMPUTE),
    BackwardInput: (EventKind.BACKWARD_INPUT, Stream.COMPUTE),
    BackwardWeight: (EventKind.BACKWARD_WEIGHT, Stream.COMPUTE), Step: (EventKind.OPTIMIZER, Stream.COMPUTE),
    Load: (EventKind.LOAD, Stream.COMPUTE), Send: (EventKind.SEND, Stream.P2P), Recv: (EventKind.RECV, Stream.P2P),
    AllGather: (EventKind.COLLECTIVE, Stream.COLLECTIVE), ReduceScatter: (EventKind.COLLECTIVE, Stream.COLLECTIVE),
    AllReduce: (EventKind.COLLECTIVE, Stream.COLLECTIVE), AllToAll: (EventKind.COLLECTIVE, Stream.COLLECTIVE),
    Offload: (EventKind.OFFLOAD, Stream.COPY), Prefetch: (EventKind.PREFETCH, Stream.COPY),
    Free: (EventKind.FREE, Stream.COMPUTE), Wait: (EventKind.WAIT, Stream.COMPUTE),
}


def classify(instr: Instr) -> tuple[EventKind, Stream]:
    """The event kind and the stream an instruction runs on."""
    return _KIND_OF[type(instr)]


@dataclass(frozen=True, slots=True)
class Event:
    rank: int
    index: int          # the instruction's index in its rank's program
    text: str           # the instruction's text form: its label everywhere
    kind: EventKind
    stream: Stream
    start: float        # seconds since the step started
    end: float


@dataclass(frozen=True, slots=True)
class Flow:
    """A point-to-point message: from the send event to the matching receive."""

    src_rank: int
    src_index: int
    dst_rank: int
    dst_index: int
    nbytes: float


@dataclass(frozen=True, slots=True)
class MemorySample:
    rank: int
    time: float
    nbytes: float       # device memory in use from this time on


@dataclass(frozen=True, slots=True)
class RankInfo:
    rank: int
    stage: int
    lane: int
    device: str         # device kind name
    gpu: str            # e.g. "a100[1, 3]"
    capacity: float     # device memory, bytes


@dataclass(frozen=True)
class Timeline:
    source: str                          # "predicted" or "measured"
    ranks: tuple[RankInfo, ...]
    events: tuple[Event, ...]
    flows: tuple[Flow, ...] = ()
    memory: tuple[MemorySample, ...] = ()
    step_time: float = 0.0
    # plan facts for the side panel, in display order: ("schedule", "1f1b"), ...
    plan: tuple[tuple[str, str], ...] = field(default=())

    def events_of(self, rank: int) -> list[Event]:
        return [e for e in self.events if e.rank == rank]

    def busy_time(self, rank: int, stream: Stream = Stream.COMPUTE) -> float:
        return sum(e.end - e.start for e in self.events if e.rank == rank and e.stream == stream
                   and e.kind is not EventKind.WAIT)

    def bubble_fraction(self, rank: int) -> float:
        """Share of the step the rank's compute stream is idle."""
        return self._idle_share(self.busy_time(rank))

    def bubble_fractions(self) -> dict[int, float]:
        """`bubble_fraction` of every rank in one pass over the events (for plans of thousands of ranks)."""
        busy = {r.rank: 0.0 for r in self.ranks}
        for e in self.events:
            if e.stream == Stream.COMPUTE and e.kind is not EventKind.WAIT:
                busy[e.rank] = busy.get(e.rank, 0.0) + e.end - e.start
        return {rank: self._idle_share(b) for rank, b in busy.items()}

    def _idle_share(self, busy: float) -> float:
        if self.step_time <= 0:
            return 0.0
        return max(0.0, 1.0 - busy / self.step_time)

    def to_json(self) -> str:
        return json.dumps({
            "version": FORMAT_VERSION, "source": self.source, "step_time": self.step_time,
            "plan": [list(p) for p in self.plan],
            "ranks": [asdict(r) for r in self.ranks],
            "events": [[e.rank, e.index, e.text, e.kind.value, e.stream.value, e.start, e.end] for e in self.events],
            "flows": [[f.src_rank, f.src_index, f.dst_rank, f.dst_index, f.nbytes] for f in self.flows],
            "memory": [[m.rank, m.time, m.nbytes] for m in self.memory],
        })

    @classmethod
    def from_json(cls, text: str) -> Timeline:
        obj = json.loads(text)
        if obj.get("version") != FORMAT_VERSION:
            raise ValueError(f"timeline format version {obj.get('version')!r}, expected {FORMAT_VERSION}")
        return cls(
            source=obj["source"], step_time=obj["step_time"],
            plan=tuple((k, v) for k, v in obj["plan"]),
            ranks=tuple(RankInfo(**r) for r in obj["ranks"]),
            events=tuple(Event(r, i, t, EventKind(k), Stream(s), a, b) for r, i, t, k, s, a, b in obj["events"]),
            flows=tuple(Flow(*f) for f in obj["flows"]),
            memory=tuple(MemorySample(*m) for m in obj["memory"]),
        )
