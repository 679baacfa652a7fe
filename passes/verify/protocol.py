"""Run every rank's program together under the runtime's blocking rules (Note [blocking rules] in
machine.py, untimed): the first mismatch, a deadlock (explained by `deadlock.py`, Note [deadlock blame]),
or a handle never waited.

Note [one run]: matching goes by posting order, never by time (Note
[event-driven]), and copies complete on their own, so whether the programs
finish, and the first mismatch met, do not depend on the clock. A machine
timed by the cost model (the simulator's) therefore proves the same thing
as an untimed one: `hetc compile` runs the programs once, the protocol
check reads the outcome and the simulator the times (passes/simulate.py
`timed_machine`), where running the machine twice was a fifth of compiling
a 64-rank, 512-microbatch plan. The planner runs its winner's programs so to
print their step (`Simulated`, passes/simulated_step.py) and hands that
machine on to its check of the winner and to `hetc compile` (passes/build.py
`ran` of `Lowered`); run again, a machine only says what its run met. Each
plan the agreement family plans and compiles ran three times before.
"""

from __future__ import annotations

from hetc.passes.verify.deadlock import Stuck, explain_deadlock, held_by_order
from hetc.passes.verify.errors import Finding, at
from hetc.passes.verify.machine import Backend, Machine
from hetc.ir.program import Program

__all__ = ["check_protocol"]


def check_protocol(program: Program, machine: Machine | None = None,
                   backend: Backend = Backend.GLOO) -> list[Finding]:
    """Every finding of running all ranks together (empty: deadlock-free and matched).

    `machine`: a machine of `program`, with the clock of whoever reads it after, run already or not (Note
    [one run]); by default an untimed one. `backend`: whose blocking rule (Note [NCCL order] in machine.py)."""
    machine = Machine(program, backend=backend) if machine is None else machine
    assert machine.backend is backend   # a machine given is of the backend asked for
    problem = machine.run()
    if problem:
        return [problem]
    active = machine.unfinished()
    if active:
        return _deadlock(machine, active)
    return [at(program, op.rank, op.index, f"handle {handle} is never waited before the step ends")
            for handle, op in machine.unwaited()]


def _deadlock(machine: Machine, active: list[int]) -> list[Finding]:
    stuck = []
    for r in active:
        op = machine.blocked_on(r)
        stuck.append(Stuck(r, machine.ranks[r].pc, op.instr, op.index, op.call, op.group, held_by_order(machine, op)))
    return explain_deadlock(machine.program, stuck, dict(machine.count))
