"""Lowering by class: every rank's program as `lower` builds it, from one lowered representative per class.

The `schedule` pass runs for every lane (the lanes' timing couples them);
the ranks then fall into classes (passes/lower/classes.py, Note [lowering
by class]); the representatives go through the other passes, beside the
ranks those passes read (below), and every other member's program is its
representative's, renamed (passes/lower/substitute.py). The result is the
Program `lower` gives, instruction for instruction: `hetc compile` lowers
through here (passes/build.py), `lower` stays the reference that builds
every rank (and dumps after a pass).

Note [what a representative is lowered beside]: a pass after `schedule`
builds a rank's program from its own, but for `p2p`, which orders a rank's
receives by its senders' schedule programs. So `p2p` runs on the
representatives beside their peers, and the later passes on the
representatives alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetc.ir.errors import InternalError
from hetc.passes.cost import CostModel
from hetc.passes.lower import PASSES
from hetc.passes.lower.classes import LaneGraph, RankClass, lane_graph, rank_classes
from hetc.passes.lower.context import LowerContext
from hetc.passes.lower.substitute import substitute
from hetc.ir.plan import Plan
from hetc.ir.program import Program, RankProgram

__all__ = ["ClassLowering", "lower_by_class"]


@dataclass(frozen=True)
class ClassLowering:
    """Every rank's program (what `lower` gives), and the classes it was built from."""

    program: Program
    classes: tuple[RankClass, ...]


def lower_by_class(plan: Plan, costs: CostModel | None = None) -> ClassLowering:
    """`lower(plan, costs=costs)`, one representative per class lowered (Note [lowering by class])."""
    ctx = LowerContext(plan, costs)
    scheduled = PASSES[0][2](ctx)   # `schedule`: every lane at once
    graph = lane_graph(ctx, scheduled)
    classes = tuple(rank_classes(ctx, graph))
    lowered = _representatives(ctx, scheduled, graph, [c.rep for c in classes])
    world = plan.pipeline.world_size
    ranks: list[RankProgram | None] = [None] * world
    for cls in classes:
        rep = ranks[cls.rep] = lowered[cls.rep]
        for rank, sub in cls.members:
            ranks[rank] = substitute(rep, sub, ctx.geometry.places[rank])
    built = tuple(rp for rp in ranks if rp is not None)
    if len(built) != world:
        raise InternalError(f"lowering by class built {len(built)} of {world} ranks' programs")
    return ClassLowering(Program(built, scheduled.groups), classes)


def _representatives(ctx: LowerContext, scheduled: Program, graph: LaneGraph, reps: list[int]
                     ) -> dict[int, RankProgram]:
    """The representatives' programs, each pass run on the ranks it reads (Note [what a representative is
    lowered beside])."""
    peers = set(reps) | graph.neighbour_ranks(ctx.geometry.places[r] for r in reps)
    program = _only(scheduled, peers)
    for name, _, fn in PASSES[1:]:
        program = fn(program, ctx)
        if name == "p2p":
            program = _only(program, set(reps))
    return {rp.rank: rp for rp in program.ranks}


def _only(program: Program, ranks: set[int]) -> Program:
    return Program(tuple(rp for rp in program.ranks if rp.rank in ranks), program.groups)
