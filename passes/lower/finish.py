"""Pass `finish`: report the step's loss to every rank.

Ranks that own the head hold the losses of their microbatches; one sum over
`world` at the end of the step gives every rank (rank 0 prints it) the mean
loss, with ranks that computed none contributing zero.
"""

from __future__ import annotations

from hetc.ir.groups import WORLD
from hetc.passes.lower.context import LowerContext
from hetc.ir.program import AllReduce, Program, RankProgram, Tensor

__all__ = ["report_loss"]


def report_loss(program: Program, ctx: LowerContext) -> Program:
    return Program(tuple(_rank(rp) for rp in program.ranks), program.groups)


def _rank(rp: RankProgram) -> RankProgram:
    instrs = rp.instrs + (AllReduce(Tensor.LOSS, str(WORLD)),)
    return RankProgram(rp.rank, rp.stage, rp.lane, rp.tp_rank, rp.cp_rank, rp.shards, instrs)
