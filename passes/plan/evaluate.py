"""Score a candidate with the cost model's formulas, once per class of alike ranks.

This is `CostModel.estimate()` (passes/cost/plan_time.py and estimate.py)
restated for the planner: the same lane timings, schedule formulas
(`pipeline_time`, `sequential_time`), tail after the flush and per-rank
memory, but each quantity is computed once per class of ranks that the
cost model would time alike (same stage, device kind and microbatch count;
same peer node groups) instead of once per rank, so that 2048 ranks score
in milliseconds. tests/test_plan_evaluate.py holds it equal to the full
estimate on plans of every schedule, ZeRO level and offload.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetc.passes.cost import RankMemory
from hetc.passes.cost.memory import interleaved_update
from hetc.passes.cost.plan_time import gathers_per_microbatch, step_end_time
from hetc.passes.cost.schedule import (LaneTiming, Unit, UnitLane, in_flight_limits, lockstep_fill, pipeline_time,
                                      sequential_time, step_lower_bound)
from hetc.passes.plan.costs import Primitives
from hetc.passes.plan.egress import egress_per_step
from hetc.passes.plan.stagecosts import StageCosts, unit_lane_times
from hetc.passes.plan.views import PlanView
from hetc.spec import ScheduleKind

__all__ = ["Score", "evaluate"]


@dataclass(frozen=True)
class Score:
    step_time_s: float
    pipeline_s: float
    bubble_s: float
    tail_s: float
    tokens_per_step: int
    memory: tuple[RankMemory, ...]    # one per class of alike ranks; `ranks` expands them
    classes: tuple[tuple[int, ...], ...]   # GPU ids of each memory entry
    price_per_hour: float
    egress_per_step: float            # $ per step for bytes crossing priced links

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s if self.step_time_s > 0 else 0.0

    @property
    def fits(self) -> bool:
        return all(m.fits for m in self.memory)

    @property
    def dollars_per_token(self) -> float:
        per_step = self.price_per_hour * self.step_time_s / 3600 + self.egress_per_step
        return per_step / self.tokens_per_step

    @property
    def dollars_per_hour(self) -> float:
        """GPU rent plus egress at this step rate."""
        egress = self.egress_per_step * 3600 / self.step_time_s if self.step_time_s else 0.0
        return self.price_per_hour + egress


def evaluate(prims: Primitives, plan: PlanView) -> Score:
    costs = [StageCosts(prims, plan, s) for s in plan.stages]
    lanes = [t for sc in costs for t in _lane_timings(sc)]
    per_mb = plan.schedule is not ScheduleKind.ZORSE
    coupled = {sc.s.index: len(sc.s.lanes) for sc in costs
               if per_mb and len(sc.s.lanes) > 1 and int(sc.s.zero.level) >= 2}
    limits = in_flight_limits(plan.schedule, lanes, plan.num_stages, coupled,
                              {sc.s.index: len(sc.s.lanes) for sc in costs})
    for sc in costs:
        sc.in_flight_limit = limits[sc.s.index]
    world = tuple(sorted(g.id for g in plan.gpus))   # the "world" group: ranks in GPU order
    end = step_end_time(prims.train.grad_clip > 0, lambda nbytes: prims.ring("all_reduce", world, nbytes))
    if plan.schedule is ScheduleKind.ZORSE:
        total = sequential_time(_zorse_units(costs), plan.num_microbatches,
                                not interleaved_update(plan.schedule, prims.train.grad_clip))
        busy = max(t.work for t in lanes)
        pipe, bubble, tail = total, max(0.0, total - busy), end
    else:
        chunks = max(len(s.ministages) for s in plan.stages)
        pt = pipeline_time(plan.schedule, lanes, chunks)
        # never below the lower bound of the step (docs/costmodel.md), then the lockstep stages' fill
        widths = {sc.s.index: len(sc.s.lanes) for sc in costs}
        extra = max(0.0, step_lower_bound(plan.schedule, lanes, chunks) - pt.total) + \
            lockstep_fill(plan.schedule, lanes, plan.num_stages, coupled, widths)
        pipe, bubble = pt.total + extra, pt.bubble + extra
        tail = _tail(costs, lanes) + end + costs[0].first_gather()
    memory, classes = _memory(costs)
    tokens = plan.num_microbatches * plan.micro_batch * prims.model.seq
    price = sum(g.device.price for g in plan.gpus)
    return Score(pipe + tail, pipe, bubble, tail, tokens, memory, classes, price,
                 egress_per_step(prims, plan, costs))


def _lane_timings(sc: StageCosts) -> list[LaneTiming]:
    out = []
    for lanes in sc.lane_classes.values():
        lane = lanes[0]
        f, i, w = sc.compute(lane)
        f += sc.overhead(lane)
        p2p = sc.p2p(lane)
        reduce, gather, copies = sc.collectives(lane)
        zc = sc.cycle(lane, f, i, w, p2p)
        out.append(LaneTiming(sc.s.index, lane, sc.s.counts[lane], f, i, w, p2p,
                              reduce + gathers_per_microbatch(sc.plan.schedule) * gather + copies, zc.bound,
                              zc.trail))
    return out


def _tail(costs: list[StageCosts], lanes: list[LaneTiming]) -> float:
    """Mirrors plan_time._tail: lane 0 syncs with its ZeRO groups, every device kind steps its shard."""
    tail, lead = 0.0, 0.0
    for sc in costs:
        mine = [t for t in lanes if t.stage == sc.s.index]
        trail = max(t.trail for t in mine)
        worst = trail + sc.sync(0) + max(sc.optimizer(lane) for lane in _kind_reps(sc))
        tail = max(tail, worst - lead)
        lead += max(t.backward + t.p2p for t in mine)
    return max(tail, 0.0)


def _kind_reps(sc: StageCosts) -> list[int]:
    """The first lane holding each device kind of the stage (its lowest rank of the kind)."""
    seen: dict[str, int] = {}
    for lane, gpus in enumerate(sc.s.lanes):
        for g in gpus:
            seen.setdefault(g.device.name, lane)
    return list(seen.values())


def _zorse_units(costs: list[StageCosts]) -> list[Unit]:
    plan = costs[0].plan
    units = []
    for ms, (_, _, s) in enumerate(plan.ministages):
        sc = costs[s]
        classes = {lane: lanes[0] for lanes in sc.lane_classes.values() for lane in lanes}
        per_class = {rep: unit_lane_times(sc, rep, ms) for rep in set(classes.values())}
        unit_lanes = tuple(UnitLane(tuple(sc.s.routes[lane]), *per_class[classes[lane]])
                           for lane in range(len(sc.s.lanes)))
        numel = sc.numel(sc.ministage_units(ms))
        fetch = 0.0
        if int(sc.s.zero.level) >= 3:
            fetch += sc.p.ring("all_gather", sc.s.ring, numel * sc.p.delta, sc.s.concurrent(0))
        if sc.s.knobs.offload.params:
            fetch += sc.p.copy(sc.s.lanes[0][0], numel * sc.p.delta * sc.shard(0).params)
        ratio = numel / max(sc.numel(), 1.0)
        units.append(Unit(s, unit_lanes, fetch, sc.sync(0, per_ministage=True) * ratio,
                          sc.optimizer(0) * ratio,
                          sc.s.knobs.offload.optimizer))
    return units


def _memory(costs: list[StageCosts]) -> tuple[tuple[RankMemory, ...], tuple[tuple[int, ...], ...]]:
    memory: list[RankMemory] = []
    classes: list[list[int]] = []
    for sc in costs:
        seen: dict[tuple, int] = {}
        for lane, gpus in enumerate(sc.s.lanes):
            for gpu in gpus:
                key = (gpu.device.name, sc.s.counts[lane], sc.s.node_share(lane))
                if key not in seen:
                    seen[key] = len(memory)
                    memory.append(sc.memory(lane, gpu, sc.s.counts[lane]))
                    classes.append([])
                classes[seen[key]].append(gpu.id)
    return tuple(memory), tuple(tuple(c) for c in classes)