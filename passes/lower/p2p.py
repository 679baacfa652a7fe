"""Pass `p2p`: sends and receives around compute, asynchronous, deadlock-free.

Note [p2p placement]: every send is an `isend` posted right after the op
that produced its tensor and waited only at the end of the step, so a rank
never blocks on a send; every receive is posted one compute op before its
consumer (the transfer overlaps that op) and waited right before the
consumer. Under Zorse's schedule a receive is posted as many compute ops
ahead as its transfer takes (`_leads`): a stage sweeps one ministage over
all its lanes' microbatches, so where a stage of one lane takes the
microbatches of two upstream lanes, each activation of a lane's sweep was
sent long before and only the posting held it back; one op ahead, a 0.37
ms border transfer against 0.25 ms ops left the consumer waiting on every
microbatch (random job 1024/0, benchmarks/plan_agreement.py: 10.7 %
longer than Zorse's estimate, which puts the transfers on the way of the
first microbatch alone). The other schedules keep one op: their order
interleaves microbatches that come back over the borders (Note [async
sends] in passes/cost/transfers.py). With compute orders that come from
one feasible execution (see Note [schedules by simulation]) no cycle of
waits can form; the verifier proves it for the concrete programs.

Note [channel order]: messages between a pair of ranks match in posting
order (NCCL and gloo both need it), so a rank posts the receives from one
peer in the order that peer sends them. Where a rank consumes them in a
different order (several ministages of a stage exchanging with the same
peer, as in 1F1B over virtual stages), a receive is posted early enough not
to overtake one the peer sends after it. That is all NCCL needs too: each
direction of a pair has a communicator and a stream of its own (Note [one
communicator per direction] in runtime/comm.py), where messages start in
the order they match in.

Note [border pieces]: where the block layouts of two bordering lanes differ
(hetc/ir/layout.py), a boundary tensor travels as pieces `seq=a:b` from the
positions holding them (`LowerContext.messages`); a consumer waits for all
of its pieces. Gradients go back the same way with the roles swapped. A
side that replicates its tokens over tp ranks receives each token once, as
its ranks' tp parts, and its tp group gathers them (Note [scatter-gather
borders] in hetc/ir/layout.py).
"""

from __future__ import annotations

import dataclasses
import math

from hetc.ir.geometry import RankPlace
from hetc.passes.lower.context import LowerContext, next_handle
from hetc.passes.lower.units import Unit, split_units
from hetc.ir.program import (COMPUTE_TYPES, PHASE_OF, Backward, BackwardInput, Forward, Instr, Program, RankProgram, Recv,
                          Send, Tensor, Wait)
from hetc.ir.spec import ScheduleKind

__all__ = ["insert_p2p"]

# a message on one channel: (tensor kind, producing ministage, microbatch, token range or None)
_Msg = tuple[Tensor, int, int, tuple[int, int] | None]


def _key(instr: Send | Recv) -> _Msg:
    return (instr.what, instr.ms, instr.mb, instr.seq)


def insert_p2p(program: Program, ctx: LowerContext) -> Program:
    # each instruction's sends, found once: the send orders and the rank's own program both read them
    sends = [[_sends_after(instr, ctx.geometry.places[rp.rank], ctx) for instr in rp.instrs] for rp in program.ranks]
    send_order = _send_orders(program, sends)
    return Program(tuple(_rank(rp, ctx.geometry.places[rp.rank], ctx, send_order, own)
                         for rp, own in zip(program.ranks, sends)), program.groups)


def _send_orders(program: Program, sends: list[list[list[Send]]]) -> dict[tuple[int, int], dict[_Msg, int]]:
    """(src, dst) -> message -> its position among the sends src posts to dst (`sends`: per rank, per
    instruction, the sends after it)."""
    orders: dict[tuple[int, int], dict[_Msg, int]] = {}
    for rp, own in zip(program.ranks, sends):
        for after in own:
            for send in after:
                channel = orders.setdefault((rp.rank, send.peer_to), {})
                channel[_key(send)] = len(channel)
    return orders


def _post_slots(needs: list[list[Recv]], place: RankPlace,
                send_order: dict[tuple[int, int], dict[_Msg, int]], leads: list[int]) -> list[list[Recv]]:
    """The receives to post before each unit's compute (slot k: one unit ahead of unit k), in channel order;
    `needs[k]`: the receives unit k's compute needs, `leads[k]`: the slot they are posted in at the latest."""
    by_channel: dict[int, list[_Post]] = {}
    for k, recvs in enumerate(needs):
        for recv in recvs:
            seq = send_order[(recv.peer_from, place.rank)][_key(recv)]
            by_channel.setdefault(recv.peer_from, []).append(_Post(leads[k], seq, recv))
    for items in by_channel.values():
        items.sort(key=lambda it: it.position)
        for earlier, later in zip(reversed(items[:-1]), reversed(items[1:])):
            earlier.slot = min(earlier.slot, later.slot)   # never post after a message the peer sends later
    slots: list[list[Recv]] = [[] for _ in needs]
    for post in sorted((it for items in by_channel.values() for it in items),
                       key=lambda it: (it.slot, it.position, it.recv.peer_from)):
        slots[post.slot].append(post.recv)
    return slots


@dataclasses.dataclass
class _Post:
    """A receive to post before unit `slot`'s compute (`_post_slots` moves it earlier), `position` on its channel."""

    slot: int
    position: int
    recv: Recv


def _rank(rp: RankProgram, place: RankPlace, ctx: LowerContext,
          send_order: dict[tuple[int, int], dict[_Msg, int]], sends: list[list[Send]]) -> RankProgram:
    """`sends`: the sends after each of the rank's instructions (`_sends_after`)."""
    handle = next_handle(rp.instrs)
    units = split_units(rp.instrs)
    needs = [[r for op in unit.compute for r in _recvs_for(op, place, ctx)] for unit in units]
    # give every receive its handle up front, in posting order, so posts and waits agree
    posted: list[list[Recv]] = []
    wait_for: dict[_Msg, int] = {}
    for slot in _post_slots(needs, place, send_order, _leads(units, needs, place, ctx)):
        posted.append([])
        for r in slot:
            posted[-1].append(Recv(r.what, r.ms, r.mb, r.peer_from, r.shape, handle, r.seq))
            wait_for[_key(r)] = handle
            handle += 1
    out: list[Instr] = []
    send_waits: list[Wait] = []
    if posted:
        out += posted[0]
    after = iter(sends)   # the units split the instructions in order
    for k, unit in enumerate(units):
        out += [Wait(wait_for[_key(r)]) for r in needs[k]]
        if k + 1 < len(units):
            out += posted[k + 1]
        for instr in unit.instrs:
            out.append(instr)
            for send in next(after):
                out.append(Send(send.what, send.ms, send.mb, send.peer_to, send.shape, handle, send.seq))
                send_waits.append(Wait(handle))
                handle += 1
    out += send_waits
    return RankProgram(rp.rank, rp.stage, rp.lane, rp.tp_rank, rp.cp_rank, rp.shards, tuple(out))


def _leads(units: list[Unit], needs: list[list[Recv]], place: RankPlace, ctx: LowerContext) -> list[int]:
    """Per unit k, the slot its receives are posted in (Note [p2p placement]): k, one compute op ahead; under
    Zorse's schedule the slot whose ops from there to unit k take as long as the longest of its transfers."""
    leads = list(range(len(units)))
    if ctx.pipeline.schedule is not ScheduleKind.ZORSE:
        return leads
    costs, rank = ctx.costs, place.rank
    ops = [sum(costs.op_time(rank, op.ms, PHASE_OF[type(op)]) for op in unit.compute
               if isinstance(op, COMPUTE_TYPES)) for unit in units]
    for k, recvs in enumerate(needs):
        transfer = max((costs.message_time(r.peer_from, rank, math.prod(r.shape) * costs.delta) for r in recvs),
                       default=0.0)
        slot, ahead = k, ops[k - 1] if k > 0 else 0.0
        while slot > 1 and ahead < transfer:   # slot j posts before unit j − 1's compute
            slot -= 1
            ahead += ops[slot - 1]
        leads[k] = slot
    return leads


def _input_message(op: Instr, ctx: LowerContext) -> tuple[Tensor, int] | None:
    """(kind, producing ministage) of the boundary tensor compute op `op` consumes, if any."""
    if isinstance(op, Forward) and not ctx.starts_model(op.ms):
        return Tensor.ACT, op.ms - 1
    if isinstance(op, (Backward, BackwardInput)) and not ctx.ends_model(op.ms):
        return Tensor.GRAD, op.ms + 1
    return None


def _recvs_for(op: Instr, place: RankPlace, ctx: LowerContext) -> list[Recv]:
    """The receives `op` needs from other ranks (Note [border pieces])."""
    consumed = _input_message(op, ctx)
    if consumed is None or not isinstance(op, COMPUTE_TYPES):
        return []
    what, ms = consumed
    return [Recv(what, ms, op.mb, m.src, m.shape, seq=m.seq) for m in ctx.messages(what, ms, op.mb)
            if m.dst == place.rank]


def _sends_after(op: Instr, place: RankPlace, ctx: LowerContext) -> list[Send]:
    """The sends of `op`'s output to other ranks (without handles)."""
    if isinstance(op, Forward) and not ctx.ends_model(op.ms):
        what = Tensor.ACT
    elif isinstance(op, (Backward, BackwardInput)) and not ctx.starts_model(op.ms):
        what = Tensor.GRAD
    else:
        return []
    return [Send(what, op.ms, op.mb, m.dst, m.shape, seq=m.seq) for m in ctx.messages(what, op.ms, op.mb)
            if m.src == place.rank]
