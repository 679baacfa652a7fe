"""A plan the planner has not built yet, resolved to GPUs, lanes, ministages and microbatch routes.

`PlanView` is what the class-by-class composition reads (`candidate_stage.StageCosts`):
the facts a `Pipeline` carries (ministages in model order, each stage's
lanes and the microbatches routed to them) without building a Spec.
`StageContext` stands in for a whole plan around one stage (the planner's
option tables): the stage itself, exact, between one-GPU stand-ins for its
neighbours. Ranks are GPU ids; a lane is a run of `tp` consecutive GPUs of
a stage. `ResolvedStage` (a stage's GPUs, lanes and ZeRO rings) is built
once per stage of GPUs and shared by every view of it, so that views of
many candidates are cheap. The planner turns its candidates into views
(passes/plan/views.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

from hetc.ir.memo import cached_property
from hetc.passes.cost.links import groups_at_once
from hetc.passes.cost.plan_time import peer_lanes
from hetc.ir.pipeline import route_microbatches
from hetc.ir.spec import Checkpointing, OffloadSpec, ScheduleKind, ZeroShard, ZeroSpec
from hetc.ir.topology import Gpu

__all__ = ["OffloadChoice", "PlanView", "ResolvedStage", "StageConfig", "StageContext", "StageView"]


class OffloadChoice(Protocol):
    """What a stage keeps on the host (the planner's `candidate.Offload`)."""

    @property
    def params(self) -> bool: ...

    @property
    def optimizer(self) -> bool: ...

    @property
    def activations(self) -> bool: ...

    def to_spec(self) -> OffloadSpec: ...


class StageConfig(Protocol):
    """One stage's configuration (the planner's `candidate.Knobs`)."""

    @property
    def zero(self) -> int: ...

    @property
    def offload(self) -> OffloadChoice: ...

    @property
    def ministages(self) -> int: ...

    @property
    def checkpoint(self) -> Checkpointing: ...


class ResolvedStage:
    """The GPUs of one stage, its lanes and its ZeRO ring (the first rank of every lane)."""

    def __init__(self, gpus: tuple[Gpu, ...], tp: int):
        self.gpus = gpus
        self.tp = tp
        self.lanes = tuple(self.gpus[i:i + self.tp] for i in range(0, len(self.gpus), self.tp))
        self.ring = tuple(lane[0].id for lane in self.lanes)
        self.lane_hosts = [lane[0].host for lane in self.lanes]
        self.host_of_ring = dict(zip(self.ring, self.lane_hosts))
        self._ring_by_host: dict[tuple[str, int], list[int]] = {}
        for host, r in zip(self.lane_hosts, self.ring):
            self._ring_by_host.setdefault(host, []).append(r)

    def node_ring(self, lane: int) -> tuple[int, ...]:
        """Hierarchical ZeRO (`shard = node`): the ring members on this lane's node."""
        return tuple(self._ring_by_host[self.lane_hosts[lane]])

    def concurrent(self, lane: int) -> int:
        """The stage's GPUs on the node of the lane's first GPU: their border transfers share the node's link
        (`CostModel.node_streams`, Note [node links])."""
        return self._concurrent[lane]

    @cached_property
    def _concurrent(self) -> list[int]:
        return [self._on_host[lane[0].host] for lane in self.lanes]

    def at_once(self, lane: int, across: bool = False) -> int:
        """ZeRO groups like the lane's crossing its node's link at once (`links.groups_at_once`): the stage's
        GPUs on the node over the ring's members there (`across`: one per node, hierarchical ZeRO's)."""
        return groups_at_once(self._on_host[self.lane_hosts[lane]], 1 if across else len(self.node_ring(lane)))

    @cached_property
    def _on_host(self) -> Counter[tuple[str, int]]:
        return Counter(g.host for g in self.gpus)

    @cached_property
    def lane_devices(self) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
        """Per lane: its GPUs' device kinds and ids (what a lane's compute is looked up by)."""
        return [(tuple(g.device.name for g in lane), tuple(g.id for g in lane)) for lane in self.lanes]

    @cached_property
    def classes(self) -> list[tuple[int, ...]]:
        """Lanes that time alike: same device kinds, node groups, concurrency and node-local ring."""
        out: dict[tuple[object, ...], list[int]] = {}
        for lane, gpus in enumerate(self.lanes):
            key = (tuple(g.device.name for g in gpus), tuple(g.group for g in gpus), self.concurrent(lane),
                   self._on_host[self.lane_hosts[lane]], len(self._ring_by_host[self.lane_hosts[lane]]))
            out.setdefault(key, []).append(lane)
        return [tuple(v) for v in out.values()]


@dataclass(frozen=True)
class StageView:
    index: int
    res: ResolvedStage
    knobs: StageConfig
    zero: ZeroSpec
    ministages: tuple[int, ...]    # global ministage indices, in the stage's order
    counts: tuple[int, ...]        # microbatches per lane

    @property
    def lanes(self) -> tuple[tuple[Gpu, ...], ...]:
        return self.res.lanes

    @property
    def ring(self) -> tuple[int, ...]:
        return self.res.ring

    @property
    def tp(self) -> int:
        return self.res.tp

    def concurrent(self, lane: int) -> int:
        return self.res.concurrent(lane)

    def node_share(self, lane: int) -> int | None:
        return len(self.res.node_ring(lane)) if self.zero.shard is ZeroShard.NODE else None

    @property
    def routes(self) -> tuple[tuple[int, ...], ...]:
        return _routes(self.counts)

    @property
    def lane_of_microbatch(self) -> tuple[int, ...]:
        return _lane_of_microbatch(self.counts)


@dataclass(frozen=True)
class PlanView:
    """A whole candidate resolved; `StageCosts` reads it through the methods below."""

    stages: tuple[StageView, ...]
    ministages: tuple[tuple[int, int, int], ...]   # (first, stop, stage) in model order
    schedule: ScheduleKind
    prefetch: int
    micro_batch: int

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_microbatches(self) -> int:
        return sum(self.stages[0].counts)

    def stage_of_ministage(self, ms: int) -> int:
        return self.ministages[ms][2]

    @cached_property
    def gpus(self) -> tuple[Gpu, ...]:
        return tuple(g for s in self.stages for g in s.res.gpus)

    def peer_gpu(self, stage: int, lane: int, other: int) -> Gpu:
        """First rank of the lane of `other` serving most of this lane's microbatches (lowest index on
        ties)."""
        return self.stages[other].lanes[self.peer_lanes(stage, other)[lane]][0]

    def peer_lanes(self, a: int, b: int) -> tuple[int, ...]:
        """For every lane of stage a, the lane of stage b serving most of its microbatches."""
        return _peers(self.stages[a].counts, self.stages[b].counts)

    def peer_streams(self, stage: int, lane: int, other: int) -> int | None:
        """The streams a border from stage `other` to this lane is sent at: its peer lane's GPUs on the
        peer's node (`CostModel.node_streams`, Note [node links])."""
        return self.stages[other].concurrent(self.peer_lanes(stage, other)[lane])


@dataclass(frozen=True)
class StageContext:
    """The stand-in plan around one stage (what `StageCosts` reads of a PlanView): ministages in model
    order, the stage's own among them, and per neighbour stage the one GPU that stands for it."""

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

    def peer_streams(self, stage: int, lane: int, other: int) -> int | None:
        """Not known around one stage: the caller counts its own lane's."""
        return None

    @property
    def gpus(self) -> tuple[Gpu, ...]:
        """The plan's GPUs are not known around one stage: `StageCosts` counts the stage's own."""
        return ()


@lru_cache(maxsize=4096)
def _routes(counts: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(r) for r in route_microbatches(list(counts)))


@lru_cache(maxsize=4096)
def _lane_of_microbatch(counts: tuple[int, ...]) -> tuple[int, ...]:
    out = [0] * sum(counts)
    for lane, mbs in enumerate(_routes(counts)):
        for mb in mbs:
            out[mb] = lane
    return tuple(out)


@lru_cache(maxsize=4096)
def _peers(mine: tuple[int, ...], theirs: tuple[int, ...]) -> tuple[int, ...]:
    """Per lane of `mine`, the lane of `theirs` sharing most microbatches (`plan_time.peer_lanes`)."""
    if len(theirs) == 1:
        return (0,) * len(mine)
    return peer_lanes(_lane_of_microbatch(mine), _lane_of_microbatch(theirs), len(mine))
