"""Classes of alike ranks, whose programs are one program up to rank numbers, microbatch ids and group names.

Note [lowering by class]: after the `schedule` pass (one timed run of all
lanes together) every later pass builds a rank's program from what it
reads of the plan: its own compute order; the messages around each op
(peers, shapes, token pieces); the send order of each sender; its own
compute times and its links' transfer times (p2p's leads under Zorse); its
groups by name; and, for ties, the order of its peers' rank numbers. Two ranks that read the same of all that, up to
renaming, get the same program up to that renaming. So the class key is
built of exactly those readings, lane by lane (a lane's ranks share one
compute order; a rank is its lane's class and its position in the lane):

- the lane's *shape*: its stage, its compute order with each microbatch
  numbered by first appearance, every position's compute times (per layer
  and phase, the unit of a ZeRO-3 split included) and, per op that sends or
  receives, which of its neighbour lanes is at the other end (numbered by
  first appearance), the op there by its index in that lane's order, and
  the border's pieces with their transfer times;
- refined to a fixed point with the classes of its neighbours (colour
  refinement): the lanes at the other end of every message are alike in
  turn, and theirs, so everything a pass reads through a peer is alike.

This is stronger than the cost model's classes (passes/cost/classes.py
groups lanes that *time* alike, by device kind and microbatch count, for
an estimate): a program reads more than its time. A member's renaming
(`Substitution`) maps its representative's lane and neighbours to its
own; a member where that is not one-to-one or does not keep the order of
rank numbers (ties among receives posted together go by rank number)
forms a class of its own. Correctness first: the exactness test (tests/test_lower_by_class.py)
lowers every spec under specs/ and random jobs both ways and compares the
listings.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from hetc.ir.errors import InternalError
from hetc.ir.groups import GroupId
from hetc.ir.geometry import RankPlace
from hetc.passes.lower.context import LowerContext
from hetc.passes.lower.substitute import Substitution
from hetc.ir.pipeline import Lane, Stage
from hetc.ir.program import (COMPUTE_TYPES, Backward, BackwardInput, ComputeInstr, Forward, Instr, Load,
                          Program, Tensor)

__all__ = ["LaneGraph", "RankClass", "lane_graph", "rank_classes"]

# how far from a representative its renaming is built and checked: its peers, whose programs' rank numbers
# and send orders its program reads
_DEPTH = 1


@dataclass(frozen=True)
class RankClass:
    """A representative rank, lowered; its members, each with the renaming that derives its program."""

    rep: int
    members: tuple[tuple[int, Substitution], ...]


@dataclass(frozen=True)
class LaneGraph:
    """Every lane of the plan (by id: its index here) with what its class reads (Note [lowering by class])."""

    lanes: tuple[tuple[Stage, Lane], ...]
    ids: dict[tuple[int, int], int]               # (stage, lane index) -> lane id
    microbatches: tuple[tuple[int, ...], ...]     # per lane, its microbatches in order of first appearance
    neighbours: tuple[tuple[int, ...], ...]       # per lane, the lanes it exchanges messages with, in order
    shapes: tuple[int, ...]                       # per lane, the id of its shape

    def lane_of(self, place: RankPlace) -> int:
        return self.ids[(place.stage.index, place.lane.index)]

    def neighbour_ranks(self, places: Iterable[RankPlace]) -> set[int]:
        """The ranks of every lane next to the lanes of `places` (their peers, and more)."""
        lanes = {self.lane_of(place) for place in places}
        return {r for lane in lanes for n in self.neighbours[lane] for r in self.lanes[n][1].ranks}


class _Interner:
    """Hashable values to small ints, so that keys nest cheaply."""

    def __init__(self) -> None:
        self.ids: dict[Hashable, int] = {}

    def __call__(self, value: Hashable) -> int:
        return self.ids.setdefault(value, len(self.ids))


def lane_graph(ctx: LowerContext, scheduled: Program) -> LaneGraph:
    """The plan's lanes and their shapes, from the `schedule` pass's programs."""
    lanes = tuple((stage, lane) for stage in ctx.pipeline.stages for lane in stage.lanes)
    ids = {(stage.index, lane.index): i for i, (stage, lane) in enumerate(lanes)}
    orders = [_scheduled_ops(scheduled.ranks[lane.ranks[0]].instrs) for _, lane in lanes]
    index = [{(type(op), op.ms, op.mb): k for k, op in enumerate(order) if not isinstance(op, Load)}
             for order in orders]
    intern, links, times = _Interner(), _Links(ctx), _Interner()
    microbatches, neighbours, shapes = [], [], []
    for i, (stage, lane) in enumerate(lanes):
        mbs = tuple(dict.fromkeys(op.mb for op in orders[i]))
        numbered = {mb: n for n, mb in enumerate(mbs)}
        pattern = tuple((type(op), getattr(op, "ms", None), numbered[op.mb]) for op in orders[i])
        near: dict[int, int] = {}     # neighbour lane -> its number here, in order of first message
        ends = []
        for k, op in enumerate(orders[i]):
            if isinstance(op, Load):
                continue
            for way, what, border, other in _borders(ctx, op):
                there = ids[(ctx.stage_of(other).index, ctx.lane_for(other, op.mb).index)]
                src, dst = (there, i) if way == "in" else (i, there)
                ends.append((k, way, near.setdefault(there, len(near)), index[there][(type(op), other, op.mb)],
                             links(what, border, op.mb, src, dst)))
        ranks = tuple(times(ctx.costs.compute_key(r)) for r in lane.ranks)
        microbatches.append(mbs)
        neighbours.append(tuple(near))
        shapes.append(intern((stage.index, pattern, ranks, tuple(ends))))
    return LaneGraph(lanes, ids, tuple(microbatches), tuple(neighbours), tuple(shapes))


def _scheduled_ops(instrs: tuple[Instr, ...]) -> list[Load | ComputeInstr]:
    """A lane's program after pass `schedule`: loads and compute ops only."""
    out: list[Load | ComputeInstr] = []
    for instr in instrs:
        if not isinstance(instr, (Load, *COMPUTE_TYPES)):
            raise InternalError(f"pass `schedule` made `{instr}`: lowering by class reads loads and compute only")
        out.append(instr)
    return out


def _borders(ctx: LowerContext, op: ComputeInstr) -> list[tuple[str, Tensor, int, int]]:
    """(in or out, the tensor, the ministage producing it, the other end's ministage) of each boundary tensor
    compute op `op` receives or sends (pass `p2p`: a forward takes the activation of the ministage before
    and gives its own to the next; a backward takes the gradient of the next and gives its own back), where
    the other end is on another stage (inside a stage every position holds the same tokens: nothing travels)."""
    if isinstance(op, Forward):
        ends = [("in", Tensor.ACT, op.ms - 1, op.ms - 1)] if not ctx.starts_model(op.ms) else []
        ends += [("out", Tensor.ACT, op.ms, op.ms + 1)] if not ctx.ends_model(op.ms) else []
    elif isinstance(op, (Backward, BackwardInput)):
        ends = [("in", Tensor.GRAD, op.ms + 1, op.ms + 1)] if not ctx.ends_model(op.ms) else []
        ends += [("out", Tensor.GRAD, op.ms, op.ms - 1)] if not ctx.starts_model(op.ms) else []
    else:
        return []   # a weight gradient stays on its rank
    stage = ctx.pipeline.ministages[op.ms].stage
    return [end for end in ends if ctx.pipeline.ministages[end[3]].stage != stage]


class _Links:
    """The pieces of a border between two lanes, by position, with each piece's transfer time: the same for
    every microbatch the two lanes exchange (the layouts are their stages'), so found once per lane pair."""

    def __init__(self, ctx: LowerContext):
        self.ctx = ctx
        self.intern = _Interner()
        self.seen: dict[tuple[Tensor, int, int, int], int] = {}

    def __call__(self, what: Tensor, border: int, mb: int, src: int, dst: int) -> int:
        key = (what, border, src, dst)
        got = self.seen.get(key)
        if got is None:
            ctx, costs = self.ctx, self.ctx.costs
            pieces = tuple((ctx.geometry.places[m.src].pos, ctx.geometry.places[m.dst].pos, m.shape, m.seq,
                            costs.message_time(m.src, m.dst, math.prod(m.shape) * costs.delta))
                           for m in ctx.messages(what, border, mb))
            got = self.seen[key] = self.intern(pieces)
        return got


def _refined(graph: LaneGraph) -> list[int]:
    """Each lane's class: its shape, refined by its neighbours' classes until no class splits."""
    colour = list(graph.shapes)
    count = len(set(colour))
    while True:
        intern = _Interner()
        colour = [intern((colour[i], tuple(colour[n] for n in near))) for i, near in enumerate(graph.neighbours)]
        if len(intern.ids) == count:
            return colour
        count = len(intern.ids)


def rank_classes(ctx: LowerContext, graph: LaneGraph) -> list[RankClass]:
    """The plan's ranks in classes (Note [lowering by class]), each led by its lowest rank."""
    colour = _refined(graph)
    by_key: dict[tuple[int, int], list[RankPlace]] = {}
    for place in ctx.geometry.places:
        by_key.setdefault((colour[graph.lane_of(place)], place.pos), []).append(place)
    maps = _LaneMaps(graph)
    out = []
    for places in by_key.values():
        rep, members = places[0], []
        for place in places[1:]:
            sub = _substitution(ctx, graph, maps, rep, place)
            if sub is None:
                out.append(RankClass(place.rank, ()))
            else:
                members.append((place.rank, sub))
        out.append(RankClass(rep.rank, tuple(members)))
    return out


class _LaneMaps:
    """Per (representative's lane, member's lane): the ranks and microbatches the renaming maps, or None
    where the lanes around them do not correspond one to one or rank order is not kept."""

    def __init__(self, graph: LaneGraph):
        self.graph = graph
        self.seen: dict[tuple[int, int], tuple[dict[int, int], dict[int, int]] | None] = {}

    def __call__(self, a: int, b: int) -> tuple[dict[int, int], dict[int, int]] | None:
        if (a, b) not in self.seen:
            self.seen[(a, b)] = self._maps(a, b)
        return self.seen[(a, b)]

    def _maps(self, a: int, b: int) -> tuple[dict[int, int], dict[int, int]] | None:
        graph = self.graph
        lanes = _lane_map(graph, a, b)
        if lanes is None:
            return None
        ranks = {x: y for p, q in lanes.items() for x, y in zip(graph.lanes[p][1].ranks, graph.lanes[q][1].ranks)}
        images = [ranks[x] for x in sorted(ranks)]
        if any(u >= v for u, v in itertools.pairwise(images)):
            return None    # ties between peers go by rank number
        return ranks, dict(zip(graph.microbatches[a], graph.microbatches[b]))


def _lane_map(graph: LaneGraph, a: int, b: int) -> dict[int, int] | None:
    """Lane `a`'s neighbourhood onto lane `b`'s, neighbour by neighbour (`_DEPTH` steps), if one to one."""
    mapping = {a: b}
    frontier = [(a, b)]
    for _ in range(_DEPTH):
        step = []
        for x, y in frontier:
            if len(graph.neighbours[x]) != len(graph.neighbours[y]):
                return None
            for u, v in zip(graph.neighbours[x], graph.neighbours[y]):
                if u not in mapping:
                    mapping[u] = v
                    step.append((u, v))
                elif mapping[u] != v:
                    return None
        frontier = step
    return mapping if len(set(mapping.values())) == len(mapping) else None


def _substitution(ctx: LowerContext, graph: LaneGraph, maps: _LaneMaps, rep: RankPlace,
                  member: RankPlace) -> Substitution | None:
    got = maps(graph.lane_of(rep), graph.lane_of(member))
    groups = _group_names(ctx, rep, member)
    if got is None or groups is None:
        return None
    ranks, microbatches = got
    return Substitution(ranks, microbatches, groups)


def _group_names(ctx: LowerContext, rep: RankPlace, member: RankPlace) -> dict[str, str] | None:
    """The representative's group names onto the member's (their per-microbatch copies follow), or None
    where one has a group the other lacks."""
    out: dict[str, str] = {}
    for a, b in zip(_groups(ctx, rep), _groups(ctx, member), strict=True):
        if (a is None) != (b is None):
            return None
        if a is not None and b is not None:
            out[str(a)] = str(b)
    return out


def _groups(ctx: LowerContext, place: RankPlace) -> list[GroupId | None]:
    """Every group of a rank's own that a pass may name (`LowerContext`'s group questions)."""
    return [ctx.geometry.tp_group(place), ctx.geometry.cp_group(place), ctx.geometry.zero_group(place), ctx.geometry.outer_group(place),
            ctx.geometry.expert_group(place), *(ctx.geometry.ep_group(place, ms) for ms in place.stage.ministages)]
