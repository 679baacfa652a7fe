"""The blocking machine both the verifier and the simulator drive (Note [blocking rules], machine.py).

Hand-written two-rank programs with a toy clock: the times follow from the
rules alone (a message starts when both ends are posted, a collective when
its last member posts, copies queue on the copy stream, a wait moves the
rank to the end of what it waits for), and the untimed run finds the same
deadlocks the verifier reports.
"""

from __future__ import annotations

from hetc.passes.verify.machine import NO_TIME, Machine
from hetc.passes.verify.protocol import check_protocol
from hetc.ir.program import (AllReduce, Forward, Group, Offload, Program, RankProgram, Recv, Send, Shard, Step,
                          Tensor, Wait)


class _Clock:
    """Compute 1 s, a step 0.5 s, a message 2 s, a collective 3 s, a copy 4 s."""

    def local(self, rank, instr) -> float:
        return 0.5 if isinstance(instr, Step) else 1.0

    def copy(self, rank, instr) -> float:
        return 4.0

    def p2p(self, send, recv) -> float:
        return 2.0

    def collective(self, ops) -> float:
        return 3.0


def _program(rank0, rank1) -> Program:
    shard = (Shard(0, 0),)
    return Program((RankProgram(0, 0, 0, 0, 0, shard, tuple(rank0)), RankProgram(1, 1, 0, 0, 0, shard, tuple(rank1))),
                   (Group("world", (0, 1)),))


SHAPE = (1, 4, 8)


def _run(program: Program, clock=None) -> Machine:
    machine = Machine(program, clock or _Clock(), record=True)
    assert machine.run() is None and not machine.unfinished()
    return machine


def test_a_message_starts_when_both_ends_are_posted():
    # rank 0 computes (1 s) then sends; rank 1 posts its receive at once and computes while it waits
    machine = _run(_program([Forward(0, 0), Send(Tensor.ACT, 0, 0, 1, SHAPE, 1), Wait(1)],
                            [Recv(Tensor.ACT, 0, 0, 0, SHAPE, 1), Forward(1, 1), Wait(1), Forward(1, 0)]))
    ends = {(op.rank, op.index): (op.start, op.end) for op in machine.ran}
    assert ends[(0, 1)] == ends[(1, 0)] == (1.0, 3.0)        # posted at 1 s by the later end, 2 s long
    assert ends[(1, 3)] == (3.0, 4.0)                          # the wait held rank 1 until the message arrived
    assert [s.t for s in machine.ranks] == [3.0, 4.0] and machine.end_time() == 4.0
    assert [(s.rank, r.rank) for s, r in machine.messages] == [(0, 1)]


def test_a_collective_starts_when_its_last_member_posts_and_copies_queue():
    machine = _run(_program(
        [Offload(Tensor.PARAMS, 0, None, 1), Offload(Tensor.PARAMS, 0, None, 2), AllReduce(Tensor.LOSS, "world"),
         Wait(1), Wait(2)],
        [Forward(1, 0), Step(1), AllReduce(Tensor.LOSS, "world")]))
    ends = {(op.rank, op.index): (op.start, op.end) for op in machine.ran}
    assert ends[(0, 0)] == (0.0, 4.0) and ends[(0, 1)] == (4.0, 8.0)   # one copy stream: the second queues
    assert ends[(0, 2)] == ends[(1, 2)] == (1.5, 4.5)                  # rank 1 posts after compute and step
    assert machine.ranks[0].t == 8.0 and machine.ranks[1].t == 4.5


def test_untimed_runs_are_the_verifiers():
    swapped = _program([Recv(Tensor.GRAD, 1, 0, 1, SHAPE), Send(Tensor.ACT, 0, 0, 1, SHAPE)],
                       [Recv(Tensor.ACT, 0, 0, 0, SHAPE), Send(Tensor.GRAD, 1, 0, 0, SHAPE)])
    machine = Machine(swapped, NO_TIME)
    assert machine.run() is None and machine.unfinished() == [0, 1]     # both receive first: nobody sends
    findings = check_protocol(swapped)
    assert findings and all("deadlock" in f.message for f in findings)
    fixed = _program([Send(Tensor.ACT, 0, 0, 1, SHAPE), Recv(Tensor.GRAD, 1, 0, 1, SHAPE)],
                     [Recv(Tensor.ACT, 0, 0, 0, SHAPE), Send(Tensor.GRAD, 1, 0, 0, SHAPE)])
    assert check_protocol(fixed) == [] and _run(fixed).end_time() == 4.0   # two 2 s messages in a row


def test_a_machine_runs_once_and_then_only_says_what_its_run_met():
    """Note [one run]: the planner hands its run machine to the winner's check and to `hetc compile`; run again,
    it must neither move past a mismatch it stopped at nor change the times it found."""
    mismatched = _program([Send(Tensor.ACT, 0, 0, 1, SHAPE), Forward(0, 0)],
                          [Recv(Tensor.ACT, 0, 0, 0, (1, 4, 9)), Forward(1, 0)])
    machine = Machine(mismatched, _Clock(), record=True)
    problem = machine.run()
    assert problem is not None and "shape" in problem.message
    pcs = [state.pc for state in machine.ranks]
    assert machine.run() is problem and [state.pc for state in machine.ranks] == pcs
    assert check_protocol(mismatched, machine) == [problem]
    ran = _run(_program([Forward(0, 0), Send(Tensor.ACT, 0, 0, 1, SHAPE, 1), Wait(1)],
                        [Recv(Tensor.ACT, 0, 0, 0, SHAPE, 1), Forward(1, 1), Wait(1), Forward(1, 0)]))
    events = list(ran.ran)
    assert ran.run() is None and ran.ran == events and ran.end_time() == 4.0
    assert check_protocol(ran.program, ran) == []
