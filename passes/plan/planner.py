"""`plan_spec`: fill every `auto` of a spec's parallel plan and say what the plan costs.

The search (`search.Search`) proposes plans; the baselines (`baselines`)
are scored beside them and one that beats the search's best, and agrees
with what the spec fixes, is chosen instead. The chosen plan is written
back into the Spec (`emit`), validated, and estimated by the cost model
itself (`CostModel.estimate()`) up to `FULL_ESTIMATE_RANKS` ranks; beyond
that the planner's class-by-class score, the same composition, is reported.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetc.errors import InternalError, SpecError
from hetc.gc_pause import paused_collector
from hetc.passes.cost import CostModel, Estimate, Profiles
from hetc.passes.plan.baselines import Baseline
from hetc.passes.plan.candidate import Candidate
from hetc.passes.plan.deadline import DEFAULT_TIME_LIMIT_S, SCREEN_SHARE, Deadline
from hetc.passes.plan.emit import emit_spec
from hetc.passes.plan.idle import IdleReason, idle_reasons
from hetc.passes.cost.candidate_score import Score
from hetc.passes.plan.infeasible import no_plan_error
from hetc.passes.plan.objective import Goal
from hetc.passes.plan.search import Found, Search, SearchLimits
from hetc.passes.plan.space import space_from_spec
from hetc.passes.plan.would_fit import would_fit
from hetc.passes.resolve import plan_has_auto as needs_plan   # one rule for what is left to plan
from hetc.passes.simulated_step import simulated_estimate
from hetc.passes.validate import Checked, check_spec
from hetc.program import Program
from hetc.spec import Spec

__all__ = ["FULL_ESTIMATE_RANKS", "PlanResult", "needs_plan", "plan_checked", "plan_spec"]

log = logging.getLogger(__name__)

# Above this many ranks the full estimate takes most of a second (it looks up measured network fits
# pair by pair); the planner's own score, the same composition class by class (passes/cost/classes.py),
# stands in.
FULL_ESTIMATE_RANKS = 1024


@dataclass(frozen=True)
class PlanResult:
    spec: Spec                         # the explicit spec
    checked: Checked                   # ... validated and resolved
    goal: Goal
    score: Score | None                # the planner's score of the plan (None: nothing was planned)
    estimate: Estimate | None          # the cost model's estimate (None above FULL_ESTIMATE_RANKS)
    candidate: Candidate | None = None
    baselines: tuple[Baseline, ...] = ()
    chosen: str = "planner"            # or the name of the baseline that won
    seconds: float = 0.0
    structures: int = 0
    # the winner as Note [the planner checks its winner] lowered and verified it (with the `profiles` the
    # plan was made with), for whoever builds the plan next; None where it was not checked, or checked by
    # lane position (no `keep_program`)
    program: Program | None = None
    # what the time limit left unsearched, where the search met it (Note [an anytime search])
    time_limit_note: str | None = None
    idle: tuple[IdleReason, ...] = ()  # why each node group the plan leaves idle is idle (passes/plan/idle.py)

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

    `keep_program`: check the winner on every rank's program and return it (`PlanResult.program`, which
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
    assert spec.parallel is not None   # check_spec refuses a spec that is not complete
    goal = Goal.of(spec.parallel.objective)
    if not needs_plan(spec):  # nothing searched: the cost model's estimate at any size
        return PlanResult(spec, checked, goal, None, _estimate(checked, profiles, always=True))
    start = time.perf_counter()
    topo = checked.topology
    assert topo is not None   # a complete spec has a cluster
    search = Search(spec, topo, profiles, space_from_spec(spec, topo, **space_overrides), goal, limits, deadline)
    found = search.run(progress, aside=None if keep_program else (_checks_out, base_dir))
    scored = search.baselines()
    best, chosen = _choose(search, found, scored)
    note = _time_limit_note(search, found)
    if note is not None and (best is None or not goal.admits(best.score)):   # Note [an anytime search]
        raise SpecError.at(spec.parallel.span, f"no plan found within the planner's time limit: {note}; "
                                               "allow it more time (--time-limit S)")
    if best is None or not goal.admits(best.score):
        raise no_plan_error(search, found, scored,
                            lambda: would_fit(spec, topo, profiles, search.space, goal, deadline))
    explicit = emit_spec(spec, best.candidate, topo, search.space.zero_base)
    planned = check_spec(explicit, base_dir)
    checked_aside = search.aside == (best.candidate, True)   # Note [the check beside the refinement]
    program = None if checked_aside else _check_winner(planned, profiles, chosen, keep_program)
    estimate = _estimate(planned, profiles, program=program)   # simulated on the checked programs if kept
    _cross_check(best.score, estimate)
    idle = idle_reasons(search, found, scored, best, written=search.space.fixed.idle is not None)
    return PlanResult(explicit, planned, goal, best.score, estimate, best.candidate, tuple(scored), chosen,
                      time.perf_counter() - start, search.visited, program, note, idle)


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


def _choose(search: Search, found: list[Found], scored: list[Baseline]) -> tuple[Found | None, str]:
    """The search's best, unless a baseline the spec allows does better."""
    pool = [(f, "planner") for f in found[:1]]
    pool += [(Found(b.candidate, b.score, None), b.name) for b in scored
             if b.candidate is not None and b.score is not None and search.space.fixed.admits(b.candidate)]
    if not pool:
        return None, "planner"
    # on a tie the search's own plan stays (it comes first)
    best, name = min(pool, key=lambda fn: (search.rank(fn[0])[:3], fn[1] != "planner"))
    return best, name


def _estimate(checked: Checked, profiles: Profiles | None, always: bool = False,
              program: Program | None = None) -> Estimate | None:
    """The cost model's estimate, with the compiled programs' simulated step where they are quick to build,
    as explain prints it (Note [one step time] in passes/simulated_step.py); `program`: those programs, if
    the winner's check kept them."""
    p = checked.pipeline
    if p is None or (p.world_size > FULL_ESTIMATE_RANKS and not always):
        return None
    assert checked.topology is not None   # a pipeline runs on a cluster
    costs = CostModel(checked.spec, p, checked.topology, profiles)
    return simulated_estimate(checked.spec, costs, costs.estimate(), program)


# Note [the planner checks its winner]: the chosen plan is lowered and verified (deadlock-freedom,
# dataflow, every rank's memory against its device) before it is printed, so `hetc plan` never prints a
# plan that `hetc compile` refuses. A refusal is the cost model and the compiled program disagreeing,
# a bug in hetc, not the user's: it is an InternalError naming the plan and the verifier's finding.
# Lowering and verifying costs about 0.3 ms of CPU per compute op of one lane (a microbatch through a
# ministage); above CHECK_OPS of them (specs/zorse/c_auto.het: 14k, 4 s) the check would take longer than
# the search itself, and the agreement test and benchmark (benchmarks/plan_agreement.py) check such plans.
# Where nobody keeps the program (`hetc plan`), a plan whose lane positions copy each other is checked on
# its ranks at lane position 0 (Note [checking one lane position] in passes/verify/positions.py, the same
# check): at 2048 GPUs in lanes of 4, a quarter of the ranks. Where that check fails the full one runs, so
# the error names what it always named.
CHECK_OPS = 8192


def _check_winner(checked: Checked, profiles: Profiles | None, chosen: str, keep_program: bool) -> Program | None:
    from hetc.passes.build import build
    from hetc.passes.verify import VerifyError
    from hetc.passes.verify.positions import passes_by_position

    plan = checked.explicit()
    if plan is None or plan.pipeline.num_microbatches * len(plan.pipeline.ministages) > CHECK_OPS:
        return None
    costs = CostModel(plan.spec, plan.pipeline, plan.topology, profiles)
    if not keep_program and passes_by_position(plan.spec, plan.pipeline, costs):
        return None
    try:   # what `hetc compile` runs, without the timeline and the per-rank report it writes beside
        program = build(plan, costs=costs, simulated=False).program
    except VerifyError as err:
        what = "does not fit in device memory" if err.check == "memory" else f"fails the {err.check} check"
        raise InternalError(f"the plan hetc plan chose ({chosen}) {what} once compiled, though its cost model "
                            f"said it fits; this is a bug in hetc's cost model or lowering:\n" +
                            "\n".join(f"  {f}" for f in err.findings[:4])
                            ) from None
    return program


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
        explicit = emit_spec(search.spec, candidate, search.topo, search.space.zero_base)
        _check_winner(check_spec(explicit, base_dir), search.profiles, "planner", keep_program=False)
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
                    "(%.2g%% apart): passes/cost/candidate_stage.py reads the candidate otherwise than "
                    "passes/cost/pipeline_stage.py reads its pipeline", score.step_time_s, closed, 100 * drift)
