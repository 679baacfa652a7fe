"""The planner's last step: its best few plans and the baselines, chosen on the step `hetc plan` prints.

Note [one number]: `hetc plan` prints one step time per plan, the chosen
plan's and every baseline's, as `hetc explain` prints it: the step of the
compiled programs, simulated, where they build in a moment (Note [one step
time] in passes/simulated_step.py), else the closed form, which the
agreement test holds within AGREEMENT of that simulation. The search ranks
plans by the closed form, which is fast. Choosing on it and printing the
simulation broke the promise that the chosen plan is never slower than a
fitting baseline: a Llama-3-8B job on 256 H100 + 32 A100-40 + 256 L4 in
two regions (tests/test_plan_one_number.py) chose a plan of closed form
2.35 s, simulated 2.60 s, and printed the "only H100" grid (closed form and
simulation 2.53 s) beside it as faster.

So the choice is made on the printed number: the search's FINAL_PLANS best
distinct plans and every baseline the spec allows (`contenders`, in the
search's closed-form order) are re-timed on their compiled programs, and
the best by that step (the objective's value at it) is chosen, a baseline's
plan emitted where one wins. The closed form spares the simulations that
cannot change the choice: a contender whose closed form over 1 + AGREEMENT
is already worse than the best printed step so far is not simulated, and a
baseline so left out prints its closed form (marked in the table), which
is then above the chosen plan's printed step. Where a contender's programs
do not build in a moment (too many ops or lanes in lockstep), or it has
more than FULL_ESTIMATE_RANKS ranks (the planner prints its class-by-class
score there), its printed number is its closed form, for plans and
baselines alike. Baselines that do not fit are not re-timed (nothing can
run them). Where the plan that wins is refused by the winner's check, the
planner chooses again without it (`_checked_choice` in planner.py); so
where the validator refuses a contender other than the closed form's own
choice as written out (the search's space admitted it: random job 18, an
interleaved ZeRO-3 plan whose lockstep lanes serve different microbatch
patterns, third of the search's plans), with a warning.

Cost: one lowering and simulation per plan re-timed (about 0.13 ms of CPU a
compute op here); the closed form's choice's was always run, to print it.
The baselines that could win are re-timed whatever it costs (the promise
needs them); the search's other plans only up to FINAL_OPS compute ops
together, and not once the time limit has passed (the time-limit note then
names the re-timing, Note [an anytime search]). Measured beside the
closed form's choice: on that 8B job (288 ranks) two more plans, 1.1 s of
CPU; on the A100-40 + V100-16 clusters of benchmarks/planner.py (catalog
times) 0.3 s at 128 GPUs, 1.3 s at 512 and 0.9 s at 2048 (whose plans use
512), a third plan left out there by FINAL_OPS.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path

from hetc.passes.cost import CostModel, Estimate
from hetc.passes.plan.candidate_score import Score
from hetc.passes.plan.baselines import Baseline
from hetc.passes.plan.emit import emit_spec
from hetc.passes.plan.search import Found, Search
from hetc.passes.simulated_step import (AGREEMENT, Simulated, compute_ops, quick_to_simulate, simulated_step,
                                       with_simulated)
from hetc.ir.errors import SpecError
from hetc.passes.validate import check_spec
from hetc.ir.plan import Plan
from hetc.ir.program import Program
from hetc.ir.spec import Spec

__all__ = ["FINAL_OPS", "FINAL_PLANS", "FULL_ESTIMATE_RANKS", "FinalChoice", "Printed", "choose_printed", "contenders"]

# Above this many ranks the full estimate takes most of a second (it looks up measured network fits
# pair by pair); the planner's own score, the same composition class by class (passes/cost/classes.py),
# stands in, and is what `hetc plan` prints.
FULL_ESTIMATE_RANKS = 1024

# the search's best distinct plans re-timed beside the baselines, and the compute ops of the programs
# re-timed for those after the closed form's choice (Note [one number]): about a second here
FINAL_PLANS = 3
FINAL_OPS = 10_000
log = logging.getLogger(__name__)

RETIMING = "re-timing of its best plans"   # what the time limit cut short, where it did (Note [an anytime search])

Contender = tuple[Found, str]   # a plan with the search's (closed-form) score, and "planner" or a baseline's name


@dataclass(frozen=True)
class Printed:
    """A plan as `hetc plan` prints it: written out, checked, its cost model, and its compiled programs'
    simulated step where they build in a moment (Note [one number])."""

    found: Found                       # the plan, with the search's closed-form score
    name: str                          # "planner", or the baseline's name
    explicit: Spec
    plan: Plan                         # ... checked
    costs: CostModel | None            # None above FULL_ESTIMATE_RANKS ranks
    simulated: Simulated | None        # None: the closed form is printed

    @property
    def score(self) -> Score:
        """The search's score at the printed step."""
        if self.simulated is None:
            return self.found.score
        return replace(self.found.score, step_time_s=self.simulated.step_s)

    @property
    def program(self) -> Program | None:
        return None if self.simulated is None else self.simulated.program

    @property
    def ops(self) -> int:
        """The compute ops of the programs simulated (0: none were)."""
        return 0 if self.simulated is None or self.costs is None else compute_ops(self.costs.pipeline)

    def estimate(self) -> Estimate | None:
        """The cost model's estimate at the printed step (None above FULL_ESTIMATE_RANKS ranks)."""
        if self.costs is None:
            return None
        closed = self.costs.estimate()
        return closed if self.simulated is None else with_simulated(closed, self.costs, self.simulated)


@dataclass(frozen=True)
class FinalChoice:
    chosen: Printed
    baselines: tuple[Baseline, ...]    # each at its printed step (`Baseline.closed_form_s` where simulated)


def contenders(search: Search, found: list[Found], baselines: list[Baseline]) -> list[Contender]:
    """The search's FINAL_PLANS best distinct plans and every baseline the spec allows, best first by the
    search's closed form (on a tie the search's own plan first)."""
    plans: dict[object, Found] = {}
    for f in found:   # best first
        if len(plans) == FINAL_PLANS:
            break
        plans.setdefault(f.candidate.key(), f)
    pool = [(f, "planner") for f in plans.values()]
    pool += [(Found(b.candidate, b.score, None), b.name) for b in baselines
             if b.candidate is not None and b.score is not None and search.space.fixed.admits(b.candidate)]
    return sorted(pool, key=lambda fn: (search.rank(fn[0])[:3], fn[1] != "planner"))


def choose_printed(search: Search, pool: list[Contender], baselines: list[Baseline], base_dir: Path | None,
                   retimed: dict[tuple[object, ...], Printed | None] | None = None) -> FinalChoice:
    """The best of `pool` (`contenders`, not empty) by the step `hetc plan` prints (Note [one number]),
    and `baselines` at theirs; `retimed`: the contenders re-timed so far (None: past FINAL_OPS), by `_key`."""
    goal = search.goal
    retimed = {} if retimed is None else retimed
    printed: dict[int, Printed] = {}
    best = math.inf   # the objective's value at the best admitted printed step so far
    ops_left = float(FINAL_OPS)   # for the search's plans after the first contender
    for i, (f, name) in enumerate(pool):
        if not f.score.fits or goal.value(_least(f)) > best:
            continue   # nothing runs it, or even at the least step it could print it would lose
        budgeted = i > 0 and name == "planner"
        if budgeted and _out_of_time(search):
            continue
        if _key(f, name) not in retimed:
            retimed[_key(f, name)] = _valid_printed(search, f, name, base_dir, ops_left if budgeted else math.inf,
                                                    i == 0)
        got = retimed[_key(f, name)]
        if got is None:
            continue   # its programs are past what is left of FINAL_OPS: not a contender
        printed[i] = got
        ops_left -= got.ops if budgeted else 0
        if goal.admits(got.score):
            best = min(best, goal.value(got.score))
    winner = min(printed, key=lambda i: (not goal.admits(printed[i].score), goal.value(printed[i].score), i))
    timed = {name: printed[i] for i, (_, name) in enumerate(pool) if i in printed}
    allowed = {name for _, name in pool}
    return FinalChoice(printed[winner], tuple(_at_printed(b, timed.get(b.name), b.name in allowed)
                                              for b in baselines))


def _out_of_time(search: Search) -> bool:
    """Whether the time limit has passed, which leaves the search's plans after the first contender
    unre-timed (Note [an anytime search]: the note says so)."""
    if not search.deadline.passed():
        return False
    if RETIMING not in search.cut_short:
        search.cut_short.append(RETIMING)
    return True


def _key(f: Found, name: str) -> tuple[object, ...]:
    return (name, f.candidate.key())


def _least(f: Found) -> Score:
    """`f`'s score at the least step it could print: its closed form above FULL_ESTIMATE_RANKS ranks, else
    that of its compiled programs, which the closed form is held to within AGREEMENT."""
    if sum(stage.size for stage in f.candidate.stages) > FULL_ESTIMATE_RANKS:
        return f.score
    return replace(f.score, step_time_s=f.score.step_time_s / (1 + AGREEMENT))


def _valid_printed(search: Search, f: Found, name: str, base_dir: Path | None, ops_left: float,
                   first: bool) -> Printed | None:
    """`_printed`, and None where the validator refuses the plan written out, which is no contender (Note [one
    number]); a refusal of the closed form's own choice (`first`) is raised, as it always was."""
    try:
        return _printed(search, f, name, base_dir, ops_left)
    except SpecError as err:
        if first:
            raise
        log.warning("hetc plan's %s plan of closed form %.4g s/step is refused as written out, so it is no "
                    "contender; this is a bug in the planner's search space:\n%s", name, f.score.step_time_s, err)
        return None


def _printed(search: Search, f: Found, name: str, base_dir: Path | None, ops_left: float) -> Printed | None:
    """`f`'s plan written out, checked and, where its programs build in a moment, simulated; None where they
    would build but have more than `ops_left` compute ops."""
    explicit = emit_spec(search.job, f.candidate, search.space.zero_base)
    plan = check_spec(explicit, base_dir).plan()
    if plan.pipeline.world_size > FULL_ESTIMATE_RANKS:
        return Printed(f, name, explicit, plan, None, None)
    costs = CostModel(plan, search.profiles)
    p = plan.pipeline
    if quick_to_simulate(p, costs.model) and compute_ops(p) > ops_left:
        return None
    return Printed(f, name, explicit, plan, costs, simulated_step(costs))


def _at_printed(b: Baseline, printed: Printed | None, allowed: bool) -> Baseline:
    """`b` with its printed step (its compiled programs' where they were simulated, else its closed form) and
    whether it agrees with what the spec fixes (`allowed`: a contender)."""
    if printed is None or printed.simulated is None or b.score is None:
        return replace(b, allowed=allowed)
    return replace(b, score=printed.score, closed_form_s=b.score.step_time_s, allowed=allowed)
