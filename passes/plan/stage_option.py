"""What one stage costs under one configuration, per class of alike lanes: the option tables' entries.

For a stage read between stand-ins (`candidate_view.StageContext`), an
option records per class of lanes the seconds of one microbatch (its
cycle) and the most microbatches that fit in memory, and for the stage its
pipeline fill, gradient-sync-and-step tail and drain: the terms of the
planner's assignment model (passes/plan/assign.py), from the same
formulas the composition uses (`classes.lane_timing`, `StageCosts`).

Under Zorse's schedule a stage runs its ministages one after the other,
each over every microbatch; only its last ministage overlaps the next
stage, so the rest of its work counts as fill (Note [Zorse serialises a
stage's ministages]).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hetc.passes.plan.candidate_stage import StageCosts, unit_lane_times
from hetc.passes.cost.classes import lane_timing
from hetc.ir.spec import ScheduleKind, ZeroShard

__all__ = ["LaneClass", "StageOptionCosts", "lane_cap", "lockstep", "option_costs", "serialised_fill"]


@dataclass(frozen=True, slots=True)
class LaneClass:
    lanes: tuple[int, ...]      # lane indices of the stage
    cycle: float                # seconds per microbatch (compute + p2p waits, or the collectives beside it)
    cap: int                    # most microbatches per lane that fit in memory (0: none fit)


@dataclass(frozen=True, slots=True)
class StageOptionCosts:
    classes: tuple[LaneClass, ...]
    fill: float                 # this stage's share of the pipeline bubble (before `serialised_fill`)
    tail: float                 # gradient sync + optimizer step after the flush
    drain: float                # backward + p2p of one microbatch (what later stages' tails hide behind)
    equal_counts: bool          # per-microbatch collectives: every lane must serve as many microbatches


def option_costs(sc: StageCosts, classes: Sequence[tuple[int, ...]], m: int) -> StageOptionCosts:
    """The stage's terms with `m` microbatches, one timing per class of lanes (each led by its first).

    Lanes in lockstep must serve equal counts; when `m` does not split evenly over them the option cannot
    be placed, whatever it costs, so only its lanes' memory caps are found (the search asks whether it
    fits) and its times are not: infinite cycles and no fill, tail or drain.
    """
    schedule = sc.plan.schedule
    equal = lockstep(schedule, sc.s.knobs.zero, sc.s.zero.shard, len(sc.s.lanes))
    if equal and m % len(sc.s.lanes):
        caps = tuple(LaneClass(lanes, math.inf, lane_cap(sc, lanes[0], m)) for lanes in classes)
        return StageOptionCosts(caps, 0.0, 0.0, 0.0, equal)
    lane_classes, fill, tail, drain = [], 0.0, 0.0, 0.0
    trail = 0.0
    for lanes in classes:
        lane = lanes[0]
        f, i, w = sc.compute(lane)
        borders = sc.p2p(lane)
        p2p = borders.total
        if schedule is ScheduleKind.ZORSE:
            # a lane sends a microbatch on and goes on with the next: transfers delay the next stage, not it
            per_ms = [unit_lane_times(sc, lane, ms) for ms in sc.s.ministages]
            cycle = sum(u.forward + u.backward for u in per_ms)
            one = cycle + sum(u.p2p_out + u.p2p_back for u in per_ms)
        else:
            timing = lane_timing(sc.p.engine, schedule, sc.s.index, lane, 0, (f, i, w), borders, sc.collectives(lane),
                                 sc.shares(), sc.unit_ops(lane))
            one, cycle, trail = timing.one, timing.cycle, timing.trail
        fill = max(fill, max(0.0, f + i + p2p - w) if schedule is ScheduleKind.ZB else one)
        sync = sum(sc.sync(lane, ms) for ms in sc.s.ministages) if schedule is ScheduleKind.ZORSE else sc.sync(lane)
        tail = max(tail, trail + sync + sc.optimizer(lane))
        drain = max(drain, i + w + p2p)
        lane_classes.append(LaneClass(lanes, cycle, lane_cap(sc, lane, m)))
    if schedule is ScheduleKind.ZORSE:
        fill += sc.fetch(sc.s.ministages[0])   # the first ministage comes in before it can start
    return StageOptionCosts(tuple(lane_classes), fill, tail, drain, equal)


def lockstep(schedule: ScheduleKind, level: int, shard: ZeroShard, num_lanes: int) -> bool:
    """Whether a stage's lanes run in lockstep, each serving as many microbatches: ZeRO-2/3 over all of them,
    collectives per microbatch (every schedule but Zorse's)."""
    return schedule is not ScheduleKind.ZORSE and level >= 2 and shard is ZeroShard.ALL and num_lanes > 1


def serialised_fill(sc: StageCosts, work: float | None) -> float:
    """Note [Zorse serialises a stage's ministages]: the next stage starts on a microbatch only once this
    stage runs its last ministage, so all but 1/k of the stage's `work` (its busiest lane's seconds over
    all its microbatches) cannot overlap the pipeline."""
    if sc.plan.schedule is not ScheduleKind.ZORSE or work is None or sc.plan.num_stages <= 1:
        return 0.0
    k = len(sc.s.ministages)
    return (k - 1) / k * work


def lane_cap(sc: StageCosts, lane: int, m: int) -> int:
    """The most microbatches a lane of this class can serve within memory (at most `m`; 0: not one).

    Found with as few probes of the lane's memory as its schedule allows (Note [memory caps]).
    """
    per_microbatch = sc.activations_per_count()
    if per_microbatch:   # linear in the count: the closed form, checked
        room = sc.headroom(lane, 1)
        if room < 0:
            return 0
        guess = min(1 + int(room / per_microbatch), m)
        if not sc.fits(lane, guess):
            return _last_fitting(sc, lane, 1, guess)
        if guess == m or not sc.fits(lane, guess + 1):
            return guess
        return _last_fitting(sc, lane, guess + 1, m + 1)
    if sc.fits(lane, m):
        return m
    return _last_fitting(sc, lane, 1, m) if sc.fits(lane, 1) else 0


def _last_fitting(sc: StageCosts, lane: int, lo: int, hi: int) -> int:
    """The last count in [lo, hi) that fits, given that `lo` fits and `hi` does not (m + 1 never does)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if sc.fits(lane, mid) else (lo, mid)
    return lo


# Note [memory caps]: each probe of a lane's memory builds the rank's breakdown at that count, so the cap
# is found with few. Where the activations grow linearly with the count (GPipe, Zorse without offloaded
# activations) the memory is non-decreasing in it and the headroom at one microbatch gives the cap in
# closed form, checked at it and one past it (a Zorse peak can grow by less than a whole microbatch's
# activations, never more). Elsewhere the memory stops growing at the in-flight limit, but not always
# monotonically (interleaved 1F1B's last, partial group of microbatches can hold less than a whole one), so
# the cap is bisected between one microbatch and `m` as it always was.
