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
`estimate_step_s`), and each rank's memory as the verifier walks those
programs (Note [memory timeline] in passes/verify/memory.py), where the
programs are small enough to build in about a second: at most
SIMULATED_OPS compute ops over all ranks (a rank's: its lane's
microbatches times its stage's ministages; about 0.1 ms each to lower,
verify and simulate on this machine), with no group of more than
SIMULATED_LOCKSTEP_LANES lanes in lockstep (lowering's schedule simulation
of such a group grows much faster than its ops: Note [coupled lanes] in
passes/lower/lane_sim.py). Above that they print the estimate, and say so.
The memory is compile's for the same reason: the closed form counts the
in-flight limit's stash on every lane (Note [in-flight limit]), and a lane
whose round trips come back before its next input arrives holds fewer. On
a hand-written ZB plan (a stage of 3 lanes fed by 2 in lockstep, 3
microbatches a lane) the closed form counted 3 stashes where the compiled
lane holds 2: 14.09 GiB explained, 11.89 GiB compiled (+18.5 %); with
compile's peak explain says what compile will, fits or not, and prints the
closed form's total beside it. The planner's plans agree within 10 % either
way (the same test). The planner chooses among its best plans and the
baselines on this same step (Note [one number] in passes/plan/final.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hetc.passes.cost import CostModel
from hetc.passes.cost.estimate import Estimate, RankMemory, with_simulated_step
from hetc.passes.simulate import timed_machine
from hetc.passes.verify.machine import Machine
from hetc.passes.verify.memory import Peak, rank_peaks
from hetc.ir.pipeline import Pipeline
from hetc.ir.program import Program
from hetc.ir.spec import ModelSpec

__all__ = ["AGREEMENT", "SIMULATED_LOCKSTEP_LANES", "SIMULATED_OPS", "Simulated", "compiled_memory", "compute_ops",
           "quick_to_simulate", "simulated_estimate", "simulated_step", "with_simulated"]

SIMULATED_OPS = 20_000
# Two stages of ZeRO-2 lanes, 4 microbatches a lane, lowered on this machine: 32 lanes a stage 0.13 s, 64 lanes
# 2.7 s, 128 lanes (2 microbatches) 5.1 s; 256 lanes of H100 beside 256 of L4 took over 18 GB.
SIMULATED_LOCKSTEP_LANES = 32
# How far the closed form may be from this simulation: what tests/test_plan_agreement.py holds on every plan of
# the random family and the specs.
AGREEMENT = 0.10


@dataclass(frozen=True)
class Simulated:
    """The programs `hetc compile` builds from a plan, run once on the blocking machine timed by the plan's
    cost model: their step, and the machine, which the verifier's protocol check and the simulator read
    after (Note [one run] in passes/verify/protocol.py) wherever the plan is built next."""

    step_s: float
    program: Program
    machine: Machine      # run, and finished


def compiled_memory(closed: RankMemory, peak: Peak) -> RankMemory:
    """A rank's closed-form breakdown with the compiled program's peak in its place (Note [one step time]):
    ZeRO-3's gathered parameters count as buffers, as the closed form counts them; what the rank offloads to
    the host is the closed form's, and so are the activations it holds in the step where the compiled peak, as
    the closed form's, comes after the last backward and holds none."""
    parts = peak.parts
    in_step = closed.activations_in_step if parts["activations"] == 0 else None
    return replace(closed, params=parts["params"], grads=parts["grads"], optimizer=parts["optimizer"],
                   activations=parts["activations"], buffers=parts["gathered"] + parts["buffers"],
                   reserve=parts["reserve"], activations_in_step=in_step)


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
    return Simulated(machine.end_time(), program, machine)


def simulated_estimate(costs: CostModel, estimate: Estimate, program: Program | None = None) -> Estimate:
    """`estimate` with the step of the programs `hetc compile` builds from `costs`' plan, simulated
    (Note [one step time]); the estimate as it is where the programs are too many to build in a moment, or
    compile would refuse them (the estimate is all there is). `program`: those programs, lowered already."""
    got = simulated_step(costs, program)
    return estimate if got is None else with_simulated(estimate, costs, got)


def with_simulated(estimate: Estimate, costs: CostModel, simulated: Simulated) -> Estimate:
    """`estimate` at `simulated`'s step, with its programs' memory peaks as compile's memory check walks them
    (Note [one step time])."""
    peaks = {peak.rank: peak for peak in rank_peaks(simulated.program, costs.pipeline, costs)}
    memory = tuple(compiled_memory(m, peaks[m.rank]) for m in estimate.memory)
    return with_simulated_step(estimate, costs, simulated.step_s, memory)
