"""The runtime's blocking rules, as one machine the verifier and the simulator both drive.

Note [blocking rules]: an instruction with a handle only *posts* its work;
`wait` blocks until that work is complete; without a handle an instruction
posts and waits at once. A send and a receive complete together, when both
are posted (gloo's rendezvous, the conservative model); messages between
two ranks match in posting order (what NCCL requires), and must agree on
tensor, ministage, microbatch and shape. A collective completes when every
member of its group has posted it (under NCCL's rule, Note [NCCL order],
"posted" reads "started" throughout); the k-th collective of a group must be
the same on every member. Copies to and from the host queue on the rank's
copy stream and complete on their own. A compute op of a ministage whose
shard names tp/cp/ep groups is a collective on each of them (Note [compute
collectives] in hetc/ir/program.py): it completes when every member of each
has posted the same op (on an ep group, whose members serve different
microbatches: the same kind of op on the same ministage). If no rank can
move and some have not finished, the programs deadlock.

Time: each rank has a clock. An op is posted at the rank's time; local
work (compute, the optimizer step) runs for its duration on the rank's
thread; a message starts when both ends are posted, a collective when its
last member posts, a copy when the copy stream is free; each then takes
the `Clock`'s duration. A wait moves the rank's time to the end of what it
waits for. The verifier runs the machine with `NO_TIME` (every duration
zero) to prove the programs finish; the simulator plugs in the cost model.

Note [event-driven]: a rank is advanced again only when one of its posted
ops completes, so a run costs about one visit per instruction. Matching
goes by posting order per channel and per group, never by time, so the
times do not depend on the order ranks are visited in.

Note [NCCL order]: gloo completes a posted op as soon as its partners are
posted. NCCL does not: torch's ProcessGroupNCCL runs a process group's
point-to-point traffic between two ranks on one communicator and one stream
(`pointToPoint` keys it by `getKeySendRecv(rank, peer)`, both directions
alike), and a process group's collectives on the group's communicator and
stream. On a stream the kernels run in posting order, one at a time, and a
receive (or send) kernel holds the stream until its partner arrives:
"send(x1) is allowed to block until the corresponding recv() is called"
(NVIDIA/nccl #783); send-then-recv posted on both ranks hangs (NVIDIA/nccl
#479). So under `Backend.NCCL` each rank keeps one queue (a *line*) per
communicator, and an op *starts* only at the head of its line, once every
earlier op the rank posted there has completed. The communicators are: the
group, for a collective and for a compute op's part on a tp/cp/ep group;
the *direction* (sender, receiver), for a send or receive, since the
runtime sends to a higher rank on one process group and to a lower rank on
another (Note [one communicator per direction] in runtime/comm.py).
Matching is unchanged (FIFO per channel, k-th call per group), so
mismatches are found as under gloo; a matched message or full call runs
when every one of its ops has started, at the latest start. Each op enters
and leaves its line once, and a completion looks only at the next op of
each line it frees, so the rule keeps a run linear.

The rule never blocks more than gloo's, so a program deadlocks under NCCL
exactly where it does under gloo; what it adds is time: a direction's
messages, and a group's calls, run one after the other. For collectives: a
member's (k+1)-th call on a group is posted after its k-th, so when the
(k+1)-th call is full, the k-th is too. For messages: a direction's line
holds the sender's sends and the receiver's receives in posting order,
which is the order they match in, so the k-th send and the k-th receive
each wait only for messages 1..k-1 of that direction, which complete once
posted, as under gloo. With both directions on one communicator (torch's
default) that was not so: a receive posted ahead of a send to the same peer
could hold the pair's one stream while the peer's receive held its own, and
every 1F1B program that posts its receives ahead hung in its first step
(tests/listings/pp_receives_ahead.txt).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, cast

from hetc.passes.verify.errors import Finding, at
from hetc.ir.groups import split_direction
from hetc.ir.program import (COLLECTIVE_TYPES, COMPUTE_TYPES, ComputeInstr, Free, Instr, Load, Offload, Prefetch, Program,
                          Recv, Send, Step, Tensor, Wait)

# Instructions that only take the rank's own time; so does a compute op unless its ministage has collectives.
_LOCAL = frozenset({Load, Free, Step})
_COMPUTE = frozenset(COMPUTE_TYPES)

__all__ = ["NO_TIME", "Backend", "Clock", "Communicator", "Machine", "Op", "RankState", "collective_groups",
           "communicator_name", "compute_groups"]


class Backend(StrEnum):
    """Whose blocking rule the machine runs (Note [NCCL order])."""

    GLOO = "gloo"   # a posted op completes as soon as its partners are posted
    NCCL = "nccl"   # ... and only once every earlier op its rank posted on the same communicator has completed


# A communicator, as NCCL sees it: the (sender, receiver) direction of a send or receive, or a group's name.
Communicator = tuple[int, int] | str


def communicator_name(comm: Communicator) -> str:
    return f"the direction {comm[0]} -> {comm[1]}" if isinstance(comm, tuple) else f"group '{comm}'"


def compute_groups(program: Program) -> dict[tuple[int, int], tuple[str, ...]]:
    """(rank, ministage) -> the groups its compute ops are collectives on (Note [compute collectives])."""
    return {(rp.rank, sh.ms): sh.compute_groups for rp in program.ranks for sh in rp.shards}


def collective_groups(rank: int, instr: Instr, groups: dict[tuple[int, int], tuple[str, ...]]) -> tuple[str, ...]:
    """The groups `instr` is a call on: a collective's own group, a compute op's tp/cp/ep groups."""
    if isinstance(instr, COLLECTIVE_TYPES):
        return (instr.group,)
    if isinstance(instr, COMPUTE_TYPES):
        return groups.get((rank, instr.ms), ())
    return ()


@dataclass(eq=False, slots=True)
class Op:
    """One posted instruction (or one group's part of a compute op with collectives)."""

    rank: int
    index: int
    instr: Instr
    post: float = 0.0
    start: float = 0.0
    end: float | None = None     # set when the op completes
    call: int | None = None      # a collective's number among its group's calls
    group: str | None = None     # the group it is a collective on (a compute op's tp/cp/ep group)
    parent: Op | None = None     # the compute op this is one group's part of
    parts: list[Op] | None = None     # a compute op's parts, one per group
    slowest: float = 0.0         # a part: the longest compute among the members of its call
    waiting: int = 0             # a compute op's parts not yet complete
    comm: Communicator | None = None  # the communicator a send, receive, collective or part runs on
    ready: float | None = None   # when it could start: posted, and (NCCL) at the head of its line
    meeting: _Meeting | None = None   # once matched: the message's two ends, or every member's op of a call

    @property
    def done(self) -> bool:
        return self.end is not None


@dataclass(eq=False, slots=True)
class _Meeting:
    """A matched message or a full call: it runs once none of its ops is `unready` (Note [NCCL order])."""

    ops: list[Op]
    unready: int


class Clock(Protocol):
    """How long each kind of work takes (seconds)."""

    def local(self, rank: int, instr: Instr) -> float: ...     # compute, step, load, free
    def copy(self, rank: int, instr: Instr) -> float: ...      # offload / prefetch on the copy stream
    def p2p(self, send: Op, recv: Op) -> float: ...
    def collective(self, ops: list[Op]) -> float: ...          # every member's op of one call


class _NoTime:
    """The verifier's clock: every duration zero."""

    def local(self, rank: int, instr: Instr) -> float:
        return 0.0

    def copy(self, rank: int, instr: Instr) -> float:
        return 0.0

    def p2p(self, send: Op, recv: Op) -> float:
        return 0.0

    def collective(self, ops: list[Op]) -> float:
        return 0.0


NO_TIME: Clock = _NoTime()


@dataclass
class RankState:
    pc: int = 0
    t: float = 0.0
    posted: dict[int, Op] = field(default_factory=dict)    # handle -> op
    waited: set[int] = field(default_factory=set)
    blocking: Op | None = None                              # a handle-less op in flight
    copy_free: float = 0.0                                  # when the copy stream is next free
    issued: list[float] = field(default_factory=list)       # the time each instruction was first reached

    def finished(self, length: int) -> bool:
        return self.pc >= length and self.blocking is None


class Machine:
    """All ranks' programs run together under Note [blocking rules], timed by `clock`."""

    def __init__(self, program: Program, clock: Clock = NO_TIME, record: bool = False,
                 backend: Backend = Backend.GLOO):
        """`record`: keep every completed op with its times (`ran`) and the matched messages;
        `backend`: whose blocking rule to run (Note [NCCL order])."""
        self.program, self.clock, self.record, self.backend = program, clock, record, backend
        self.lines: dict[tuple[int, Communicator], deque[Op]] = {}   # NCCL: (rank, comm) -> ops not yet complete
        self.ranks = [RankState() for _ in program.ranks]
        self.sends: dict[tuple[int, int], deque[Op]] = {}
        self.recvs: dict[tuple[int, int], deque[Op]] = {}
        self.calls: dict[str, list[dict[int, Op]]] = {}     # group -> k -> rank -> op
        self.count: dict[tuple[str, int], int] = {}          # (group, rank) -> calls posted
        self.members = {g.name: set(g.ranks) for g in program.groups}
        self.compute_groups = compute_groups(program)
        self.lockstep = {key for key, groups in self.compute_groups.items() if groups}   # compute ops that are calls
        self.across_lanes = {sh.ep_group for rp in program.ranks for sh in rp.shards if sh.ep_group}
        # hierarchical ZeRO: (rank, outer group) -> the pieces its node group cut the buffer into (`_cut`)
        self.outer_cuts = {(rp.rank, sh.outer): len(self.members.get(sh.group, ()))
                           for rp in program.ranks for sh in rp.shards if sh.outer and sh.group}
        self.runnable: deque[int] = deque(range(len(program.ranks)))
        self.queued = set(self.runnable)
        self.ran: list[Op] = []                   # completed ops that did work (the timeline's events)
        self.problem: Finding | None = None       # the first protocol error `run` met
        self.messages: list[tuple[Op, Op]] = []   # (send, receive) pairs, in matching order

    # -------------------------------------------------------------- completion

    def _finish(self, op: Op, start: float, duration: float) -> None:
        op.start, op.end = start, start + duration
        if self.record:
            self.ran.append(op)
        self._wake(op.rank)

    def _wake(self, rank: int) -> None:
        if rank not in self.queued:
            self.queued.add(rank)
            self.runnable.append(rank)

    def _part_done(self, part: Op) -> None:
        parent = part.parent
        assert parent is not None and parent.parts is not None   # a part belongs to its compute op
        parent.waiting -= 1
        if parent.waiting == 0:
            start = max(p.start for p in parent.parts)
            self._finish(parent, start, max(p.slowest for p in parent.parts))

    # -------------------------------------------------------------- posting

    def _post(self, op: Op) -> Finding | None:
        instr = op.instr
        if isinstance(instr, Send):
            return self._post_p2p(op, (op.rank, instr.peer_to), self.sends, self.recvs)
        if isinstance(instr, Recv):
            return self._post_p2p(op, (instr.peer_from, op.rank), self.recvs, self.sends)
        if isinstance(instr, COLLECTIVE_TYPES):
            return self._post_collective(op)
        if isinstance(instr, (Offload, Prefetch)):
            state = self.ranks[op.rank]
            start = max(op.post, state.copy_free)
            self._finish(op, start, self.clock.copy(op.rank, instr))
            assert op.end is not None   # _finish set it
            state.copy_free = op.end
            return None
        return self._post_compute(op, collective_groups(op.rank, instr, self.compute_groups))

    def _post_compute(self, op: Op, groups: tuple[str, ...]) -> Finding | None:
        """A compute op with tp/cp/ep collectives: one part per group, done when every part is."""
        op.waiting, op.parts = len(groups), []
        for group in groups:
            part = Op(op.rank, op.index, op.instr, op.post, group=group, parent=op)
            op.parts.append(part)
            problem = self._post_collective(part)
            if problem:
                return problem
        return None

    def _post_p2p(self, op: Op, channel: tuple[int, int], mine: dict[tuple[int, int], deque[Op]],
                  theirs: dict[tuple[int, int], deque[Op]]) -> Finding | None:
        peer = channel[1] if isinstance(op.instr, Send) else channel[0]
        if not 0 <= peer < len(self.ranks) or peer == op.rank:
            return at(self.program, op.rank, op.index, f"peer {peer} is not another rank of this "
                      f"{len(self.ranks)}-rank program")
        self._enter_line(op, channel)
        waiting = theirs.get(channel)
        if not waiting:
            mine.setdefault(channel, deque()).append(op)
            return None
        other = waiting.popleft()
        send, recv = (op, other) if isinstance(op.instr, Send) else (other, op)
        assert isinstance(send.instr, Send) and isinstance(recv.instr, Recv)
        problem = _mismatch(send.instr, recv.instr)
        if problem:
            return at(self.program, recv.rank, recv.index, f"{problem}; the next message from rank "
                      f"{send.rank} is `{send.instr}` (its instruction {send.index})")
        if self.record:
            self.messages.append((send, recv))
        self._meet([send, recv])
        return None

    def _post_collective(self, op: Op) -> Finding | None:
        group = op.group
        if group is None:   # not a compute op's part: a collective instruction
            assert isinstance(op.instr, COLLECTIVE_TYPES)
            group = op.instr.group
        members = self.members.get(group)
        if members is None:
            return at(self.program, op.rank, op.index, f"unknown group '{group}'")
        if op.rank not in members:
            return at(self.program, op.rank, op.index, f"rank {op.rank} is not a member of group '{group}'")
        self._enter_line(op, group)
        k = self.count.get((group, op.rank), 0)
        self.count[(group, op.rank)] = k + 1
        op.call = k
        if op.parent is not None and op.parent.call is None:
            op.parent.call, op.parent.group = k, group
        calls = self.calls.setdefault(group, [])
        if k == len(calls):
            calls.append({})
        entry = calls[k]
        if entry:   # every earlier poster agrees with the first one
            other = next(iter(entry.values()))
            any_mb = group in self.across_lanes
            if _collective_key(other.instr, any_mb) != _collective_key(op.instr, any_mb):
                return at(self.program, op.rank, op.index, f"collective #{k} on group '{group}' differs: rank "
                          f"{other.rank} calls `{other.instr}` (its instruction {other.index})")
            if self.outer_cuts and (mine := self._cut(op.rank, group)) != (theirs := self._cut(other.rank, group)):
                return at(self.program, op.rank, op.index, f"collective #{k} on group '{group}' reduces this "
                          f"rank's 1/{mine} of its ministage's buffer with rank {other.rank}'s 1/{theirs}: "
                          "buffers of different sizes")
        entry[op.rank] = op
        if len(entry) == len(members):
            self._meet(list(entry.values()))
            calls[k] = {}   # matched: keep no references
        return None

    def _cut(self, rank: int, group: str) -> int:
        """Into how many pieces `rank` has cut the buffer a collective on `group` acts on: its node group's size
        where `group` is an outer group of its (hierarchical ZeRO reduces shard i of every node together), else
        1. Every member must agree, or each moves a buffer of another size."""
        return self.outer_cuts.get((rank, split_direction(group)[0]), 1)

    # -------------------------------------------------------------- starting (Note [NCCL order])

    def _enter_line(self, op: Op, comm: Communicator) -> None:
        """Under NCCL, queue `op` on its rank's line for `comm`; it is ready once at the head (gloo: at once)."""
        op.comm = comm
        if self.backend is Backend.GLOO:
            op.ready = op.post
            return
        line = self.lines.setdefault((op.rank, comm), deque())
        line.append(op)
        if len(line) == 1:
            op.ready = op.post

    def _meet(self, ops: list[Op]) -> None:
        """A matched message or full call: run it now if all its ops have started, else when the last one does."""
        unready = sum(o.ready is None for o in ops)
        if unready == 0:
            self._run_met(ops)
            return
        meeting = _Meeting(ops, unready)
        for o in ops:
            o.meeting = meeting

    def _run_met(self, first: list[Op]) -> None:
        """Complete `first`, then whatever the ops it frees from their lines can now run (a worklist, not
        recursion: one completion may free a long chain)."""
        due = [first]
        while due:
            ops = due.pop()
            self._complete(ops)
            if self.backend is Backend.NCCL:
                due.extend(m.ops for o in ops if (m := self._leave_line(o)) is not None)

    def _leave_line(self, op: Op) -> _Meeting | None:
        """`op` completed: the next op of its line starts; its meeting, if that can now run."""
        assert op.comm is not None and op.end is not None   # a completed op on a line
        op.meeting = None   # done: no op -> meeting -> op cycle left for the collector
        line = self.lines[(op.rank, op.comm)]
        assert line[0] is op   # only the head of a line runs
        line.popleft()
        if not line:
            return None
        nxt = line[0]
        nxt.ready = max(nxt.post, op.end)
        meeting = nxt.meeting
        if meeting is None:
            return None
        meeting.unready -= 1
        return meeting if meeting.unready == 0 else None

    def _complete(self, ops: list[Op]) -> None:
        if isinstance(ops[0].instr, (Send, Recv)):
            send, recv = ops
            start, duration = max(_started(send), _started(recv)), self.clock.p2p(send, recv)
            self._finish(send, start, duration)
            self._finish(recv, start, duration)
        else:
            self._complete_call(ops)

    def _complete_call(self, ops: list[Op]) -> None:
        start = max(_started(o) for o in ops)
        if ops[0].parent is not None:        # parts of compute ops: the compute itself is timed once all are in
            slowest = max(self.clock.local(o.rank, o.instr) for o in ops)   # the call waits for its slowest
            for o in ops:
                o.start, o.end, o.slowest = start, start, slowest
            for o in ops:
                self._part_done(o)
            return
        duration = self.clock.collective(ops)
        for o in ops:
            self._finish(o, start, duration)

    # -------------------------------------------------------------- stepping

    def advance(self, r: int) -> Finding | None:
        """Run rank r as far as it can go."""
        state, instrs = self.ranks[r], self.program.ranks[r].instrs
        while state.pc < len(instrs):
            if state.blocking is not None:
                end = state.blocking.end
                if end is None:
                    return None
                state.t = max(state.t, end)
                state.blocking = None
                state.pc += 1
                continue
            if len(state.issued) == state.pc:      # first reached (a wait may be retried; t holds meanwhile)
                state.issued.append(state.t)
            instr = instrs[state.pc]
            kind = type(instr)
            if isinstance(instr, Wait):
                op = state.posted.get(instr.handle)
                if op is None or instr.handle in state.waited:
                    why = "was never posted" if op is None else "was already waited"
                    return at(self.program, r, state.pc, f"handle {instr.handle} {why}")
                if op.end is None:
                    return None
                state.waited.add(instr.handle)
                state.t = max(state.t, op.end)
            elif kind in _LOCAL or (kind in _COMPUTE and (r, cast(ComputeInstr, instr).ms) not in self.lockstep):
                self._run_local(r, state, instr)
            else:
                problem = self._issue(r, state, instr)
                if problem:
                    return problem
                if state.blocking is not None:
                    continue
            state.pc += 1
        return None

    def _run_local(self, r: int, state: RankState, instr: Instr) -> None:
        """Work on the rank's own thread (compute without collectives, step, load, free): it just takes time."""
        duration = self.clock.local(r, instr)
        if duration > 0 and self.record:
            self.ran.append(Op(r, state.pc, instr, state.t, state.t, state.t + duration))
        state.t += duration

    def _issue(self, r: int, state: RankState, instr: Instr) -> Finding | None:
        """Post communication or copies; a handle-less one becomes what the rank blocks on."""
        op = Op(r, state.pc, instr, state.t)
        handle = getattr(instr, "handle", None)
        if handle is not None:
            if handle in state.posted:
                return at(self.program, r, state.pc, f"handle {handle} is used twice")
            state.posted[handle] = op
        problem = self._post(op)
        if problem is None and handle is None:
            state.blocking = op
        return problem

    def run(self) -> Finding | None:
        """Advance ranks until none can move (Note [event-driven]); the first protocol error, if any.

        The outcome is also kept as `problem`. A machine runs once: run again, it moves nothing and says what
        its run met, so whoever ran it can hand it on to whoever checks it (Note [one run] in protocol.py)."""
        while self.problem is None and self.runnable:
            r = self.runnable.popleft()
            self.queued.discard(r)
            self.problem = self.advance(r)
        return self.problem

    def unfinished(self) -> list[int]:
        return [r for r, state in enumerate(self.ranks) if not state.finished(len(self.program.ranks[r].instrs))]

    def blocked_on(self, r: int) -> Op:
        """The op an unfinished rank waits for."""
        state = self.ranks[r]
        instr = self.program.ranks[r].instrs[state.pc] if state.pc < len(self.program.ranks[r].instrs) else None
        op = state.posted[instr.handle] if isinstance(instr, Wait) else state.blocking
        assert op is not None   # an unfinished rank waits on something
        return op

    def held(self, op: Op) -> tuple[Op, Op] | None:
        """Under NCCL, why `op` cannot start (Note [NCCL order]): (an op of it, or of its partners, that is not
        at the head of its line; the op ahead of it there). None where NCCL's order is not what holds it."""
        for own in op.parts or [op]:
            for o in own.meeting.ops if own.meeting is not None else [own]:
                if o.ready is None:
                    assert o.comm is not None   # only ops on a line wait to start
                    return o, self.lines[(o.rank, o.comm)][0]
        return None

    def unwaited(self) -> list[tuple[int, Op]]:
        """(handle, op) of posted ops whose handle no wait completes before the step ends."""
        return [(h, op) for state in self.ranks for h, op in state.posted.items() if h not in state.waited]

    def end_time(self) -> float:
        return max([s.t for s in self.ranks] + [op.end for op in self.ran if op.end is not None], default=0.0)


def _started(op: Op) -> float:
    assert op.ready is not None   # only ops that started complete
    return op.ready


def _mismatch(send: Send, recv: Recv) -> str:
    if (send.what, send.ms, send.mb, send.seq) != (recv.what, recv.ms, recv.mb, recv.seq):
        return "receives a different message than is sent"
    if send.shape != recv.shape:
        return f"shape {'x'.join(map(str, recv.shape))} does not match the sent shape " \
               f"{'x'.join(map(str, send.shape))}"
    return ""


def _collective_key(instr: Instr, any_mb: bool = False) -> tuple[str, object, object, object, object]:
    """What every member of a collective must agree on. The sum of a tied embedding's copies names each
    member's own ministage holding one (Note [tied gradients] in hetc/ir/program.py): its ms may differ."""
    what = getattr(instr, "what", None)
    ms = None if what is Tensor.TIED else getattr(instr, "ms", None)
    mb = None if any_mb else getattr(instr, "mb", None)
    return type(instr).__name__, what, ms, mb, getattr(instr, "unit", None)
