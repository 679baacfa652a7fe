"""The verifier's check of a plan one lane position at a time (what `hetc plan` runs on its winner).

Note [checking one lane position]: on a plan where every lane is t ranks
wide and the ranks at one lane position hold what position 0 holds, the
programs of position p are copies of those of position 0, and the check of
position 0 alone is the check of all t. Precisely, `lane_positions` accepts
a plan when every stage has tp = t > 1 with cp = 1, ep = 1 and ZeRO not
hierarchical; every rank holds the same tokens at every border (no sequence
parallelism splitting them: `boundary_ranges`); every lane's ranks sit on
one kind of device; and for every p, ordering the lanes by their rank at
position 0 orders them by their rank at position p. Let φ_p map the rank at
position 0 of each lane to its rank at position p.

1. Lowering copies position 0 (read from passes/lower, checked on the
   agreement family by tests/test_check_positions.py). `schedule` gives a
   lane's ranks one compute order. `p2p`: with equal holdings every border
   message goes from position q of one lane to position q of the other,
   whole (`hetc.ir.layout.transfers`, Piece(q, q)) or as part q of t
   (Note [scatter-gather borders] in hetc/ir/layout.py), with one shape; channels
   are ordered by posting order and, among receives posted together, by
   peer rank, which φ_p keeps. `zero`: a rank's shard group is its stage's
   `dp.s{s}.p{pos}` (a group of one position), its compute runs on its
   lane's tp group (all positions), the loss and the gradient norm on
   `world`; sizes come from the stage and the device. So the program of
   φ_p(r) is r's with peers mapped by φ_p, `dp...p0` named `dp...p{p}` and
   the header's rank and tp rank changed; every group lies inside one
   position or holds the same lanes at every position (tp groups, world);
   a border piece's tokens are part p's, part 0's shifted by p·seq/t.
2. The check of the copies is the check of position 0. `dataflow` and
   `memory` read one rank's program, its place, its holdings, sizes and
   device, which the copies share (a renamed group has as many members).
   `protocol`: let P be every rank's programs and P₀ those of position 0
   (`lower(ranks=...)`), renumbered, each group cut to its members at
   position 0 (a tp group to one rank, whose calls complete when posted).
   Matching goes by posting order per channel and per group (Note [blocking
   rules]), so whether the machine finishes, mismatches or leaves a handle
   unwaited does not depend on the order ranks move in. Any run of P₀ lifts
   to a run of P, each move of r made by every φ_p(r) in turn: a message
   stays inside one position; a call on a group that lies across positions
   completes in P once every member posted it, which in the lift is when
   its members at position 0 did, as in P₀; the copies' calls carry the
   same kind, ministage, microbatch and unit, so they agree as P₀'s do.
   Where P₀ is stuck, so is the lift of its last state (a copy waits on the
   image of what r waits on, which nobody posts); where P₀ meets a mismatch
   or an unwaited handle, P meets its image. So P passes iff P₀ passes.

Where the check of position 0 fails, or a plan is not of this shape, the
caller runs the full check (`passes_by_position` answers False), so every
finding and message stays the full check's. At 2048 GPUs (tp 4) the check
lowers and verifies 512 ranks instead of 2048.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetc.ir.layout import boundary_ranges
from hetc.passes.cost import CostModel
from hetc.passes.lower import lower
from hetc.ir.geometry import hierarchical_zero
from hetc.passes.verify.dataflow import rank_dataflow
from hetc.passes.verify.memory import Sizes, group_sizes, rank_peak
from hetc.passes.verify.protocol import check_protocol
from hetc.passes.verify import shape_problem
from hetc.ir.pipeline import Pipeline
from hetc.ir.plan import Plan
from hetc.ir.program import Group, Instr, Program, RankProgram, Recv, Send

__all__ = ["LanePositions", "lane_positions", "part_passes", "passes_by_position", "position_program"]


@dataclass(frozen=True)
class LanePositions:
    """A plan's lanes, all `width` ranks wide, whose positions copy position 0 (Note [checking one lane
    position])."""

    width: int
    firsts: tuple[int, ...]   # every lane's rank at position 0, in rank order


def lane_positions(pipeline: Pipeline, seq: int) -> LanePositions | None:
    """The plan's lane positions if it has the shape of Note [checking one lane position], else None."""
    width = pipeline.stages[0].lane_size
    if width == 1:
        return None   # nothing to spare
    for stage in pipeline.stages:
        if stage.tp != width or stage.cp != 1 or stage.ep != 1 or hierarchical_zero(stage):
            return None
    if len({boundary_ranges(stage, pos, seq) for stage in pipeline.stages for pos in range(width)}) != 1:
        return None
    lanes = sorted((lane for stage in pipeline.stages for lane in stage.lanes), key=lambda lane: lane.ranks[0])
    if any(len({pipeline.world[r].device for r in lane.ranks}) != 1 for lane in lanes):
        return None
    for pos in range(1, width):
        at_pos = [lane.ranks[pos] for lane in lanes]
        if at_pos != sorted(at_pos):
            return None
    return LanePositions(width, tuple(lane.ranks[0] for lane in lanes))


def passes_by_position(plan: Plan, costs: CostModel) -> bool:
    """True where `verify(lower(plan, costs=costs), plan, costs)` passes, known from lane
    position 0 alone (Note [checking one lane position]); False where that check fails or the plan is not of
    its shape: the full check says why, or that it passes after all."""
    positions = lane_positions(plan.pipeline, plan.model.seq)
    if positions is None:
        return False
    return part_passes(lower(plan, costs=costs, ranks=positions.firsts), positions, plan, costs)


def part_passes(part: Program, positions: LanePositions, plan: Plan, sizes: Sizes) -> bool:
    """Whether position 0's programs (`part`, in the order of `positions.firsts`, with every group) pass
    `verify`'s checks, read as Note [checking one lane position] says."""
    pipeline, model = plan.pipeline, plan.model
    if len(part.ranks) != len(positions.firsts) or \
            any(shape_problem(rp, r, pipeline) for r, rp in zip(positions.firsts, part.ranks)):
        return False
    layers, clip = model.num_model_layers, plan.train.grad_clip > 0
    if any(rank_dataflow(rp, pipeline, layers, clip, model.seq) for rp in part.ranks):
        return False
    if check_protocol(position_program(part, positions)):
        return False
    members = group_sizes(part.groups)
    return all(rank_peak(rp, pipeline, sizes, members).first_over is None for rp in part.ranks)


def position_program(part: Program, positions: LanePositions) -> Program:
    """P₀ of the Note: position 0's programs (`part`, in the order of `positions.firsts`) as a program of their
    own, rank i the i-th of them, each group cut to its members among them (a group with none is left out:
    naming it is an unknown group). A peer outside them becomes -1, which the machine refuses."""
    index = {r: i for i, r in enumerate(positions.firsts)}
    ranks = tuple(RankProgram(i, rp.stage, rp.lane, rp.tp_rank, rp.cp_rank, rp.shards,
                              tuple(_renumbered(instr, index) for instr in rp.instrs))
                  for i, rp in enumerate(part.ranks))
    groups = tuple(Group(g.name, members) for g in part.groups
                   if (members := tuple(index[r] for r in g.ranks if r in index)))
    return Program(ranks, groups)


def _renumbered(instr: Instr, index: dict[int, int]) -> Instr:
    if isinstance(instr, Send):
        return Send(instr.what, instr.ms, instr.mb, index.get(instr.peer_to, -1), instr.shape, instr.handle,
                    instr.seq)
    if isinstance(instr, Recv):
        return Recv(instr.what, instr.ms, instr.mb, index.get(instr.peer_from, -1), instr.shape, instr.handle,
                    instr.seq)
    return instr
