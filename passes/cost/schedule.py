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

from dataclasses import dataclass

from hetc.spec import ScheduleKind

__all__ = ["LaneTiming", "PipelineTime", "Unit", "UnitLane", "pipeline_time", "sequential_time"]


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


# ------------------------------------------------------------------ Zorse


@dataclass(frozen=True)
class UnitLane:
    microbatches: tuple[int, ...]
    forward: float       # per microbatch, including exposed boundary copies
    backward: float      # per microbatch, including recomputation
    p2p_out: float = 0.0   # per microbatch: the activation to the next unit (forward)
    p2p_back: float = 0.0  # per microbatch: the gradient to the previous unit (backward)


@dataclass(frozen=True)
class Unit:
    """One ministage: its stage and lanes, and what it costs once per step."""

    stage: int
    lanes: tuple[UnitLane, ...]
    fetch: float = 0.0      # bring its parameters in (ZeRO-3 gather, host copy): prefetched
    sync: float = 0.0       # reduce its gradients after its backward: beside later compute
    step: float = 0.0       # its optimizer step
    step_on_host: bool = False


def sequential_time(units: list[Unit], num_microbatches: int) -> float:
    """Zorse: each unit runs all its microbatches forward, then the next; backward in reverse.

    A stage starts fetching a unit's parameters when it starts the unit
    before it (one unit of prefetch), syncs a unit's gradients on its
    communication stream and steps its optimizer right after its backward.
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
        if unit.step_on_host:
            done = max(done, comm_free[unit.stage] + unit.step)
        else:
            stage_free[unit.stage] = max(end, comm_free[unit.stage]) + unit.step
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
