"""One sequence from an explicit plan to its checked programs: cost model → lower → verify → simulate.

`build` is the only place that runs it: `hetc compile` and its re-prediction with other profiles
(hetc/compiler.py), the planner's check of its winner (passes/plan/planner.py), the agreement test and
benchmark (passes/agreement.py) and live rebalancing (runtime/rebalance.py). Each asks for what it needs:
programs lowered here or given (`Lowered`: run and verified here or already), simulated or not, and the
evaluation programs.
Lowering here goes by class (one representative per class of alike ranks, the others renamed:
passes/lower/by_class.py), which gives the programs `lower` gives rank by rank. The programs are run
once against the cost model, verified from that run and timed from it (Note [one run] in
passes/verify/protocol.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from hetc.passes.cost import CostModel, Profiles
from hetc.passes.lower import lower
from hetc.passes.lower.by_class import lower_by_class
from hetc.passes.simulate import simulate, timed_machine
from hetc.ir.plan import Plan
from hetc.passes.verify import verified_evaluation, verify
from hetc.passes.verify.machine import Machine
from hetc.ir.program import Program
from hetc.ir.timeline import Timeline

__all__ = ["Lowered", "PlanBuild", "build"]


@dataclass(frozen=True)
class PlanBuild:
    """A plan's programs, the cost model that timed them, and what the caller asked for."""

    plan: Plan
    program: Program
    costs: CostModel
    timeline: Timeline | None = None         # the simulated step (None: not simulated)
    evaluation: Program | None = None        # the verified evaluation programs (asked for, and the job evaluates)
    eval_timeline: Timeline | None = None    # one validation batch, simulated

    @property
    def step_time_s(self) -> float | None:
        return None if self.timeline is None else self.timeline.step_time


@dataclass(frozen=True)
class Lowered:
    """A plan's programs lowered already, and what has been done with them since, so that `build` does not do
    it again: the planner's winner as it printed and checked it (`PlanResult.lowered`)."""

    program: Program
    ran: Machine | None = None   # run on the blocking machine the plan's cost model times (Note [one run])
    verified: bool = False       # verified with that cost model (Note [the planner checks its winner])


def build(plan: Plan, profiles: Profiles | None = None, *, costs: CostModel | None = None,
          lowered: Lowered | None = None, simulated: bool = True, evaluation: bool = False,
          facts: Iterable[tuple[str, str]] = (), dump_after: str | None = None,
          on_dump: Callable[[str, Program], None] | None = None,
          progress: Callable[[str], None] | None = None) -> PlanBuild:
    """`plan`'s programs, timed with `costs` (default: the cost model of `profiles`).

    `lowered`: the plan's programs, lowered already, run and verified as it says with these costs (else
    lowered here, `dump_after` / `on_dump` as `hetc compile --dump-after`); what it has not had is done here
    (VerifyError when unsafe or over memory), and a machine it ran is read, not run again (Note [one run]).
    `simulated`: time one step (`facts`: the side panel of its timeline); `evaluation`: derive and verify the
    evaluation programs too; `progress(line)` hears each phase done.
    """
    say = progress or (lambda _: None)
    costs = costs or CostModel(plan, profiles)
    if lowered is None:
        program, classes = _lowered(plan, costs, dump_after, on_dump)
        say(f"lowered {program.world_size:,} ranks{classes}: "
            f"{sum(len(rp.instrs) for rp in program.ranks):,} instructions")
        lowered = Lowered(program)
    program, machine = lowered.program, lowered.ran
    if not lowered.verified:
        if machine is None and simulated:
            machine = timed_machine(program, costs)   # run once (Note [one run])
        verify(program, plan, costs, machine=machine)
        say(f"verified ({len(program.groups):,} groups)")
    timeline = simulate(program, plan, costs, facts, ran=machine) if simulated else None
    if timeline is not None:
        say("simulated one step")
    evaluated = verified_evaluation(program, plan) if evaluation else None
    eval_timeline = simulate(evaluated, plan, costs) \
        if evaluated is not None and simulated else None
    return PlanBuild(plan, program, costs, timeline, evaluated, eval_timeline)


def _lowered(plan: Plan, costs: CostModel, dump_after: str | None,
             on_dump: Callable[[str, Program], None] | None) -> tuple[Program, str]:
    """Every rank's program, and how many classes it was lowered in (for the progress line): by class
    (passes/lower/by_class.py, the same programs), but rank by rank where every rank's program is dumped
    after a pass (`hetc compile --dump-after`)."""
    if on_dump is not None and dump_after is not None:
        return lower(plan, dump_after, on_dump, costs), ""
    got = lower_by_class(plan, costs)
    return got.program, f" in {len(got.classes):,} classes"
