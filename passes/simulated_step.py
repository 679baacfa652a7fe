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
lower, verify and simulate on this machine). Above that they print the
estimate, and say so. Memory stays the estimate's: the memory check is the
verifier's, which compile runs, and the two agree within 10 % (the same test).
"""

from __future__ import annotations

from hetc.passes.cost import CostModel
from hetc.passes.cost.estimate import Estimate, with_simulated_step
from hetc.passes.simulate import timed_machine
from hetc.pipeline import Pipeline
from hetc.program import Program
from hetc.spec import Spec

__all__ = ["SIMULATED_OPS", "compute_ops", "simulated_estimate"]

SIMULATED_OPS = 20_000


def compute_ops(pipeline: Pipeline) -> int:
    """The compute ops of all the plan's programs: per rank, its lane's microbatches through its stage."""
    return sum(len(lane.ranks) * len(lane.microbatches) * len(stage.ministages)
               for stage in pipeline.stages for lane in stage.lanes)


def simulated_estimate(spec: Spec, costs: CostModel, estimate: Estimate, program: Program | None = None) -> Estimate:
    """`estimate` with the step of the programs `hetc compile` builds from `spec`'s plan (`costs`'), simulated
    (Note [one step time]); the estimate as it is where the programs are too many to build in a moment.
    `program`: those programs, lowered already (the planner's check of its winner)."""
    pipeline = costs.pipeline
    if compute_ops(pipeline) > SIMULATED_OPS:
        return estimate
    if program is None:
        from hetc.passes.lower import lower   # lowering imports the cost model: not at this module's import

        program = lower(spec, pipeline, costs=costs)
    machine = timed_machine(program, spec, costs)
    if machine.run() is not None or machine.unfinished():
        return estimate   # programs compile would refuse (and name why): the estimate is all there is
    return with_simulated_step(estimate, costs, machine.end_time())
