"""One stage's quantities in the cost model, for a plan view (or the stand-in pipeline of tables.py).

Each method restates what passes/cost computes for a rank of the stage
(CostModel, plan_time.py, estimate.py): compute per lane, border transfers,
ZeRO collectives beside the compute and after the flush, the optimizer
step, and memory. `evaluate` composes them into a plan's score.
"""

from __future__ import annotations

from functools import cached_property

from hetc.passes.cost import RankMemory
from hetc.passes.cost.cores import host_slowdowns
from hetc.passes.cost.memory import (GRAD_BUCKET_PARAMS, in_flight, interleaved_update, resident_params,
                                    shard_factors)
from hetc.passes.cost.schedule import ZeroCycle, zero_cycle
from hetc.passes.cost.shapes import LayerKind
from hetc.passes.plan.costs import Primitives
from hetc.spec import ScheduleKind, ZeroShard
from hetc.topology import Gpu

__all__ = ["StageCosts", "unit_lane_times"]

_KINDS = (LayerKind.EMBED, LayerKind.BLOCK, LayerKind.HEAD)


class StageCosts:
    """Per-stage quantities of the cost model, for one stage of a plan view."""

    def __init__(self, prims: Primitives, plan, stage):
        """`plan`: a PlanView or tables.StageContext; `stage`: a StageView."""
        self.p, self.plan, self.s = prims, plan, stage
        self.last_ms = len(plan.ministages) - 1
        # microbatches a lane keeps in flight (Note [in-flight limit]); None: the stages ahead (option tables)
        self.in_flight_limit: int | None = None
        self._statics: dict[int | None, tuple[float, float, float, float, float]] = {}

    # ------------------------------------------------------------ layers

    @cached_property
    def layer_counts(self) -> tuple[int, int, int]:
        """(embed, blocks, head) units this stage owns."""
        head = self.p.model.layers + 1
        idx = [i for ms in self.s.ministages for i in range(*self.plan.ministages[ms][:2])]
        return (idx.count(0), sum(1 for i in idx if 0 < i < head), idx.count(head))

    def ministage_units(self, ms: int) -> tuple[int, int, int]:
        first, stop, _ = self.plan.ministages[ms]
        head = self.p.model.layers + 1
        return (int(first == 0), len(range(max(first, 1), min(stop, head))), int(stop > head))

    def _sum(self, units: tuple[int, int, int], per_kind) -> float:
        return sum(n * per_kind(kind) for n, kind in zip(units, _KINDS) if n)

    def numel(self, units: tuple[int, int, int] | None = None) -> float:
        return self._sum(units or self.layer_counts, lambda k: self.p.params(k, self.s.tp))

    def boundary_bytes(self, ms: int) -> float:
        return 0.0 if ms == self.last_ms else self.p.boundary

    @cached_property
    def ms_numel(self) -> list[float]:
        return [self.numel(self.ministage_units(ms)) for ms in self.s.ministages]

    def compute(self, lane: int, units: tuple[int, int, int] | None = None) -> tuple[float, float, float]:
        """(F, I, W) seconds of one microbatch through `units` (default: the stage) on a lane."""
        gpus = self.s.lanes[lane]
        f, i, w = self.p.lane_compute(tuple(g.device.name for g in gpus), self.s.tp, tuple(g.id for g in gpus),
                                      self.s.knobs.offload.activations, units or self.layer_counts)
        slow = self.slowdown(lane)
        return f * slow, i * slow, w * slow

    @cached_property
    def _slowdowns(self) -> dict[tuple[str, int], float]:
        cluster = self.p.topo.cluster
        return host_slowdowns(self.plan.gpus or self.s.res.gpus, {n.name: n.cores for n in cluster.nodes},
                              cluster.cores, self.p.probe.profiles.shared)

    def slowdown(self, lane: int) -> float:
        """Mirrors CostModel.slowdown: the lane's slowest rank for sharing its node's cores."""
        return max(self._slowdowns.get(g.host, 1.0) for g in self.s.lanes[lane])

    def overhead(self, lane: int) -> float:
        """The engine's seconds per microbatch outside the layers (`CostModel.microbatch_overhead`)."""
        return max(self.p.overhead(g) for g in self.s.lanes[lane])

    # ------------------------------------------------------------ communication

    def border(self, lane: int, other: int, ms: int) -> float:
        peer = self.plan.peer_gpu(self.s.index, lane, other)
        share = self.boundary_bytes(ms) / self.s.tp
        return self.p.p2p(self.s.lanes[lane][0], peer, share, self.s.concurrent(lane))

    def p2p(self, lane: int) -> float:
        total = 0.0
        for ms in self.s.ministages:
            for nb, border in ((ms - 1, ms - 1), (ms + 1, ms)):
                if 0 <= nb <= self.last_ms and self.plan.stage_of_ministage(nb) != self.s.index:
                    total += self.border(lane, self.plan.stage_of_ministage(nb), border)
        return total

    @cached_property
    def lane_classes(self) -> dict[tuple, list[int]]:
        return _lane_classes(self)

    def shard(self, lane: int):
        return shard_factors(self.s.zero, len(self.s.ring), self.s.node_share(lane))

    def zero_ring(self, lane: int) -> tuple[int, ...]:
        return self.s.res.node_ring(lane) if self.s.zero.shard is ZeroShard.NODE else self.s.ring

    def collectives(self, lane: int) -> tuple[float, float, float]:
        """Mirrors plan_time._collectives: (reduce-scatter, one gather, host copies) per microbatch."""
        level, off = int(self.s.zero.level), self.s.knobs.offload
        if self.plan.schedule is ScheduleKind.ZORSE or (level < 2 and not off.params):
            return 0.0, 0.0, 0.0
        nbytes = self.numel() * self.p.delta
        k, ring = self.s.concurrent(lane), self.zero_ring(lane)
        reduce = self.p.ring("reduce_scatter", ring, nbytes, k) if level >= 2 else 0.0
        gather = self.p.ring("all_gather", ring, nbytes, k) if level >= 3 else 0.0
        copies = 2 * self.p.copy(self.s.lanes[lane][0], nbytes * self.shard(lane).params) if off.params else 0.0
        return reduce, gather, copies

    def cycle(self, lane: int, f: float, i: float, w: float, p2p: float) -> ZeroCycle:
        """The lane's cycle and trail with its collectives (`zero_cycle`, Note [zero cycle])."""
        schedule = self.plan.schedule
        ops = (f, i, w) if schedule is ScheduleKind.ZB else (f, i + w)
        whole = max(self.numel(), 1.0)
        shares = (self.ms_numel[0] / whole, max(self.ms_numel) / whole)
        return zero_cycle(schedule, ops, p2p, *self.collectives(lane), shares)

    def sync(self, lane: int, per_ministage: bool = False) -> float:
        level = int(self.s.zero.level)
        nbytes = self.numel() * self.p.delta
        k = self.s.concurrent(lane)
        if self.s.zero.shard is ZeroShard.NODE:
            node = self.s.res.node_ring(lane)
            inner = (self.p.ring("reduce_scatter", node, nbytes, k) if level < 2 or per_ministage else 0.0) + \
                (self.p.ring("all_gather", node, nbytes, k) if level <= 2 else 0.0)
            across = self.s.res.across_ring(lane)
            return inner + self.p.ring("all_reduce", across, nbytes / max(len(node), 1), k)
        ring = self.s.ring
        if level <= 1:
            return self.p.ring("all_reduce", ring, nbytes, k)
        gather = self.p.ring("all_gather", ring, nbytes, k) if level == 2 else 0.0
        if per_ministage:
            return self.p.ring("reduce_scatter", ring, nbytes, k) + gather
        return gather

    def first_gather(self) -> float:
        """Mirrors plan_time._first_gather for the first stage."""
        if int(self.s.zero.level) < 3 or len(self.s.lanes) < 2:
            return 0.0
        return self.p.ring("all_gather", self.zero_ring(0), self.ms_numel[0] * self.p.delta, self.s.concurrent(0))

    def optimizer(self, lane: int) -> float:
        numel = self.numel() * self.shard(lane).optimizer
        gpu = self.s.lanes[lane][0]
        on_host = self.s.knobs.offload.optimizer
        t = self.p.optimizer(gpu, numel, on_host) * self.slowdown(lane)
        if on_host:
            t += self.p.copy(gpu, numel * (self.p.states.grads + self.p.states.params))
        return t

    # ------------------------------------------------------------ memory

    def memory(self, lane: int, gpu: Gpu, count: int) -> RankMemory:
        """Mirrors estimate._memory for a rank of `lane` serving `count` microbatches."""
        params, grads, optimizer, buffers, host = self._static(self.s.node_share(lane))
        acts, acts_host = self._activations(count)
        return RankMemory(gpu.id, str(gpu), gpu.device.name, self.s.index, params, grads, optimizer, acts,
                          buffers, self.p.context(gpu), gpu.device.memory, host + acts_host)

    def fits(self, lane: int, count: int) -> bool:
        """Whether every rank of `lane` fits serving `count` microbatches."""
        params, grads, optimizer, buffers, _ = self._static(self.s.node_share(lane))
        acts = self._activations(count)[0]
        return all(params + grads + optimizer + acts + buffers + self.p.context(g) <= g.device.memory
                   for g in self.s.lanes[lane])

    def headroom(self, lane: int, count: int) -> float:
        """Bytes left on the fullest rank of `lane` serving `count` microbatches."""
        params, grads, optimizer, buffers, _ = self._static(self.s.node_share(lane))
        used = params + grads + optimizer + self._activations(count)[0] + buffers
        return min(g.device.memory - used - self.p.context(g) for g in self.s.lanes[lane])

    def activations_per_count(self) -> float:
        """Activation bytes each further microbatch adds when that is linear in the count (GPipe, Zorse
        without offloaded activations), else 0."""
        schedule = self.plan.schedule
        zorse = schedule is ScheduleKind.ZORSE and not self.s.knobs.offload.activations
        if schedule is ScheduleKind.GPIPE or zorse:
            return sum(self._per_mb_activations)
        return 0.0

    def _static(self, node_share: int | None) -> tuple[float, float, float, float, float]:
        """(params, grads, optimizer, buffers, host) bytes on a rank: all but activations and reserve."""
        got = self._statics.get(node_share)
        if got is not None:
            return got
        st, p, off = self.s, self.p, self.s.knobs.offload
        shard = shard_factors(st.zero, len(st.ring), node_share)
        params_each = [n * p.states.params for n in self.ms_numel]
        params, largest = sum(params_each), max(params_each)
        prefetch = self.plan.prefetch
        clip = p.train.grad_clip
        resident = resident_params(self.plan.schedule, clip, params, largest, prefetch) if off.params else params
        grads_sharded = sum(n * p.states.grads for n in self.ms_numel) * shard.grads
        grads = grads_sharded
        if interleaved_update(self.plan.schedule, clip):
            grads = max(n * p.states.grads for n in self.ms_numel)
        optimizer = sum(n * p.states.optimizer for n in self.ms_numel) * shard.optimizer
        gather = (1 + prefetch) * largest if int(st.zero.level) >= 3 and len(st.lanes) > 1 else 0.0
        p2p = 2 * max((self.boundary_bytes(ms) for ms in st.ministages), default=0.0)
        bucket = min(grads_sharded, GRAD_BUCKET_PARAMS * p.states.grads) if len(st.lanes) > 1 else 0.0
        host = (params * shard.params if off.params else 0.0) + (optimizer if off.optimizer else 0.0)
        got = self._statics[node_share] = (resident * shard.params, grads,
                                           0.0 if off.optimizer else optimizer,
                                           p2p + bucket + gather, host)
        return got

    @cached_property
    def _per_mb_activations(self) -> list[float]:
        return [self._sum(self.ministage_units(ms), lambda k: self.p.activations(k, self.s.tp))
                for ms in self.s.ministages]

    def _activations(self, count: int) -> tuple[float, float]:
        st = self.s
        per_mb = self._per_mb_activations
        schedule = self.plan.schedule
        if schedule is not ScheduleKind.ZORSE:
            held = in_flight(schedule, st.index, self.plan.num_stages, count, len(st.ministages),
                             self.in_flight_limit)
            return held * sum(per_mb), 0.0
        if not st.knobs.offload.activations:
            return count * sum(per_mb), 0.0
        # every rank of a tp group holds the whole boundary activation (no sequence parallelism)
        boundary = sum(self.boundary_bytes(ms - 1) for ms in st.ministages if ms > 0)
        buffers = (1 + self.plan.prefetch) * max(self.boundary_bytes(ms) for ms in st.ministages)
        return max(per_mb) + buffers, count * boundary


def _lane_classes(sc: StageCosts) -> dict[tuple, list[int]]:
    """Lanes the cost model times alike: the stage's lane class, microbatch count and border peers' groups."""
    out: dict[tuple, list[int]] = {}
    plan, st = sc.plan, sc.s
    neighbours = sorted({plan.stage_of_ministage(nb) for ms in st.ministages for nb in (ms - 1, ms + 1)
                         if 0 <= nb <= sc.last_ms and plan.stage_of_ministage(nb) != st.index})
    hosts = st.res.lane_hosts
    peer_keys = [_peer_keys(plan, st.index, o, hosts) for o in neighbours]
    for c, lanes in enumerate(st.res.classes):
        for lane in lanes:
            key = (c, st.counts[lane], *(keys[lane] for keys in peer_keys))
            out.setdefault(key, []).append(lane)
    return out


def _peer_keys(plan, stage: int, other: int, hosts: list) -> list[tuple[str, bool]]:
    """Per lane of `stage`: its peer's node group in stage `other`, and whether they share a host."""
    theirs = plan.stages[other].lanes
    peers = [theirs[lane][0] for lane in plan.peer_lanes(stage, other)]
    return [(p.group, p.host == h) for p, h in zip(peers, hosts)]


def unit_lane_times(sc: StageCosts, lane: int, ms: int) -> tuple[float, float, float, float]:
    """(forward, backward, p2p out, p2p back) of one microbatch through ministage `ms` on `lane`."""
    plan = sc.plan
    f, i, w = sc.compute(lane, sc.ministage_units(ms))
    f += sc.overhead(lane) / len(sc.s.ministages)   # as plan_time._unit_lane spreads it
    b = i + w
    if sc.s.knobs.offload.activations:  # the copy runs beside the compute (whose backward reruns it)
        copy = sc.p.copy(sc.s.lanes[lane][0], sc.boundary_bytes(ms))
        f, b = max(f, copy), max(b, copy)
    out = back = 0.0
    if ms < sc.last_ms and plan.stage_of_ministage(ms + 1) != sc.s.index:
        out = sc.border(lane, plan.stage_of_ministage(ms + 1), ms)
    if ms > 0 and plan.stage_of_ministage(ms - 1) != sc.s.index:
        back = sc.border(lane, plan.stage_of_ministage(ms - 1), ms - 1)
    return f, b, out, back
