"""What `hetc plan` and `hetc explain` promise is what `hetc compile` builds (issue 11, Done-when 1).

For 100 random heterogeneous jobs (tests/random_jobs.py), a few deep TP
pipelines of many microbatches (`deep_job`) and every spec under specs/: the planner either prints a plan or says, located, that
nothing fits; the plan compiles and verifies (deadlock, dataflow, memory);
explain's step time is within 10 % of the compiled program's simulated
step; every rank's memory by explain is within 10 % of the compiled
program's peak, both ways; and so are the planner's own class-by-class
score of the plan (`hetc plan`'s step time and memory). The plans are
built once per session (tests/planned.py) and shared with
tests/test_step_bound.py.

Known residual gaps are strict xfails, by cause (`GAPS`): when a fix
closes one, its seed passes and the xfail fails, so the list only shrinks.
"""

from __future__ import annotations

import pytest

from hetc.passes.agreement import Agreement, compare
from hetc.passes.plan.planner import PlanResult
from hetc.passes.verify import Backend, plan_backend, verify
from tests.planned import DEEP_JOBS, JOBS, LLAMA_JOBS, SPECS, Planned, spec_name
from tests.plans import TEST_SPECS
from tests.test_check_positions import assert_copies_position_0

TOLERANCE = 0.10

# Causes of the gaps that remain, each measured on the seeds or specs listed with it (docs/costmodel.md,
# "Known limits"). When a fix closes one, its xfail fails: drop the entry.
GAPS: dict[int, str] = {}


def _outcome(got: Planned | None) -> str | None:
    """None when the plan (explain's estimate and the planner's own score) agrees with its compiled
    program, or nothing fits; else what does not."""
    if got is None:
        return None
    agreement = compare(got.built)
    problems = [] if agreement.within(TOLERANCE) else [agreement.describe()]
    if got.result.score is not None:
        problems += _score_problems(got.result, agreement)
    return "; ".join(problems) or None


def _score_problems(result: PlanResult, agreement: Agreement) -> list[str]:
    """The planner's own class-by-class score held to the compiled program, as explain's estimate is."""
    score, out = result.score, []
    assert score is not None
    gap = score.step_time_s / agreement.simulated_s - 1
    if abs(gap) > TOLERANCE:
        out.append(f"step: plan {score.step_time_s:.4g} s vs compiled {agreement.simulated_s:.4g} s "
                   f"({100 * gap:+.1f}%)")
    rank_of = {g.id: r for r, g in enumerate(result.plan.pipeline.world)}
    for mem, gpus in zip(score.memory, score.classes, strict=True):
        for gpu in gpus:
            peak = agreement.peaks[rank_of[gpu]]
            if abs(mem.total / peak - 1) > TOLERANCE:
                out.append(f"memory: rank {rank_of[gpu]} plan {mem.total / 2**30:.2f} GiB vs compiled "
                           f"{peak / 2**30:.2f} GiB")
                break
    return out


def _jobs() -> list:
    out = []
    for seed in range(JOBS):
        reason = GAPS.get(seed)
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        out.append(pytest.param(seed, marks=marks, id=f"job{seed}"))
    return out


@pytest.mark.parametrize("seed", _jobs())
def test_random_job_plans_compile_and_agree(seed, plan_cache):
    got = plan_cache.job(seed)
    problem = _outcome(got)
    assert problem is None, f"{got and got.path.read_text()}\n{problem}"


# Deep TP pipelines of many microbatches (tests/random_jobs.py `deep_job`; issue 32, 2), measured as above
DEEP_GAPS: dict[int, str] = {}


def _deep() -> list:
    return [pytest.param(seed, id=f"deep{seed}",
                         marks=[pytest.mark.xfail(strict=True, reason=DEEP_GAPS[seed])] if seed in DEEP_GAPS else [])
            for seed in range(DEEP_JOBS)]


@pytest.mark.parametrize("seed", _deep())
def test_deep_tp_pipelines_compile_and_agree(seed, plan_cache):
    """4-16 stages, 32-256 microbatches a lane, tp 2-8 (the shapes of Sailor's measured runs): explain's closed
    form and memory against the compiled programs, as for the random jobs."""
    got = plan_cache.deep(seed)
    problem = _outcome(got)
    assert problem is None, f"{got and got.path.read_text()}\n{problem}"


@pytest.mark.parametrize("name", sorted(LLAMA_JOBS))
def test_three_kind_two_region_llama_jobs_compile_and_agree(name, plan_cache):
    """Llama-3-8B and 70B on H100 + A100-40 + L4 in two regions, planned on all three kinds: explain's step and
    every rank's memory against the compiled programs, as for the random jobs (issue 32: the memory parted by
    30 % on such a job once)."""
    got = plan_cache.llama(name)
    assert got is not None, "nothing fits"
    kinds = {g.device.name for g in got.result.plan.pipeline.world}
    assert kinds == {"H100", "A100-40", "L4"}, kinds
    problem = _outcome(got)
    assert problem is None, problem


SPEC_GAPS: dict[str, str] = {}


def _specs() -> list:
    out = []
    for path in SPECS:
        name = spec_name(path)
        reason = SPEC_GAPS.get(name)
        out.append(pytest.param(path, id=name,
                                marks=[pytest.mark.xfail(strict=True, reason=reason)] if reason else []))
    return out


@pytest.mark.parametrize("path", _specs())
def test_every_spec_compiles_and_agrees(path, plan_cache):
    got = plan_cache.spec(path)
    problem = _outcome(got)
    assert problem is None, problem
    # CPU plans too: what a GPU cluster runs must be what the CPU suite proves (a GPU plan's build proved it)
    if got is not None and plan_backend(got.built.plan.pipeline) is not Backend.NCCL:
        verify(got.built.program, got.built.plan, backend=Backend.NCCL)



def test_a_zorse_plan_stepping_and_keeping_its_parameters_on_the_host_agrees(plan_cache):
    """Zorse's interleaved update with ZeRO-2 and the optimizer and parameters on the host: the host's Adam
    steps on the rank's thread (the closed form counted it beside the compute: 2.98 s of a compiled 7.87 s),
    and the parameters of the ministages whose updates overlap the backward stay (Note [regathers of
    offloaded parameters] in passes/lower/zero.py: the estimate was -38.8 % of the compiled peak)."""
    got = plan_cache.spec(TEST_SPECS / "zorse_host_step.het")
    assert got is not None, "the plan fits"
    problem = _outcome(got)
    assert problem is None, problem


def test_plans_of_copied_lane_positions_are_checked_as_in_full(plan_cache):
    """Where a planned program's lane positions copy position 0, it is those copies and the check of position 0
    (what `hetc plan` runs, Note [checking one lane position]) passes it as `verify` did
    (tests/test_check_positions.py)."""
    planned = [plan_cache.job(seed) for seed in range(JOBS)] + [plan_cache.spec(path) for path in SPECS]
    built = [got.built for got in planned if got is not None]
    copied = [b for b in built if assert_copies_position_0(b.program, b.plan, b.costs)]
    assert copied
