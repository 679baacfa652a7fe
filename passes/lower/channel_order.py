"""Pass `nccl_order`: each pair of ranks posts its messages, both directions, in one order.

Note [NCCL channel order]: torch's NCCL backend runs all point-to-point
traffic between two ranks, both directions, on one communicator and one
stream; the operations start in posting order, one at a time, and a receive
(or a send) holds the stream until its partner arrives (Note [NCCL order] in
passes/verify/machine.py). So the two ranks of a pair must post the pair's
messages in the same order: if rank 0 posts `recv grad mb=0` before `send act
mb=2` while rank 2 posts `recv act mb=2` before `send grad mb=0`, each waits
on the other (specs/demo/pp.het before this pass). Megatron batches the
operations of a step point into one `batch_isend_irecv`; torchtitan's
pipelining does the same. hetc keeps one `isend`/`irecv` per message and
orders them instead, which needs no new instruction and keeps every
receive's overlap where the order allows it.

The pair's order is the order its messages are *sent* in a timed run of the
two ranks' programs together (`_send_keys`): program order, compute for the
cost model's time, a receive's wait for its matching send plus the link's
time, and each compute op no sooner than it started in the schedule pass's
timed run of every lane (`LowerContext.schedule`, Note [schedules by
simulation]); other waits on third ranks cost nothing (the order only has to
be one the two programs agree on, and the timing only chooses among such
orders). The floor keeps the order the one the step meets: without it the
upstream rank of a pair ran ahead of its own inputs, so under 1F1B a lane's
receive of its next activation was ordered before the gradient it sends the
same peer, and in the step, where that activation comes only once the
upstream lane has its own input, the receive held the pair's one stream with
the gradient, and the upstream lane's backward, waiting behind it. 8 stages
of 2 lanes with tp 4 (tests/random_jobs.py `deep_job`, seed 13) simulated
18.9 ms so, 16.2 ms under gloo's rule, and 16.3 ms with the floor (its
closed form: 15.7 ms). The floors come from one run of all lanes, made once
and read by lowering by class as well (Note [lowering by class] in
passes/lower/classes.py).

Sends stay where p2p put them, right after the op producing their tensor;
each receive moves (`_place`) to the nearest position between the pair's
sends that precede and follow it in that order, and before its own wait.
Such a position always exists: if rank a waited for message n before it
posts m, n was sent before m was in the timed run (a wait follows its send
by the transfer's time, and a rank's clock, floors and all, never runs
back), so n comes first. Posting in the agreed order on both sides is what
NCCL needs; the verifier proves the whole program under the nccl rules
(`verify(..., backend=Backend.NCCL)` in hetc/compiler.py).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field

from hetc.ir.errors import InternalError
from hetc.passes.lower.context import LowerContext
from hetc.ir.program import COMPUTE_TYPES, PHASE_OF, Instr, Program, RankProgram, Recv, Send, Wait

__all__ = ["order_channels"]

# a message's place in its pair's order: (send time, Lamport count, sender, its index among the sender's
# sends on that channel); unique per message, equal on both ranks
_Key = tuple[float, int, int, int]


def order_channels(program: Program, ctx: LowerContext, ranks: Collection[int] | None = None) -> Program:
    """`ranks`: reorder only these ranks' programs and keep them alone (lowering by class, Note [lowering by
    class] in passes/lower/classes.py); `program` then holds each of their peers too."""
    by_rank = {rp.rank: rp for rp in program.ranks}
    wanted = None if ranks is None else set(ranks)
    keys: dict[tuple[int, int], list[_Key]] = {}      # (src, dst) -> the keys of its sends, in posting order
    for a, b in sorted(_pairs(program)):
        if a in by_rank and b in by_rank and (wanted is None or a in wanted or b in wanted):
            keys.update(_send_keys(by_rank[a], by_rank[b], ctx))
    chosen = program.ranks if ranks is None else tuple(by_rank[r] for r in ranks)
    return Program(tuple(_reorder(rp, keys) for rp in chosen), program.groups)


def _pairs(program: Program) -> set[tuple[int, int]]:
    """Every unordered pair of ranks with a message between them, as (low, high)."""
    ends = ((rp.rank, _peer(instr)) for rp in program.ranks for instr in rp.instrs)
    return {(min(rank, peer), max(rank, peer)) for rank, peer in ends if peer is not None}


def _peer(instr: Instr) -> int | None:
    if isinstance(instr, Send):
        return instr.peer_to
    if isinstance(instr, Recv):
        return instr.peer_from
    return None


@dataclass
class _Cursor:
    """One rank's progress through its program in the pair's timed run."""

    rp: RankProgram
    index: int = 0
    time: float = 0.0
    count: int = 0                                  # Lamport count: strictly increases along every edge
    recvs: dict[int, tuple[int, float]] = field(default_factory=dict)   # handle -> (index among the peer's messages, bytes)
    received: int = 0

    @property
    def done(self) -> bool:
        return self.index == len(self.rp.instrs)


def _send_keys(a: RankProgram, b: RankProgram, ctx: LowerContext) -> dict[tuple[int, int], list[_Key]]:
    """The keys of the messages between ranks a and b, per direction, from their programs run together."""
    cursors = {a.rank: _Cursor(a), b.rank: _Cursor(b)}
    sent: dict[int, list[tuple[float, int]]] = {a.rank: [], b.rank: []}   # sender -> (time, count) per send
    while not all(c.done for c in cursors.values()):
        moved = False
        for rank, cursor in cursors.items():
            peer = b.rank if rank == a.rank else a.rank
            moved |= _advance(cursor, peer, sent, ctx)
        if not moved:
            raise InternalError(f"ranks {a.rank} and {b.rank} wait on each other's messages: the p2p pass "
                                "placed a receive's wait before the send it needs")
    return {(src, dst): [(t, n, src, k) for k, (t, n) in enumerate(sent[src])]
            for src, dst in ((a.rank, b.rank), (b.rank, a.rank))}


def _advance(cursor: _Cursor, peer: int, sent: dict[int, list[tuple[float, int]]], ctx: LowerContext) -> bool:
    """Run `cursor` until it waits for a message `peer` has not sent yet; whether it moved."""
    start = cursor.index
    costs, rank, starts = ctx.costs, cursor.rp.rank, ctx.schedule.starts
    while not cursor.done:
        instr = cursor.rp.instrs[cursor.index]
        if isinstance(instr, Wait) and instr.handle in cursor.recvs:
            k, nbytes = cursor.recvs[instr.handle]
            if k >= len(sent[peer]):
                break
            t, n = sent[peer][k]
            cursor.time = max(cursor.time, t + costs.message_time(peer, rank, nbytes))
            cursor.count = max(cursor.count, n)
        elif isinstance(instr, Send) and instr.peer_to == peer:
            sent[rank].append((cursor.time, cursor.count))
        elif isinstance(instr, Recv) and instr.peer_from == peer:
            if instr.handle is None:
                raise InternalError(f"rank {rank}: `{instr}` blocks at its post: p2p posts every receive with a handle")
            cursor.recvs[instr.handle] = (cursor.received, math.prod(instr.shape) * costs.delta)
            cursor.received += 1
        elif isinstance(instr, COMPUTE_TYPES):
            phase = PHASE_OF[type(instr)]   # no sooner than the timed run of every lane started it
            cursor.time = max(cursor.time, starts[(phase, instr.ms, instr.mb)]) + \
                costs.op_time(rank, instr.ms, phase, instr.unit)
        cursor.count += 1
        cursor.index += 1
    return cursor.index > start


def _reorder(rp: RankProgram, keys: dict[tuple[int, int], list[_Key]]) -> RankProgram:
    """`rp` with each receive moved to its place in its pair's order (sends and everything else stay)."""
    position: dict[int, float] = {}     # instruction index -> where it goes (receives that move: between two)
    recvs_by_peer: dict[int, list[int]] = defaultdict(list)
    sends_by_peer: dict[int, list[int]] = defaultdict(list)
    waits = {instr.handle: i for i, instr in enumerate(rp.instrs) if isinstance(instr, Wait)}
    for i, instr in enumerate(rp.instrs):
        if isinstance(instr, Recv):
            recvs_by_peer[instr.peer_from].append(i)
        elif isinstance(instr, Send):
            sends_by_peer[instr.peer_to].append(i)
    for peer, recvs in recvs_by_peer.items():
        sends = _Sends(sends_by_peer[peer], keys.get((rp.rank, peer), []))
        last = -math.inf
        for k, i in enumerate(recvs):
            recv = rp.instrs[i]
            assert isinstance(recv, Recv) and recv.handle is not None
            position[i] = last = _place(rp.rank, recv, i, keys[(peer, rp.rank)][k], sends, waits[recv.handle], last)
    order = sorted(range(len(rp.instrs)), key=lambda i: (position.get(i, float(i)), i))
    return dataclasses.replace(rp, instrs=tuple(rp.instrs[i] for i in order))


# a receive placed between two instructions sits this far after the earlier one; receives that share a gap
# keep their channel order through the tie on the index in `_reorder`'s sort
_GAP = 0.5


@dataclass(frozen=True)
class _Sends:
    """A rank's sends to one peer: their instruction indices and keys, both increasing (posting order)."""

    indices: list[int]
    keys: list[_Key]

    def around(self, key: _Key) -> tuple[float, float]:
        """The indices of the last send before `key` in the pair's order and the first after it (±inf)."""
        j = bisect.bisect_left(self.keys, key)
        return (self.indices[j - 1] if j > 0 else -math.inf), (self.indices[j] if j < len(self.keys) else math.inf)


def _place(rank: int, recv: Recv, index: int, key: _Key, sends: _Sends, wait: int, after: float) -> float:
    """Where receive `recv` (at `index`, waited at `wait`) goes: after the pair's sends before it in the order
    and after the previous receive from its peer (`after`), before the sends after it and its wait."""
    before, following = sends.around(key)
    lo, hi = max(after, before + _GAP), min(wait - _GAP, following - _GAP)
    if lo > hi:
        raise InternalError(f"rank {rank}: no place for `{recv}` in its pair's order (between {lo} and {hi})")
    return min(max(float(index), lo), hi)
