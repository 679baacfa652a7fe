"""Step time of a pipeline from per-lane, per-microbatch timings, for each schedule kind.

What overlaps with what (docs/costmodel.md):

- point-to-point activations and gradients block the sending and the
  receiving rank (Megatron's and DeepSpeed's 1F1B wait for them); the
  activation of one microbatch and the gradient of another cross a border
  in opposite directions at the same time, so each border costs one
  transfer per microbatch and cycle;
- per-microbatch ZeRO collectives (ZeRO-3 gathers, ZeRO-2/3
  reduce-scatters under gradient accumulation) run on their own stream
  beside the compute: a cycle lasts max(compute + p2p, collectives);
- the bubble: 1F1B and GPipe fill and drain once through every stage but
  the bottleneck; interleaved 1F1B with v chunks divides that by v; ZB-H1
  fills it with weight-gradient work, leaving (F + I − W) per stage.

Zorse's sequential ministages are a different shape and are simulated
microbatch by microbatch in `sequential_time`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hetc.spec import ScheduleKind

__all__ = ["LaneTiming", "PipelineTime", "Unit", "UnitLane", "exposed_first_gather", "in_flight_limits",
           "lockstep_fill",
           "pipeline_time", "sequential_time", "step_lower_bound"]


@dataclass(frozen=True, slots=True)
class LaneTiming:
    """Per-microbatch seconds of one lane of one stage (all of the stage's ministages)."""

    stage: int
    lane: int
    microbatches: int
    forward: float
    input_grad: float
    weight_grad: float
    p2p: float = 0.0          # blocking transfers on this stage's borders
    overlapped: float = 0.0   # collectives beside the compute

    @property
    def backward(self) -> float:
        return self.input_grad + self.weight_grad

    @property
    def one(self) -> float:
        """One microbatch through this lane, forward and backward."""
        return self.forward + self.backward + self.p2p

    @property
    def cycle(self) -> float:
        return max(self.one, self.overlapped)

    @property
    def work(self) -> float:
        return self.microbatches * self.cycle


@dataclass(frozen=True, slots=True)
class PipelineTime:
    total: float
    busy: float          # the bottleneck lane's own work
    bubble: float
    bottleneck: tuple[int, int]   # (stage, lane)


def pipeline_time(schedule: ScheduleKind, lanes: list[LaneTiming], chunks: int = 1) -> PipelineTime:
    """Forward and backward of every microbatch, for 1F1B-like schedules and GPipe."""
    worst = max(lanes, key=lambda t: t.work)
    others: dict[int, float] = {}
    for t in lanes:
        if t.stage != worst.stage:
            others[t.stage] = max(others.get(t.stage, 0.0), _fill(schedule, t))
    bubble = sum(others.values())
    if schedule is ScheduleKind.INTERLEAVED:
        bubble /= max(chunks, 1)
    return PipelineTime(worst.work + bubble, worst.work, bubble, (worst.stage, worst.lane))


def _fill(schedule: ScheduleKind, t: LaneTiming) -> float:
    if schedule is ScheduleKind.ZB:
        return max(0.0, t.forward + t.input_grad + t.p2p - t.weight_grad)
    return t.one


def exposed_first_gather(gather: float, first: LaneTiming) -> float:
    """The part of the first stage's first ZeRO-3 gather that shows: a lane whose cycle is set by its
    collectives (`overlapped` > `one`) already counts every gather in its work."""
    slack = first.work - first.microbatches * first.one
    return max(0.0, gather - slack)


def step_lower_bound(schedule: ScheduleKind, lanes: Sequence[LaneTiming], chunks: int = 1) -> float:
    """No schedule of these lanes runs its pipeline faster (docs/costmodel.md, "The lower bound of a step").

    The busiest lane (stage b) is busy `work`; it cannot start before the
    first microbatch has come through every stage before it (their fastest
    lane's forward and transfers), and after its last op the last gradient
    still goes back through them (input-gradient backward under ZB); under
    interleaved 1F1B only through their first of `chunks` chunks. Zorse
    runs stage by stage, so only the busy time bounds it.
    """
    worst = max(lanes, key=lambda t: t.work)
    if schedule is ScheduleKind.ZORSE:
        return worst.work
    bound = worst.work
    for s in {t.stage for t in lanes if t.stage < worst.stage}:
        mine = [t for t in lanes if t.stage == s]
        back = (lambda t: t.input_grad) if schedule is ScheduleKind.ZB else (lambda t: t.backward)
        share = 1 / chunks if schedule is ScheduleKind.INTERLEAVED else 1.0
        bound += (min(t.forward + t.p2p for t in mine) + min(back(t) for t in mine)) * share
    return bound


# ------------------------------------------------------------------ in-flight limit


def in_flight_limits(schedule: ScheduleKind, lanes: Sequence[LaneTiming], num_stages: int,
                     coupled: Mapping[int, int] | None = None,
                     lane_counts: Mapping[int, int] | None = None) -> dict[int, int]:
    """Per stage: how many microbatches each lane keeps in flight under 1F1B and ZB-H1.

    Note [in-flight limit]: the one number lowering's schedule
    (passes/lower/schedule.py) holds every lane of the stage to and the
    estimate counts stashed activations with. A microbatch stays in flight
    on a lane from its forward to its last backward op: the lane's own
    forward and backward plus the round trip R through every stage after it
    (the forward and input-gradient backward of one microbatch on that
    stage's slowest lane, with its border transfers). The pipeline runs at
    its busiest lane's pace: over the step (T* busy seconds) a lane serving
    n microbatches starts one every T*/n, so by Little's law it keeps
    ⌈(own + R) / (T*/n)⌉ in flight not to wait. With equal lanes that is
    Megatron's S − s, never less; a stage of few fast lanes feeding many
    slower ones (uneven lanes, Zorse's heterogeneous pipelines) needs more,
    and held to S − s it would idle most of the step. Lanes of a stage keep
    one limit (ZeRO-2/3 couples them), the largest any of them needs.

    `coupled`: stage -> its lanes, for stages whose lanes run in lockstep
    (Note [coupled lanes] in passes/lower/lane_sim.py): such a stage runs
    its k-th microbatch on every lane at once, so a microbatch coming from
    the stage before it (of `lane_counts` lanes) also waits for the
    L_d / L_{d−1} − 1 others of its slot, one period of that stage apart,
    and its slot's gradients come back from a stage after it of fewer lanes
    in the same way.
    """
    stages = range(num_stages)
    if schedule not in (ScheduleKind.ONE_F_ONE_B, ScheduleKind.ZB) or not lanes:
        return {s: num_stages - s for s in stages}
    trip = {s: max((_round_trip_share(schedule, t) for t in lanes if t.stage == s), default=0.0)
            for s in stages}
    busiest = max(t.work for t in lanes)
    for d, width in (coupled or {}).items():
        trip[d] += _slot_wait(lanes, lane_counts, busiest, width, d - 1)   # its slot fills from the stage before
        if d + 1 < num_stages:   # and its slot's gradients come back from the stage after
            trip[d + 1] += _slot_wait(lanes, lane_counts, busiest, width, d + 1)
    out = {}
    for s in stages:
        after = sum(trip[d] for d in range(s + 1, num_stages))
        mine = [t for t in lanes if t.stage == s]
        needed = max(math.ceil((t.one + after) * t.microbatches / busiest * (1 - 1e-9)) if busiest > 0 else 1
                     for t in mine)
        most = max(t.microbatches for t in mine)
        out[s] = max(num_stages - s, min(needed, most))
    return out


def lockstep_fill(schedule: ScheduleKind, lanes: Sequence[LaneTiming], num_stages: int,
                  coupled: Mapping[int, int], lane_counts: Mapping[int, int]) -> float:
    """The fill and drain that lockstep stages add to the bubble under 1F1B-like schedules: their first
    slot waits for its microbatches to arrive, their last one for its gradients to come back
    (`in_flight_limits`). GPipe runs every forward before any backward: the waits hide in that."""
    if not lanes or schedule is ScheduleKind.GPIPE:
        return 0.0
    busiest = max(t.work for t in lanes)
    return sum(_slot_wait(lanes, lane_counts, busiest, width, d - 1) +
               (_slot_wait(lanes, lane_counts, busiest, width, d + 1) if d + 1 < num_stages else 0.0)
               for d, width in coupled.items())


def _slot_wait(lanes: Sequence[LaneTiming], lane_counts: Mapping[int, int] | None, busiest: float, width: int,
               other: int) -> float:
    """What a microbatch of a lockstep stage of `width` lanes waits for the rest of its slot to pass through
    stage `other` of fewer lanes (one period of that stage's lanes per further microbatch)."""
    mine = [t for t in lanes if t.stage == other]
    if not mine or not lane_counts or width <= lane_counts[other]:
        return 0.0
    period = busiest / max(t.microbatches for t in mine)
    return (width / lane_counts[other] - 1) * period


def _round_trip_share(schedule: ScheduleKind, t: LaneTiming) -> float:
    """What one microbatch spends in this lane on its way down and back (the gradient leaves after I)."""
    back = t.input_grad if schedule is ScheduleKind.ZB else t.backward
    return t.forward + back + t.p2p


# ------------------------------------------------------------------ Zorse


@dataclass(frozen=True)
class UnitLane:
    microbatches: tuple[int, ...]
    forward: float       # per microbatch, including exposed boundary copies
    backward: float      # per microbatch, including recomputation
    p2p_out: float = 0.0   # per microbatch: the activation to the next unit (forward)
    p2p_back: float = 0.0  # per microbatch: the gradient to the previous unit (backward)

    @classmethod
    def of(cls, microbatches: tuple[int, ...], forward: float, backward: float, boundary_copy: float,
           p2p_out: float, p2p_back: float) -> UnitLane:
        """With activations offloaded, the boundary activation goes to the host after the forward and
        comes back for the backward (`boundary_copy` seconds each way) beside the compute; the
        backward's rerun of the ministage is in its compute time."""
        return cls(microbatches, max(forward, boundary_copy), max(backward, boundary_copy), p2p_out, p2p_back)


@dataclass(frozen=True)
class Unit:
    """One ministage: its stage and lanes, and what it costs once per step."""

    stage: int
    lanes: tuple[UnitLane, ...]
    fetch: float = 0.0      # bring its parameters in (ZeRO-3 gather, host copy): prefetched
    sync: float = 0.0       # reduce its gradients after its backward: beside later compute
    step: float = 0.0       # its optimizer step
    step_on_host: bool = False

    @classmethod
    def of(cls, stage: int, lanes: tuple[UnitLane, ...], fetch: float, numel: float, stage_numel: float,
           sync: float, step: float, step_on_host: bool) -> Unit:
        """A ministage of `numel` parameters of its stage's `stage_numel`: its share of the stage's
        per-ministage gradient sync (`sync`) and of its optimizer step (`step`)."""
        ratio = numel / max(stage_numel, 1.0)
        return cls(stage, lanes, fetch, sync * ratio, step * ratio, step_on_host)


def sequential_time(units: list[Unit], num_microbatches: int, steps_at_end: bool = False) -> float:
    """Zorse: each unit runs all its microbatches forward, then the next; backward in reverse.

    A stage starts fetching a unit's parameters when it starts the unit
    before it (one unit of prefetch), syncs a unit's gradients on its
    communication stream and steps its optimizer right after its backward
    (`steps_at_end`: after every unit's sync, as with gradient clipping).
    """
    stage_free: dict[int, float] = {}
    stage_started: dict[int, float] = {}
    comm_free: dict[int, float] = {}
    done = 0.0
    arrive = [0.0] * num_microbatches
    for unit in units:
        arrive = _run(unit, arrive, stage_free, stage_started, forward=True)
    for unit in reversed(units):
        arrive = _run(unit, arrive, stage_free, stage_started, forward=False)
        end = stage_free[unit.stage]
        comm_free[unit.stage] = max(comm_free.get(unit.stage, 0.0), end) + unit.sync
        if steps_at_end:
            continue
        if unit.step_on_host:
            done = max(done, comm_free[unit.stage] + unit.step)
        else:
            stage_free[unit.stage] = max(end, comm_free[unit.stage]) + unit.step
    if steps_at_end:   # every stage's steps after the last sync of the step (the global norm)
        synced = max([*stage_free.values(), *comm_free.values()])
        return synced + max(sum(u.step for u in units if u.stage == s) for s in stage_free)
    return max([done, *stage_free.values(), *comm_free.values()])


def _run(unit: Unit, arrive: list[float], stage_free: dict[int, float], stage_started: dict[int, float],
         forward: bool) -> list[float]:
    free = stage_free.get(unit.stage, 0.0)
    start = max(free, stage_started.get(unit.stage, 0.0) + unit.fetch)
    stage_started[unit.stage] = start
    out = list(arrive)
    end_all = start
    for lane in unit.lanes:
        per = lane.forward if forward else lane.backward
        t = start
        for j in lane.microbatches:
            t = max(t, arrive[j]) + per
            out[j] = t + (lane.p2p_out if forward else lane.p2p_back)
        end_all = max(end_all, t)
    stage_free[unit.stage] = end_all
    return out
