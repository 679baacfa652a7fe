"""Validation while training: every `eval_every` steps, the mean loss over `eval_batches` batches.

The loss comes from each rank's evaluation program (passes/lower/forward_only.py),
so every plan computes it with the schedule and collectives it trains with,
and the batches come from the evaluation source (Note [Plan-independent
data] in runtime/data.py): batch k holds global sequences k·B .. (k+1)·B − 1
of it, the same batches at every evaluation, so the values are comparable.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hetc.passes.verify import verified_evaluation
from hetc.ir.plan import Plan
from hetc.ir.program import Program, RankProgram
from hetc.runtime.data import DataSource, make_eval_source
from hetc.runtime.interpreter import Interpreter

__all__ = ["Evaluator", "make_evaluator"]


@dataclass(frozen=True)
class Evaluator:
    program: RankProgram      # this rank's evaluation program
    data: DataSource
    every: int
    batches: int

    def due(self, done: int) -> bool:
        """Whether to evaluate once `done` steps are complete."""
        return done % self.every == 0

    def run(self, interpreter: Interpreter) -> float:
        """The validation loss: the mean of the batches' mean losses (equal-sized batches)."""
        total = sum(interpreter.evaluate(k, self.program, self.data) for k in range(self.batches))
        return total / self.batches


def make_evaluator(program: Program, plan: Plan, rank: int, plan_dir: Path,
                   evaluation: RankProgram | None) -> Evaluator | None:
    """This rank's evaluator, with `evaluation`, the program compile verified and wrote beside its listing
    (Note [verified once] in hetc/plandir.py); None when the job does not evaluate."""
    train = plan.train
    data = make_eval_source(plan.model, train, plan_dir)
    if data is None:
        return None
    own = evaluation
    if own is None:     # a plan directory from before compile wrote them: derived and verified here
        programs = verified_evaluation(program, plan)
        assert programs is not None, "make_eval_source gave data, so the job evaluates"
        own = programs.ranks[rank]
    return Evaluator(own, data, train.eval_every, train.eval_batches)
