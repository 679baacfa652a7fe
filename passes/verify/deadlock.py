"""Explain a deadlock: for each blocked rank, who it waits for and whether they ever will act.

Note [deadlock blame]: when no rank can move, every unfinished rank waits
on a partner — a send's receiver, a receive's sender, the members of a
collective that have not posted it. A partner whose whole program has no
matching operation is the fault (a dropped receive, a wrong peer, a missing
collective call); a partner that has one but is blocked before it only
passes the wait along. Findings list the first kind before the second, so
the error leads with the rank whose program is wrong, not with rank 0.
Under NCCL's rule (Note [NCCL order] in machine.py) a partner may also have
posted its op but queued it behind another on the same communicator; the
finding then names that communicator and the op ahead (`held_by_order`),
and comes after the partners that never act but before those that only
pass a wait along.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hetc.passes.verify.errors import Finding, at
from hetc.passes.verify.machine import Machine, Op, collective_groups, communicator_name, compute_groups
from hetc.ir.program import Instr, Program, Recv, Send, Tensor

__all__ = ["Stuck", "explain_deadlock", "held_by_order"]

MAX_FINDINGS = 8


@dataclass(frozen=True, slots=True)
class Stuck:
    """Rank `rank` is blocked at instruction `index` on `op` (posted at `op_index`; `call`: its collective
    number on `group`, which a compute op with tp/cp collectives names; `held`: why NCCL's order keeps it
    from starting, `held_by_order`)."""

    rank: int
    index: int
    op: Instr
    op_index: int
    call: int | None = None
    group: str | None = None
    held: str = ""


class _Partners:
    """What every rank's whole program posts: p2p messages per channel, collective calls per group."""

    def __init__(self, program: Program):
        self.program = program
        self.sends: Counter[tuple[int, int, Tensor, int, int]] = Counter()
        self.recvs: Counter[tuple[int, int, Tensor, int, int]] = Counter()
        self.calls: Counter[tuple[str, int]] = Counter()
        groups = compute_groups(program)
        for rp in program.ranks:
            for instr in rp.instrs:
                if isinstance(instr, Send):
                    self.sends[(rp.rank, instr.peer_to, instr.what, instr.ms, instr.mb)] += 1
                elif isinstance(instr, Recv):
                    self.recvs[(instr.peer_from, rp.rank, instr.what, instr.ms, instr.mb)] += 1
                else:
                    for group in collective_groups(rp.rank, instr, groups):
                        self.calls[(group, rp.rank)] += 1
        self.members = {g.name: g.ranks for g in program.groups}

    def blame(self, s: Stuck, posted: dict[tuple[str, int], int]) -> tuple[bool, str]:
        """(the partner never acts, why) for one blocked rank."""
        op = s.op
        if isinstance(op, Send):
            if self.recvs[(s.rank, op.peer_to, op.what, op.ms, op.mb)] == 0:
                return True, f"rank {op.peer_to} posts no matching receive"
            return False, f"rank {op.peer_to} is blocked before its matching receive"
        if isinstance(op, Recv):
            if self.sends[(op.peer_from, s.rank, op.what, op.ms, op.mb)] == 0:
                return True, f"rank {op.peer_from} posts no matching send"
            return False, f"rank {op.peer_from} is blocked before its matching send"
        group = s.group or getattr(op, "group", None)
        if group is not None and s.call is not None:
            members = self.members.get(group, ())
            never = [m for m in members if self.calls[(group, m)] <= s.call]
            if never:
                return True, (f"{_ranks(never)} of '{group}' make only {self.calls[(group, never[0])]} "
                              f"call(s) on it, never this #{s.call}")
            late = [m for m in members if posted.get((group, m), 0) <= s.call]
            return False, f"{_ranks(late)} of '{group}' are blocked before this collective"
        return False, ""


def held_by_order(machine: Machine, op: Op) -> str:
    """Why NCCL's order keeps `op` from starting ('' where it does not): what is queued ahead, and where."""
    held = machine.held(op)
    if held is None:
        return ""
    queued, ahead = held
    assert queued.comm is not None   # a held op is on a line
    where = communicator_name(queued.comm)
    if queued.rank == op.rank:
        return (f"on {where} it is queued behind this rank's `{ahead.instr}` (instruction {ahead.index}), "
                "which never completes (NCCL starts a communicator's operations in posting order)")
    return (f"on {where}, rank {queued.rank}'s matching `{queued.instr}` (instruction {queued.index}) is queued "
            f"behind its `{ahead.instr}` (instruction {ahead.index}) (NCCL starts a communicator's operations "
            "in posting order)")


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:6])) + (", ..." if len(ranks) > 6 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"


def explain_deadlock(program: Program, stuck: list[Stuck], posted: dict[tuple[str, int], int]) -> list[Finding]:
    """Findings for the blocked ranks, the ranks whose partner never acts first (Note [deadlock blame])."""
    partners = _Partners(program)
    ranked = []
    for s in stuck:
        never, why = partners.blame(s, posted) if not s.held else (False, s.held)
        order = 0 if never else 1 if s.held else 2
        waits = f"waits for `{s.op}` (instruction {s.op_index}), which never completes" \
            if s.op_index != s.index else "blocks forever"
        ranked.append((order, s.rank, at(program, s.rank, s.index,
                                         f"deadlock: {waits}" + (f": {why}" if why else ""))))
    return [finding for _, _, finding in sorted(ranked, key=lambda x: x[:2])[:MAX_FINDINGS]]
