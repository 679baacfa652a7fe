"""Run every rank's program together under the runtime's blocking rules.

Note [blocking rules]: an instruction with a handle only *posts* its work;
`wait` blocks until that work is complete; without a handle an instruction
posts and waits at once. A send and a receive complete together, when both
are posted (gloo's rendezvous, the conservative model); messages between
two ranks match in posting order (what NCCL requires), and must agree on
tensor, ministage, microbatch and shape. A collective completes when every
member of its group has posted it; the k-th collective of a group must be
the same on every member. Copies to and from the host complete on their own.
A compute op of a ministage whose shard names tp/cp/ep groups is a
collective on each of them (Note [compute collectives] in hetc/program.py):
it completes when every member of each has posted the same op (on an ep
group, whose members serve different microbatches: the same kind of op on
the same ministage). If no rank can
move and some have not finished, the programs deadlock (explained by
`deadlock.py`, Note [deadlock blame]).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hetc.passes.verify.deadlock import Stuck, explain_deadlock
from hetc.passes.verify.errors import Finding, at
from hetc.program import COLLECTIVE_TYPES, COMPUTE_TYPES, Instr, Program, Recv, Send, Wait

__all__ = ["check_protocol"]


@dataclass
class _Op:
    rank: int
    index: int
    instr: Instr
    done: bool = False
    call: int | None = None      # a collective's number among its group's calls
    group: str | None = None     # the group it is a collective on (a compute op's tp or cp group)
    parent: _Op | None = None  # the compute op this is one group's part of
    parts: int = 0               # a compute op's parts not yet complete


@dataclass
class _Rank:
    pc: int = 0
    posted: dict[int, _Op] = field(default_factory=dict)    # handle -> op
    waited: set[int] = field(default_factory=set)
    blocking: _Op | None = None                              # a handle-less op in flight


class _Sim:
    def __init__(self, program: Program):
        self.program = program
        self.ranks = [_Rank() for _ in program.ranks]
        self.sends: dict[tuple[int, int], deque[_Op]] = {}
        self.recvs: dict[tuple[int, int], deque[_Op]] = {}
        self.calls: dict[str, list[dict[int, _Op]]] = {}     # group -> k -> rank -> op
        self.count: dict[tuple[str, int], int] = {}          # (group, rank) -> calls posted
        self.members = {g.name: set(g.ranks) for g in program.groups}
        self.compute_groups = {(rp.rank, sh.ms): sh.compute_groups for rp in program.ranks for sh in rp.shards}
        self.across_lanes = {sh.ep_group for rp in program.ranks for sh in rp.shards if sh.ep_group}
        self.runnable: deque[int] = deque(range(len(program.ranks)))   # ranks that may move (Note [event-driven])
        self.queued = set(self.runnable)

    def _complete(self, op: _Op) -> None:
        op.done = True
        if op.parent is not None:
            op.parent.parts -= 1
            if op.parent.parts == 0:
                self._complete(op.parent)
            return
        if op.rank not in self.queued:
            self.queued.add(op.rank)
            self.runnable.append(op.rank)

    # -------------------------------------------------------------- posting

    def post(self, op: _Op) -> Finding | None:
        instr = op.instr
        if isinstance(instr, Send):
            return self._post_p2p(op, (op.rank, instr.peer_to), self.sends, self.recvs)
        if isinstance(instr, Recv):
            return self._post_p2p(op, (instr.peer_from, op.rank), self.recvs, self.sends)
        if isinstance(instr, COLLECTIVE_TYPES):
            return self._post_collective(op)
        groups = self.compute_groups.get((op.rank, instr.ms), ()) if isinstance(instr, COMPUTE_TYPES) else ()
        if groups:
            return self._post_compute(op, groups)
        op.done = True  # local work: copies, compute
        return None

    def _post_compute(self, op: _Op, groups: tuple[str, ...]) -> Finding | None:
        """A compute op with tp/cp collectives: one part per group, done when every part is."""
        op.parts = len(groups)
        for group in groups:
            problem = self._post_collective(_Op(op.rank, op.index, op.instr, group=group, parent=op))
            if problem:
                return problem
        return None

    def _post_p2p(self, op: _Op, channel, mine, theirs) -> Finding | None:
        peer = channel[1] if isinstance(op.instr, Send) else channel[0]
        if not 0 <= peer < len(self.ranks) or peer == op.rank:
            return at(self.program, op.rank, op.index, f"peer {peer} is not another rank of this "
                      f"{len(self.ranks)}-rank program")
        waiting = theirs.get(channel)
        if waiting:
            other = waiting.popleft()
            send, recv = (op, other) if isinstance(op.instr, Send) else (other, op)
            assert isinstance(send.instr, Send) and isinstance(recv.instr, Recv)
            problem = _mismatch(send.instr, recv.instr)
            if problem:
                return at(self.program, recv.rank, recv.index, f"{problem}; the next message from rank "
                          f"{send.rank} is `{send.instr}` (its instruction {send.index})")
            self._complete(op)
            self._complete(other)
            return None
        mine.setdefault(channel, deque()).append(op)
        return None

    def _post_collective(self, op: _Op) -> Finding | None:
        group = op.group
        if group is None:   # not a compute op's part: a collective instruction
            assert isinstance(op.instr, COLLECTIVE_TYPES)
            group = op.instr.group
        members = self.members.get(group)
        if members is None:
            return at(self.program, op.rank, op.index, f"unknown group '{group}'")
        if op.rank not in members:
            return at(self.program, op.rank, op.index, f"rank {op.rank} is not a member of group '{group}'")
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
        entry[op.rank] = op
        if len(entry) == len(members):
            for o in entry.values():
                self._complete(o)
            calls[k] = {}   # done: keep no references
        return None

    # -------------------------------------------------------------- stepping

    def advance(self, r: int) -> tuple[bool, Finding | None]:
        """Run rank r as far as it can go; (made progress, error)."""
        state, instrs = self.ranks[r], self.program.ranks[r].instrs
        moved = False
        while state.pc < len(instrs):
            if state.blocking is not None:
                if not state.blocking.done:
                    return moved, None
                state.blocking = None
                state.pc += 1
                moved = True
                continue
            instr = instrs[state.pc]
            if isinstance(instr, Wait):
                op = state.posted.get(instr.handle)
                if op is None or instr.handle in state.waited:
                    why = "was never posted" if op is None else "was already waited"
                    return moved, at(self.program, r, state.pc, f"handle {instr.handle} {why}")
                if not op.done:
                    return moved, None
                state.waited.add(instr.handle)
                state.pc += 1
                moved = True
                continue
            op = _Op(r, state.pc, instr)
            handle = getattr(instr, "handle", None)
            if handle is not None:
                if handle in state.posted:
                    return moved, at(self.program, r, state.pc, f"handle {handle} is used twice")
                state.posted[handle] = op
            problem = self.post(op)
            if problem:
                return moved, problem
            if handle is None:
                state.blocking = op
                continue
            state.pc += 1
            moved = True
        return moved, None

    def run(self) -> list[Finding]:
        """Note [event-driven]: a rank is advanced again only when one of its posted ops completes."""
        while self.runnable:
            r = self.runnable.popleft()
            self.queued.discard(r)
            _, problem = self.advance(r)
            if problem:
                return [problem]
        active = {r for r, state in enumerate(self.ranks)
                  if state.pc < len(self.program.ranks[r].instrs) or state.blocking is not None}
        if active:
            return self._deadlock(active)
        return self._leftovers()

    def _deadlock(self, active: set[int]) -> list[Finding]:
        stuck = []
        for r in sorted(active):
            state = self.ranks[r]
            instr = self.program.ranks[r].instrs[state.pc]
            op = state.posted[instr.handle] if isinstance(instr, Wait) else state.blocking
            assert op is not None   # an active rank waits on something
            stuck.append(Stuck(r, state.pc, op.instr, op.index, op.call, op.group))
        posted = {key: n for key, n in self.count.items()}
        return explain_deadlock(self.program, stuck, posted)

    def _leftovers(self) -> list[Finding]:
        out = []
        for r, state in enumerate(self.ranks):
            for h, op in state.posted.items():
                if h not in state.waited:
                    out.append(at(self.program, r, op.index, f"handle {h} is never waited before the step ends"))
        return out


def _mismatch(send: Send, recv: Recv) -> str:
    if (send.what, send.ms, send.mb, send.seq) != (recv.what, recv.ms, recv.mb, recv.seq):
        return "receives a different message than is sent"
    if send.shape != recv.shape:
        return f"shape {'x'.join(map(str, recv.shape))} does not match the sent shape " \
               f"{'x'.join(map(str, send.shape))}"
    return ""


def _collective_key(instr, any_mb: bool = False) -> tuple:
    return (type(instr).__name__, getattr(instr, "what", None), getattr(instr, "ms", None),
            None if any_mb else getattr(instr, "mb", None))


def check_protocol(program: Program) -> list[Finding]:
    """Every finding of running all ranks together (empty: deadlock-free and matched)."""
    return _Sim(program).run()
