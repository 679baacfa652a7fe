"""The step time of a whole plan: lanes' per-microbatch timings, the schedule, the tail.

The tail after the pipeline flush (Megatron-DeepSpeed: `ReduceGrads`, then
`OptimizerStep`): every stage reduces its gradients over its ZeRO group and
steps its optimizer as soon as its own last backward is done; stage s
finishes its backward earlier than stage 0 by the drain behind it, so only
what is left of its tail after that lead is exposed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hetc.passes.cost.memory import interleaved_update, offloaded
from hetc.passes.cost.schedule import (LaneTiming, Unit, UnitLane, lockstep_fill, pipeline_time, sequential_time,
                                      step_lower_bound, zero_cycle)
from hetc.pipeline import Lane, Stage
from hetc.spec import OffloadTarget, ScheduleKind, ZeroShard

__all__ = ["PlanTime", "border_time", "gathers_per_microbatch", "lane_timings", "plan_time", "step_end_time",
           "sync_time", "zorse_units"]


@dataclass(frozen=True)
class PlanTime:
    step: float
    pipeline: float
    bubble: float
    tail: float
    lanes: tuple[LaneTiming, ...]
    bottleneck: tuple[int, int] | None


def plan_time(cm) -> PlanTime:
    lanes = lane_timings(cm)
    p = cm.pipeline
    end = step_end_time(cm.spec.train.grad_clip > 0,
                        lambda nbytes: cm.collective_time("all_reduce", tuple(range(p.world_size)), nbytes))
    if p.schedule is ScheduleKind.ZORSE:
        total = sequential_time(zorse_units(cm), p.num_microbatches,
                                not interleaved_update(p.schedule, cm.spec.train.grad_clip))
        busy = max(t.work for t in lanes)
        return PlanTime(total + end, total, max(0.0, total - busy), end, tuple(lanes), None)
    chunks = max(len(s.ministages) for s in p.stages)
    pipe = pipeline_time(p.schedule, lanes, chunks)
    # never below the lower bound of the step (docs/costmodel.md), then the lockstep stages' fill
    extra = max(0.0, step_lower_bound(p.schedule, lanes, chunks) - pipe.total) + \
        lockstep_fill(p.schedule, lanes, len(p.stages), cm.coupled_stages, {s.index: len(s.lanes) for s in p.stages})
    # the first stage's first compute op waits for its ZeRO-3 gather: nothing runs beside it yet
    tail = _tail(cm, lanes) + end + _first_gather(cm)
    return PlanTime(pipe.total + extra + tail, pipe.total + extra, pipe.bubble + extra, tail, tuple(lanes),
                    pipe.bottleneck)


# what the all-reduces of the step's loss and squared gradient norm carry (one float64 each)
SCALAR_BYTES = 8.0


def step_end_time(clips: bool, all_reduce) -> float:
    """The step's last collectives over every rank: the loss report, and the norm when clipping.

    They are latency-bound (8 bytes), so on slow links or many ranks they
    show; `all_reduce(nbytes)` times one over the whole world.
    """
    return all_reduce(SCALAR_BYTES) * (2 if clips else 1)


def lane_timings(cm) -> list[LaneTiming]:
    out = []
    for stage in cm.pipeline.stages:
        for lane in stage.lanes:
            reps = _reps(cm, lane.ranks)
            f, i, w = (max(sum(cm.compute_time(r, ms, ph) for ms in stage.ministages) for r in reps)
                       for ph in ("F", "I", "W"))
            f += max(cm.microbatch_overhead(r) for r in reps)
            p2p = _p2p_per_microbatch(cm, stage, lane)
            reduce, gather, copies = _collectives(cm, stage, lane)
            ops = (f, i, w) if cm.pipeline.schedule is ScheduleKind.ZB else (f, i + w)
            zc = zero_cycle(cm.pipeline.schedule, ops, p2p, reduce, gather, copies, _shares(cm, stage, lane.ranks[0]))
            out.append(LaneTiming(stage.index, lane.index, len(lane.microbatches), f, i, w, p2p,
                                  reduce + gathers_per_microbatch(cm.pipeline.schedule) * gather + copies,
                                  zc.bound, zc.trail))
    return out


def _reps(cm, ranks) -> list[int]:
    """One rank per device kind and core share among `ranks`: such ranks time alike."""
    seen: dict[tuple[str, float], int] = {}
    for r in sorted(ranks):
        seen.setdefault((cm.gpu(r).device.name, cm.slowdown(r)), r)
    return list(seen.values())


def _concurrent(cm, rank: int) -> int:
    """Ranks of this rank's lane on its node: they send their shares over the node's link at once."""
    lane = cm.pipeline.lane_of_rank[rank]
    return sum(1 for r in lane.ranks if cm.gpu(r).host == cm.gpu(rank).host)


def _peer_lane(cm, stage: Stage, lane: Lane) -> Lane:
    """The lane of `stage` that serves most of `lane`'s microbatches."""
    served = Counter(cm.lane_of_microbatch(stage.index)[mb] for mb in lane.microbatches)
    best = max(served.items(), key=lambda kv: (kv[1], -kv[0]))[0]
    return stage.lanes[best]


def border_time(cm, stage: Stage, lane: Lane, other: Stage, ms: int) -> float:
    """One transfer (each rank its share of the activation) between `lane` and its peer in `other`.

    The share is 1/(tp·cp) as in Megatron, whose tp ranks each send a slice
    and all-gather after the border (validated on Sailor's measured runs).
    hetc's own lowering does so only with sequence parallelism; without it,
    every tp replica receives the whole tensor (tp× the bytes, which the
    traffic table counts), so this underestimates such borders.
    """
    peer = _peer_lane(cm, other, lane)
    src, dst = lane.ranks[0], peer.ranks[0]
    share = cm.boundary_bytes(ms) / (stage.tp * stage.cp)
    return cm.p2p_time(src, dst, share, _concurrent(cm, src))


def _p2p_per_microbatch(cm, stage: Stage, lane: Lane) -> float:
    p = cm.pipeline
    total = 0.0
    for ms in stage.ministages:
        for nb, border in ((ms - 1, ms - 1), (ms + 1, ms)):
            if 0 <= nb < len(p.ministages) and p.ministages[nb].stage != stage.index:
                total += border_time(cm, stage, lane, p.stages[p.ministages[nb].stage], border)
    return total


def _stage_numel(cm, stage: Stage, rank: int) -> float:
    return sum(cm.numel(ms, rank) for ms in stage.ministages)


def _shares(cm, stage: Stage, rank: int) -> tuple[float, float]:
    """The fractions of the stage's parameters in its first and in its largest ministage."""
    whole = max(_stage_numel(cm, stage, rank), 1.0)
    each = [cm.numel(ms, rank) for ms in stage.ministages]
    return each[0] / whole, max(each) / whole


def _collectives(cm, stage: Stage, lane: Lane) -> tuple[float, float, float]:
    """Per-microbatch work beside the compute: (ZeRO-2/3 reduce-scatter, one ZeRO-3 gather, parameter copies
    from the host), each in seconds (Note [zero cycle] in schedule.py says how the compute waits for them)."""
    level = stage.zero.resolved_level
    rank = lane.ranks[0]
    if cm.pipeline.schedule is ScheduleKind.ZORSE:
        return 0.0, 0.0, 0.0  # Zorse gathers and reduces once per ministage (see zorse_units)
    if level < 2 and stage.offload.params is OffloadTarget.NONE:
        return 0.0, 0.0, 0.0
    group = cm.node_group(rank) if stage.zero.shard is ZeroShard.NODE else cm.zero_group(rank)
    nbytes = _stage_numel(cm, stage, rank) * cm.delta
    k = _concurrent(cm, rank)
    reduce = cm.collective_time("reduce_scatter", group, nbytes, k) if level >= 2 else 0.0
    gather = cm.collective_time("all_gather", group, nbytes, k) if level >= 3 else 0.0
    copies = 2 * cm.copy_time(rank, nbytes * cm.shard(rank).params) \
        if stage.offload.params is not OffloadTarget.NONE else 0.0
    return reduce, gather, copies


def gathers_per_microbatch(schedule: ScheduleKind) -> int:
    """ZeRO-3 gathers a ministage's parameters around each of its compute ops: F and B, or F, I and W."""
    return 3 if schedule is ScheduleKind.ZB else 2


def _first_gather(cm) -> float:
    """ZeRO-3: the first stage waits for its first ministage's gather before anything runs."""
    stage = cm.pipeline.stages[0]
    rank = stage.lanes[0].ranks[0]
    if stage.zero.resolved_level < 3 or len(cm.zero_group(rank)) < 2:
        return 0.0
    group = cm.node_group(rank) if stage.zero.shard is ZeroShard.NODE else cm.zero_group(rank)
    nbytes = cm.numel(stage.ministages[0], rank) * cm.delta
    return cm.collective_time("all_gather", group, nbytes, _concurrent(cm, rank))


def sync_time(cm, stage: Stage, rank: int, per_ministage: bool = False) -> float:
    """Gradient reduction after the last backward (and ZeRO-1/2's parameter all-gather).

    Under per-microbatch schedules ZeRO-2/3 reduce-scatter after every
    gradient op; the lane's cycle and trail count those (Note [zero cycle]).
    """
    level = stage.zero.resolved_level
    nbytes = _stage_numel(cm, stage, rank) * cm.delta
    k = _concurrent(cm, rank)
    if stage.zero.shard is ZeroShard.NODE:
        node = cm.node_group(rank)
        across = tuple(r for r in cm.zero_group(rank) if r in _same_position(cm, rank))
        inner = (cm.collective_time("reduce_scatter", node, nbytes, k) if level < 2 or per_ministage else 0.0) + \
            (cm.collective_time("all_gather", node, nbytes, k) if level <= 2 else 0.0)
        return inner + cm.collective_time("all_reduce", across, nbytes / max(len(node), 1), k)
    group = cm.zero_group(rank)
    if level <= 1:
        return cm.collective_time("all_reduce", group, nbytes, k)
    gather = cm.collective_time("all_gather", group, nbytes, k) if level == 2 else 0.0
    if per_ministage:  # Zorse: one reduce-scatter per ministage, then (ZeRO-2) one gather
        return cm.collective_time("reduce_scatter", group, nbytes, k) + gather
    return gather


def _same_position(cm, rank: int) -> set[int]:
    """Ranks of the ZeRO group at this rank's index within their node's shard group."""
    node = cm.node_group(rank)
    idx = node.index(rank)
    by_host: dict[tuple[str, int], list[int]] = {}
    for r in cm.zero_group(rank):
        by_host.setdefault(cm.gpu(r).host, []).append(r)
    return {members[idx] for members in by_host.values() if idx < len(members)}


def _opt_time(cm, stage: Stage, rank: int) -> float:
    numel = _stage_numel(cm, stage, rank) * cm.shard(rank).optimizer
    t = cm.optimizer_time(rank, numel)
    if offloaded(stage.offload)[1]:  # gradients down, parameters back up
        t += cm.copy_time(rank, numel * (cm.states.grads + cm.states.params))
    return t


def _tail(cm, lanes: list[LaneTiming]) -> float:
    p = cm.pipeline
    drain = {s.index: max(t.backward + t.p2p for t in lanes if t.stage == s.index) for s in p.stages}
    tail, lead = 0.0, 0.0
    for stage in p.stages:
        # ranks at one position of every lane sync together; the optimizer differs by device kind
        step = max(_opt_time(cm, stage, r) for r in _reps(cm, stage.ranks))
        trail = max(t.trail for t in lanes if t.stage == stage.index)
        worst = trail + max(sync_time(cm, stage, r) for r in stage.lanes[0].ranks) + step
        tail = max(tail, worst - lead)
        lead += drain[stage.index]
    return max(tail, 0.0)


# ------------------------------------------------------------------ Zorse units


def zorse_units(cm) -> list[Unit]:
    p = cm.pipeline
    units = []
    for ms in p.ministages:
        stage = p.stages[ms.stage]
        rank = stage.lanes[0].ranks[0]
        lanes = tuple(_unit_lane(cm, stage, lane, ms.index) for lane in stage.lanes)
        numel = cm.numel(ms.index, rank)
        fetch = 0.0
        if int(stage.zero.level) >= 3:
            fetch += cm.collective_time("all_gather", cm.zero_group(rank), numel * cm.delta,
                                        _concurrent(cm, rank))
        if stage.offload.params is not OffloadTarget.NONE:
            fetch += cm.copy_time(rank, numel * cm.delta * cm.shard(rank).params)
        ratio = numel / max(_stage_numel(cm, stage, rank), 1.0)
        sync = sync_time(cm, stage, rank, per_ministage=True) * ratio
        step = _opt_time(cm, stage, rank) * ratio
        units.append(Unit(stage.index, lanes, fetch, sync, step, offloaded(stage.offload)[1]))
    return units


def _unit_lane(cm, stage: Stage, lane: Lane, ms: int) -> UnitLane:
    p = cm.pipeline
    rank = lane.ranks[0]
    reps = _reps(cm, lane.ranks)
    share = 1 / len(stage.ministages)   # the engine's per-microbatch cost, spread over the stage's units
    f = max(cm.compute_time(r, ms, "F") + cm.microbatch_overhead(r) * share for r in reps)
    b = max(cm.compute_time(r, ms, "B") for r in reps)
    offload_acts = stage.offload.activations is not OffloadTarget.NONE
    if offload_acts:
        # boundary activations go to the host after the forward and come back for the backward,
        # beside the compute (the backward's recompute of the ministage is in compute_time)
        copy = cm.copy_time(rank, cm.held_boundary_bytes(ms, stage))
        f, b = max(f, copy), max(b, copy)
    out = back = 0.0
    if ms + 1 < len(p.ministages) and p.ministages[ms + 1].stage != stage.index:
        out = border_time(cm, stage, lane, p.stages[p.ministages[ms + 1].stage], ms)
    if ms > 0 and p.ministages[ms - 1].stage != stage.index:
        back = border_time(cm, stage, lane, p.stages[p.ministages[ms - 1].stage], ms - 1)
    return UnitLane(lane.microbatches, f, b, out, back)
