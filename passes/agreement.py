"""Build a checked plan as `hetc compile` does and compare it with the cost model's estimate.

`build(plan, profiles)` lowers the plan, verifies it (deadlock, dataflow,
memory) and simulates its step: what `hetc plan` checks its winner with
before printing it (Note [the planner checks its winner]) and what the
agreement test (tests/test_plan_agreement.py) and benchmark
(benchmarks/plan_agreement.py) hold the estimate to.

`compare(built)` puts the estimate (`hetc explain`) beside the compiled
program: step time against the simulated timeline, every rank's memory
against the verifier's peak.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetc.passes.build import Lowered, build as build_plan
from hetc.passes.cost import CostModel, Estimate, Profiles
from hetc.passes.verify.memory import Peak, rank_peaks
from hetc.ir.plan import Plan
from hetc.ir.program import Program
from hetc.ir.timeline import Timeline

__all__ = ["Agreement", "Built", "build", "compare"]


@dataclass(frozen=True)
class Built:
    """A plan lowered, verified and simulated."""

    plan: Plan
    program: Program
    costs: CostModel
    step_time_s: float | None          # None: not simulated
    peaks: tuple[Peak, ...]
    timeline: Timeline | None = None   # the simulated step (None: not simulated)


def build(plan: Plan, profiles: Profiles | None = None, simulated: bool = True,
          lowered: Lowered | None = None) -> Built:
    """Lower and verify `plan` (VerifyError if it is unsafe or does not fit), then simulate it
    (passes/build.py), with every rank's memory peak.

    `lowered`: the plan's programs, lowered already with these `profiles`, and run and verified as it says
    (the planner's winner, `PlanResult.lowered`); what they have not had is done here."""
    got = build_plan(plan, profiles, lowered=lowered, simulated=simulated)
    return Built(plan, got.program, got.costs, got.step_time_s,
                 tuple(rank_peaks(got.program, plan.pipeline, got.costs)), got.timeline)


@dataclass(frozen=True)
class Agreement:
    """The estimate beside the compiled program: relative gaps (estimate / compiled − 1)."""

    estimate: Estimate
    simulated_s: float
    step_gap: float
    peaks: tuple[float, ...]           # per rank: the compiled program's peak bytes
    memory_gaps: tuple[float, ...]     # per rank

    @property
    def worst_memory_gap(self) -> tuple[int, float]:
        """(rank, gap) of the rank whose estimate is furthest from its compiled peak."""
        rank = max(range(len(self.memory_gaps)), key=lambda r: abs(self.memory_gaps[r]))
        return rank, self.memory_gaps[rank]

    def within(self, tolerance: float) -> bool:
        return abs(self.step_gap) <= tolerance and all(abs(g) <= tolerance for g in self.memory_gaps)

    def describe(self) -> str:
        rank, gap = self.worst_memory_gap
        return (f"step: estimate {self.estimate.step_time_s:.4g} s vs compiled {self.simulated_s:.4g} s "
                f"({100 * self.step_gap:+.1f}%); worst memory: rank {rank} estimate "
                f"{self.estimate.memory[rank].total / 2**30:.2f} GiB vs compiled "
                f"{self.peaks[rank] / 2**30:.2f} GiB ({100 * gap:+.1f}%)")


def compare(built: Built) -> Agreement:
    assert built.step_time_s is not None, "compare() needs a simulated step"
    estimate = built.costs.estimate()
    peaks = tuple(p.total for p in built.peaks)
    gaps = tuple(m.total / p - 1 for m, p in zip(estimate.memory, peaks, strict=True))
    return Agreement(estimate, built.step_time_s, estimate.step_time_s / built.step_time_s - 1, peaks, gaps)
