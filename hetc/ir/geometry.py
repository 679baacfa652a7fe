"""Where each rank of a plan sits, and which ranks form its groups: derived once from the pipeline.

Note [rank geometry]: a rank's place (its stage, lane, position in the lane, tp and cp rank) and the
members of its tp, cp, ZeRO and node groups follow from the pipeline alone. Lowering names the groups
in the program (Note [group names] in hetc/ir/groups.py), the cost model times collectives over their
members; both read them here, so the ranks a collective is timed over are the ranks it runs on. A lane's
ranks are cp-major: position p = cp_rank · tp + tp_rank. With cp > 1 the ZeRO group `dp.s{stage}.t{t}`
is Megatron's dp × cp group: cp ranks replicate the parameters and see different tokens.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from hetc.ir.groups import TIED, WORLD, Axis, Direction, GroupId, GroupKind
from hetc.ir.memo import cached_property
from hetc.ir.pipeline import Lane, Pipeline, Stage
from hetc.ir.program import Group
from hetc.ir.spec import ModelSpec, ZeroShard

__all__ = ["Geometry", "RankPlace", "hierarchical_zero", "uneven_node_shards"]

H = TypeVar("H", bound=Hashable)


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


def hierarchical_zero(stage: Stage) -> bool:
    """Shard inside nodes and replicate across them (HSDP); level 0 has nothing to shard."""
    return stage.zero.shard is ZeroShard.NODE and stage.zero.resolved_level > 0


def uneven_node_shards(lanes: Sequence[Sequence[H]], tp: int, cp: int = 1) -> Counter[H] | None:
    """Hierarchical ZeRO over lanes whose ranks sit on nodes `lanes` (each lane's hosts, cp-major): where the
    nodes hold different numbers of one tp rank's replicas, how many each holds; None where every node
    holds as many. Each node shards the state over its own replicas and shard i of every node is reduced
    with shard i of the others, which only match where every node cuts the same pieces (HSDP's mesh):
    the validator refuses such a stage (passes/validate_plan.py), the planner never proposes one."""
    for t in range(tp):
        per_node = Counter(lane[c * tp + t] for lane in lanes for c in range(cp))
        if len(set(per_node.values())) > 1:
            return per_node
    return None


class Geometry:
    """Every rank's place and groups in `pipeline` (Note [rank geometry])."""

    def __init__(self, pipeline: Pipeline, model: ModelSpec):
        self.pipeline, self.model = pipeline, model
        self._replicas: dict[tuple[int, int], tuple[int, ...]] = {}

    @cached_property
    def _by_rank(self) -> dict[int, RankPlace]:
        return {rank: RankPlace(rank, stage, lane, pos) for stage in self.pipeline.stages for lane in stage.lanes
                for pos, rank in enumerate(lane.ranks)}

    @cached_property
    def places(self) -> tuple[RankPlace, ...]:
        """Every rank's place, in rank order (each rank of a plan serves a lane)."""
        return tuple(self._by_rank[r] for r in range(self.pipeline.world_size))

    def place(self, rank: int) -> RankPlace:
        return self._by_rank[rank]

    # ---------------------------------------------------------------- members

    def tp_members(self, place: RankPlace) -> tuple[int, ...]:
        """The ranks of this rank's lane that share its sequence part (its TP group)."""
        tp = place.stage.tp
        return place.lane.ranks[place.cp_rank * tp:(place.cp_rank + 1) * tp]

    def cp_members(self, place: RankPlace) -> tuple[int, ...]:
        """The ranks of this rank's lane with its tp rank (its CP group)."""
        return place.lane.ranks[place.tp_rank::place.stage.tp]

    def replicas(self, place: RankPlace) -> tuple[int, ...]:
        """The ranks holding the same parameters as this one: its tp rank in every lane and cp rank (the
        DP/ZeRO group; memoised: every rank of a stage with the same tp rank has the same replicas)."""
        stage = place.stage
        key = (stage.index, place.tp_rank)
        got = self._replicas.get(key)
        if got is None:
            got = self._replicas[key] = tuple(lane.ranks[c * stage.tp + place.tp_rank]
                                              for lane in stage.lanes for c in range(stage.cp))
        return got

    def node_replicas(self, place: RankPlace) -> tuple[int, ...]:
        """This rank's replicas on its own node (hierarchical ZeRO shards over them)."""
        host = self.pipeline.world[place.rank].host
        return tuple(r for r in self.replicas(place) if self.pipeline.world[r].host == host)

    # ---------------------------------------------------------------- groups, as the program names them

    def _dp_id(self, place: RankPlace) -> GroupId:
        dp = GroupId(GroupKind.DP, place.stage.index)
        return dp.at(Axis.TP_RANK, place.tp_rank) if place.stage.cp > 1 else dp.at(Axis.POS, place.pos)

    def zero_group(self, place: RankPlace) -> GroupId | None:
        """The group sharding this rank's ministages, or None when nothing replicates them."""
        if len(self.replicas(place)) == 1:
            return None
        if hierarchical_zero(place.stage):
            return self._dp_id(place).at(Axis.NODE, self._node_index(place))
        return self._dp_id(place)

    def outer_group(self, place: RankPlace) -> GroupId | None:
        """Hierarchical ZeRO: this rank's shard on every other node; None where no other node holds replicas
        (a stage on one node: its node group is its whole ZeRO group, and a group of one would reduce nothing)."""
        if len(self.replicas(place)) == 1 or not hierarchical_zero(place.stage):
            return None
        inner = self.node_replicas(place)
        if len(inner) == len(self.replicas(place)):
            return None
        return self._dp_id(place).of_kind(GroupKind.DPX).at(Axis.SHARD, inner.index(place.rank))

    def _node_index(self, place: RankPlace) -> int:
        nodes = list(dict.fromkeys(self.pipeline.world[r].host for r in self.replicas(place)))
        return nodes.index(self.pipeline.world[place.rank].host)

    def tp_group(self, place: RankPlace) -> GroupId | None:
        """The group this rank's tensor-parallel collectives run on (None for tp = 1)."""
        if place.stage.tp == 1:
            return None
        return GroupId(GroupKind.TP, place.stage.index).at(Axis.LANE, place.lane.index).at(Axis.CP_RANK, place.cp_rank)

    def cp_group(self, place: RankPlace) -> GroupId | None:
        """The group this rank's context-parallel collectives run on (None for cp = 1)."""
        if place.stage.cp == 1:
            return None
        return GroupId(GroupKind.CP, place.stage.index).at(Axis.LANE, place.lane.index).at(Axis.TP_RANK, place.tp_rank)

    def ep_group(self, place: RankPlace, ms: int) -> GroupId | None:
        """The expert-parallel group of ministage `ms`'s MoE blocks on this rank (None: ep = 1, or no block)."""
        if place.stage.ep == 1 or not self._has_block(ms):
            return None
        group = place.lane.index // place.stage.ep
        return GroupId(GroupKind.EP, place.stage.index).at(Axis.EP_GROUP, group).at(Axis.POS, place.pos)

    def expert_group(self, place: RankPlace) -> GroupId | None:
        """The group replicating this rank's experts (None when no other rank holds them)."""
        stage = place.stage
        if stage.ep == 1 or len(stage.lanes) // stage.ep * stage.lane_size == 1:
            return None
        return GroupId(GroupKind.DPE, stage.index).at(Axis.EP_RANK, place.lane.index % stage.ep)

    @cached_property
    def tied_ministages(self) -> tuple[int, ...]:
        """The ministages holding a copy of a tied embedding (`Pipeline.tied_ministages`); each rank holds at
        most one (hetc.passes.validate_runtime)."""
        return self.pipeline.tied_ministages(self.model)

    def _has_block(self, ms: int) -> bool:
        m = self.pipeline.ministages[ms]
        return any(1 <= i <= self.model.layers for i in m.layers)

    @cached_property
    def groups(self) -> tuple[Group, ...]:
        """Every group any pass may name, in a stable order: the program's group table. torch numbers a group's
        members by global rank; where the order of concatenation matters, validation refused lanes whose
        ranks break it (passes/validate_plan.py), so the members sorted are the members in lane order."""
        named: dict[GroupId, list[int]] = {WORLD: list(range(self.pipeline.world_size))}
        for place in self.places:
            for group in self.groups_of(place):
                named.setdefault(group, []).append(place.rank)
        if self.tied_ministages:
            named[TIED] = list(self.pipeline.tied_ranks(self.model))
        return tuple(Group(str(g), tuple(sorted(r))) for g, r in named.items())   # named in the program

    def groups_of(self, place: RankPlace) -> list[GroupId]:
        """The groups this rank belongs to, its ZeRO groups with their per-microbatch copies first."""
        lane = [g for g in (self.tp_group(place), self.cp_group(place)) if g]
        experts = sorted({g for ms in place.stage.ministages if (g := self.ep_group(place, ms))}, key=str)
        if experts and (replicas := self.expert_group(place)):
            experts += with_copies(replicas)
        inner = self.zero_group(place)
        if inner is None:
            return lane + experts
        outer = self.outer_group(place)
        return with_copies(inner) + ([outer] if outer else []) + lane + experts


def with_copies(group: GroupId) -> list[GroupId]:
    """A group and its per-microbatch forward and backward copies (Note [group names])."""
    return [group, *(group.per_microbatch(d) for d in Direction)]
