"""A plan's step time and memory, evaluated once per class of alike lanes and ranks.

The one composition of the cost model for both of its readers:
`CostModel.estimate()` (`hetc explain`, compile's reports), whose stages
are read rank by rank from a resolved Pipeline (`pipeline_stage.PipelineStage`,
every lane its own class), and the planner, whose stages are read from a
candidate class by class (passes/plan/candidate_stage.py) so that 2048 ranks
score in milliseconds. A stage answers the `StageSource` questions (its
lanes' per-microbatch times, its ZeRO collectives, its memory per class
of ranks) with the formulas of passes/cost (`CostModel.layer_cost`,
`zero_time`, `memory.state_memory`, ...); `evaluate_classes` composes them:
the lanes' timings, the in-flight limits lowering's schedule holds them to
(Note [in-flight limit]) and interleaved 1F1B's grouping (Note [interleaved
groups]), the schedule's pipeline (`compose_step`) and every class's memory
at its peak.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from hetc.passes.cost.memory import RankMemory, interleaved_group, interleaved_update, interleaved_warmup
from hetc.passes.cost.schedule import (ChunkSweep, Grouping, LaneTiming, Unit, UnitOp, in_flight_limits,
                                      in_steady_order, interleaved_grouping, lockstep_fill, pipeline_time,
                                      sequential_time, stage_max, step_lower_bound, zero_cycle)
from hetc.passes.cost.transfers import Borders, Engine, transfer_waits
from hetc.passes.cost.zero_time import gathers_per_microbatch
from hetc.ir.spec import ScheduleKind, ZeroSpec

__all__ = ["ClassEstimate", "PlanShape", "PlanTime", "StageSource", "StepShape", "compose_step", "coupled_stages",
           "evaluate_classes", "flush_tail", "lane_timing", "lane_timings", "throughput", "tokens_per_step", "zorse_units"]


@dataclass(frozen=True)
class PlanTime:
    step: float
    pipeline: float
    bubble: float
    tail: float
    lanes: tuple[LaneTiming, ...]
    bottleneck: tuple[int, int] | None


class StageSource(Protocol):
    """One stage of a plan as the composition reads it; `lane` is a lane index of the stage."""

    index: int
    num_lanes: int
    zero: ZeroSpec

    def lane_classes(self) -> Sequence[Sequence[int]]:
        """Lanes that time alike, each class led by the lane that stands for it."""
        ...

    def count(self, lane: int) -> int:
        """Microbatches routed to `lane`."""
        ...

    def compute(self, lane: int) -> tuple[float, float, float]:
        """(F, I, W) seconds of one microbatch through the stage on `lane`: its slowest device kind."""
        ...

    def overhead(self, lane: int) -> float: ...

    def p2p(self, lane: int) -> Borders:
        """The lane's border transfers of one microbatch."""
        ...

    def collectives(self, lane: int) -> tuple[float, float, float]:
        """(reduce-scatter, one ZeRO-3 gather, host copies) seconds per microbatch beside the compute."""
        ...

    def shares(self) -> tuple[float, float]:
        """The fractions of the stage's parameters in its first and in its largest ministage."""
        ...

    def unit_ops(self, lane: int) -> Sequence[UnitOp]:
        """One microbatch's ops of the units the stage gathers per block, in run order (`schedule.unit_ops`);
        empty where it gathers none (Note [zero-3 units])."""
        ...

    def flush(self) -> float:
        """The stage's worst exposed gradient sync plus optimizer step after its last backward."""
        ...

    def first_gather(self) -> float: ...

    def unit(self, ms: int) -> Unit:
        """Zorse: ministage `ms` of this stage over every lane."""
        ...

    def memory_classes(self, limit: int, grouping: Grouping) -> Sequence[tuple[RankMemory, tuple[int, ...]]]:
        """Per class of alike ranks: one's memory at its peak, with `limit` microbatches in flight (under
        interleaved 1F1B, its groups), and the ids of the ranks it stands for."""
        ...


@dataclass(frozen=True)
class PlanShape:
    engine: Engine                      # whose point-to-point behaviour is timed (Note [async sends])
    schedule: ScheduleKind
    num_microbatches: int
    grad_clip: float
    ministage_stages: tuple[int, ...]   # the stage of each ministage, in model order
    chunks: int                         # the most ministages of a stage


@dataclass(frozen=True)
class ClassEstimate:
    time: PlanTime                       # its lanes: one timing per class of lanes
    limits: dict[int, int]               # per stage, the microbatches a lane keeps in flight
    grouping: Grouping                   # interleaved 1F1B's groups (Note [interleaved groups])
    memory: tuple[RankMemory, ...]       # one per class of alike ranks
    classes: tuple[tuple[int, ...], ...]  # the ranks each memory entry stands for


def tokens_per_step(num_microbatches: int, micro_batch: int, seq: int) -> int:
    return num_microbatches * micro_batch * seq


def throughput(tokens: int, step_time_s: float) -> float:
    """Tokens per second (0 for a step that takes no time)."""
    return tokens / step_time_s if step_time_s > 0 else 0.0


def coupled_stages(schedule: ScheduleKind, stages: Sequence[StageSource]) -> dict[int, int]:
    """Stages whose lanes run in lockstep (per-microbatch ZeRO-2/3 collectives): stage -> lanes."""
    per_mb = schedule is not ScheduleKind.ZORSE
    return {s.index: s.num_lanes for s in stages if per_mb and s.num_lanes > 1 and s.zero.resolved_level >= 2}


def lane_timings(engine: Engine, schedule: ScheduleKind, stages: Sequence[StageSource],
                 sweep: Callable[[int, int], ChunkSweep | None] | None = None) -> list[LaneTiming]:
    """One timing per class of lanes, led by its first lane; `sweep(stage, n)`: under interleaved 1F1B, a lane
    of n microbatches that holds them all in one group (`lane_timing`), else None."""
    out = []
    leads = [(st, lanes[0]) for st in stages for lanes in st.lane_classes()]
    # ZB-H1's and interleaved 1F1B's steady orders (Note [async sends]), lanes in lockstep included
    even = in_steady_order(schedule, microbatch_counts(stages))
    for st, lane in leads:
        f, i, w = st.compute(lane)
        f += st.overhead(lane)
        n = st.count(lane)
        out.append(lane_timing(engine, schedule, st.index, lane, n, (f, i, w), st.p2p(lane),
                               st.collectives(lane), st.shares(), st.unit_ops(lane),
                               sweep(st.index, n) if sweep is not None else None, even))
    return out


def microbatch_counts(stages: Sequence[StageSource]) -> list[list[int]]:
    """Per stage, the microbatches each of its lanes serves (what routes them, `route_microbatches`)."""
    return [[st.count(lane) for lane in range(st.num_lanes)] for st in stages]


def lane_timing(engine: Engine, schedule: ScheduleKind, stage: int, lane: int, microbatches: int,
                compute: tuple[float, float, float], borders: Borders, collectives: tuple[float, float, float],
                shares: tuple[float, float], units: Sequence[UnitOp] = (), sweep: ChunkSweep | None = None,
                in_order: bool = False) -> LaneTiming:
    """A lane's per-microbatch timing: its (F, I, W), border transfers and what of them it waits for
    (Note [async sends]; `in_order`: in its schedule's steady order, `schedule.in_steady_order`), and the cycle and trail its ZeRO collectives (reduce-scatter, gather, host
    copies) allow (`zero_cycle`, Note [zero cycle]; `units`: its unit ops where it gathers per block).
    `sweep`: an interleaved 1F1B lane whose one group holds all its microbatches runs each chunk's
    forwards, then its gradient ops, back to back, as GPipe does (Note [chunk loop]): a gradient op
    waits for the reduce-scatter of the one before it (Note [sweep waits])."""
    f, i, w = compute
    reduce, gather, copies = collectives
    ops = (f, i, w) if schedule is ScheduleKind.ZB else (f, i + w)
    waits = transfer_waits(engine, schedule, borders, compute, in_order)
    zc = zero_cycle(schedule, ops, waits, reduce, gather, copies, shares, units, sweep)
    return LaneTiming(stage, lane, microbatches, f, i, w, borders.total,
                      reduce + gathers_per_microbatch(schedule) * gather + copies, zc.bound, zc.trail, waits,
                      borders.later)


def evaluate_classes(shape: PlanShape, stages: Sequence[StageSource], end: float,
                     memory: bool = True) -> ClassEstimate:
    """The step (`end`: the step's last all-reduces) and, with `memory`, every class's memory."""
    lanes = lane_timings(shape.engine, shape.schedule, stages)
    coupled = coupled_stages(shape.schedule, stages)
    widths = {s.index: s.num_lanes for s in stages}
    limits = in_flight_limits(shape.schedule, lanes, len(stages), coupled, widths, microbatch_counts(stages))
    grouping, entries = _grouping(shape, stages, lanes, limits)
    step = StepShape(shape.schedule, len(stages), shape.chunks, shape.num_microbatches, shape.grad_clip,
                     coupled, widths, limits, grouping)
    if shape.schedule is ScheduleKind.INTERLEAVED and any(step.sweep(t.stage, t.microbatches) for t in lanes):
        lanes = lane_timings(shape.engine, shape.schedule, stages, step.sweep)   # their groups known now
    time = compose_step(step, lanes, end, lambda: [_trail(lanes, s.index) + s.flush() for s in stages],
                        stages[0].first_gather, lambda: zorse_units(shape, stages))
    if not memory:
        return ClassEstimate(time, limits, grouping, (), ())
    if entries is None:
        entries = [entry for s in stages for entry in s.memory_classes(limits[s.index], grouping)]
    return ClassEstimate(time, limits, grouping, tuple(m for m, _ in entries), tuple(ids for _, ids in entries))


def _grouping(shape: PlanShape, stages: Sequence[StageSource], lanes: Sequence[LaneTiming], limits: dict[int, int]
              ) -> tuple[Grouping, list[tuple[RankMemory, tuple[int, ...]]] | None]:
    """Interleaved 1F1B's grouping (`schedule.interleaved_grouping`), breadth-first only where every rank's
    stash of it fits (it holds more than Megatron's groups); and the memory it was checked with, if any."""
    first = max(stages[0].count(lane) for lane in range(stages[0].num_lanes))
    grouping = interleaved_grouping(shape.schedule, lanes, len(stages), shape.chunks, first)
    if grouping is Grouping.DEPTH_FIRST:
        return grouping, None
    entries = [entry for s in stages for entry in s.memory_classes(limits[s.index], grouping)]
    if all(mem.fits for mem, _ in entries):
        return grouping, entries
    return Grouping.DEPTH_FIRST, None


def _trail(lanes: Sequence[LaneTiming], stage: int) -> float:
    """The stage's last reduce-scatter past its lanes' last cycle (Note [zero cycle])."""
    return max(t.trail for t in lanes if t.stage == stage)


def zorse_units(shape: PlanShape, stages: Sequence[StageSource]) -> list[Unit]:
    """Zorse's units: every ministage in model order, on its stage's lanes."""
    return [stages[s].unit(ms) for ms, s in enumerate(shape.ministage_stages)]


@dataclass(frozen=True)
class StepShape:
    """What the step's composition reads of a plan besides its lanes' timings."""

    schedule: ScheduleKind
    num_stages: int
    chunks: int                      # the most ministages of a stage (interleaved 1F1B's v)
    num_microbatches: int
    grad_clip: float
    coupled: dict[int, int]          # lockstep stages -> their lanes (`coupled_stages`)
    widths: dict[int, int]           # stage -> its lanes
    limits: dict[int, int]           # stage -> the microbatches a lane keeps in flight (Note [in-flight limit])
    grouping: Grouping = Grouping.DEPTH_FIRST   # interleaved 1F1B's groups (Note [interleaved groups])

    def group(self, lane: LaneTiming) -> int:
        """Under interleaved 1F1B, the lane's microbatches in each group (`memory.interleaved_group`)."""
        return self._group_of(lane.microbatches)

    def sweep(self, stage: int, microbatches: int) -> ChunkSweep | None:
        """Under interleaved 1F1B, a lane of `stage` whose one group holds all its `microbatches` (`lane_timing`),
        with its warm-up (`memory.interleaved_warmup`); else None."""
        group = self._group_of(microbatches)
        if group < microbatches:
            return None
        return ChunkSweep(microbatches, self.chunks, interleaved_warmup(stage, self.num_stages, self.chunks, group))

    def _group_of(self, microbatches: int) -> int:
        return interleaved_group(self.num_stages, self.widths[0], microbatches, self.num_microbatches,
                                 self.grouping)


def compose_step(shape: StepShape, lanes: list[LaneTiming], end: float, flush: Callable[[], list[float]],
                 first_gather: Callable[[], float], units: Callable[[], list[Unit]]) -> PlanTime:
    """The step from its lanes' timings (one per lane, or one per class of alike lanes: only maxima and
    minima over them are taken): the schedule's pipeline, never below the step's lower bound
    (docs/costmodel.md), the lockstep stages' fill, then the tail after the flush (`flush()`: per stage,
    its worst exposed gradient sync plus optimizer step), the first ZeRO-3 gather and the step's last
    all-reduces (`end`). Zorse's sequential ministages are simulated unit by unit (`units()`)."""
    if shape.schedule is ScheduleKind.ZORSE:
        total = sequential_time(units(), shape.num_microbatches,
                                not interleaved_update(shape.schedule, shape.grad_clip))
        busy = max(t.work for t in lanes)
        return PlanTime(total + end, total, max(0.0, total - busy), end, tuple(lanes), None)
    pipe = pipeline_time(shape.schedule, lanes, shape.chunks, shape.limits, shape.group)
    extra = max(0.0, step_lower_bound(shape.schedule, lanes, shape.chunks, shape.limits) - pipe.total) + \
        lockstep_fill(shape.schedule, lanes, shape.num_stages, shape.coupled, shape.widths)
    # the first stage's first compute op waits for its ZeRO-3 gather: nothing runs beside it yet
    tail = flush_tail(lanes, flush(), shape.schedule, pipe.bottleneck[0]) + end + first_gather()
    return PlanTime(pipe.total + extra + tail, pipe.total + extra, pipe.bubble + extra, tail, tuple(lanes),
                    pipe.bottleneck)


def flush_tail(lanes: list[LaneTiming], worst: list[float], schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B,
               bottleneck: int | None = None) -> float:
    """The exposed tail: stage s syncs and steps (`worst[s]` seconds) after its own last backward, which
    comes earlier than stage 0's by the drain (backward and transfers) of the stages before it. Under ZB-H1
    the gradient leaves a stage after its input gradient, so the drain is the input gradients and transfers
    of the stages before it, and the stage's own last weight gradient and stage 0's fall on either end
    (random job 64/1: a last stage of 8 lanes syncing over them ended 6.3 ms before stage 0, not 8.7). The
    `bottleneck` stage's whole work, its last weight gradient too, lies within the pipeline's time: it ends
    no later (random job 90 under the GEMM curve: a 0.45 s weight gradient of the bottleneck counted again
    put explain at +11.5 % of its compiled step)."""
    zb = schedule is ScheduleKind.ZB
    drain = stage_max(lanes, lambda t: (t.input_grad if zb else t.backward) + t.p2p)
    last = stage_max(lanes, lambda t: t.weight_grad if zb else 0.0)   # under ZB-H1, its last weight gradient
    tail, lead = 0.0, 0.0
    for s, mine in enumerate(worst):
        before_end = lead + last[0] - last[s]   # how long before the pipeline's end stage s ends
        tail = max(tail, mine - (max(before_end, 0.0) if s == bottleneck else before_end))
        lead += drain[s]
    return max(tail, 0.0)
