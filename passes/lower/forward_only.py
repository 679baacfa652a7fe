"""Pass `forward_only`: the evaluation program, derived from a lowered training program.

Note [Evaluation programs]
Validation runs every rank's training program with everything that serves
learning taken out, so it keeps the schedule, the routing of microbatches
to lanes, the layout pieces and the parameter traffic the plan was
verified with. Kept: `load`, `fwd`, activation sends and receives, the
ZeRO-3 gathers and frees (the parameters must be whole to compute), the
host offload of parameters (a release: the host copy stays current) and
their prefetch, and the loss all-reduce (the mean loss of the batch, as in
training). Dropped: backward ops, gradient sends
and receives, gradient reductions, the norm all-reduce, optimizer steps,
the gathers that publish a stepped shard (ZeRO-1/2 and hierarchical outer
gathers), the offload and prefetch of stashed activations, and the waits
of everything dropped.

Each rank keeps a subsequence of its own instructions, and every dropped
communication is dropped on all of its parties together (a message on
both ends, a collective on every member), so the result is what the
verifier checks (`verify(..., forward_only=True)`) and the simulator times
like any program. Its memory never exceeds the training program's at the
same instruction: it allocates a subset (no stash, no gradient), which is
why the memory check is not rerun on it.
"""

from __future__ import annotations

import dataclasses

from hetc.ir.program import (AllGather, AllReduce, AllToAll, Forward, Free, Instr, Load, Offload, Prefetch,
                          Program, RankProgram, Recv, Send, Shard, Tensor, Wait)

__all__ = ["forward_only"]


def forward_only(program: Program) -> Program:
    """Every rank's evaluation program (Note [Evaluation programs])."""
    return Program(tuple(_rank(rp) for rp in program.ranks), program.groups)


def _rank(rp: RankProgram) -> RankProgram:
    shards = {s.ms: s for s in rp.shards}
    dropped: set[int] = set()   # handles of dropped instructions not yet waited
    kept: list[Instr] = []
    for instr in rp.instrs:
        if isinstance(instr, Wait):
            if instr.handle in dropped:
                dropped.discard(instr.handle)
            else:
                kept.append(instr)
        elif _keeps(instr, shards):
            # no step changes the parameters: their offloads release the device copy only (Note [clean
            # parameter offload] in offload.py)
            kept.append(dataclasses.replace(instr, host_current=True) if isinstance(instr, Offload) else instr)
        elif (handle := getattr(instr, "handle", None)) is not None:
            dropped.add(handle)
    return RankProgram(rp.rank, rp.stage, rp.lane, rp.tp_rank, rp.cp_rank, rp.shards, tuple(kept))


def _keeps(instr: Instr, shards: dict[int, Shard]) -> bool:
    if isinstance(instr, (Load, Forward, Free)):
        return True
    if isinstance(instr, (Send, Recv, AllToAll)):
        return instr.what is Tensor.ACT
    if isinstance(instr, (Offload, Prefetch)):
        return instr.what is Tensor.PARAMS
    if isinstance(instr, AllReduce):
        return instr.what is Tensor.LOSS
    if isinstance(instr, AllGather):
        part = shards[instr.ms].part(instr.group)
        return part.level == 3 and instr.group != part.outer
    return False   # backward, gradient reductions, step
