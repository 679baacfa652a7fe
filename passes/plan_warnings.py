"""Warnings on a plan that is valid and runs, but not as its author most likely meant: located at the spec,
printed by `hetc check`, `explain` and `compile` on stderr, and never an exit status of their own.

Note [contiguous chunks]: interleaved 1F1B shortens the pipeline's fill
because its chunks loop: Megatron's virtual stages give stage s the layers
of chunks s, s + p, s + 2p, ..., so a microbatch comes back to each stage
v times and the first microbatch reaches the last stage after p − 1 chunks,
not p − 1 stages. A plan whose every stage holds consecutive layers
(`ministages = k` over one range, or ranges that follow one another) has no
loop: no microbatch comes back, and a stage of k chunks runs each for its
whole group before the next (Note [chunks after a stage] in
passes/cost/memory.py), so its first microbatch leaves the stage later than
under 1F1B. The random chunk plan of tests/test_random_plans_train.py (seed
7: stages of 1, 3 and 2 chunks) compiles to 16.4 ms a step as interleaved
1F1B and 14.1 ms as 1F1B. Uneven lanes can still order a step's ops a
little better one way or the other (tests/specs/interleaved_hetero.het,
two tp-2 lanes feeding four of 3-5 microbatches: 3.00 ms interleaved,
3.05 ms as 1F1B), so this is a warning, not an error.
"""

from __future__ import annotations

from hetc.ir.errors import Diagnostic
from hetc.ir.plan import Plan
from hetc.ir.spec import ScheduleKind
from hetc.passes.validate_runtime import check_loss_scaling

__all__ = ["plan_warnings"]


def plan_warnings(plan: Plan) -> list[Diagnostic]:
    """What `plan` runs that its spec most likely did not mean (module docstring), and what `hetc run` will
    refuse of a plan the cost model times (fp16 without clipping: passes/validate_runtime.py)."""
    found = [_chunks_that_never_loop(plan)]
    if (problem := check_loss_scaling(plan.model, plan.train)) is not None:
        found.append(Diagnostic(plan.model.span_of("dtype"), f"{problem}; `hetc run` refuses this plan until then",
                                severity="warning"))
    return [d for d in found if d is not None]


def _chunks_that_never_loop(plan: Plan) -> Diagnostic | None:
    pipeline = plan.pipeline
    if pipeline.schedule is not ScheduleKind.INTERLEAVED or pipeline.revisits_stages or len(pipeline.stages) < 2:
        return None   # one stage has no fill to shrink
    return Diagnostic(plan.parallel.span_of("schedule"), "interleaved 1F1B over chunks that never loop: every "
                       "stage holds consecutive layers, so no microbatch comes back to a stage and the chunks do not "
                       "shrink the pipeline's fill; loop each stage's ranges over the stages, "
                       "as Megatron's virtual stages do (`layers = [block0, block2]`), or use `schedule = 1f1b`", severity="warning")
