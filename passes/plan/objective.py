"""What the planner optimises: Sailor's objectives over the exact score of a plan.

`throughput` minimises the step time (tokens per step are fixed by the
global batch); `cost` minimises dollars per token: GPU rent (DeviceSpec
price, for the GPUs the plan uses; idle GPUs are not rented) over the step
plus egress for bytes that cross priced links. Either may carry a budget
($/h, rent plus egress at the plan's step rate) and a minimum throughput.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetc.passes.plan.candidate_score import Score
from hetc.ir.spec import Objective, ObjectiveSpec

__all__ = ["Goal"]


@dataclass(frozen=True)
class Goal:
    kind: Objective = Objective.THROUGHPUT
    budget: float = 0.0            # $/h, 0: none
    min_throughput: float = 0.0    # tokens/s, 0: none

    @classmethod
    def of(cls, spec: ObjectiveSpec) -> Goal:
        return cls(spec.goal, spec.budget, spec.min_throughput)

    def value(self, score: Score) -> float:
        """Lower is better."""
        if self.kind is Objective.COST:
            return score.dollars_per_token
        return score.step_time_s

    def within_budget(self, score: Score) -> bool:
        return self.budget <= 0 or score.dollars_per_hour <= self.budget * (1 + 1e-9)

    def fast_enough(self, score: Score) -> bool:
        return score.tokens_per_s >= self.min_throughput * (1 - 1e-9)

    def admits(self, score: Score) -> bool:
        return score.fits and self.within_budget(score) and self.fast_enough(score)

    def describe(self) -> str:
        text = "maximum throughput" if self.kind is Objective.THROUGHPUT else "least $ per token"
        limits = [f"≤ {self.budget:g} $/h" for _ in [0] if self.budget > 0]
        limits += [f"≥ {self.min_throughput:,.0f} tokens/s" for _ in [0] if self.min_throughput > 0]
        return text + (f" ({', '.join(limits)})" if limits else "")
