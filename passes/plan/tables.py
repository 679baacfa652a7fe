"""Per-stage option tables: what a stage costs for each layer count and configuration.

For a fixed stage layout, schedule and micro-batch size, a stage's cost
depends on how many layer units it owns (n) and on its `Knobs`. For each
(n, knobs) an `Option` records, per class of alike lanes, the seconds of
one microbatch (its cycle), the microbatches that still fit in memory, and
the stage's pipeline fill, gradient-sync-and-step tail and drain. `assign`
chooses one option per stage and the microbatches per lane class.

Under Zorse's schedule a stage runs its ministages one after the other,
each over every microbatch; only its last ministage overlaps the next
stage, so the rest of its work counts as fill (Note [Zorse serialises a
stage's ministages]).

Entries come from `evaluate.StageCosts` on a stand-in pipeline: the stage
itself, exact, between one-rank stand-ins for its neighbours (their first
GPU receives its activations). Only the border peers are approximate; the
chosen plan is scored exactly afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hetc.errors import InternalError
from hetc.passes.cost.classes import lane_timing
from hetc.passes.plan.candidate import Knobs, split_evenly
from hetc.passes.cost.probe import Primitives
from hetc.passes.plan.routing import bottleneck
from hetc.passes.plan.stagecosts import StageCosts, unit_lane_times
from hetc.passes.plan.views import ResolvedStage, StageView
from hetc.spec import ScheduleKind, ZeroShard, ZeroSpec
from hetc.topology import Gpu

__all__ = ["LaneClass", "Option", "StageContext", "StageTable", "stage_costs", "stage_table"]


@dataclass(frozen=True, slots=True)
class LaneClass:
    lanes: tuple[int, ...]      # lane indices of the stage
    cycle: float                # seconds per microbatch (compute + p2p, or the collectives beside it)
    cap: int                    # most microbatches per lane that fit in memory (0: none fit)


@dataclass(frozen=True, slots=True)
class Option:
    layers: int
    knobs: Knobs
    classes: tuple[LaneClass, ...]
    fill: float                 # this stage's share of the pipeline bubble
    tail: float                 # gradient sync + optimizer step after the flush
    drain: float                # backward + p2p of one microbatch (what later stages' tails hide behind)
    equal_counts: bool          # per-microbatch collectives: every lane must serve as many microbatches
    work: float | None          # least busiest-lane seconds over all microbatches (None: cannot place them)

    def lane_classes(self) -> list[tuple[int, float, int]]:
        return [(len(c.lanes), c.cycle, c.cap) for c in self.classes]

    @property
    def placed_work(self) -> float:
        """`work` of an option that can place its microbatches (the only ones the search keeps)."""
        if self.work is None:
            raise InternalError(f"an option that cannot place its microbatches was kept: {self.knobs}")
        return self.work


@dataclass
class StageTable:
    index: int
    res: ResolvedStage
    options: list[Option] = field(default_factory=list)

    def by_layers(self) -> dict[int, list[Option]]:
        out: dict[int, list[Option]] = {}
        for o in self.options:
            out.setdefault(o.layers, []).append(o)
        return out


@dataclass(frozen=True)
class StageContext:
    """The stand-in pipeline around one stage (what `StageCosts` reads from a PlanView)."""

    ministages: tuple[tuple[int, int, int], ...]
    schedule: ScheduleKind
    prefetch: int
    num_stages: int
    micro_batch: int
    neighbours: dict[int, Gpu]

    def stage_of_ministage(self, ms: int) -> int:
        return self.ministages[ms][2]

    def peer_gpu(self, stage: int, lane: int, other: int) -> Gpu:
        return self.neighbours[other]

    @property
    def gpus(self) -> tuple[Gpu, ...]:
        """The plan's GPUs are not known around one stage: `StageCosts` counts the stage's own."""
        return ()


def _context(prims: Primitives, index: int, num_stages: int, n: int, ministages: int, interleave: int,
             neighbours: dict[int, Gpu], schedule: ScheduleKind, prefetch: int) -> tuple[StageContext, tuple]:
    """Stand-in ministages: this stage's own, at their true layer kinds, between neighbour stand-ins.

    Only the kinds of a ministage's layers matter (blocks are alike), so a
    chunk is placed at the model's start if it holds the embedding, at its
    end if it holds the head, and right after the embedding otherwise.
    """
    units = prims.model.num_model_layers
    last_stage = index == num_stages - 1
    sizes = split_evenly(n, interleave or ministages)
    out: list[tuple[int, int, int]] = []
    own = []
    lo = 0 if index == 0 else (units - n if last_stage and not interleave else 1)
    for j, size in enumerate(sizes):
        first_chunk, last_chunk = j == 0, j == len(sizes) - 1
        if interleave:
            lo = 0 if index == 0 and first_chunk else (units - size if last_stage and last_chunk else 1)
        if num_stages > 1 and (first_chunk or interleave) and not (index == 0 and first_chunk):
            out.append((0, 0, (index - 1) % num_stages))
        own.append(len(out))
        out.append((lo, lo + size, index))
        lo += size
        if num_stages > 1 and (last_chunk or interleave) and not (last_stage and last_chunk):
            out.append((0, 0, (index + 1) % num_stages))
    ctx = StageContext(tuple(out), schedule, prefetch, num_stages, prims.micro_batch, neighbours)
    return ctx, tuple(own)


def stage_costs(prims: Primitives, res: ResolvedStage, index: int, num_stages: int, n: int, knobs: Knobs,
                schedule: ScheduleKind, neighbours: dict[int, Gpu], interleave: int = 0, prefetch: int = 1,
                zero_base: ZeroSpec | None = None) -> StageCosts:
    """The cost model's view of stage `index` owning n layer units under `knobs`, between stand-ins."""
    m = prims.num_microbatches
    nominal = tuple(split_evenly(m, len(res.lanes))) if len(res.lanes) <= m else (1,) * len(res.lanes)
    ctx, own = _context(prims, index, num_stages, n, knobs.ministages, interleave, neighbours, schedule,
                        prefetch)
    view = StageView(index, res, knobs, replace(zero_base or ZeroSpec(), level=knobs.zero), own, nominal)
    return StageCosts(prims, ctx, view)


def stage_table(prims: Primitives, res: ResolvedStage, index: int, num_stages: int, layer_range: range,
                knob_options: list[Knobs], schedule: ScheduleKind, neighbours: dict[int, Gpu],
                interleave: int = 0, prefetch: int = 1, zero_base: ZeroSpec | None = None) -> StageTable:
    table = StageTable(index, res)
    for n in layer_range:
        for knobs in knob_options:
            if knobs.ministages > n or (interleave and interleave > n):
                continue
            sc = stage_costs(prims, res, index, num_stages, n, knobs, schedule, neighbours, interleave,
                             prefetch, zero_base)
            table.options.append(_option(prims, sc, n, knobs, res.classes, prims.num_microbatches))
    return table


def _option(prims: Primitives, sc: StageCosts, n: int, knobs: Knobs, classes, m: int) -> Option:
    schedule = sc.plan.schedule
    lane_classes, fill, tail, drain = [], 0.0, 0.0, 0.0
    trail = 0.0
    for lanes in classes:
        lane = lanes[0]
        f, i, w = sc.compute(lane)
        p2p = sc.p2p(lane)
        if schedule is ScheduleKind.ZORSE:
            # a lane sends a microbatch on and goes on with the next: transfers delay the next stage, not it
            per_ms = [unit_lane_times(sc, lane, ms) for ms in sc.s.ministages]
            cycle = sum(u.forward + u.backward for u in per_ms)
            one = cycle + sum(u.p2p_out + u.p2p_back for u in per_ms)
        else:
            timing = lane_timing(schedule, sc.s.index, lane, 0, (f, i, w), p2p, sc.collectives(lane), sc.shares())
            one, cycle, trail = timing.one, timing.cycle, timing.trail
        fill = max(fill, max(0.0, f + i + p2p - w) if schedule is ScheduleKind.ZB else one)
        tail = max(tail, trail + sc.sync(lane, per_ministage=schedule is ScheduleKind.ZORSE) + sc.optimizer(lane))
        drain = max(drain, i + w + p2p)
        lane_classes.append(LaneClass(lanes, cycle, _cap(sc, lane, m)))
    per_mb = schedule is not ScheduleKind.ZORSE and knobs.zero >= 2 and sc.s.zero.shard is ZeroShard.ALL
    equal = per_mb and len(sc.s.lanes) > 1
    work = bottleneck(m, [(len(c.lanes), c.cycle, c.cap) for c in lane_classes], equal)
    if schedule is ScheduleKind.ZORSE:
        fill += sc.fetch(sc.s.ministages[0])   # the first ministage comes in before it can start
    if schedule is ScheduleKind.ZORSE and work is not None and sc.plan.num_stages > 1:
        # Note [Zorse serialises a stage's ministages]: the next stage starts on a microbatch only once
        # this stage runs its last ministage, so all but 1/k of the stage's work cannot overlap the pipeline
        k = len(sc.s.ministages)
        fill += (k - 1) / k * work
    return Option(n, knobs, tuple(lane_classes), fill, tail, drain, equal, work)


def _cap(sc: StageCosts, lane: int, m: int) -> int:
    """The most microbatches a lane of this class can serve within memory (memory grows with the count)."""
    if sc.fits(lane, m):
        return m
    if not sc.fits(lane, 1):
        return 0
    lo, hi = 1, m   # fits(lo), not fits(hi)
    per_microbatch = sc.activations_per_count()
    if per_microbatch:  # linear in the count: the closed form, checked
        guess = min(max(1 + int(sc.headroom(lane, 1) / per_microbatch), 1), m - 1)
        if sc.fits(lane, guess):
            lo = guess
            hi = guess + 1 if not sc.fits(lane, guess + 1) else m
        else:
            hi = guess
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if sc.fits(lane, mid) else (lo, mid)
    return lo
