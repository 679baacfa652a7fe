"""Pass `p2p`: sends and receives around compute, asynchronous, deadlock-free.

Note [p2p placement]: every send is an `isend` posted right after the op
that produced its tensor and waited only at the end of the step, so a rank
never blocks on a send; every receive is posted one compute op before its
consumer (the transfer overlaps that op) and waited right before the
consumer. With compute orders that come from one feasible execution (see
Note [schedules by simulation]) no cycle of waits can form; the verifier
proves it for the concrete programs. Sends and receives between a pair of
ranks happen in the same order on both sides, which NCCL needs.
"""

from __future__ import annotations

from hetc.program import (Backward, BackwardInput, Forward, Instr, Program, RankProgram, Recv, Send, Tensor,
                          Wait)
from hetc.passes.lower.context import LowerContext, RankPlace, next_handle
from hetc.passes.lower.units import split_units

__all__ = ["insert_p2p"]


def insert_p2p(program: Program, ctx: LowerContext) -> Program:
    return Program(tuple(_rank(rp, ctx.places[rp.rank], ctx) for rp in program.ranks), program.groups)


def _rank(rp: RankProgram, place: RankPlace, ctx: LowerContext) -> RankProgram:
    handle = next_handle(rp.instrs)
    units = split_units(rp.instrs)
    recvs: list[list[Recv]] = []
    for unit in units:
        wanted = [_recv_for(op, place, ctx) for op in unit.compute]
        recvs.append([r for r in wanted if r is not None])
    # give every receive its handle up front, so posts and waits agree
    posted: list[list[Recv]] = []
    for unit_recvs in recvs:
        with_handles = []
        for r in unit_recvs:
            with_handles.append(Recv(r.what, r.ms, r.mb, r.peer_from, r.shape, handle))
            handle += 1
        posted.append(with_handles)
    out: list[Instr] = []
    send_waits: list[Wait] = []
    if posted:
        out += posted[0]
    for k, unit in enumerate(units):
        out += [Wait(r.handle) for r in posted[k]]
        if k + 1 < len(units):
            out += posted[k + 1]
        for instr in unit.instrs:
            out.append(instr)
            send = _send_after(instr, place, ctx, handle)
            if send is not None:
                out.append(send)
                send_waits.append(Wait(handle))
                handle += 1
    out += send_waits
    return RankProgram(rp.rank, rp.stage, rp.lane, rp.tp_rank, rp.cp_rank, rp.shards, tuple(out))


def _recv_for(op: Instr, place: RankPlace, ctx: LowerContext) -> Recv | None:
    """The receive `op` needs from another rank, if any."""
    if isinstance(op, Forward) and not ctx.starts_model(op.ms):
        peer = ctx.peer(op.ms - 1, op.mb, place.pos)
        if peer != place.rank:
            return Recv(Tensor.ACT, op.ms - 1, op.mb, peer, ctx.boundary_shape(op.ms - 1))
    if isinstance(op, (Backward, BackwardInput)) and not ctx.ends_model(op.ms):
        peer = ctx.peer(op.ms + 1, op.mb, place.pos)
        if peer != place.rank:
            return Recv(Tensor.GRAD, op.ms + 1, op.mb, peer, ctx.boundary_shape(op.ms))
    return None


def _send_after(op: Instr, place: RankPlace, ctx: LowerContext, handle: int) -> Send | None:
    """The send of `op`'s output to another rank, if any."""
    if isinstance(op, Forward) and not ctx.ends_model(op.ms):
        peer = ctx.peer(op.ms + 1, op.mb, place.pos)
        if peer != place.rank:
            return Send(Tensor.ACT, op.ms, op.mb, peer, ctx.boundary_shape(op.ms), handle)
    if isinstance(op, (Backward, BackwardInput)) and not ctx.starts_model(op.ms):
        peer = ctx.peer(op.ms - 1, op.mb, place.pos)
        if peer != place.rank:
            return Send(Tensor.GRAD, op.ms, op.mb, peer, ctx.boundary_shape(op.ms - 1), handle)
    return None
