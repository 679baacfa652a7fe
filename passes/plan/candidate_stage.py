"""One stage of a candidate as the cost model's composition reads it (`passes.cost.classes.StageSource`).

Once per class of alike lanes: compute per lane, border transfers, ZeRO
collectives beside the compute and after the flush, the optimizer step,
Zorse's units and memory per class of ranks, each from passes/cost's
formulas (`CostModel.layer_cost` through `Primitives`, `zero_time`,
`memory.state_memory`, `plan_time.stage_borders`) with the candidate's
groups (candidate_view.py). The planner's option tables read it too
(stage_option.py), on a stand-in pipeline around one stage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from hetc.ir.layout import BorderLayout, gathers_at_border
from hetc.ir.memo import cached_property
from hetc.ir.program import Collective, Unit as LayerUnit
from hetc.passes.plan.candidate_view import PlanView, StageContext, StageView
from hetc.passes.cost.cores import Computing, busy_share
from hetc.passes.cost.params import tied_copy_params
from hetc.passes.cost.memory import (BackwardPeak, RankMemory, ShardFactors, StateMemory, StatesHeld, activation_memory,
                                    interleaved_group, rank_headroom, rank_memory, shard_factors, state_memory,
                                    ZorseParams, forwards_first, gpipe_backward_peak, zorse_backward_peak,
                                    zorse_gathers)
from hetc.passes.cost.plan_time import border_crossings, lane_borders, ministage_borders, stage_borders
from hetc.passes.cost.schedule import Grouping, Unit, UnitLane, UnitOp, unit_ops
from hetc.passes.cost.zero_time import (ZeroRings, across_nodes, fetch_time, first_gather_time, flush_time,
                                       optimizer_step_time, piece_collectives, publish_time, sync_time,
                                       zero_collectives)
from hetc.passes.cost.zero_units import gathers_per_block, ministage_units
from hetc.passes.cost.shapes import LayerKind
from hetc.passes.cost.transfers import Borders
from hetc.passes.plan.primitives import Primitives
from hetc.ir.spec import ScheduleKind, ZeroShard, ZeroSpec
from hetc.ir.topology import Gpu

__all__ = ["StageCosts", "unit_lane_times"]

_KINDS = (LayerKind.EMBED, LayerKind.BLOCK, LayerKind.HEAD)
# lanes timed alike: (lane class, microbatch count, then per neighbouring stage (peer's node group, same host))
_LaneClassKey = tuple[int | tuple[str, bool], ...]


class StageCosts:
    """Per-stage quantities of the cost model, for one stage of a plan view."""

    def __init__(self, prims: Primitives, plan: PlanView | StageContext, stage: StageView):
        self.p, self.plan, self.s = prims, plan, stage
        self.index: int = stage.index
        self.num_lanes: int = len(stage.lanes)
        self.zero: ZeroSpec = stage.zero
        self.last_ms = len(plan.ministages) - 1
        # microbatches a lane keeps in flight (Note [in-flight limit]); None: the stages ahead (option tables)
        self.in_flight_limit: int | None = None
        self.grouping = Grouping.DEPTH_FIRST   # interleaved 1F1B's, as the last `memory_classes` asked
        self._statics: dict[int | None, StateMemory] = {}
        self._helds: dict[int | None, StatesHeld] = {}
        self._rooms: dict[tuple[str, int | None, int, int | None, Grouping], float] = {}
        self._numels: dict[tuple[int, int, int], float] = {}
        self._shards: dict[int | None, ShardFactors] = {}
        self._rings: dict[int, ZeroRings] = {}

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

    def _sum(self, units: tuple[int, int, int], per_kind: Callable[[str], float]) -> float:
        total = 0.0
        for n, kind in zip(units, _KINDS):
            if n:
                total += n * per_kind(kind)
        return total

    def numel(self, units: tuple[int, int, int] | None = None) -> float:
        units = units or self.layer_counts
        got = self._numels.get(units)
        if got is None:
            got = self._numels[units] = self._sum(units, lambda k: self.p.params(k, self.s.tp)) + \
                self._tied_copy(units)
        return got

    def _tied_copy(self, units: tuple[int, int, int]) -> float:
        """The head's copy of a tied embedding in layers with these (embed, blocks, head) counts (as
        `CostModel.layers_numel`: split like the untied head's matrix)."""
        embed, _, head = units
        m = self.p.model
        return tied_copy_params(m, range(1 - embed, m.layers + 1 + head)) / self.s.tp

    def boundary_bytes(self, ms: int) -> float:
        return 0.0 if ms == self.last_ms else self.p.boundary

    @cached_property
    def unit_numels(self) -> list[float]:
        """The parameters of each unit the stage gathers per block (Note [zero-3 units]), in layer order;
        empty: none split. The planner plans no expert parallelism (ep = 1)."""
        return [self.numel(u) for u in self._unit_layers]

    @cached_property
    def _unit_layers(self) -> list[tuple[int, int, int]]:
        """The (embed, blocks, head) counts of each unit the stage gathers per block, in layer order."""
        head = self.p.model.layers + 1
        return [(int(u.first == 0), int(0 < u.first < head), int(u.first == head)) for _, u in self._units]

    @cached_property
    def _units(self) -> list[tuple[int, LayerUnit]]:
        """(ministage, unit) of every unit the stage gathers per block, in layer order."""
        per_block = gathers_per_block(self.plan.schedule, self.s.zero, self.s.knobs.offload.to_spec(), 1)
        return [(ms, u) for ms in self.s.ministages
                for u in ministage_units(self.p.model, range(*self.plan.ministages[ms][:2]), per_block)]

    @cached_property
    def _unit_gathers(self) -> list[tuple[int, int]]:
        """Per unit of `_unit_layers`: the boundary tensors it gathers (a ministage's first unit its
        activation, its last unit its gradient; `crossings`)."""
        units = self._units
        out = []
        for k, (ms, _) in enumerate(units):
            into, back = self.crossings(ms)
            first = k == 0 or units[k - 1][0] != ms
            last = k + 1 == len(units) or units[k + 1][0] != ms
            out.append((into * first, back * last))
        return out

    def unit_ops(self, lane: int) -> tuple[UnitOp, ...]:
        """`schedule.unit_ops` of the lane (as `plan_time.lane_unit_ops`); empty where it gathers none per block."""
        if not self._unit_layers:
            return ()
        computes = [(f, i + w) for f, i, w in (self.compute(lane, u, g)
                                               for u, g in zip(self._unit_layers, self._unit_gathers))]
        computes[0] = (computes[0][0] + self.overhead(lane), computes[0][1])
        return unit_ops(computes, piece_collectives(self.s.zero, self.rings(lane),
                                                    [n * self.p.delta for n in self.unit_numels]))

    @cached_property
    def ms_numel(self) -> list[float]:
        return [self.numel(self.ministage_units(ms)) for ms in self.s.ministages]

    def compute(self, lane: int, units: tuple[int, int, int] | None = None,
                gathers: tuple[int, int] | None = None) -> tuple[float, float, float]:
        """(F, I, W) seconds of one microbatch through `units` (default: the stage) on a lane, with the
        `gathers` (forward, input-gradient) of boundary tensors they consume (default: the stage's,
        `crossings`), as `CostModel.compute_time` counts them."""
        devices, ids = self.s.res.lane_devices[lane]
        knobs = self.s.knobs
        f, i, w = self.p.lane_compute(devices, self.s.tp, ids, knobs.offload.activations, knobs.checkpoint,
                                      units or self.layer_counts, self.slowdown(lane))
        if gathers is None:
            gathers = self._stage_gathers if units is None else (0, 0)
        if gathers != (0, 0):
            g = self.border_gather(lane)
            f, i = f + gathers[0] * g, i + gathers[1] * g
        return f, i, w

    @cached_property
    def _slowdowns(self) -> dict[int, float]:
        """Per GPU id of the plan (around one stage: the stage's own), `cores.rank_slowdowns` of its ranks read
        as `model.computing_ranks` reads a pipeline; empty when nobody is slowed."""
        if not self.p.cores_shared:
            return {}
        stages = self.plan.stages if isinstance(self.plan, PlanView) else (self.s,)
        most = max(max(s.counts) for s in stages)
        chunks = max(len(s.ministages) for s in stages)
        ranks = {g.id: Computing(g.host, g.device.name, s.index,
                                 busy_share(self.plan.schedule, self.plan.num_stages, count, most, chunks))
                 for s in stages for lane, count in zip(s.lanes, s.counts) for g in lane}
        slow = dict(zip(ranks, self.p.rank_slowdowns(tuple(ranks.values()))))
        return slow if any(v != 1.0 for v in slow.values()) else {}

    def slowdown(self, lane: int) -> float:
        """Mirrors CostModel.slowdown: the lane's slowest rank for sharing its node's cores."""
        slow = self._slowdowns
        if not slow:   # no node of the plan shares its cores
            return 1.0
        return max(slow.get(g.id, 1.0) for g in self.s.lanes[lane])

    def overhead(self, lane: int) -> float:
        """The engine's seconds per microbatch outside the layers (`CostModel.microbatch_overhead`)."""
        return max(self.p.overhead(g) for g in self.s.lanes[lane])

    # ------------------------------------------------------------ communication

    def border(self, lane: int, other: int, ms: int) -> float:
        """`plan_time.border_time` for the candidate: the lane's tp shares sent at once (Note [scatter-gather
        borders] in hetc/ir/layout.py; the gather of the parts is the consumer's, `compute`), at the streams
        of the sending lane on its node (the lane's own where the stand-in plan does not know them)."""
        peer = self.plan.peer_gpu(self.s.index, lane, other)
        share = self.boundary_bytes(ms) / self.s.tp
        streams = self.plan.peer_streams(self.s.index, lane, other) or self.s.concurrent(lane)
        return self.p.p2p(peer, self.s.lanes[lane][0], share, streams)

    def border_gather(self, lane: int) -> float:
        """`CostModel.border_gather_time` for the lane: its tp group's all-gather of a boundary tensor received
        in tp parts (Note [scatter-gather borders] in hetc/ir/layout.py), inside the consuming compute."""
        if not gathers_at_border(BorderLayout(self.s.tp), self.p.model.seq):
            return 0.0
        return self.p.ring(Collective.ALL_GATHER, tuple(g.id for g in self.s.lanes[lane]), self.p.boundary)

    @cached_property
    def _stage_gathers(self) -> tuple[int, int]:
        """The boundary tensors one microbatch's forward and input-gradient through the stage gather."""
        crossings = [self.crossings(ms) for ms in self.s.ministages]
        return sum(c[0] for c in crossings), sum(c[1] for c in crossings)

    def crossings(self, ms: int) -> tuple[int, int]:
        """`plan_time.border_crossings` of ministage `ms` in the candidate."""
        return border_crossings(ms, self.s.index, self.plan.stage_of_ministage, self.last_ms + 1)

    def p2p(self, lane: int) -> Borders:
        return lane_borders(self.s.ministages, self.s.index, self.plan.stage_of_ministage, self.last_ms + 1,
                            lambda other, ms: self.border(lane, other, ms))

    def lane_classes(self) -> list[list[int]]:
        return list(self._lane_classes.values())

    @cached_property
    def _lane_classes(self) -> dict[tuple[object, ...], list[int]]:
        return _lane_classes(self)

    def count(self, lane: int) -> int:
        return self.s.counts[lane]

    def flush(self) -> float:
        """`zero_time.flush_time`: lane 0's first rank stands for the positions (the tp ranks of a lane
        sit on one node), the first lane holding each device kind and core share for them."""
        return flush_time((self.sync(0),), (self.optimizer(lane) for lane in _kind_reps(self)))

    def unit(self, ms: int) -> Unit:
        """Zorse: ministage `ms` over every lane (one timing per class of lanes)."""
        rep = {lane: lanes[0] for lanes in self.lane_classes() for lane in lanes}
        per_class = {r: unit_lane_times(self, r, ms) for r in set(rep.values())}
        routes = self.s.routes   # (looked up by the lanes' counts: once, not per lane)
        lanes = tuple(per_class[rep[lane]].serving(routes[lane]) for lane in range(len(self.s.lanes)))
        numel = self.numel(self.ministage_units(ms))
        return Unit.of(self.s.index, lanes, self.fetch(ms), numel, self.numel(), self.sync(0, ms, publish=False),
                       self.optimizer(0), publish_time(self.s.zero, numel * self.p.delta, self.rings(0)))

    def memory_classes(self, limit: int | None, grouping: Grouping = Grouping.DEPTH_FIRST
                       ) -> list[tuple[RankMemory, tuple[int, ...]]]:
        """One entry per device kind, microbatch count and node share, with its GPU ids."""
        self.in_flight_limit, self.grouping = limit, grouping
        seen: dict[tuple[object, ...], tuple[RankMemory, list[int]]] = {}
        lane_devices = self.s.res.lane_devices
        for lane, (gpus, count) in enumerate(zip(self.s.lanes, self.s.counts)):
            share = self.s.node_share(lane)
            devices, ids = lane_devices[lane]
            if len(set(devices)) == 1:   # (a lane of one device kind, as a lane inside a node is: at once)
                key = (devices[0], count, share)
                got = seen.get(key)
                if got is None:
                    got = seen[key] = (self.memory(lane, gpus[0], count), [])
                got[1].extend(ids)
                continue
            for gpu in gpus:
                key = (gpu.device.name, count, share)
                got = seen.get(key)
                if got is None:
                    got = seen[key] = (self.memory(lane, gpu, count), [])
                got[1].append(gpu.id)
        return [(mem, tuple(ids)) for mem, ids in seen.values()]

    def shard(self, lane: int) -> ShardFactors:
        return self.shard_of(self.s.node_share(lane))

    def shard_of(self, node_share: int | None) -> ShardFactors:
        got = self._shards.get(node_share)
        if got is None:
            got = self._shards[node_share] = shard_factors(self.s.zero, len(self.s.ring), node_share)
        return got

    def rings(self, lane: int) -> ZeroRings:
        """The ZeRO groups of `lane`'s first rank (`passes.cost.zero_time`)."""
        got = self._rings.get(lane)
        if got is None:
            got = self._rings[lane] = self._zero_rings(lane)
        return got

    def _zero_rings(self, lane: int) -> ZeroRings:
        res = self.s.res
        k = res.at_once(lane)
        if self.s.zero.shard is not ZeroShard.NODE:
            return ZeroRings(lambda kind, ranks, nbytes: self.p.ring(kind, ranks, nbytes, k), self.p.states, self.s.ring)
        across = across_nodes(self.s.ring, lambda r: res.host_of_ring[r], self.s.ring[lane])
        k_across = res.at_once(lane, across=True)   # (the node's ring is inside the node: no link shared)
        return ZeroRings(lambda kind, ranks, nbytes: self.p.ring(kind, ranks, nbytes,
                                                                 k_across if ranks == across else k),
                         self.p.states, self.s.ring, res.node_ring(lane), across)

    def _copier(self, lane: int) -> Callable[[float], float]:
        gpu = self.s.lanes[lane][0]
        return lambda nbytes: self.p.copy(gpu, nbytes)

    def shares(self) -> tuple[float, float]:
        """The fractions of the stage's parameters in its first and in its largest ministage (unit)."""
        whole = max(self.numel(), 1.0)
        each = self.unit_numels or self.ms_numel   # units reduce on their own (Note [zero-3 units])
        return each[0] / whole, max(each) / whole

    def collectives(self, lane: int) -> tuple[float, float, float]:
        return zero_collectives(self.plan.schedule, self.s.zero, self.s.knobs.offload.params,
                               self.numel() * self.p.delta, self.rings(lane), self._copier(lane),
                               self.shard(lane).params, [n * self.p.delta for n in self.unit_numels])

    def sync(self, lane: int, ms: int | None = None, publish: bool = True) -> float:
        """The stage's gradient sync, or (`ms`) ministage `ms`'s alone (`plan_time.stage_sync_time`)."""
        numel = self.numel() if ms is None else self.numel(self.ministage_units(ms))
        return sync_time(self.s.zero, numel * self.p.delta, self.rings(lane), ms is not None,
                         [n * self.p.delta for n in self.unit_numels], publish)

    def first_gather(self) -> float:
        first = self.unit_numels[0] if self.unit_numels else self.ms_numel[0]
        return first_gather_time(self.s.zero, first * self.p.delta, self.rings(0))

    def fetch(self, ms: int) -> float:
        """Zorse brings ministage `ms` in once per step."""
        return fetch_time(self.s.zero, self.s.knobs.offload.params,
                          self.numel(self.ministage_units(ms)) * self.p.delta, self.rings(0), self._copier(0),
                          self.shard(0).params)

    def optimizer(self, lane: int) -> float:
        gpu, on_host = self.s.lanes[lane][0], self.s.knobs.offload.optimizer
        slow = self.slowdown(lane)
        return optimizer_step_time(lambda numel: self.p.optimizer(gpu, numel, on_host) * slow, self._copier(lane),
                                   self.numel() * self.shard(lane).optimizer, on_host, self.p.states)

    # ------------------------------------------------------------ memory

    def memory(self, lane: int, gpu: Gpu, count: int) -> RankMemory:
        """A rank of `lane` serving `count` microbatches (`passes.cost.memory.rank_memory`)."""
        share = self.s.node_share(lane)
        return rank_memory(gpu.id, gpu, self.s.index, self._static(share), self._activations(count),
                           self._backward_peak(share, count))

    def fits(self, lane: int, count: int) -> bool:
        """Whether every rank of `lane` fits serving `count` microbatches."""
        return self.headroom(lane, count) >= 0

    def headroom(self, lane: int, count: int) -> float:
        """Bytes left on the fullest rank of `lane` serving `count` microbatches."""
        share = self.s.node_share(lane)
        return min(self._room(g, share, count) for g in self._kinds(lane))

    def _kinds(self, lane: int) -> Iterable[Gpu]:
        """One GPU of each device kind in `lane` (a kind's ranks hold alike)."""
        return {g.device.name: g for g in self.s.lanes[lane]}.values()

    def _room(self, gpu: Gpu, node_share: int | None, count: int) -> float:
        """Bytes left on a rank of `gpu`'s kind below the share a plan may fill (Note [planning headroom]);
        memoised (the option tables search counts)."""
        key = (gpu.device.name, node_share, count, self.in_flight_limit, self.grouping)
        got = self._rooms.get(key)
        if got is None:
            got = self._rooms[key] = rank_headroom(gpu, self._static(node_share), self._activations(count),
                                                   self._backward_peak(node_share, count)) - self.p.spare(gpu)
        return got

    @cached_property
    def _borders(self) -> tuple[float, float, float]:
        """(the boundary activations its ministages take in, the largest one it holds at a border, the largest
        one a ministage takes in)."""
        st = self.s
        inputs = [self.boundary_bytes(ms - 1) for ms in st.ministages if ms > 0]
        return sum(inputs), max(self.boundary_bytes(ms) for ms in st.ministages), max(inputs, default=0.0)

    def activations_per_count(self) -> float:
        """Activation bytes each further microbatch adds when that is linear in the count (GPipe, Zorse
        without offloaded activations), else 0."""
        schedule = self.plan.schedule
        zorse = schedule is ScheduleKind.ZORSE and not self.s.knobs.offload.activations
        if schedule is ScheduleKind.GPIPE or zorse:
            return sum(self._per_mb_activations)
        return 0.0

    def _backward_peak(self, node_share: int | None, count: int) -> BackwardPeak | None:
        """Activations and gradients at once at a Zorse or GPipe rank's peak (`memory.zorse_backward_peak`,
        `memory.gpipe_backward_peak`)."""
        schedule, offloaded = self.plan.schedule, bool(self.s.knobs.offload.activations)
        if forwards_first(schedule, self.s.index, self.plan.num_stages, count, self.in_flight_limit):
            return gpipe_backward_peak(offloaded, self._activations(count)[0],
                                       sum(self._per_mb_activations), self._static(node_share))
        if schedule is not ScheduleKind.ZORSE:
            return None
        grads = [n * self.p.states.grads for n in self.ms_numel]
        factors = self.shard_of(node_share)
        params = ZorseParams([n * self.p.states.params * factors.params for n in self.ms_numel], self.plan.prefetch,
                             self._regathers, self._held(node_share).gathers) if self.s.knobs.offload.params else None
        return zorse_backward_peak(schedule, self.p.train.grad_clip, offloaded, count, self._per_mb_activations,
                                   grads, sum(grads) * factors.grads, factors.grads < 1.0,
                                   (2 + self.plan.prefetch) * self._borders[2], params, self._tied_to_end,
                                   factors.reduced, zorse_gathers(self._held(node_share), self.plan.prefetch))

    @cached_property
    def _regathers(self) -> bool:
        """ZeRO-1/2 over a group: each ministage's parameters are gathered back after its step."""
        return self.zero.resolved_level in (1, 2) and len(self.s.ring) > 1

    @cached_property
    def _tied_to_end(self) -> int | None:
        """The stage's ministage (its index among them) holding the head's copy of a tied embedding, whose
        update waits for the end of the step (`memory.zorse_backward_peak`)."""
        if not self.p.model.tied_embeddings:
            return None
        tied = {ms for ms, (first, stop, _) in enumerate(self.plan.ministages)
                if first == 0 or stop == self.p.model.num_model_layers}
        mine = [k for k, ms in enumerate(self.s.ministages) if ms in tied]
        return mine[-1] if len(tied) == 2 and mine else None

    def _static(self, node_share: int | None) -> StateMemory:
        """What a rank holds but activations and its reserve (`passes.cost.memory.state_memory`)."""
        got = self._statics.get(node_share)
        if got is None:
            got = self._statics[node_share] = state_memory(self._held(node_share), self.s.knobs.offload.to_spec(),
                                                           self.plan.schedule, self.p.train.grad_clip,
                                                           self.plan.prefetch)
        return got

    def _held(self, node_share: int | None) -> StatesHeld:
        """The states a rank holds, per ministage (`passes.cost.memory.StatesHeld`)."""
        got = self._helds.get(node_share)
        if got is None:
            got = self._helds[node_share] = self._states_held(node_share)
        return got

    def _states_held(self, node_share: int | None) -> StatesHeld:
        st, p, shard = self.s, self.p, self.shard_of(node_share)
        return StatesHeld([n * p.states.params for n in self.ms_numel], [n * p.states.grads for n in self.ms_numel],
                          sum(n * p.states.grads for n in self.ms_numel) * shard.grads,
                          sum(n * p.states.optimizer for n in self.ms_numel) * shard.optimizer, shard,
                          st.zero.resolved_level >= 3 and len(st.lanes) > 1, len(st.lanes),
                          self._borders[1] if st.ministages else 0.0, p.states.grads,
                          [n * p.states.params for n in self.unit_numels], self._regathers)

    @cached_property
    def _per_mb_activations(self) -> list[float]:
        checkpoint = self.s.knobs.checkpoint
        return [self._sum(self.ministage_units(ms), lambda k: self.p.activations(k, self.s.tp, checkpoint))
                for ms in self.s.ministages]

    def _activations(self, count: int) -> tuple[float, float]:
        # every rank of a tp group holds the whole boundary activation (no sequence parallelism)
        st = self.s
        held, _, largest_input = self._borders
        return activation_memory(self.plan.schedule, st.index, self.plan.num_stages, count,
                                 self._per_mb_activations, self.in_flight_limit, st.knobs.offload.activations,
                                 held, largest_input, self.plan.prefetch, self._group(count))

    def _group(self, count: int) -> int | None:
        """A lane's microbatches per group of interleaved 1F1B (`memory.interleaved_group`); None around one
        stage (the option tables), where the first stage is not known: p, as in a grid."""
        if not isinstance(self.plan, PlanView):
            return None
        return interleaved_group(self.plan.num_stages, len(self.plan.stages[0].counts), count,
                                 self.plan.num_microbatches, self.grouping)


def _lane_classes(sc: StageCosts) -> dict[tuple[object, ...], list[int]]:
    """Lanes the cost model times alike: the stage's lane class, microbatch count and border peers' groups."""
    out: dict[tuple[object, ...], list[int]] = {}
    plan, st = sc.plan, sc.s
    assert isinstance(plan, PlanView)   # lanes are told apart by their peers in a whole plan only
    neighbours = sorted({o for o, _ in stage_borders(st.ministages, st.index, plan.stage_of_ministage,
                                                     sc.last_ms + 1)})
    hosts = st.res.lane_hosts
    peer_keys: list[list[tuple[str, bool]]] = []
    if neighbours:
        assert isinstance(plan, PlanView)   # a stage with borders is timed inside its plan
        peer_keys = [_peer_keys(plan, st.index, o, hosts) for o in neighbours]
    peers_of = list(zip(*peer_keys)) if peer_keys else [()] * len(st.lanes)   # per lane, its peers' keys
    counts = st.counts
    for c, lanes in enumerate(st.res.classes):
        for lane in lanes:
            key: _LaneClassKey = (c, counts[lane], *peers_of[lane])
            got = out.get(key)
            if got is None:
                out[key] = [lane]
            else:
                got.append(lane)
    return out


def _kind_reps(sc: StageCosts) -> list[int]:
    """The first lane holding each device kind and core share of the stage (`plan_time.kind_reps`)."""
    seen: dict[tuple[str, float], int] = {}
    for lane, (devices, _) in enumerate(sc.s.res.lane_devices):
        slowdown = sc.slowdown(lane)
        for name in devices:
            seen.setdefault((name, slowdown), lane)
    return list(seen.values())


def _peer_keys(plan: PlanView, stage: int, other: int, hosts: list[tuple[str, int]]) -> list[tuple[str, bool]]:
    """Per lane of `stage`: its peer's node group in stage `other`, and whether they share a host."""
    theirs = plan.stages[other].lanes
    peers = [theirs[lane][0] for lane in plan.peer_lanes(stage, other)]
    return [(p.group, p.host == h) for p, h in zip(peers, hosts)]


def unit_lane_times(sc: StageCosts, lane: int, ms: int) -> UnitLane:
    """One microbatch through ministage `ms` on `lane` (`UnitLane.of`), with `lane`'s microbatches."""
    plan = sc.plan
    f, i, w = sc.compute(lane, sc.ministage_units(ms), sc.crossings(ms))
    f += sc.overhead(lane) / len(sc.s.ministages)   # as plan_time.unit_lane spreads it
    copy = sc.p.copy(sc.s.lanes[lane][0], sc.boundary_bytes(ms)) if sc.s.knobs.offload.activations else 0.0
    after, before = ministage_borders(ms, sc.s.index, plan.stage_of_ministage, sc.last_ms + 1)
    out = sc.border(lane, after, ms) if after is not None else 0.0
    back = sc.border(lane, before, ms - 1) if before is not None else 0.0
    return UnitLane.of(sc.s.routes[lane], f, i + w, copy, out, back)
