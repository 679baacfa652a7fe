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

from dataclasses import dataclass, replace

from hetc.passes.cost import RankMemory
from hetc.passes.cost.plan_time import StepShape, compose_step, step_end_time
from hetc.passes.cost.schedule import LaneTiming, Unit, in_flight_limits
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
    widths = {sc.s.index: len(sc.s.lanes) for sc in costs}
    limits = in_flight_limits(plan.schedule, lanes, plan.num_stages, coupled, widths)
    for sc in costs:
        sc.in_flight_limit = limits[sc.s.index]
    world = tuple(sorted(g.id for g in plan.gpus))   # the "world" group: ranks in GPU order
    end = step_end_time(prims.train.grad_clip > 0, lambda nbytes: prims.ring("all_reduce", world, nbytes))
    shape = StepShape(plan.schedule, plan.num_stages, max(len(s.ministages) for s in plan.stages),
                      plan.num_microbatches, prims.train.grad_clip, coupled, widths)
    t = compose_step(shape, lanes, end, lambda: [_stage_flush(sc) for sc in costs], costs[0].first_gather,
                     lambda: _zorse_units(costs))
    memory, classes = _memory(costs)
    tokens = plan.num_microbatches * plan.micro_batch * prims.model.seq
    price = sum(g.device.price for g in plan.gpus)
    return Score(t.step, t.pipeline, t.bubble, t.tail, tokens, memory, classes, price,
                 egress_per_step(prims, plan, costs))


def _lane_timings(sc: StageCosts) -> list[LaneTiming]:
    out = []
    for lanes in sc.lane_classes.values():
        lane = lanes[0]
        f, i, w = sc.compute(lane)
        f += sc.overhead(lane)
        out.append(LaneTiming(sc.s.index, lane, sc.s.counts[lane], f, i, w, sc.p2p(lane),
                              sc.overlapped(lane)))
    return out


def _stage_flush(sc: StageCosts) -> float:
    """Lane 0 syncs with its ZeRO groups, every device kind steps its shard (plan_time._stage_flush)."""
    return sc.sync(0) + max(sc.optimizer(lane) for lane in _kind_reps(sc))


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
        unit_lanes = tuple(replace(per_class[classes[lane]], microbatches=sc.s.routes[lane])
                           for lane in range(len(sc.s.lanes)))
        ratio = sc.numel(sc.ministage_units(ms)) / max(sc.numel(), 1.0)
        units.append(Unit(s, unit_lanes, sc.fetch(ms), sc.sync(0, per_ministage=True) * ratio,
                          sc.optimizer(0) * ratio, sc.s.knobs.offload.optimizer))
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