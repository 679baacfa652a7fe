"""What every lowering pass needs to know about the plan, computed once.

`LowerContext` answers the questions passes ask over and over: which lane
runs ministage k for microbatch j, which group a ministage's ZeRO
collectives use, which messages carry a boundary tensor between two lanes
(pieces of the sequence where their block layouts differ, hetc/layout.py).
Groups are `hetc.groups.GroupId` values, named in the program by their
text (Note [group names] in hetc/groups.py). With cp > 1 the ZeRO group
`dp.s{stage}.t{t}` is Megatron's dp × cp group: cp ranks replicate the
parameters and see different tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetc.memo import cached_property
from hetc.errors import InternalError
from hetc.groups import TIED, WORLD, Axis, Direction, GroupId, GroupKind
from hetc.layout import Range, boundary_ranges, held_length, transfers
from hetc.passes.cost import CostModel
from hetc.passes.lower.lane_sim import Run
from hetc.pipeline import Lane, Pipeline, Stage
from hetc.program import Group, Instr, RankProgram, Tensor
from hetc.spec import CPKind, Spec, ZeroShard
from hetc.topology import Topology

__all__ = ["LowerContext", "Message", "RankPlace", "hierarchical_zero", "next_handle"]


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


@dataclass(frozen=True, slots=True)
class Message:
    """One point-to-point transfer of a boundary tensor (or, with `seq`, of its tokens [a, b))."""

    src: int
    dst: int
    shape: tuple[int, ...]
    seq: Range | None


class LowerContext:
    def __init__(self, spec: Spec, pipeline: Pipeline, costs: CostModel | None = None):
        self.spec = spec
        self.pipeline = pipeline
        self._costs = costs
        assert spec.model is not None and spec.train is not None and spec.parallel is not None   # checked
        self.model = spec.model
        self.train = spec.train
        self.parallel = spec.parallel
        self.grad_clip = spec.train.grad_clip
        self._messages: dict[tuple[Tensor, int, int], tuple[Message, ...]] = {}
        self._replicas: dict[tuple[int, int], tuple[int, ...]] = {}
        self._held: dict[tuple[int, int], tuple[Range, ...]] = {}

    @cached_property
    def costs(self) -> CostModel:
        """The cost model the schedule is timed with (the catalog's arithmetic unless one is given)."""
        return self._costs or CostModel(self.spec, self.pipeline, Topology(self.spec))

    @cached_property
    def schedule(self) -> Run:
        """The timed run of every lane (Note [schedules by simulation]), made once: pass `schedule` takes
        each lane's compute order from it, pass `nccl_order` when each op ran (Note [NCCL channel order])."""
        from hetc.passes.lower.schedule import timed_schedule   # that module reads this context: not at import
        return timed_schedule(self)

    def in_flight_limit(self, stage: int) -> int:
        """Microbatches each lane of `stage` keeps in flight (Note [in-flight limit], passes/cost)."""
        return self.costs.in_flight_limits[stage]

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

    def held(self, stage: Stage, pos: int) -> tuple[Range, ...]:
        """The tokens lane position `pos` of `stage` holds at its ministages' borders (the same in every
        lane of the stage: memoised)."""
        got = self._held.get((stage.index, pos))
        if got is None:
            got = self._held[(stage.index, pos)] = boundary_ranges(stage, pos, self.model.seq)
        return got

    def messages(self, what: Tensor, ms: int, mb: int) -> tuple[Message, ...]:
        """The transfers of `what` leaving ministage `ms` for microbatch `mb` (activation forward to ms+1,
        gradient backward to ms−1) between different ranks.

        Each position of the consuming lane gets the tokens it holds from
        the producing lane (`hetc.layout.transfers`); where the layouts agree
        that is one whole tensor per position, else pieces of the sequence.
        """
        key = (what, ms, mb)
        if key not in self._messages:
            self._messages[key] = self._transfers(ms, ms + 1 if what is Tensor.ACT else ms - 1, mb)
        return self._messages[key]

    def _transfers(self, producer: int, consumer: int, mb: int) -> tuple[Message, ...]:
        (src_stage, src_lane), (dst_stage, dst_lane) = ((self.stage_of(m), self.lane_for(m, mb))
                                                        for m in (producer, consumer))
        giving = [self.held(src_stage, p) for p in range(len(src_lane.ranks))]
        needing = [self.held(dst_stage, q) for q in range(len(dst_lane.ranks))]
        out = []
        for piece in transfers(giving, needing):
            src, dst = src_lane.ranks[piece.giver], dst_lane.ranks[piece.needer]
            if src != dst:
                tokens = held_length(giving[piece.giver]) if piece.seq is None else piece.seq[1] - piece.seq[0]
                out.append(Message(src, dst, (self.pipeline.micro_batch, tokens, self.model.hidden), piece.seq))
        return tuple(out)

    def stage_of(self, ms: int) -> Stage:
        return self.pipeline.stages[self.pipeline.ministages[ms].stage]

    def starts_model(self, ms: int) -> bool:
        return self.pipeline.ministages[ms].first_layer == 0

    def ends_model(self, ms: int) -> bool:
        return self.pipeline.ministages[ms].stop_layer == self.model.num_model_layers

    # ---------------------------------------------------------------- groups

    def replicas(self, place: RankPlace) -> tuple[int, ...]:
        """The ranks holding the same parameters as this one: its tp rank in every lane and cp rank
        (memoised: every rank of a stage with the same tp rank has the same replicas)."""
        stage = place.stage
        key = (stage.index, place.tp_rank)
        got = self._replicas.get(key)
        if got is None:
            got = self._replicas[key] = tuple(lane.ranks[c * stage.tp + place.tp_rank]
                                              for lane in stage.lanes for c in range(stage.cp))
        return got

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
        if len(self.replicas(place)) == 1 or not hierarchical_zero(place.stage):
            return None
        inner = self._inner_members(place)
        return self._dp_id(place).of_kind(GroupKind.DPX).at(Axis.SHARD, inner.index(place.rank))

    def _node_index(self, place: RankPlace) -> int:
        nodes: list[tuple[str, int]] = []
        for r in self.replicas(place):
            if self.pipeline.world[r].host not in nodes:
                nodes.append(self.pipeline.world[r].host)
        return nodes.index(self.pipeline.world[place.rank].host)

    def _inner_members(self, place: RankPlace) -> list[int]:
        host = self.pipeline.world[place.rank].host
        return [r for r in self.replicas(place) if self.pipeline.world[r].host == host]

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
        """Every group any pass may name, in a stable order."""
        named: dict[GroupId, list[int]] = {WORLD: list(range(self.pipeline.world_size))}
        for place in self.places:
            for group in self._groups_of(place):
                named.setdefault(group, []).append(place.rank)
        if self.tied_ministages:
            named[TIED] = list(self.pipeline.tied_ranks(self.model))
        for place in self.places:
            self._check_lane_order(place)
        return tuple(Group(str(g), tuple(sorted(r))) for g, r in named.items())   # named in the program

    def _check_lane_order(self, place: RankPlace) -> None:
        """torch numbers a group's members by global rank; where the order of concatenation matters the lane's
        ranks follow it (validation refused plans that break this: hetc.passes.validate_plan)."""
        stage, ranks = place.stage, place.lane.ranks
        ordered = []
        if stage.sequence_parallel and stage.tp > 1:
            ordered.append(ranks[place.cp_rank * stage.tp:(place.cp_rank + 1) * stage.tp])
        if stage.cp > 1 and stage.cp_kind is CPKind.ULYSSES:
            ordered.append(ranks[place.tp_rank::stage.tp])
        first = place.lane.index - place.lane.index % stage.ep
        ordered.append(tuple(lane.ranks[place.pos] for lane in stage.lanes[first:first + stage.ep]))
        for members in ordered:
            if list(members) != sorted(members):
                raise InternalError(f"rank {place.rank}: group members {members} are not in rank order")

    def _groups_of(self, place: RankPlace) -> list[GroupId]:
        lane = [g for g in (self.tp_group(place), self.cp_group(place)) if g]
        experts = sorted({g for ms in place.stage.ministages if (g := self.ep_group(place, ms))}, key=str)
        if experts and (replicas := self.expert_group(place)):
            experts += _with_copies(replicas)
        inner = self.zero_group(place)
        if inner is None:
            return lane + experts
        outer = self.outer_group(place)
        return _with_copies(inner) + ([outer] if outer else []) + lane + experts


def _with_copies(group: GroupId) -> list[GroupId]:
    """A group and its per-microbatch forward and backward copies (Note [group names])."""
    return [group, *(group.per_microbatch(d) for d in Direction)]


def hierarchical_zero(stage: Stage) -> bool:
    """Shard inside nodes and replicate across them (HSDP); level 0 has nothing to shard."""
    return stage.zero.shard is ZeroShard.NODE and stage.zero.resolved_level > 0


def next_handle(instrs: list[Instr] | tuple[Instr, ...]) -> int:
    """The first handle number not used in a rank's program."""
    used = [h for i in instrs if (h := getattr(i, "handle", None)) is not None]
    return max(used, default=-1) + 1


def rank_shell(place: RankPlace) -> RankProgram:
    return RankProgram(place.rank, place.stage.index, place.lane.index, place.tp_rank, place.cp_rank, (), ())
