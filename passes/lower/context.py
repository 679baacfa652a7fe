"""What every lowering pass needs to know about the plan, computed once.

`LowerContext` answers the questions passes ask over and over: which rank
runs ministage k for microbatch j at my lane position, which group a
ministage's ZeRO collectives use, what shape a boundary tensor has.
Group names follow one scheme (Note [group names]):

    dp.s{stage}.p{pos}         the stage's lanes at lane position pos (ZeRO)
    dp.s{stage}.p{pos}.f|.b    per-microbatch forward / backward collectives
    dp.s{stage}.p{pos}.n{k}    hierarchical ZeRO: the lanes on node k
    dpx.s{stage}.p{pos}.i{i}   hierarchical ZeRO: shard i of every node
    world                      every rank (loss, gradient norm)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from hetc.pipeline import Lane, Pipeline, Stage
from hetc.program import Group, Instr, RankProgram
from hetc.spec import Spec, ZeroShard

__all__ = ["LowerContext", "RankPlace", "next_handle"]


@dataclass(frozen=True, slots=True)
class RankPlace:
    rank: int
    stage: Stage
    lane: Lane
    pos: int          # index inside the lane: cp_rank * tp + tp_rank

    @property
    def tp_rank(self) -> int:
        return self.pos % self.stage.tp

    @property
    def cp_rank(self) -> int:
        return self.pos // self.stage.tp


class LowerContext:
    def __init__(self, spec: Spec, pipeline: Pipeline):
        self.spec = spec
        self.pipeline = pipeline
        self.model = spec.model
        self.train = spec.train
        self.grad_clip = spec.train.grad_clip

    @cached_property
    def places(self) -> tuple[RankPlace, ...]:
        out: dict[int, RankPlace] = {}
        for stage in self.pipeline.stages:
            for lane in stage.lanes:
                for pos, rank in enumerate(lane.ranks):
                    out[rank] = RankPlace(rank, stage, lane, pos)
        return tuple(out[r] for r in range(self.pipeline.world_size))

    @cached_property
    def _lane_by_stage_mb(self) -> dict[tuple[int, int], Lane]:
        return {(s.index, mb): lane for s in self.pipeline.stages for lane in s.lanes for mb in lane.microbatches}

    def lane_for(self, ms: int, mb: int) -> Lane:
        """The lane that runs ministage `ms` on microbatch `mb`."""
        return self._lane_by_stage_mb[(self.pipeline.ministages[ms].stage, mb)]

    def peer(self, ms: int, mb: int, pos: int) -> int:
        """The rank at lane position `pos` (clamped to that lane's size) that runs ms on mb."""
        lane = self.lane_for(ms, mb)
        return lane.ranks[min(pos, len(lane.ranks) - 1)]

    def receivers(self, ms: int, mb: int, pos: int, from_size: int) -> list[int]:
        """The ranks running ms on mb whose `peer` is lane position `pos` of a lane of `from_size` ranks.

        The inverse of `peer`: where two bordering lanes differ in size, one
        rank of the smaller lane serves several of the larger one.
        """
        lane = self.lane_for(ms, mb)
        return [r for p, r in enumerate(lane.ranks) if min(p, from_size - 1) == pos]

    def stage_of(self, ms: int) -> Stage:
        return self.pipeline.stages[self.pipeline.ministages[ms].stage]

    def starts_model(self, ms: int) -> bool:
        return self.pipeline.ministages[ms].first_layer == 0

    def ends_model(self, ms: int) -> bool:
        return self.pipeline.ministages[ms].stop_layer == self.model.num_model_layers

    def boundary_shape(self, ms: int) -> tuple[int, ...]:
        """Shape of the activation leaving ministage ms (and of its gradient)."""
        stage = self.stage_of(ms)
        return (self.pipeline.micro_batch, self.model.seq // stage.cp, self.model.hidden)

    # ---------------------------------------------------------------- groups

    def zero_group(self, place: RankPlace) -> str | None:
        """The group sharding this rank's ministages, or None for a single lane."""
        stage = place.stage
        if len(stage.lanes) == 1:
            return None
        if _hierarchical(stage):
            return f"dp.s{stage.index}.p{place.pos}.n{self._node_index(place)}"
        return f"dp.s{stage.index}.p{place.pos}"

    def outer_group(self, place: RankPlace) -> str | None:
        if len(place.stage.lanes) == 1 or not _hierarchical(place.stage):
            return None
        inner = self._inner_members(place)
        return f"dpx.s{place.stage.index}.p{place.pos}.i{inner.index(place.rank)}"

    def _node_index(self, place: RankPlace) -> int:
        nodes = self._stage_nodes(place.stage)
        return nodes.index(self.pipeline.world[place.rank].host)

    def _stage_nodes(self, stage: Stage) -> list:
        nodes: list = []
        for lane in stage.lanes:
            host = self.pipeline.world[lane.ranks[0]].host
            if host not in nodes:
                nodes.append(host)
        return nodes

    def _inner_members(self, place: RankPlace) -> list[int]:
        host = self.pipeline.world[place.rank].host
        return [lane.ranks[place.pos] for lane in place.stage.lanes
                if self.pipeline.world[lane.ranks[place.pos]].host == host]

    @cached_property
    def groups(self) -> tuple[Group, ...]:
        """Every group any pass may name, in a stable order."""
        named: dict[str, list[int]] = {"world": list(range(self.pipeline.world_size))}
        for place in self.places:
            for name in self._groups_of(place):
                named.setdefault(name, []).append(place.rank)
        return tuple(Group(n, tuple(sorted(r))) for n, r in named.items())

    def _groups_of(self, place: RankPlace) -> list[str]:
        inner = self.zero_group(place)
        if inner is None:
            return []
        names = [inner, f"{inner}.f", f"{inner}.b"]
        outer = self.outer_group(place)
        return names + ([outer] if outer else [])


def _hierarchical(stage: Stage) -> bool:
    """Shard inside nodes and replicate across them (HSDP); level 0 has nothing to shard."""
    return stage.zero.shard is ZeroShard.NODE and stage.zero.level > 0


def next_handle(instrs: list[Instr] | tuple[Instr, ...]) -> int:
    """The first handle number not used in a rank's program."""
    used = [h for i in instrs if (h := getattr(i, "handle", None)) is not None]
    return max(used, default=-1) + 1


def rank_shell(place: RankPlace) -> RankProgram:
    return RankProgram(place.rank, place.stage.index, place.lane.index, place.tp_rank, place.cp_rank, (), ())
