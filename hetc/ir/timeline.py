"""A timeline of one training step: what each rank did when, on which stream.

The compiler's simulator predicts one (`timeline.json` in a plan directory)
and `hetc run --trace` measures one; both use this format, so `hetc viz`
draws either, or both side by side.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

from hetc.ir.program import (AllGather, AllReduce, AllToAll, Backward, BackwardInput, BackwardWeight, Forward,
                          Free, Instr, Load, Offload, Prefetch, Recv, ReduceScatter, Send, Step, Wait)

__all__ = [
    "Event",
    "EventKind",
    "Flow",
    "MemorySample",
    "RankInfo",
    "Stream",
    "TimeClass",
    "Timeline",
    "class_times",
    "classify",
    "mean_class_times",
]

FORMAT_VERSION = 1
_R = TypeVar("_R")


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


class TimeClass(StrEnum):
    """What a rank's thread spent a step's time on (Note [time classes])."""

    COMPUTE = "compute"            # forward, backward, data load, free
    COMM_WAIT = "comm_wait"        # blocked in a send, receive or collective, or waiting for one
    OPTIMIZER = "optimizer"        # the optimizer step
    OFFLOAD = "offload"            # host <-> device copies, or waiting for one


# Note [time classes]: the simulator (passes/simulate.py) and `hetc run
# --metrics` (runtime/interpreter.py) both know when a rank's thread reached
# each instruction: the machine's issue times, and the interpreter's clock
# before each handler. The time from reaching instruction i to reaching i+1
# (for the last, to the end of the rank's step) is charged to i's class; a
# `wait` is charged to the class of the work it waits for. The classes of a
# rank so sum to its thread's time, never more than the step, and the
# prediction and the measurement are split by one rule.
_CLASS_OF = {EventKind.OPTIMIZER: TimeClass.OPTIMIZER, EventKind.SEND: TimeClass.COMM_WAIT,
             EventKind.RECV: TimeClass.COMM_WAIT, EventKind.COLLECTIVE: TimeClass.COMM_WAIT,
             EventKind.OFFLOAD: TimeClass.OFFLOAD, EventKind.PREFETCH: TimeClass.OFFLOAD}


def class_times(instrs: tuple[Instr, ...] | list[Instr], reached: list[float], end: float) -> dict[TimeClass, float]:
    """Seconds per class of one rank's step, from the time its thread reached each instruction."""
    out = {c: 0.0 for c in TimeClass}
    posted: dict[int, TimeClass] = {}
    for i, instr in enumerate(instrs[:len(reached)]):
        if isinstance(instr, Wait):
            cls = posted.get(instr.handle, TimeClass.COMM_WAIT)
        else:
            cls = _CLASS_OF.get(classify(instr)[0], TimeClass.COMPUTE)
            handle = getattr(instr, "handle", None)
            if handle is not None:
                posted[handle] = cls
        after = reached[i + 1] if i + 1 < len(reached) else end
        out[cls] += max(after - reached[i], 0.0)
    return out


def mean_class_times(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """The mean over ranks of each class's seconds (the figure `viz --compare` and `calibrate` show)."""
    if not per_rank:
        return {}
    return {c.value: sum(r.get(c.value, 0.0) for r in per_rank) / len(per_rank) for c in TimeClass}


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
    # seconds per TimeClass of each rank's step (Note [time classes]); empty when not known
    classes: tuple[dict[str, float], ...] = field(default=())

    def events_of(self, rank: int) -> list[Event]:
        return [e for e in self.events if e.rank == rank]

    def bubble_fraction(self, rank: int) -> float:
        """Share of the step the rank's compute stream is idle."""
        return self._idle_share(sum(e.end - e.start for e in self.events_of(rank)
                                    if e.stream == Stream.COMPUTE and e.kind is not EventKind.WAIT))

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
            "classes": list(self.classes),
        })

    @classmethod
    def from_json(cls, text: str) -> Timeline:
        """The timeline `to_json` wrote; ValueError or TypeError naming the first field that is not."""
        obj = json.loads(text)
        if not isinstance(obj, dict) or obj.get("version") != FORMAT_VERSION:
            version = obj.get("version") if isinstance(obj, dict) else None
            raise ValueError(f"timeline format version {version!r}, expected {FORMAT_VERSION}")
        plan, classes = _listed(obj, "plan"), obj.get("classes", [])
        if not isinstance(classes, list):
            raise TypeError("classes: expected a list")
        return cls(
            source=_typed(obj.get("source"), "str", "source"),
            step_time=_typed(obj.get("step_time"), "float", "step_time"),
            plan=tuple(_plan_fact(p, f"plan[{i}]") for i, p in enumerate(plan)),
            ranks=_records(RankInfo, _listed(obj, "ranks"), "ranks"),
            events=_records(Event, _listed(obj, "events"), "events"),
            flows=_records(Flow, _listed(obj, "flows"), "flows"),
            memory=_records(MemorySample, _listed(obj, "memory"), "memory"),
            classes=tuple(_class_times(r, f"classes[{i}]") for i, r in enumerate(classes)),
        )


# the JSON values each field type of the records above takes, by the value's own type: cheap on timelines of
# millions of events, and a bool (an int to isinstance) is not a number here
_JSON_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "str": (str,)}
_ENUMS: dict[str, type[StrEnum]] = {"EventKind": EventKind, "Stream": Stream}


def _typed(value: Any, type_name: str, where: str) -> Any:
    if type_name in _ENUMS:
        choices = [k.value for k in _ENUMS[type_name]]
        if value not in choices:
            raise ValueError(f"{where}: {value!r} is not one of {', '.join(choices)}")
        return _ENUMS[type_name](value)
    if type(value) not in _JSON_TYPES[type_name]:
        raise ValueError(f"{where}: expected {type_name}, got {type(value).__name__}")
    return value


def _records(kind: type[_R], rows: list[Any], key: str) -> tuple[_R, ...]:
    """The records of JSON rows: lists in field order (events, flows, memory) or objects (ranks)."""
    fields = dataclasses.fields(kind)   # type: ignore[arg-type]
    types = [str(f.type) for f in fields]
    allowed = [_JSON_TYPES.get(t, (str,)) for t in types]   # an enum's value is a string
    enums = [(j, {k.value: k for k in _ENUMS[t]}) for j, t in enumerate(types) if t in _ENUMS]
    out = []
    for i, row in enumerate(rows):
        if isinstance(row, dict):
            row = [row.get(f.name) for f in fields]
        if not isinstance(row, list) or len(row) != len(fields) or \
                not all(type(v) in ok for v, ok in zip(row, allowed)):
            _wrong(fields, types, row, f"{key}[{i}]")
        for j, members in enums:
            row[j] = members.get(row[j]) or _typed(row[j], types[j], f"{key}[{i}].{fields[j].name}")
        out.append(kind(*row))
    return tuple(out)


def _wrong(fields: tuple[dataclasses.Field[Any], ...], types: list[str], row: Any, where: str) -> None:
    """Raise the error that names what is wrong with a record's row."""
    if not isinstance(row, list) or len(row) != len(fields):
        raise ValueError(f"{where}: expected {len(fields)} fields ({', '.join(f.name for f in fields)})")
    for f, t, v in zip(fields, types, row):
        _typed(v, t, f"{where}.{f.name}")


def _listed(obj: dict[str, Any], key: str) -> list[Any]:
    value = obj.get(key)
    if not isinstance(value, list):
        raise TypeError(f"{key}: expected a list, got {type(value).__name__}")
    return value


def _plan_fact(value: Any, where: str) -> tuple[str, str]:
    if not isinstance(value, list) or len(value) != 2:
        raise ValueError(f"{where}: expected a [name, value] pair")
    return _typed(value[0], "str", where), _typed(value[1], "str", where)


def _class_times(row: Any, where: str) -> dict[str, float]:
    if not isinstance(row, dict):
        raise TypeError(f"{where}: expected an object of seconds per time class")
    known = [c.value for c in TimeClass]
    for k, v in row.items():
        if k not in known:
            raise ValueError(f"{where}: {k!r} is not one of {', '.join(known)}")
        _typed(v, "float", f"{where}.{k}")
    return {k: float(v) for k, v in row.items()}
