"""The lower bound of a step (no program of this plan runs one faster, docs/costmodel.md), and how far
a compiled step is from it: measurements the tests and benchmarks hold the compiled programs to.

Note [step lower bound]: the bound is taken over the rank thread and the
chains of work every program of the plan must run, whatever order its
schedule gives the ops; it reads the plan's choices (stages, lanes and
their microbatches, ZeRO levels and groups, the schedule's kind) and times
them with the cost model's primitives at the grain the compiled program's
simulation uses (`CostModel.op_time`, `p2p_time`, `collective_time`,
`optimizer_time`, every collective over the program's own group of ranks,
one transfer at the concurrency the simulation gives it). For each rank r
of stage s with n microbatches:

- *fill*: r's first forward waits for one of its microbatches to come
  through every ministage before its first (the forward of the fastest
  rank of the lane serving it there, and each border's transfer); under
  ZeRO-3 it also waits for its first gather, posted when r starts; on lanes
  in lockstep behind ZeRO-3 gathers r's second op waits for the group's
  latest lane to be fed (the lane before serving it runs its forwards in
  order) and a gather (`_lockstep_second_op`);
- *busy*: r's thread runs n forwards and backwards (F + I + W under ZB),
  each its own duration; under per-microbatch ZeRO the ops are lowering's
  (one per unit where the stage gathers per block, Note [zero-3 units]):
  under ZeRO-3 each starts no sooner than its gather, posted when the op
  before it started (Note [zero cycle]), and under ZeRO-2/3 the gradient op
  of a buffer (unit or ministage) waits for the reduction of that buffer's
  previous one, the rest of a microbatch's work before the first and after
  the last (all n forwards before, where r runs its forwards first);
- *tail* (what lowering cannot overlap after r's last op, Note [zero
  placement]): the reduction of its first ministage's gradients (the last
  to be produced; of that ministage's first layer alone where the stage
  gathers per block, Note [zero-3 units]: a backward runs the units in
  reverse, each other unit's reduction beside the next one's compute),
  the hierarchical outer reductions and gathers back (each unit's, one
  after another; under ZeRO-2/3 only the last unit's reduction, the others
  ran beside the backward: Note [outer reductions beside the backward] in
  passes/lower/zero.py), the norm when clipping, every optimizer step (only the
  first ministage's, and its outer reduction, under Zorse's interleaved
  update: the others ran inside the step), the last parameter gather
  after a step, and the loss all-reduce over every rank;
- *drain*: after r's last gradient op the gradient still goes back through
  the ministages before r's first, and the stage s' < s it reaches then
  runs its own tail (the fastest of its ranks);
- *round trip*: r's first backward waits for one microbatch to go down and
  back through the stages after it, and after its last forward that
  microbatch's round trip comes before its backward;
- *first backward* (one backward op per ministage: not ZB, not
  interleaved): r's first backward starts no sooner than the gradient of
  one of its microbatches comes back from the lane serving it in the next
  stage, which starts its own backwards no sooner than its first backward
  (recursively); where r's program runs every forward before its first
  backward (GPipe, Zorse: `programs_forwards_first`), no sooner than its n
  forwards; its n backwards (and their ZeRO waits) follow;
- *one microbatch*: each microbatch goes down through every ministage and
  back (what bounds a step of few microbatches), then the first stage's
  tail.

The step is at least the largest of these chains over all ranks
(`StepBound`: the rank whose chain sets it and its parts). Everything not
named here (per-microbatch transfers beside the compute, ZeRO-3 on Zorse's
sweeps, host copies, expert buffers) is left out: leaving work out keeps it
a lower bound.

`bound_gap(built)` puts the compiled program's simulated step beside the
lower bound of its plan and splits the difference over the rank whose chain sets the bound, read from
the simulated timeline: its first compute op starts later than the bound's
fill (`fill`), its compute span holds idle time, waiting for the
pipeline's inputs (`bubbles`: uneven lanes, in-flight limits) or for
collectives (`comm`: ZeRO), and its last op is followed by more than the
bound's drain and tail (`tail`). The four parts sum to the difference.
tests/test_step_bound.py and benchmarks/plan_agreement.py read both: they are measurements of the
compiled programs, not what any command prints.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hetc.passes.agreement import Built
from hetc.passes.cost.model import CostModel
from hetc.passes.cost.schedule import round_trip_span
from hetc.passes.cost.zero_time import across_nodes
from hetc.passes.cost.plan_time import stage_units
from hetc.passes.cost.zero_units import in_run_order
from hetc.ir.pipeline import Lane, Stage
from hetc.ir.program import (COMPUTE_TYPES, Backward, BackwardWeight, Collective, Forward, Phase, Program,
                             RankProgram, Unit)
from hetc.ir.spec import ScheduleKind, ZeroShard
from hetc.ir.timeline import Event, EventKind, Stream, Timeline

__all__ = ["BoundGap", "StepBound", "bound_gap", "programs_forwards_first", "programs_in_flight", "step_bound"]

SCALAR_BYTES = 8.0   # the loss and the norm: one float64 each (passes/lower/finish.py, zero.py)
_GRAD_PHASES = frozenset({Phase.BACKWARD, Phase.WEIGHT_GRAD})   # the ops after which lowering reduces


@dataclass(frozen=True)
class _Op:
    """One compute op of a microbatch as lowering emits it: ministage `ms`'s `phase`, of one unit or whole."""

    ms: int
    unit: Unit | None
    phase: Phase
    time: float


@dataclass(frozen=True)
class StepBound:
    """The lower bound and the chain that sets it (all seconds)."""

    total: float
    rank: int
    fill: float     # before the rank's first compute op
    busy: float     # the rank's own compute span
    drain: float    # after its last op, the gradient back through the stages before it (0: its own tail)
    tail: float     # what cannot overlap after the last backward (its own, or the drained stage's)


def step_bound(cm: CostModel, in_flight: Mapping[int, int] | None = None,
               forwards_first: frozenset[int] = frozenset()) -> StepBound:
    """The lower bound of one step of `cm`'s plan (Note [step lower bound]); `in_flight`: per rank, the most
    microbatches its program keeps in flight (`programs_in_flight`), else as many as it serves;
    `forwards_first`: the ranks whose program runs every forward before its first backward op
    (`programs_forwards_first`; GPipe, Zorse), else none."""
    chains = _Chains(cm, in_flight or {}, forwards_first)
    best: StepBound | None = chains.of_microbatches()
    for stage in cm.pipeline.stages:
        for lane in (lane for lane in stage.lanes if lane.microbatches):   # a lane with none only steps
            for rank in lane.ranks:
                got = chains.of_rank(stage, lane, rank)
                if best is None or got.total > best.total:
                    best = got
    assert best is not None   # a plan has a rank
    return best


def programs_in_flight(program: Program) -> dict[int, int]:
    """Per rank, the most microbatches its compute order holds between their first forward and their last
    backward op (B, or W under ZB): the in-flight limit it keeps (Note [in-flight limit])."""
    out = {}
    for rp in program.ranks:
        ops = [i for i in rp.instrs if isinstance(i, COMPUTE_TYPES)]
        owed = Counter(i.mb for i in ops if isinstance(i, (Backward, BackwardWeight)))
        started: set[int] = set()
        most = 0
        for instr in ops:
            if isinstance(instr, Forward):
                started.add(instr.mb)
            elif isinstance(instr, (Backward, BackwardWeight)):
                owed[instr.mb] -= 1
                if not owed[instr.mb]:
                    started.discard(instr.mb)
            most = max(most, len(started))
        out[rp.rank] = most
    return out


def programs_forwards_first(program: Program) -> frozenset[int]:
    """The ranks whose compute order runs every forward before its first backward op (B, I or W)."""
    def forwards_first(rp: RankProgram) -> bool:
        forward = [isinstance(i, Forward) for i in rp.instrs if isinstance(i, COMPUTE_TYPES)]
        return forward == sorted(forward, reverse=True)   # no forward after a backward op
    return frozenset(rp.rank for rp in program.ranks if forwards_first(rp))


class _Chains:
    def __init__(self, cm: CostModel, in_flight: Mapping[int, int], forwards_first: frozenset[int]) -> None:
        self.cm, self.in_flight, self.forwards_first = cm, in_flight, forwards_first
        self._first_grads: dict[int, float] = {}
        p = cm.pipeline
        self.p, self.kind = p, p.schedule
        self.back = Phase.INPUT_GRAD if self.kind is ScheduleKind.ZB else Phase.BACKWARD   # the way back
        self.lane_of = {(s.index, mb): lane for s in p.stages for lane in s.lanes for mb in lane.microbatches}
        # a chain depends on a microbatch only through the lanes it passes: memoised per (ministage, lanes)
        self._transfers: dict[tuple[int, int, int], float] = {}
        self._fastests: dict[tuple[int, int, Phase], float] = {}
        self.world = tuple(range(p.world_size))
        self.end = cm.collective_time(Collective.ALL_REDUCE, self.world, SCALAR_BYTES)
        self.clips = cm.train.grad_clip > 0
        # the sum of a tied embedding's copies waits for both copies' last backward (Note [tied gradients])
        self.tied = frozenset(p.tied_ranks(cm.model))
        self.tails = {r: self._tail(r) for s in p.stages for r in s.ranks}
        self.stage_tail = {s.index: min(self.tails[r] for r in s.ranks) for s in p.stages}

    # ------------------------------------------------------------ per rank

    def of_rank(self, stage: Stage, lane: Lane, rank: int) -> StepBound:
        cm, n = self.cm, len(lane.microbatches)
        f, i, w = (sum(cm.op_time(rank, ms, ph) for ms in stage.ministages) for ph in (Phase.FORWARD, Phase.INPUT_GRAD, Phase.WEIGHT_GRAD))
        first = stage.ministages[0]
        fill = self._fill(stage, lane, rank)
        held = min(self.in_flight.get(rank, n), n)
        forwards_first = rank in self.forwards_first
        work, zero = n * (f + i + w) + self._other_steps(rank), self._zero_span(stage, rank, n, forwards_first)
        span = max(work, zero)
        if self.kind is not ScheduleKind.INTERLEAVED:   # its ministages are contiguous
            trip = min(self._round_trip(mb, stage.ministages[-1]) for mb in lane.microbatches)
            span = max(span, round_trip_span(n, held, f, i + w, trip))
        if self._times_first_grad():   # from its first backward on, every backward (and no forward when first)
            backs = max(n * (i + w), self._zero_span(stage, rank, n, False, backward_only=True)) \
                if forwards_first else n * (i + w)
            span = max(span, self._first_grad(rank) + backs - fill)
        lockstep = self._lockstep_second_op(stage, rank)
        if lockstep is not None:   # from its second op on, the rest of its work, or of its slots (`_zero_span`)
            start, first_op, first_slot = lockstep
            rest = max(work - first_op, zero - first_slot)
            if start + rest > fill + span:
                fill, span = start - first_op, rest + first_op
        tail = self.tails[rank]
        best = StepBound(fill + span + tail, rank, fill, span, 0.0, tail)
        # ZB: when its last input gradient is done, the rank still owes at most the weight gradients of the
        # microbatches it holds in flight (a stash lives until its W)
        grads_done = fill + span - (held * w if self.kind is ScheduleKind.ZB else 0.0)
        for ms in range(first):   # the gradient back to ministage ms, then its stage's tail
            other = self.p.ministages[ms].stage
            if other == stage.index:
                continue
            drain = min(self._drain(mb, first, ms) for mb in lane.microbatches)
            total = grads_done + drain + self.stage_tail[other]
            if total > best.total:
                best = StepBound(total, rank, fill, grads_done - fill, drain, self.stage_tail[other])
        return best

    def _fill(self, stage: Stage, lane: Lane, rank: int) -> float:
        return max(min(self._arrival(mb, stage.ministages[0]) for mb in lane.microbatches), self._first_gather(rank))

    def _lockstep_second_op(self, stage: Stage, rank: int) -> tuple[float, float, float] | None:
        """ZeRO-3 lanes in lockstep: the earliest start of the rank's second op, its first op's time and slot (as
        `_zero_span` counts it: no shorter than the least gather). The
        second op waits for its gather, which every rank of the group posts when it starts its first op (Note
        [zero cycle]): no sooner than the latest of their fills and a gather (the least of the stage's). Random
        jobs 22 and 58 (a 1-lane stage feeding a ZeRO-3 stage of 2 lanes, its second lane fed one upstream
        forward later) waited there 2.4 ms and more, past each lane's own fill. None: not in lockstep."""
        group = self._group(rank)
        if stage.zero.resolved_level < 3 or len(group) < 2 or stage.ep > 1 or self.kind is ScheduleKind.ZORSE:
            return None
        lanes = {r: lane for lane in stage.lanes for r in lane.ranks}
        latest = max(max(self._fill(stage, lanes[r], r), self._queued_arrival(stage, lanes[r])) for r in group)
        gather = min(self._unit_collective(Collective.ALL_GATHER, group, rank, ms) for ms in stage.ministages)
        first_op = self._ops(stage, rank)[0].time
        return latest + gather, first_op, max(first_op, gather)

    def _queued_arrival(self, stage: Stage, lane: Lane) -> float:
        """The earliest a microbatch of `lane` comes from the stage before, whose lane serving it runs its
        forwards in its microbatches' order, each no shorter than its fastest rank's (not under interleaved 1F1B,
        whose chunks come round, nor Zorse's sweeps, bounded by its busy time alone)."""
        first = stage.ministages[0]
        if first == 0 or self.kind in (ScheduleKind.INTERLEAVED, ScheduleKind.ZORSE):
            return 0.0
        before = self.p.stages[self.p.ministages[first - 1].stage]

        def arrival(mb: int) -> float:
            up = self.lane_of[(before.index, mb)]
            forward = sum(self._fastest(mb, ms, Phase.FORWARD) for ms in before.ministages)
            start = self._fill(before, up, min(up.ranks, key=lambda r: self._fill(before, up, r)))
            return start + (up.microbatches.index(mb) + 1) * forward + self._transfer(mb, first - 1)
        return min(arrival(mb) for mb in lane.microbatches)

    def _times_first_grad(self) -> bool:
        """Whether the first-backward chain applies: every stage a contiguous range of ministages, and one
        backward op per ministage (not ZB's two halves)."""
        return self.kind not in (ScheduleKind.INTERLEAVED, ScheduleKind.ZB)

    def _first_grad(self, rank: int) -> float:
        """The earliest start of the rank's first backward: no sooner than one of its microbatches' gradient
        comes back from the next stage (whose lane starts its own backwards no sooner than its first one), and
        where the rank runs every forward first, after all of them."""
        got = self._first_grads.get(rank)
        if got is not None:
            return got
        cm, stage = self.cm, self.cm.stage_of(rank)
        lane = next(lane for lane in stage.lanes if rank in lane.ranks)
        n, fill = len(lane.microbatches), self._fill(stage, lane, rank)
        f = sum(cm.op_time(rank, ms, Phase.FORWARD) for ms in stage.ministages)
        got = fill + (n if rank in self.forwards_first else 1) * f
        last = stage.ministages[-1]
        if last + 1 < len(self.p.ministages):
            after = self.p.stages[self.p.ministages[last + 1].stage]
            got = max(got, min(self._first_grad(d) + self._transfer(mb, last) +
                               sum(cm.op_time(d, ms, Phase.BACKWARD) for ms in after.ministages)
                               for mb in lane.microbatches for d in self.lane_of[(after.index, mb)].ranks))
        self._first_grads[rank] = got
        return got

    def of_microbatches(self) -> StepBound:
        """Every microbatch goes down through every ministage and back, then the first stage's tail."""
        best: StepBound | None = None
        last = len(self.p.ministages) - 1
        for mb in range(self.p.num_microbatches):
            path = self._arrival(mb, last) + self._fastest(mb, last, Phase.FORWARD) + \
                self._fastest(mb, last, self.back) + self._drain(mb, last, 0)
            lane = self.lane_of[(self.p.ministages[0].stage, mb)]
            rank = min(lane.ranks, key=lambda r: self.tails[r])
            if best is None or path + self.tails[rank] > best.total:
                best = StepBound(path + self.tails[rank], rank, 0.0, path, 0.0, self.tails[rank])
        assert best is not None   # a plan has a microbatch
        return best

    def _zero_span(self, stage: Stage, rank: int, n: int, forwards_first: bool, backward_only: bool = False) -> float:
        """The span per-microbatch ZeRO collectives allow (Note [zero cycle]), op by op as lowering emits them
        (one per unit where the stage gathers per block, Note [zero-3 units]): every op no sooner than its
        gather, posted when the op before it started; every gradient op of a buffer after the reduction of
        that buffer's previous one, with no forward beside the reduction when `forwards_first` (GPipe).
        `backward_only`: the span of the backward ops alone, from the first (the rank runs its forwards first)."""
        level, group = stage.zero.resolved_level, self._group(rank)
        if self.kind is ScheduleKind.ZORSE or level < 2 or len(group) < 2 or stage.ep > 1:
            return 0.0
        ops = [op for op in self._ops(stage, rank) if not backward_only or op.phase is not Phase.FORWARD]
        span = 0.0
        if level >= 3:
            gather = min(self._unit_collective(Collective.ALL_GATHER, group, rank, ms) for ms in stage.ministages)
            slots = [max(op.time, gather) for op in ops]
            span = n * sum(slots) - max(slot - op.time for slot, op in zip(slots, ops))   # the last waits for none
        f = sum(op.time for op in ops if op.phase is Phase.FORWARD)
        grads = [op for op in ops if op.phase in _GRAD_PHASES]
        for op in grads:   # op's buffer: the rest of a microbatch's work lies before its first or after its last
            lead = (n if forwards_first else 1) * f + \
                (sum(g.time for g in grads) - op.time if self.kind is not ScheduleKind.ZB else 0.0)
            reduce = self._buffer_collective(Collective.REDUCE_SCATTER, group, rank, op.ms, op.unit)
            span = max(span, lead + n * op.time + (n - 1) * reduce)
        return span

    def _ops(self, stage: Stage, rank: int) -> list[_Op]:
        """One microbatch's compute ops on `rank`, one per unit where the stage gathers per block."""
        phases = (Phase.FORWARD, Phase.INPUT_GRAD, Phase.WEIGHT_GRAD) if self.kind is ScheduleKind.ZB \
            else (Phase.FORWARD, Phase.BACKWARD)
        out = []
        for ms in stage.ministages:
            units: tuple[Unit | None, ...] = stage_units(self.cm, stage, ms) or (None,)
            out += [_Op(ms, u, ph, self.cm.op_time(rank, ms, ph, u)) for ph in phases for u in units]
        return out

    def _other_steps(self, rank: int) -> float:
        """Zorse's interleaved update steps every ministage but the first inside the step."""
        if not self._interleaved_update():
            return 0.0
        return sum(self._step(rank, ms) for ms in self.cm.stage_of(rank).ministages[1:])

    # ------------------------------------------------------------ chains of one microbatch

    def _arrival(self, mb: int, ms: int) -> float:
        """The earliest start of microbatch `mb`'s forward on ministage `ms`."""
        return sum(self._fastest(mb, m, Phase.FORWARD) + self._transfer(mb, m) for m in range(ms))

    def _drain(self, mb: int, start: int, stop: int) -> float:
        """After `mb`'s gradient op on ministage `start`: its gradient back to ministage `stop`, done there
        (under ZB with the weight gradients of the ministages of `stop`'s stage it passed)."""
        out = sum(self._transfer(mb, m) + self._fastest(mb, m, self.back) for m in range(stop, start))
        if self.kind is not ScheduleKind.ZB:
            return out
        owner = self.p.ministages[stop].stage
        return out + sum(self._fastest(mb, m, Phase.WEIGHT_GRAD) for m in range(stop, start) if self.p.ministages[m].stage == owner)

    def _round_trip(self, mb: int, last: int) -> float:
        """From `mb`'s forward leaving ministage `last` until its gradient comes back to it."""
        later = range(last + 1, len(self.p.ministages))
        return sum(self._fastest(mb, m, Phase.FORWARD) + self._fastest(mb, m, self.back) for m in later) + \
            sum(2 * self._transfer(mb, m) for m in range(last, len(self.p.ministages) - 1))

    def _fastest(self, mb: int, ms: int, phase: Phase) -> float:
        lane = self.lane_of[(self.p.ministages[ms].stage, mb)]
        key = (ms, lane.index, phase)
        got = self._fastests.get(key)
        if got is None:
            got = self._fastests[key] = min(self.cm.op_time(r, ms, phase) for r in lane.ranks)
        return got

    def _transfer(self, mb: int, ms: int) -> float:
        """The quickest piece of `mb`'s activation (or gradient) crossing the border after ministage `ms`."""
        p = self.p
        if ms + 1 >= len(p.ministages) or p.ministages[ms].stage == p.ministages[ms + 1].stage:
            return 0.0
        a, b = p.stages[p.ministages[ms].stage], p.stages[p.ministages[ms + 1].stage]
        src, dst = self.lane_of[(a.index, mb)], self.lane_of[(b.index, mb)]
        key = (ms, src.index, dst.index)
        got = self._transfers.get(key)
        if got is None:
            piece = self.cm.boundary_bytes(ms) / (a.tp * a.cp * b.tp * b.cp)
            got = self._transfers[key] = min(self.cm.p2p_time(x, y, piece) for x in src.ranks for y in dst.ranks)
        return got

    # ------------------------------------------------------------ collectives and steps

    def _tail(self, rank: int) -> float:
        """What follows a rank's last op (Note [zero placement]), none of it beside its compute: lowering puts
        every ministage's outer reduction and step there, but under Zorse's interleaved update only the first's
        (the others ran inside the step)."""
        stage = self.cm.stage_of(rank)
        first, last = stage.ministages[0], stage.ministages[-1]
        finals = [first] if self._interleaved_update() else list(stage.ministages)
        group = self._group(rank)
        level = stage.zero.resolved_level
        tail = self.end
        if len(group) > 1:
            kind = Collective.ALL_REDUCE if level == 0 else Collective.REDUCE_SCATTER
            tail += self._last_reduction(kind, group, rank, first)
            # Note [outer reductions beside the backward]: released buffers reduce across nodes beside the
            # backward; that of the rank's last gradient op (its first ministage's first unit) cannot
            released = level >= 2 and not self._interleaved_update()
            tail += sum(self._outer(stage, rank, ms, reductions=(1 if ms == first else 0) if released else None)
                        for ms in finals)
            stepped = first if self._interleaved_update() else last
            if level in (1, 2):
                tail += self._collective(Collective.ALL_GATHER, group, rank, stepped)
        if self.clips and not self._interleaved_update():
            tail += self.cm.collective_time(Collective.ALL_REDUCE, self.world, SCALAR_BYTES)
        if rank in self.tied:
            tail += self.cm.tied_time
        return tail + sum(self._step(rank, ms) for ms in finals)

    def _outer(self, stage: Stage, rank: int, ms: int, reductions: int | None = None) -> float:
        """Hierarchical ZeRO: the reductions across nodes (and the gathers back) of one ministage, one per
        unit where the stage gathers per block (each of the rank's shard of its buffer, one after another);
        `reductions`: of the first that many buffers only (None: all), the rest ran beside the backward."""
        if stage.zero.shard is not ZeroShard.NODE:
            return 0.0
        outer = self._across(rank)
        if len(outer) < 2:
            return 0.0
        buffers = [self.cm.unit_param_bytes(u, rank) for u in stage_units(self.cm, stage, ms)] or \
            [self._dense_bytes(rank, ms)]
        reduced = buffers if reductions is None else buffers[:reductions]
        reduce = Collective.ALL_REDUCE if stage.zero.across == 0 else Collective.REDUCE_SCATTER
        gathered = buffers if stage.zero.across != 0 else []
        inner = len(self._group(rank))
        return sum(self._ring(reduce, outer, rank, nbytes / inner) for nbytes in reduced) + \
            sum(self._ring(Collective.ALL_GATHER, outer, rank, nbytes / inner) for nbytes in gathered)

    def _group(self, rank: int) -> tuple[int, ...]:
        """The group sharding the rank's ministages: its node's share of the ZeRO group when hierarchical."""
        if self.cm.stage_of(rank).zero.shard is ZeroShard.NODE:
            return self.cm.node_group(rank)
        return self.cm.zero_group(rank)

    def _across(self, rank: int) -> tuple[int, ...]:
        return across_nodes(self.cm.zero_group(rank), lambda r: self.cm.gpu(r).host, rank)

    def _collective(self, kind: Collective, group: Sequence[int], rank: int, ms: int) -> float:
        return self._ring(kind, group, rank, self._dense_bytes(rank, ms))

    def _ring(self, kind: Collective, group: Sequence[int], rank: int, nbytes: float) -> float:
        """A ZeRO collective of `rank`'s over a buffer of `nbytes` parameters (a reduction moves their
        gradients), the stage's alike groups on the node running theirs at once as the simulation has them
        (`CostModel.groups_at_once`)."""
        return self.cm.collective_time(kind, tuple(group), self.cm.states.collective(kind, nbytes),
                                       self.cm.groups_at_once(rank, group))

    def _dense_bytes(self, rank: int, ms: int) -> float:
        return self.cm.param_bytes(ms, rank) * (1.0 - self.cm.expert_fraction(ms, rank))

    def _first_gather(self, rank: int) -> float:
        stage = self.cm.stage_of(rank)
        group = self._group(rank)
        if stage.zero.resolved_level < 3 or len(group) < 2 or stage.ep > 1:
            return 0.0
        return self._unit_collective(Collective.ALL_GATHER, group, rank, stage.ministages[0])

    def _unit_collective(self, kind: Collective, group: Sequence[int], rank: int, ms: int) -> float:
        """The fastest of ministage `ms`'s ZeRO collectives: one per unit where the stage gathers per block
        (Note [zero-3 units]), so a bound never counts a whole ministage where lowering moves one layer."""
        units: tuple[Unit | None, ...] = stage_units(self.cm, self.cm.stage_of(rank), ms) or (None,)
        return min(self._buffer_collective(kind, group, rank, ms, u) for u in units)

    def _buffer_collective(self, kind: Collective, group: Sequence[int], rank: int, ms: int, unit: Unit | None) -> float:
        """A ZeRO collective of one buffer: unit `unit` of ministage `ms`, or the ministage whole."""
        if unit is None:
            return self._collective(kind, group, rank, ms)
        return self._ring(kind, group, rank, self.cm.unit_param_bytes(unit, rank))

    def _last_reduction(self, kind: Collective, group: Sequence[int], rank: int, ms: int) -> float:
        """The gradient reduction ministage `ms`'s last backward posts: its last unit's where the stage
        gathers per block (the others were posted beside the compute of the units after them)."""
        units = stage_units(self.cm, self.cm.stage_of(rank), ms)
        return self._buffer_collective(kind, group, rank, ms, in_run_order(units, forward=False)[-1] if units else None)

    def _step(self, rank: int, ms: int) -> float:
        """The optimizer step of the rank's shard of ministage `ms` (dense parameters)."""
        stage = self.cm.stage_of(rank)
        parts = len(self._group(rank)) if stage.zero.resolved_level >= 1 else 1
        if stage.zero.shard is ZeroShard.NODE and stage.zero.across == 1:
            parts *= max(len(self._across(rank)), 1)
        numel = self.cm.numel(ms, rank) * (1.0 - self.cm.expert_fraction(ms, rank)) / parts
        return self.cm.optimizer_time(rank, numel)

    def _interleaved_update(self) -> bool:
        return self.kind is ScheduleKind.ZORSE and not self.clips

_WORK = frozenset({EventKind.FORWARD, EventKind.BACKWARD, EventKind.BACKWARD_INPUT, EventKind.BACKWARD_WEIGHT})
_EPS = 1e-12


@dataclass(frozen=True)
class BoundGap:
    bound: StepBound
    compiled_s: float
    fill: float      # seconds of the difference before the rank's first compute op
    bubbles: float   # idle inside its compute span, waiting for inputs from other stages
    comm: float      # idle inside its compute span, waiting for collectives
    tail: float      # after its last compute op, beyond the bound's drain and tail

    @property
    def ratio(self) -> float:
        """Compiled step over the bound (at least 1 for a true bound)."""
        return self.compiled_s / self.bound.total if self.bound.total > 0 else 1.0

    @property
    def reason(self) -> str:
        """The part that holds most of the difference."""
        parts = {"fill/drain": self.fill, "bubbles": self.bubbles, "comm": self.comm, "tail": self.tail}
        return max(parts, key=lambda k: parts[k])

    def describe(self) -> str:
        b = self.bound
        return (f"compiled {self.compiled_s:.4g} s = {self.ratio:.3f} x bound {b.total:.4g} s (rank {b.rank}: "
                f"fill {b.fill:.3g} + busy {b.busy:.3g} + drain {b.drain:.3g} + tail {b.tail:.3g}); beyond it: "
                f"fill {self.fill:.3g}, bubbles {self.bubbles:.3g}, comm {self.comm:.3g}, tail {self.tail:.3g} "
                f"({self.reason})")


def bound_gap(built: Built) -> BoundGap:
    """The compiled step of `built` (simulated) beside its plan's lower bound."""
    timeline = built.timeline
    assert timeline is not None, "bound_gap() needs a simulated step"
    bound = step_bound(built.costs, programs_in_flight(built.program), programs_forwards_first(built.program))
    work = sorted((e for e in timeline.events if e.rank == bound.rank and e.kind in _WORK), key=lambda e: e.start)
    first, last = work[0].start, max(e.end for e in work)
    idle = _idle_gaps(work)
    comm = sum(b - a for a, b in idle if _waited_on_collective(timeline, bound.rank, b))
    inside = (last - first) - bound.busy
    comm = min(comm, max(inside, 0.0))
    return BoundGap(bound, timeline.step_time, first - bound.fill, inside - comm, comm,
                    timeline.step_time - last - bound.drain - bound.tail)


def _idle_gaps(work: list[Event]) -> list[tuple[float, float]]:
    gaps, end = [], work[0].end
    for e in work[1:]:
        if e.start > end + _EPS:
            gaps.append((end, e.start))
        end = max(end, e.end)
    return gaps


def _waited_on_collective(timeline: Timeline, rank: int, resume: float) -> bool:
    """The rank resumed at `resume` when one of its collectives ended: it was waiting on it."""
    return any(e.rank == rank and e.stream is Stream.COLLECTIVE and abs(e.end - resume) <= 1e-9 * max(resume, 1.0)
               for e in timeline.events)
