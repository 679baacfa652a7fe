"""Predict one step's timeline by running the programs against the cost model.

Note [timeline model]: each rank issues its instructions in order. Compute
(forward, backward, optimizer step) occupies the rank's compute stream for
the cost model's duration. Asynchronous work runs beside it: a message
moves once both its send and its receive are posted, taking the link's
time; a collective starts when the last member posts it; host copies queue
on the rank's copy stream. `wait` holds the issuing thread until the work
is done, and a blocking instruction is its own wait. The step ends when
the last rank finishes. This is the same blocking model the verifier
checks, with time added, so verified programs always simulate to the end.
The compute of a ministage with tensor/context parallelism runs its
collectives inside (Note [compute collectives] in hetc/program.py), so the
ranks of its lane run it in lockstep: it starts when the last of them
reaches it and takes the slowest one's time, which the cost model's
`compute_time` gives with the TP/CP communication included.

Note [memory samples]: the memory check's walk (`rank_levels`) gives each
rank's bytes in use while each instruction runs; the simulator knows when
the rank issued each one. A sample goes where the level changes, at the
issue time of the instruction that changes it, and one more at the rank's
end for the use after its last instruction. The curve is then a step
function whose maximum is the verifier's peak.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from hetc.passes.verify.memory import Sizes, rank_levels
from hetc.pipeline import Pipeline
from hetc.program import (COLLECTIVE_TYPES, COMPUTE_TYPES, AllGather, AllReduce, AllToAll, Backward, BackwardInput,
                          BackwardWeight, Forward, Free, Instr, Load, Offload, Prefetch, Program, Recv, ReduceScatter,
                          Send, Step, Tensor, Wait)
from hetc.spec import DTYPE_BYTES, Spec
from hetc.timeline import Event, Flow, MemorySample, RankInfo, Timeline, classify

__all__ = ["SimulationError", "simulate"]

_PHASE = {Forward: "F", Backward: "B", BackwardInput: "I", BackwardWeight: "W"}


class SimulationError(RuntimeError):
    """The programs cannot be run to the end (they should have failed verification)."""


@dataclass
class _Op:
    rank: int
    index: int
    instr: Instr
    post: float
    end: float | None = None


@dataclass
class _Rank:
    pc: int = 0
    t: float = 0.0
    handles: dict[int, _Op] = field(default_factory=dict)
    blocking: _Op | None = None
    copy_free: float = 0.0


class _Sim:
    def __init__(self, program: Program, pipeline: Pipeline, spec: Spec, costs):
        self.program, self.pipeline, self.spec, self.costs = program, pipeline, spec, costs
        assert spec.model is not None   # a checked spec
        self.delta = DTYPE_BYTES[spec.model.dtype]
        self.ranks = [_Rank() for _ in program.ranks]
        self.channels: dict[tuple[int, int], tuple[deque, deque]] = {}
        self.calls: dict[str, list[list[_Op]]] = {}
        self.count: dict[tuple[str, int], int] = {}
        self.members = {g.name: g.ranks for g in program.groups}
        self.shards = {rp.rank: {s.ms: s for s in rp.shards} for rp in program.ranks}
        self.events: list[Event] = []
        self.flows: list[Flow] = []
        self.issued: list[list[float]] = [[] for _ in program.ranks]   # rank -> issue time of each instruction

    # ------------------------------------------------------------ durations

    def _compute(self, rank: int, instr) -> float:
        if isinstance(instr, Step):
            return self.costs.optimizer_time(rank, self._opt_numel(rank, instr.ms))
        if isinstance(instr, (Load, Free, Wait)):
            return 0.0
        return self.costs.compute_time(rank, instr.ms, _PHASE[type(instr)])

    def _opt_numel(self, rank: int, ms: int) -> float:
        shard = self.shards[rank][ms]
        return sum(self._part_share(rank, shard, part) * self.costs.numel(ms, rank) / self._opt_parts(part)
                   for part in (shard, shard.experts) if part is not None)

    def _opt_parts(self, part) -> int:
        if part.group is None or part.level == 0:
            return 1
        parts = len(self.members[part.group])
        if part.outer is not None and part.outer_level == 1:
            parts *= len(self.members[part.outer])
        return parts

    def _part_share(self, rank: int, shard, part) -> float:
        """The share of a ministage's parameters in buffer `part` (its expert or dense ones, or all)."""
        if shard.experts is None:
            return 1.0
        experts = self.costs.expert_fraction(shard.ms, rank)
        return experts if part is not shard else 1.0 - experts

    def _collective_bytes(self, rank: int, instr) -> float:
        if isinstance(instr, AllReduce) and instr.what in (Tensor.LOSS, Tensor.NORM):
            return 8.0
        if isinstance(instr, AllToAll):
            return self.costs.boundary_bytes(instr.ms)
        whole = self.shards[rank][instr.ms]
        shard = whole.part(instr.group)
        full = self.costs.param_bytes(instr.ms, rank) * self._part_share(rank, whole, shard)
        if instr.group == shard.outer:
            assert shard.group is not None   # an outer group is one across shard groups
            return full / len(self.members[shard.group])
        return full

    def _copy_bytes(self, rank: int, instr) -> float:
        if instr.what is Tensor.ACT:
            return self.costs.boundary_bytes(instr.ms)
        shard = self.shards[rank][instr.ms]
        full = self.costs.param_bytes(instr.ms, rank)
        return full / len(self.members[shard.group]) if shard.level == 3 and shard.group else full

    # ------------------------------------------------------------ posting

    def _post(self, op: _Op) -> None:
        instr = op.instr
        if isinstance(instr, (Send, Recv)):
            self._post_p2p(op)
        elif isinstance(instr, (AllGather, ReduceScatter, AllReduce, AllToAll)):
            self._post_collective(op)
        elif isinstance(instr, (Offload, Prefetch)):
            state = self.ranks[op.rank]
            start = max(op.post, state.copy_free)
            op.end = start + self.costs.copy_time(op.rank, self._copy_bytes(op.rank, instr))
            state.copy_free = op.end
            self._event(op.rank, op.index, start, op.end)
        else:
            op.end = op.post

    def _post_p2p(self, op: _Op) -> None:
        instr = op.instr
        assert isinstance(instr, (Send, Recv))
        is_send = isinstance(instr, Send)
        key = (op.rank, instr.peer_to) if isinstance(instr, Send) else (instr.peer_from, op.rank)
        sends, recvs = self.channels.setdefault(key, (deque(), deque()))
        mine, theirs = (sends, recvs) if is_send else (recvs, sends)
        if not theirs:
            mine.append(op)
            return
        other = theirs.popleft()
        send, recv = (op, other) if is_send else (other, op)
        assert isinstance(send.instr, Send)
        nbytes = math.prod(send.instr.shape) * self.delta
        start = max(send.post, recv.post)
        end = start + self.costs.p2p_time(send.rank, recv.rank, nbytes)
        send.end = recv.end = end
        self._event(send.rank, send.index, start, end)
        self._event(recv.rank, recv.index, start, end)
        self.flows.append(Flow(send.rank, send.index, recv.rank, recv.index, nbytes))

    def _lockstep(self, rank: int, instr) -> bool:
        if not isinstance(instr, (Forward, Backward, BackwardInput, BackwardWeight)):
            return False
        shard = self.shards[rank].get(instr.ms)
        return shard is not None and bool(shard.compute_groups)

    def _post_lockstep(self, op: _Op) -> None:
        """A compute op with tp/cp/ep collectives: every rank of the lanes its groups join together (one
        lane; an EP group's lanes), the slowest one's time."""
        assert isinstance(op.instr, COMPUTE_TYPES)
        ranks = self._lockstep_ranks(op.rank, op.instr.ms)
        calls = self._call(f"compute:{ranks}", op)
        if len(calls) < len(ranks):
            return
        start = max(o.post for o in calls)
        end = start + max(self._compute(o.rank, o.instr) for o in calls)
        for o in calls:
            o.end = end
            self._event(o.rank, o.index, start, end)

    def _lockstep_ranks(self, rank: int, ms: int) -> tuple[int, ...]:
        groups = self.shards[rank][ms].compute_groups
        lanes = {self.pipeline.lane_of_rank[m] for g in groups for m in self.members[g]}
        return tuple(sorted(r for lane in lanes for r in lane.ranks))

    def _call(self, key: str, op: _Op) -> list[_Op]:
        """Count `op` as its rank's next call on `key`; the posts of that call so far."""
        k = self.count.get((key, op.rank), 0)
        self.count[(key, op.rank)] = k + 1
        calls = self.calls.setdefault(key, [])
        if k == len(calls):
            calls.append([])
        calls[k].append(op)
        return calls[k]

    def _post_collective(self, op: _Op) -> None:
        assert isinstance(op.instr, COLLECTIVE_TYPES)
        group = op.instr.group
        members = self.members[group]
        calls = self._call(group, op)
        if len(calls) < len(members):
            return
        start = max(o.post for o in calls)
        kind = type(op.instr).__name__
        name = {"AllGather": "all_gather", "ReduceScatter": "reduce_scatter", "AllReduce": "all_reduce",
                "AllToAll": "all_to_all"}[kind]
        end = start + self.costs.collective_time(name, members, self._collective_bytes(op.rank, op.instr))
        for o in calls:
            o.end = end
            self._event(o.rank, o.index, start, end)

    # ------------------------------------------------------------ running

    def _event(self, rank: int, index: int, start: float, end: float) -> None:
        instr = self.program.ranks[rank].instrs[index]
        kind, stream = classify(instr)
        self.events.append(Event(rank, index, str(instr), kind, stream, start, end))

    def advance(self, r: int) -> bool:
        state, instrs, issued = self.ranks[r], self.program.ranks[r].instrs, self.issued[r]
        moved = False
        while state.pc < len(instrs):
            if state.blocking is not None:
                if state.blocking.end is None:
                    return moved
                state.t = max(state.t, state.blocking.end)
                state.blocking = None
                state.pc += 1
                moved = True
                continue
            if len(issued) == state.pc:      # first reached (a wait may be retried; t holds meanwhile)
                issued.append(state.t)
            instr = instrs[state.pc]
            if isinstance(instr, Wait):
                op = state.handles[instr.handle]
                if op.end is None:
                    return moved
                state.t = max(state.t, op.end)
            elif self._lockstep(r, instr):
                op = _Op(r, state.pc, instr, state.t)
                self._post_lockstep(op)
                state.blocking = op
                continue
            elif isinstance(instr, (Forward, Backward, BackwardInput, BackwardWeight, Step, Load, Free)):
                duration = self._compute(r, instr)
                if duration > 0:
                    self._event(r, state.pc, state.t, state.t + duration)
                state.t += duration
            else:
                op = _Op(r, state.pc, instr, state.t)
                self._post(op)
                handle = getattr(instr, "handle", None)
                if handle is None:
                    state.blocking = op
                    continue
                state.handles[handle] = op
            state.pc += 1
            moved = True
        return moved

    def run(self) -> float:
        active = set(range(len(self.ranks)))
        while active:
            progress = False
            for r in sorted(active):
                progress |= self.advance(r)
                if self.ranks[r].pc >= len(self.program.ranks[r].instrs) and self.ranks[r].blocking is None:
                    active.discard(r)
            if not progress and active:
                stuck = sorted(active)[:4]
                raise SimulationError(f"ranks {stuck} cannot finish the step (unverified programs?)")
        ends = [s.t for s in self.ranks] + [e.end for e in self.events]
        return max(ends, default=0.0)


def _memory_samples(sim: _Sim, sizes: Sizes) -> list[MemorySample]:
    """Each rank's memory curve, one sample per change (Note [memory samples])."""
    samples = []
    levels = rank_levels(sim.program, sim.pipeline, sizes)
    for rp, rank_level in zip(sim.program.ranks, levels, strict=True):
        times = [*sim.issued[rp.rank], sim.ranks[rp.rank].t]
        last = None
        for time, level in zip(times, rank_level, strict=True):
            if level != last:
                samples.append(MemorySample(rp.rank, time, level))
                last = level
    return samples


def simulate(program: Program, pipeline: Pipeline, spec: Spec, costs, plan_facts=()) -> Timeline:
    """The predicted Timeline of one step (source "predicted"), with each rank's memory curve."""
    sim = _Sim(program, pipeline, spec, costs)
    step_time = sim.run()
    infos = []
    for rp in program.ranks:
        gpu = pipeline.world[rp.rank]
        infos.append(RankInfo(rp.rank, rp.stage, rp.lane, gpu.device.name, str(gpu), gpu.device.memory))
    events = sorted(sim.events, key=lambda e: (e.rank, e.start, e.index))
    return Timeline("predicted", tuple(infos), tuple(events), tuple(sim.flows), tuple(_memory_samples(sim, costs)),
                    step_time, tuple(plan_facts))
