"""The first lowering pass: each rank's compute order, per schedule kind.

Note [schedules by simulation]: every lane gets a *policy* that names its
next compute op (strict sequences for GPipe and Zorse; "backward first, at
most `limit` microbatches in flight" for 1F1B, interleaved 1F1B and ZB-H1).
A small discrete-event simulation runs all lanes together with nominal
durations (forward = layers, backward = 2 × layers) and records the order
in which each lane ran its ops. Because the orders come out of one
feasible execution, they are consistent across ranks by construction —
with uneven lanes and many-to-many routing as much as in a plain grid —
and the later passes only add communication around them. Durations only
choose among valid orders, so the result is deterministic.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from hetc.errors import InternalError
from hetc.pipeline import Lane, Stage
from hetc.program import Backward, BackwardInput, BackwardWeight, Forward, Load, Program
from hetc.spec import ScheduleKind
from hetc.passes.lower.context import LowerContext, rank_shell

__all__ = ["order_compute", "Op"]

# An op is (kind, ms, mb) with kind one of "F", "B", "I", "W".
Op = tuple[str, int, int]


@dataclass
class _Policy:
    """Which op a lane runs next. `f_order` / `b_order` are its queues in order."""

    f_order: list[Op]
    b_order: list[Op]
    w_order: list[Op] = field(default_factory=list)
    limit: int | None = None      # None: strict sequence f_order + b_order
    per_unit: int = 1             # ops of one microbatch unit (ministages run back to back)
    fi: int = 0
    bi: int = 0
    wi: int = 0

    def candidates(self) -> list[Op]:
        """Ops the lane would run now, most preferred first."""
        f = self.f_order[self.fi] if self.fi < len(self.f_order) else None
        b = self.b_order[self.bi] if self.bi < len(self.b_order) else None
        w = self.w_order[self.wi] if self.wi < min(len(self.w_order), self.bi) else None
        if self.limit is None:
            return [f] if f is not None else ([b] if b is not None else [])
        in_flight = -(-self.fi // self.per_unit) - self.bi // self.per_unit
        out = [b] if b is not None else []
        if f is not None and (in_flight < self.limit or self.fi % self.per_unit):
            out.append(f)
        if w is not None:
            out.append(w)
        return out

    def advance(self, op: Op) -> None:
        if op[0] == "F":
            self.fi += 1
        elif op[0] == "W":
            self.wi += 1
        else:
            self.bi += 1

    @property
    def finished(self) -> bool:
        return self.fi == len(self.f_order) and self.bi == len(self.b_order) and self.wi == len(self.w_order)


def order_compute(ctx: LowerContext) -> Program:
    """Pass `schedule`: a Program holding only loads and compute, in run order."""
    kind = ctx.pipeline.schedule
    lanes = [(stage, lane) for stage in ctx.pipeline.stages for lane in stage.lanes]
    policies = {(s.index, lane.index): _policy(ctx, kind, s, lane) for s, lane in lanes}
    orders = _simulate(ctx, policies, split_backward=kind is ScheduleKind.ZB)
    programs = []
    for place in ctx.places:
        ops = orders[(place.stage.index, place.lane.index)]
        programs.append(_with_loads(ctx, rank_shell(place), ops))
    return Program(tuple(programs), ctx.groups)


def _policy(ctx: LowerContext, kind: ScheduleKind, stage: Stage, lane: Lane) -> _Policy:
    own = list(stage.ministages)
    mbs = list(lane.microbatches)
    bkind = "I" if kind is ScheduleKind.ZB else "B"
    num_stages = len(ctx.pipeline.stages)
    downstream = num_stages - stage.index
    if kind is ScheduleKind.ZORSE:
        f = [("F", ms, mb) for ms in own for mb in mbs]
        b = [("B", ms, mb) for ms in reversed(own) for mb in mbs]
        return _Policy(f, b)
    if kind is ScheduleKind.INTERLEAVED:
        f, b = _interleaved_orders(own, mbs, num_stages)
        v = len(own)
        limit = (downstream - 1) * 2 + (v - 1) * num_stages + 1
        return _Policy(f, b, limit=limit)
    f = [("F", ms, mb) for mb in mbs for ms in own]
    b = [(bkind, ms, mb) for mb in mbs for ms in reversed(own)]
    if kind is ScheduleKind.GPIPE:
        return _Policy(f, b)
    w = [("W", ms, mb) for _, ms, mb in b] if kind is ScheduleKind.ZB else []
    return _Policy(f, b, w, limit=downstream, per_unit=len(own))


def _interleaved_orders(own: list[int], mbs: list[int], group: int) -> tuple[list[Op], list[Op]]:
    """Megatron's interleaved order: microbatches in groups of `group`, chunk by chunk."""
    f, b = [], []
    for start in range(0, len(mbs), group):
        chunk_mbs = mbs[start:start + group]
        f += [("F", ms, mb) for ms in own for mb in chunk_mbs]
        b += [("B", ms, mb) for ms in reversed(own) for mb in chunk_mbs]
    return f, b


def _deps(ctx: LowerContext, op: Op, split_backward: bool) -> list[Op]:
    kind, ms, mb = op
    bkind = "I" if split_backward else "B"
    if kind == "F":
        return [] if ctx.starts_model(ms) else [("F", ms - 1, mb)]
    if kind == "W":
        return [("I", ms, mb)]
    deps = [("F", ms, mb)]
    if not ctx.ends_model(ms):
        deps.append((bkind, ms + 1, mb))
    return deps


def _duration(ctx: LowerContext, op: Op) -> float:
    m = ctx.pipeline.ministages[op[1]]
    layers = m.stop_layer - m.first_layer
    return {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}[op[0]] * layers


def _simulate(ctx: LowerContext, policies: dict, split_backward: bool) -> dict[tuple[int, int], list[Op]]:
    """Run every lane's policy against the others; return each lane's op order."""
    end: dict[Op, float] = {}
    orders: dict = {key: [] for key in policies}
    clock = {key: 0.0 for key in policies}
    version = {key: 0 for key in policies}
    parked: dict[Op, list] = {}
    heap = [(0.0, i, key, 0) for i, key in enumerate(sorted(policies))]
    heapq.heapify(heap)
    seq = len(heap)
    while heap:
        t, _, key, ver = heapq.heappop(heap)
        if ver != version[key]:
            continue
        policy = policies[key]
        if policy.finished:
            continue
        now = max(t, clock[key])
        chosen, wake, missing = _pick(ctx, policy, now, end, split_backward)
        if chosen is not None:
            finish = now + _duration(ctx, chosen)
            end[chosen] = finish
            orders[key].append(chosen)
            policy.advance(chosen)
            clock[key] = finish
            version[key] += 1
            seq += 1
            heapq.heappush(heap, (finish, seq, key, version[key]))
            for waiter, wver in parked.pop(chosen, []):
                seq += 1
                heapq.heappush(heap, (finish, seq, waiter, wver))
            continue
        if wake is not None:
            seq += 1
            heapq.heappush(heap, (wake, seq, key, version[key]))
        for dep in missing:
            parked.setdefault(dep, []).append((key, version[key]))
    stuck = [key for key, p in policies.items() if not p.finished]
    if stuck:
        raise InternalError(f"schedule generation is stuck: lanes {stuck} cannot proceed")
    return orders


def _pick(ctx, policy: _Policy, now: float, end: dict, split_backward: bool):
    """(op to run now | None, earliest time something may be ready, unscheduled dependencies)."""
    wake, missing = None, []
    for op in policy.candidates():
        deps = _deps(ctx, op, split_backward)
        unscheduled = [d for d in deps if d not in end]
        if unscheduled:
            missing += unscheduled
            continue
        ready = max((end[d] for d in deps), default=0.0)
        if ready <= now:
            return op, None, []
        wake = ready if wake is None else min(wake, ready)
    return None, wake, missing


_COMPUTE = {"F": Forward, "B": Backward, "I": BackwardInput, "W": BackwardWeight}


def _with_loads(ctx: LowerContext, shell, ops: list[Op]):
    """The rank's compute ops, with a `load` before the first use of each microbatch's data."""
    instrs, loaded = [], set()
    for kind, ms, mb in ops:
        needs_data = kind == "F" and (ctx.starts_model(ms) or ctx.ends_model(ms))
        if needs_data and mb not in loaded:
            instrs.append(Load(mb))
            loaded.add(mb)
        instrs.append(_COMPUTE[kind](ms, mb))
    return type(shell)(shell.rank, shell.stage, shell.lane, shell.tp_rank, shell.cp_rank, shell.shards,
                       tuple(instrs))
