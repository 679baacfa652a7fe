"""`plan_spec`: fill every `auto` of a spec's parallel plan and say what the plan costs.

The search (`search.Search`) proposes plans; the baselines (`baselines`)
are scored beside them, and the search's best few and the baselines that
agree with what the spec fixes are compared on the step `hetc plan` prints
(`final`, Note [one number]): one that beats the others is chosen. The
chosen plan is written back into the Spec (`emit`), validated, and
estimated by the cost model itself (`CostModel.estimate()`) up to
`FULL_ESTIMATE_RANKS` ranks; beyond that the planner's class-by-class
score, the same composition, is reported.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hetc.ir.errors import InternalError, SpecError
from hetc.ir.gc_pause import paused_collector
from hetc.passes.cost import CostModel, Estimate, Profiles
from hetc.passes.build import Lowered, build
from hetc.passes.plan.baselines import Baseline
from hetc.passes.plan.candidate import Candidate
from hetc.passes.plan.deadline import DEFAULT_TIME_LIMIT_S, SCREEN_SHARE, Deadline
from hetc.passes.plan.emit import emit_spec
from hetc.passes.plan.final import FULL_ESTIMATE_RANKS, FinalChoice, Printed, choose_printed, contenders
from hetc.passes.plan.idle import IdleReason, idle_reasons
from hetc.passes.plan.candidate_score import Score
from hetc.passes.plan.infeasible import no_plan_error
from hetc.passes.plan.objective import Goal
from hetc.passes.plan.search import Found, Search, SearchLimits
from hetc.passes.plan.space import SearchSpace, space_from_spec
from hetc.passes.plan.would_fit import would_fit
from hetc.passes.resolve import plan_has_auto as needs_plan   # one rule for what is left to plan
from hetc.passes.simulated_step import Simulated, simulated_estimate
from hetc.passes.validate import check_spec
from hetc.passes.validate_fit import HEADROOM_PRICE, NEAR_CAPACITY
from hetc.ir.plan import Job, Plan
from hetc.ir.spec import Spec

__all__ = ["FULL_ESTIMATE_RANKS", "Headroom", "PlanResult", "needs_plan", "plan_checked", "plan_spec"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Headroom:
    """What the memory headroom weighed (Note [planning headroom]). `kept`: the plan is held to NEAR_CAPACITY
    of each device, and `other` is the best plan for the whole device, which it passed over; else `other` is
    the best plan within that share, which cost more than HEADROOM_PRICE."""

    kept: bool
    other: Score


@dataclass(frozen=True)
class PlanResult:
    spec: Spec                         # the explicit spec
    plan: Plan                         # ... validated and resolved
    goal: Goal
    score: Score | None                # the planner's score of the plan (None: nothing was planned)
    estimate: Estimate | None          # the cost model's estimate (None above FULL_ESTIMATE_RANKS)
    candidate: Candidate | None = None
    baselines: tuple[Baseline, ...] = ()
    chosen: str = "planner"            # or the name of the baseline that won
    seconds: float = 0.0
    structures: int = 0
    # the winner's programs as the planner lowered, ran (Note [one number]) and checked them (Note [the planner
    # checks its winner]) with the `profiles` the plan was made with, for whoever builds the plan next (passes/
    # build.py); None where it did neither, or kept nothing (no `keep_program`)
    lowered: Lowered | None = None
    # what the time limit left unsearched, where the search met it (Note [an anytime search])
    time_limit_note: str | None = None
    idle: tuple[IdleReason, ...] = ()  # why each node group the plan leaves idle is idle (passes/plan/idle.py)
    headroom: Headroom | None = None   # what the memory headroom weighed; None: nothing (Note [planning headroom])

    @property
    def planned(self) -> bool:
        return self.candidate is not None

    @property
    def step_time_s(self) -> float:
        if self.estimate is not None:
            return self.estimate.step_time_s
        assert self.score is not None   # a result has an estimate or a score
        return self.score.step_time_s

    @property
    def printed_score(self) -> Score | None:
        """The planner's score at the printed step (`step_time_s`): its $ per token is the one compared with
        the baselines' (Note [one number] in passes/plan/final.py)."""
        if self.score is None:
            return None
        return replace(self.score, step_time_s=self.step_time_s)

    @property
    def simulated(self) -> bool:
        """Whether the printed step is the compiled programs', simulated (Note [one step time])."""
        return self.estimate is not None and self.estimate.closed_form_s is not None

    @property
    def tokens_per_s(self) -> float:
        if self.estimate is not None:
            return self.estimate.tokens_per_s
        assert self.score is not None   # a result has an estimate or a score
        return self.score.tokens_per_s


def plan_spec(spec: Spec, profiles: Profiles | None = None, base_dir: Path | None = None,
              progress: Callable[[str], None] | None = None, limits: SearchLimits | None = None,
              keep_program: bool = False, time_limit_s: float | None = DEFAULT_TIME_LIMIT_S,
              **space_overrides: Any) -> PlanResult:   # `space_from_spec`'s
    """The explicit plan for `spec` (returned as is, estimated, when it has no `auto`).

    `keep_program`: check the winner on every rank's program and return it (`PlanResult.lowered`, which
    `hetc compile` builds on); else the check may read one lane position (Note [the planner checks its
    winner]). `time_limit_s`: the search's time (None: no limit), after which it returns the best plan it
    found so far (Note [an anytime search])."""
    deadline = Deadline.after(time_limit_s)
    with paused_collector():   # Note [pausing the collector]
        return _plan_spec(spec, profiles, base_dir, progress, limits, keep_program, deadline, **space_overrides)


def _plan_spec(spec: Spec, profiles: Profiles | None, base_dir: Path | None,
               progress: Callable[[str], None] | None, limits: SearchLimits | None, keep_program: bool,
               deadline: Deadline, **space_overrides: Any) -> PlanResult:
    checked = check_spec(spec, base_dir)
    job = checked.job()
    if job is None:
        raise SpecError.at(spec.span, "the planner needs a whole spec: a model, a cluster, a train and a "
                                      "parallel block (an empty `parallel { }` plans everything)")
    goal = Goal.of(job.parallel.objective)
    if not needs_plan(spec):  # nothing searched: the cost model's estimate at any size
        plan = checked.plan()
        return PlanResult(spec, plan, goal, None, _estimate(plan, profiles))
    start = time.perf_counter()
    search, found, headroom = _search_with_headroom(job, profiles, space_from_spec(job, **space_overrides), goal,
                                                       limits, deadline, progress,
                                                       None if keep_program else (_checks_out, base_dir))
    scored = search.baselines()
    pool = contenders(search, found, scored)
    best = pool[0][0] if pool else None   # by the closed form: what a plan that does not fit is told of
    note = _time_limit_note(search, found)
    if note is not None and (best is None or not goal.admits(best.score)):   # Note [an anytime search]
        raise SpecError.at(job.parallel.span, f"no plan found within the planner's time limit: {note}; "
                                               "allow it more time (--time-limit S)")
    if best is None or not goal.admits(best.score):
        raise no_plan_error(search, found, scored,
                            lambda: would_fit(job, profiles, search.space, goal, deadline))
    final, lowered = _checked_choice(search, pool, scored, base_dir, keep_program)   # Note [one number]
    note = _time_limit_note(search, found)   # the limit may have cut the re-timing short
    winner, best = final.chosen, final.chosen.found
    estimate = winner.estimate()   # at the printed step, simulated on the programs checked if they were kept
    _cross_check(best.score, estimate)
    idle = idle_reasons(search, found, scored, best, written=search.space.fixed.idle is not None)
    return PlanResult(winner.explicit, winner.plan, goal, best.score, estimate, best.candidate, final.baselines,
                      winner.name, time.perf_counter() - start, search.visited, lowered, note, idle, headroom)


# Note [planning headroom]: the planner prefers plans within NEAR_CAPACITY of each device's memory (Note
# [Near capacity] in passes/validate_fit.py), the share above which `hetc plan` itself warns that the run
# may still run out of memory: specs/zorse/c_auto.het was planned at 99.8 % of a T4 (25.6 s a step) and
# printed with that warning, where a plan at 91 % runs 26.2 s. Headroom is insurance against what no
# estimate sees (the reserve every estimate keeps, context and fragmentation, passes/cost/memory.py, is
# below both), so it is bought at a price: a plan within the share is chosen where its objective is at
# most HEADROOM_PRICE worse than the best plan for the whole device, else that plan stands and the warning
# names its ranks (a Llama-3-70B job over H100, A100 and L4, tests/llama_jobs.py: 72 s at 96.5 % of an
# H100 by the planner's estimate, 119 s at best within the share, which leaves the H100s idle).
# The search plans to the whole device first, as it would without a headroom: held to the share from its
# first screen on, its screens keep other layouts (on that 70B job, none that used the H100s at tp 1).
# Only where its best plan fills more than the share does a second search run beside it, its stage
# options built to the share (the first search's options fill the whole device, so its plans within the
# share are few); the two searches' plans are then held to the share, and the baselines with them (a
# faster baseline above it says so; an idle group's memory reason names it), or, past the price, to the
# whole device. A plan above the share that compiles over its device is what an estimate may miss, not a
# bug (Note [the planner checks its winner]): where every such contender does, `hetc plan` says no plan
# fits once compiled (exit 2), naming the closest and the verifier's finding.


def _search_with_headroom(job: Job, profiles: Profiles | None, space: SearchSpace, goal: Goal,
                          limits: SearchLimits | None, deadline: Deadline, progress: Callable[[str], None] | None,
                          aside: tuple[Callable[..., Any], Any] | None
                          ) -> tuple[Search, list[Found], Headroom | None]:
    """The search and its plans, best first: within NEAR_CAPACITY of each device where the best there is at
    most HEADROOM_PRICE worse than the best for the whole device, else within the devices (Note [planning
    headroom]); and what was weighed, where anything was."""
    search = Search(job, profiles, space, goal, limits, deadline)
    found = search.run(progress, aside)
    if not found or not goal.admits(found[0].score) or found[0].score.fits_within(NEAR_CAPACITY):
        return search, found, None
    second = Search(job, profiles, space, goal, limits, deadline, fill=NEAR_CAPACITY, options_to_fill=True)
    tailored = second.run(progress)
    search.visited += second.visited   # what `hetc plan` says it searched, and what the time limit cut
    search.cut_short += [step for step in second.cut_short if step not in search.cut_short]
    held = search.refill(found + tailored, NEAR_CAPACITY)
    within = held[0].score if goal.admits(held[0].score) else None
    if within is not None and goal.value(within) <= (1 + HEADROOM_PRICE) * goal.value(found[0].score):
        return search, held, Headroom(True, found[0].score)
    return search, search.refill(found + tailored, 1.0), None if within is None else Headroom(False, within)


def _time_limit_note(search: Search, found: list[Found]) -> str | None:
    """What the time limit left unsearched (Note [an anytime search]); None where the search ended before it."""
    if not search.cut_short:
        return None
    scored = f"{len(found)} plan{'s' if len(found) != 1 else ''} scored"
    return (f"the time limit of {search.deadline.limit_s:g} s (the screens have {SCREEN_SHARE:.0%} of it) cut "
            f"short or skipped the search's {', '.join(search.cut_short)} ({scored})")


def plan_checked(spec: Spec, base_dir: Path | None = None, profiles: Profiles | None = None,
                 time_limit_s: float | None = DEFAULT_TIME_LIMIT_S) -> PlanResult:
    """The plan of `spec` (planned first if it has `auto`, within `time_limit_s`): what `hetc compile` builds
    on."""
    result = plan_spec(spec, profiles, base_dir, keep_program=True, time_limit_s=time_limit_s)
    if result.planned:
        log.info("planned %s: %.4g s/step, %s", result.chosen, result.step_time_s, result.goal.describe())
    if result.time_limit_note is not None:   # Note [an anytime search]
        log.warning("%s; the plan is the best found by then (--time-limit S allows more)", result.time_limit_note)
    return result


def _estimate(plan: Plan, profiles: Profiles | None) -> Estimate:
    """The cost model's estimate of a plan with nothing to plan, with the compiled programs' simulated step
    where they are quick to build, as explain prints it (Note [one step time] in passes/simulated_step.py)."""
    costs = CostModel(plan, profiles)
    return simulated_estimate(costs, costs.estimate())


# Note [the planner checks its winner]: the chosen plan is lowered and verified (deadlock-freedom,
# dataflow, every rank's memory against its device) before it is printed, so `hetc plan` never prints a
# plan that `hetc compile` refuses. A refusal is the cost model and the compiled program disagreeing,
# a bug in hetc, not the user's: the planner warns, naming the plan and the verifier's finding, and
# chooses again without that plan; only where it refuses every contender is it an InternalError. (A
# memory estimate within its agreement of the compiled peak can still put a plan the planner fills to
# the last GiB over it: random MoE jobs under Zorse, 78.5 GiB estimated, 82.6 GiB compiled on an
# 80 GB A100, failed `hetc plan` outright.)
# Lowering and verifying costs about 0.3 ms of CPU per compute op of one lane (a microbatch through a
# ministage); above CHECK_OPS of them (specs/zorse/c_auto.het: 14k, 4 s) the check would take longer than
# the search itself, and the agreement test and benchmark (benchmarks/plan_agreement.py) check such plans.
# Where nobody keeps the program (`hetc plan`), a plan whose lane positions copy each other is checked on
# its ranks at lane position 0 (Note [checking one lane position] in passes/verify/positions.py, the same
# check): at 2048 GPUs in lanes of 4, a quarter of the ranks. Where that check fails the full one runs, so
# the error names what it always named.
CHECK_OPS = 8192


class _Refused(InternalError):
    """The verifier refused the programs of a plan the cost model said fit (Note [the planner checks its winner]);
    `tight`: for memory, of a plan the estimate put above the planner's headroom (Note [planning headroom]),
    within what an estimate may miss; `finding`: the verifier's first."""

    def __init__(self, message: str, tight: bool = False, finding: str = "", chosen: Plan | None = None):
        super().__init__(message)
        self.tight, self.finding, self.chosen = tight and chosen is not None, finding, chosen


def _no_fit_once_compiled(search: Search, refused: _Refused) -> SpecError:
    """Every plan that fits only above the headroom compiled over a device (Note [planning headroom])."""
    assert refused.chosen is not None   # `tight` names the plan
    p = refused.chosen.pipeline
    schedule = ("" if search.space.fixed.schedule is not None else
                ", or write `schedule = 1f1b`, which keeps a microbatch fewer in flight than zb")  # DEFAULT_SCHEDULES
    return SpecError.at(search.job.parallel.span,
                        f"no plan fits in device memory once compiled: the closest ({len(p.stages)} stages, "
                        f"{p.schedule.value}, micro_batch {p.micro_batch}) fills more than {NEAR_CAPACITY:.0%} of a "
                        f"device by the planner's estimate, and its compiled programs need more than the device "
                        f"holds: {refused.finding}; add GPUs, or GPUs with more memory{schedule}")


def _checked_choice(search: Search, pool: list[tuple[Found, str]], scored: list[Baseline], base_dir: Path | None,
                    keep_program: bool) -> tuple[FinalChoice, Lowered | None]:
    """The choice on the printed step (Note [one number]) whose programs pass the winner's check, and those
    programs where they are kept. Where the winner is refused the planner says so and chooses again
    without it (Note [the planner checks its winner]); the first refusal is raised once no contender that
    fits is left."""
    refused: list[tuple[Found, str]] = []
    first: _Refused | None = None
    retimed: dict[tuple[object, ...], Printed | None] = {}
    while True:
        left = [c for c in pool if c not in refused]
        if first is not None and not any(found.score.fits for found, _ in left):
            raise _no_fit_once_compiled(search, first) if first.tight else first
        final = choose_printed(search, left, scored, base_dir, retimed)
        winner = final.chosen
        if search.aside == (winner.found.candidate, True):   # Note [the check beside the refinement]
            return final, None
        tight = not winner.found.score.fits_within(NEAR_CAPACITY)   # Note [planning headroom]
        try:
            return final, _check_winner(winner.plan, search.profiles, winner.name, keep_program, winner.simulated,
                                        tight)
        except _Refused as err:
            log.warning("%s\nhetc plan chooses again without that plan", err)
            first = first or err
            refused.append((winner.found, winner.name))


def _check_winner(plan: Plan, profiles: Profiles | None, chosen: str, keep_program: bool,
                  simulated: Simulated | None = None, tight: bool = False) -> Lowered | None:
    """Note [the planner checks its winner]; `simulated`: its programs as the planner ran them to print their step
    (Note [one number]), checked on that run. The programs, checked or not, where they are kept (`keep_program`)."""
    from hetc.passes.verify import VerifyError
    from hetc.passes.verify.positions import passes_by_position

    ran = None if simulated is None else Lowered(simulated.program, simulated.machine)
    if plan.pipeline.num_microbatches * len(plan.pipeline.ministages) > CHECK_OPS:
        return ran if keep_program else None     # `hetc compile` verifies them
    costs = CostModel(plan, profiles)
    if not keep_program and passes_by_position(plan, costs):
        return None
    try:   # what `hetc compile` runs, without the timeline and the per-rank report it writes beside
        program = build(plan, costs=costs, lowered=ran, simulated=False).program
    except VerifyError as err:
        memory = err.check == "memory"
        what = "does not fit in device memory" if memory else f"fails the {err.check} check"
        why = ("by the margin its estimate may miss, which it filled past the planner's headroom" if tight and memory
               else "though its cost model said it fits; this is a bug in hetc's cost model or lowering")
        raise _Refused(f"the plan hetc plan chose ({chosen}) {what} once compiled, {why}:\n" +
                       "\n".join(f"  {f}" for f in err.findings[:4]), tight and memory, str(err.findings[0]), plan
                       ) from None
    return Lowered(program, ran.ran if ran else None, verified=True) if keep_program else None


# Note [the check beside the refinement]: on large clusters the search's last step (CP-SAT and local search
# from the best structures) rarely changes the winner: on Sailor's 128-2048-GPU clusters of two and four
# kinds it kept the best configured plan every time. So while this process refines, the search's worker
# (Note [a forked worker]) runs the check of that plan, `_checks_out`, which emits and checks it as
# `plan_spec` does and runs `_check_winner`; where that plan is the one chosen and it passed, the planner
# does not check it again. Where another plan wins, or the check failed there, the planner runs the check
# itself, so what it prints, and every error, is what checking after choosing gives.


def _checks_out(search: Search, candidate: Candidate, base_dir: Path | None) -> bool:
    """Whether `candidate` passes the winner's check (Note [the check beside the refinement]); False where it
    fails, or anything else goes wrong, so that the planner checks it itself."""
    try:
        explicit = emit_spec(search.job, candidate, search.space.zero_base)
        _check_winner(check_spec(explicit, base_dir).plan(), search.profiles, "planner", keep_program=False)
    except Exception:   # noqa: BLE001 - the planner's own check runs and says what is wrong
        return False
    return True


def _cross_check(score: Score, estimate: Estimate | None) -> None:
    """The planner's class-by-class score and the rank-by-rank estimate are one composition over two
    readings of the plan (passes/cost/classes.py); say so loudly if they part."""
    if estimate is None:
        return
    closed = estimate.closed_form_step_s
    drift = abs(score.step_time_s - closed) / max(closed, 1e-30)
    if drift > 1e-6:
        log.warning("the planner scored this plan %.6g s/step but the cost model estimates %.6g s "
                    "(%.2g%% apart): passes/plan/candidate_stage.py reads the candidate otherwise than "
                    "passes/cost/pipeline_stage.py reads its pipeline", score.step_time_s, closed, 100 * drift)
