"""The discrete-event simulation behind pass `schedule` (Note [schedules by simulation]).

Each lane has a `Policy` naming the ops it would run next; `simulate` runs
all lanes together with the caller's durations and returns the order in which
each lane ran its ops, and when each op started (`Run`). Dependencies
between ops (a forward needs the previous ministage's forward of the same
microbatch, ...) come from the caller, so this module knows nothing about
schedules or ministages.

Note [coupled lanes]: where lanes issue a collective together around every
compute op (the lanes of a stage under ZeRO-2/3 with a per-microbatch
schedule; the lanes of an expert-parallel group around their MoE blocks), a
lane cannot get ahead of its siblings: op k of any lane starts only when
every lane of its group has run its op k-1. The simulation models that with
a pseudo-op ("K", group, k-1), finished when the group's last lane finishes
its op k-1, so the orders it returns stay feasible when the lanes are
coupled. The first lane to run its op k leads: it chooses a kind of op
(forward, backward, weight gradient) that every sibling can run once its
inputs exist, and its siblings run the same kind at k, so the group's lanes
issue the same collectives in the same order.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from hetc.ir.errors import InternalError

__all__ = ["Op", "Policy", "Run", "simulate"]

log = logging.getLogger(__name__)

# An op is (kind, ms, mb) with kind one of "F", "B", "I", "W" (and "K" for a lockstep group's point).
Op = tuple[str, int, int]
LaneKey = tuple[int, int]   # (stage, lane)


class Order(Enum):
    """How a lane under an in-flight limit picks its next op (Note [schedules by simulation])."""

    STRICT = "strict"                   # Megatron's 1F1B: a forward whenever the limit allows, else a backward
    READY_FORWARD = "ready forward"     # the same preferences among the ops whose inputs are there
    READY_BACKWARD = "ready backward"   # a backward whenever one is ready, else a forward


@dataclass
class Policy:
    """Which op a lane runs next. `f_order` / `b_order` are its queues in order."""

    f_order: list[Op]
    b_order: list[Op]
    w_order: list[Op] = field(default_factory=list)
    limit: int | None = None      # None: strict sequence f_order + b_order
    per_unit: int = 1             # ops of one microbatch unit (ministages run back to back)
    order: Order = Order.READY_BACKWARD
    fi: int = 0
    bi: int = 0
    wi: int = 0

    def candidates(self) -> list[Op]:
        """Ops the lane would run now, most preferred first."""
        f = self.next_forward()
        b = self.b_order[self.bi] if self.bi < len(self.b_order) else None
        w = self.w_order[self.wi] if self.wi < min(len(self.w_order), self.bi) else None
        if self.limit is None:
            return [f] if f is not None else ([b] if b is not None else [])
        # a microbatch's activations stay stashed until its last backward op (W under zero-bubble): it is
        # in flight until then, so ZB-H1 keeps 1F1B's peak memory (Note [in-flight limit], passes/cost)
        done = self.wi if self.w_order else self.bi
        in_flight = -(-self.fi // self.per_unit) - done // self.per_unit
        forward_allowed = f is not None and (in_flight < self.limit or self.fi % self.per_unit)
        # ZB-H1: 1F1B's order with B split; a weight gradient that holds the next forward back comes first
        # (F, I, W, F, ...), the others fill the cooldown behind the input gradients
        by_input = -(-self.fi // self.per_unit) - self.bi // self.per_unit
        first, then = (w, b) if f is not None and by_input < self.limit else (b, w)
        backs = [op for op in (first, then) if op is not None]
        if self.order is Order.STRICT and not self.bi % self.per_unit:
            return [f] if forward_allowed and f is not None else backs
        if self.order is Order.READY_FORWARD:   # the same preferences, without waiting for a late forward input
            return ([f] if forward_allowed and f is not None else []) + backs
        out = [b] if b is not None else []
        if forward_allowed and f is not None:
            out.append(f)
        if w is not None:
            out.append(w)
        return out

    def head(self, kind: str) -> list[Op]:
        """The next op of one kind (F, B or I, W) whatever the limit, for a lane following its stage's lead."""
        if kind == "F":
            queue, i = self.f_order, self.fi
        elif kind == "W":
            queue, i = self.w_order, self.wi
        else:
            queue, i = self.b_order, self.bi
        return [queue[i]] if i < len(queue) else []

    def held_back(self) -> bool:
        """The next forward waits only for the in-flight limit."""
        f = self.next_forward()
        return f is not None and self.limit is not None and f not in self.candidates()

    def next_forward(self) -> Op | None:
        return self.f_order[self.fi] if self.fi < len(self.f_order) else None

    def advance(self, op: Op) -> None:
        if op[0] == "F":
            self.fi += 1
        elif op[0] == "W":
            self.wi += 1
        else:
            self.bi += 1

    @property
    def done(self) -> int:
        return self.fi + self.bi + self.wi

    @property
    def finished(self) -> bool:
        return self.fi == len(self.f_order) and self.bi == len(self.b_order) and self.wi == len(self.w_order)


@dataclass(frozen=True)
class Run:
    """What the lanes did: each lane's ops in the order it ran them."""

    orders: dict[LaneKey, list[Op]]


class _Simulation:
    def __init__(self, policies: dict[LaneKey, Policy], deps: Callable[[Op], list[Op]],
                 duration: Callable[[Op], float], coupled: list[tuple[LaneKey, ...]], lift_limits: bool = True,
                 lag: Callable[[Op, Op], float] | None = None):
        self.policies, self.deps, self.duration = policies, deps, duration
        self.lag = lag or (lambda dep, op: 0.0)
        self.lift_limits = lift_limits
        self.group_of = {key: g for g, lanes in enumerate(coupled) for key in lanes}   # lane -> lockstep group
        self.siblings = {g: sorted(lanes) for g, lanes in enumerate(coupled)}
        self.end: dict[Op, float] = {}
        self.orders: dict[LaneKey, list[Op]] = {key: [] for key in policies}
        self.clock = {key: 0.0 for key in policies}
        self.version = {key: 0 for key in policies}
        self.parked: dict[Op, list[tuple[LaneKey, int]]] = {}      # op -> (lane, its version) waiting on it
        self.lockstep: dict[tuple[int, int], list[float]] = {}   # (group, k) -> [lanes done, latest end]
        self.lead: dict[tuple[int, int], str] = {}        # (group, k) -> kind of op the first lane ran
        self.heap = [(0.0, i, key, 0) for i, key in enumerate(sorted(policies))]
        self.seq = len(self.heap)

    def push(self, t: float, key: LaneKey, ver: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, key, ver))

    def run(self) -> Run:
        heapq.heapify(self.heap)
        while self.heap or (self.lift_limits and self._lift_limit()):
            t, _, key, ver = heapq.heappop(self.heap)
            policy = self.policies[key]
            if ver != self.version[key] or policy.finished:
                continue
            now = max(t, self.clock[key])
            chosen, wake, missing = self._pick(key, now)
            if chosen is not None:
                self._run_op(key, chosen, now)
                continue
            if wake is not None:
                self.push(wake, key, self.version[key])
            for dep in missing:
                self.parked.setdefault(dep, []).append((key, self.version[key]))
        stuck = [key for key, p in self.policies.items() if not p.finished]
        if stuck:
            raise InternalError(f"schedule generation is stuck: lanes {stuck} cannot proceed")
        return Run(self.orders)

    def _deps_of(self, key: LaneKey, op: Op) -> list[Op]:
        deps = self.deps(op)
        k = self.policies[key].done
        if key in self.group_of and k > 0:
            deps = deps + [("K", self.group_of[key], k - 1)]
        return deps

    def _candidates(self, key: LaneKey) -> tuple[list[Op], list[Op]]:
        """(ops the lane may run now, most preferred first; dependencies a sibling lane still waits for)."""
        policy = self.policies[key]
        group = self.group_of.get(key)
        if group is None:
            return policy.candidates(), []
        lead = self.lead.get((group, policy.done))
        if lead is not None:
            return policy.head(lead), []
        # the first lane at op k chooses for its group: only a kind every sibling can run once its inputs exist
        shared, waiting = [], []
        for op in policy.candidates():
            missing = [d for sib in self.siblings[group] for head in self.policies[sib].head(op[0])
                       for d in self.deps(head) if d not in self.end]
            if missing:
                waiting += missing
            else:
                shared.append(op)
        return shared, waiting

    def _pick(self, key: LaneKey, now: float) -> tuple[Op | None, float | None, list[Op]]:
        """(op to run now | None, earliest time something may be ready, unscheduled dependencies)."""
        candidates, missing = self._candidates(key)
        wake = None
        for op in candidates:
            deps = self._deps_of(key, op)
            unscheduled = [d for d in deps if d not in self.end]
            if unscheduled:
                missing += unscheduled
                continue
            ready = max((self.end[d] + _finite(self.lag(d, op), "lag", (d, op)) for d in deps), default=0.0)
            if ready <= now:
                return op, None, []
            wake = ready if wake is None else min(wake, ready)
        return None, wake, missing

    def _run_op(self, key: LaneKey, op: Op, now: float) -> None:
        finish = now + _finite(self.duration(op), "duration", op)
        k = self.policies[key].done
        self.orders[key].append(op)
        self.policies[key].advance(op)
        self.clock[key] = finish
        self.version[key] += 1
        self.push(finish, key, self.version[key])
        self._finished(op, finish)
        group = self.group_of.get(key)
        if group is not None:
            self.lead.setdefault((group, k), op[0])
            point = self.lockstep.setdefault((group, k), [0, 0.0])
            point[0] += 1
            point[1] = max(point[1], finish)
            if point[0] == len(self.siblings[group]):
                self._finished(("K", group, k), point[1])

    def _finished(self, op: Op, finish: float) -> None:
        self.end[op] = finish
        for waiter, wver in self.parked.pop(op, []):
            self.push(finish, waiter, wver)

    def _lift_limit(self) -> bool:
        """Note [lifting a limit]: when every lane waits, let one lane run a forward beyond its in-flight limit.

        With many-to-many routing (or lanes in lockstep) the 1F1B limits of
        lanes that share microbatches unevenly can wait on each other in a
        cycle. Every lane's queues follow one global order of ops, so
        following the forwards each stuck lane waits for ends at a lane
        whose next forward has its input and is held back only by its limit;
        that lane (the earliest ready, then the lowest stage and lane) keeps
        one more microbatch in flight. False when no lane can.
        """
        held = []
        for key, policy in sorted(self.policies.items()):
            forward = policy.next_forward()
            if not policy.held_back() or forward is None or \
                    self.lead.get((self.group_of.get(key, -1), policy.done), "F") != "F":
                continue
            deps = self._deps_of(key, forward)
            if all(d in self.end for d in deps):
                held.append((max([self.end[d] + self.lag(d, forward) for d in deps] + [self.clock[key]]), key))
        if not held:
            return False
        ready, key = min(held)
        for lane in self.siblings.get(self.group_of.get(key, -1), [key]):   # lanes in lockstep keep equal limits
            sibling = self.policies[lane]
            assert sibling.limit is not None   # only a limited lane is held back
            sibling.limit += 1
            self.push(ready, lane, self.version[lane])
        log.debug("schedule: lane %s runs a forward beyond its in-flight limit (now %d)", key,
                  self.policies[key].limit)
        return True


def _finite(seconds: float, what: str, of: object) -> float:
    """`seconds`, checked: a NaN or infinite time would leave an event the clock never reaches, and the
    simulation would spin for ever (Note [finite measurements] in passes/cost/sources/measured_json.py
    keeps such times out of profiles; this catches any other way in)."""
    if not (math.isfinite(seconds) and seconds >= 0):
        raise InternalError(f"schedule simulation: the {what} of {of} is {seconds} s, not a finite time")
    return seconds


def simulate(policies: dict[LaneKey, Policy], deps: Callable[[Op], list[Op]], duration: Callable[[Op], float],
             coupled: list[tuple[LaneKey, ...]] | None = None, lift_limits: bool = True,
             lag: Callable[[Op, Op], float] | None = None) -> Run:
    """Run every lane's policy against the others; return each lane's op order and each op's start.

    `lag(dep, op)`: seconds after `dep` ends before `op` may use it (a transfer; 0 by default).
    InternalError when the policies wait on each other for good (with
    `lift_limits`, only when no in-flight limit can be raised to break it).
    """
    return _Simulation(policies, deps, duration, coupled or [], lift_limits, lag).run()
