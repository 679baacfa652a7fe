"""The step time `hetc explain` and `hetc plan` print: the compiled program's, simulated, where that is quick.

Note [one step time]: explain, plan and compile print one step time for one
plan and one set of profiles. compile lowers the plan and runs the programs
against the cost model (passes/simulate.py, Note [timeline model]); the
closed-form estimate (passes/cost/estimate.py) is what the planner searches
with, and agrees with that simulation within 10 % on every plan of the
random family and the specs (tests/test_plan_agreement.py), but not to the
percent on every schedule's shape: interleaved 1F1B whose border transfers
take as long as its ops (the demo on two shared cores) waits for some
receives the closed form counts in full, and the estimate was 5.7 % over
the compiled step. So explain and plan lower and simulate the plan as
compile does, and print that step (the estimate's beside it, as
`estimate_step_s`), where the programs are small enough to build in about
a second: at most SIMULATED_OPS compute ops over all ranks (a rank's: its
lane's microbatches times its stage's ministages; about 0.1 ms each to
lower, verify and simulate on this machine), with no group of more than
SIMULATED_LOCKSTEP_LANES lanes in lockstep (lowering's schedule simulation
of such a group grows much faster than its ops: Note [coupled lanes] in
passes/lower/lane_sim.py). Above that they print the estimate, and say so.
Memory stays the estimate's: the memory check is the verifier's, which
compile runs, and the two agree within 10 % (the same test). The planner
chooses among its best plans and the baselines on this same step (Note [one
number] in passes/plan/final.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from hetc.passes.cost import CostModel
from hetc.passes.cost.estimate import Estimate, with_simulated_step
from hetc.passes.simulate import timed_machine
from hetc.ir.pipeline import Pipeline
from hetc.ir.program import Program
from hetc.ir.spec import ModelSpec

__all__ = ["AGREEMENT", "SIMULATED_LOCKSTEP_LANES", "SIMULATED_OPS", "Simulated", "compute_ops", "quick_to_simulate",
           "simulated_estimate", "simulated_step"]

SIMULATED_OPS = 20_000
# Two stages of ZeRO-2 lanes, 4 microbatches a lane, lowered on this machine: 32 lanes a stage 0.13 s, 64 lanes
# 2.7 s, 128 lanes (2 microbatches) 5.1 s; 256 lanes of H100 beside 256 of L4 took over 18 GB.
SIMULATED_LOCKSTEP_LANES = 32
# How far the closed form may be from this simulation: what tests/test_plan_agreement.py holds on every plan of
# the random family and the specs.
AGREEMENT = 0.10


@dataclass(frozen=True)
class Simulated:
    """The programs `hetc compile` builds from a plan, and their step, simulated."""

    step_s: float
    program: Program


def compute_ops(pipeline: Pipeline) -> int:
    """The compute ops of all the plan's programs: per rank, its lane's microbatches through its stage."""
    return sum(len(lane.ranks) * len(lane.microbatches) * len(stage.ministages)
               for stage in pipeline.stages for lane in stage.lanes)


def quick_to_simulate(pipeline: Pipeline, model: ModelSpec) -> bool:
    """Whether the plan's programs build and simulate in about a second (Note [one step time])."""
    from hetc.passes.lower.schedule import lockstep_groups   # lowering imports the cost model: not at import

    return compute_ops(pipeline) <= SIMULATED_OPS and \
        all(len(group.lanes) <= SIMULATED_LOCKSTEP_LANES for group in lockstep_groups(pipeline, model))


def simulated_step(costs: CostModel, program: Program | None = None) -> Simulated | None:
    """The programs `hetc compile` builds from `costs`' plan, simulated (Note [one step time]); None
    where they are too many to build in a moment, or compile would refuse them. `program`: those programs,
    lowered already."""
    pipeline = costs.pipeline
    if not quick_to_simulate(pipeline, costs.model):
        return None
    if program is None:
        from hetc.passes.lower.by_class import lower_by_class   # lowering imports the cost model: not at import

        program = lower_by_class(costs.plan, costs).program     # compile's programs, as compile lowers them
    machine = timed_machine(program, costs)
    if machine.run() is not None or machine.unfinished():
        return None   # programs compile would refuse (and name why)
    return Simulated(machine.end_time(), program)


def simulated_estimate(costs: CostModel, estimate: Estimate, program: Program | None = None) -> Estimate:
    """`estimate` with the step of the programs `hetc compile` builds from `costs`' plan, simulated
    (Note [one step time]); the estimate as it is where the programs are too many to build in a moment, or
    compile would refuse them (the estimate is all there is). `program`: those programs, lowered already."""
    got = simulated_step(costs, program)
    return estimate if got is None else with_simulated_step(estimate, costs, got.step_s)
