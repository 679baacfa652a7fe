"""What `hetc plan` and `hetc explain` promise is what `hetc compile` builds (issue 11, Done-when 1).

For 100 random heterogeneous jobs (tests/random_jobs.py) and every spec
under specs/: the planner either prints a plan or says, located, that
nothing fits; the plan compiles and verifies (deadlock, dataflow, memory);
explain's step time is within 10 % of the compiled program's simulated
step; every rank's memory by explain is within 10 % of the compiled
program's peak, both ways; and so are the planner's own class-by-class
score of the plan (`hetc plan`'s step time and memory). The planner searches narrowly here (the
agreement of what it prints is under test, not how well it searches), so
the family stays within a minute or two of CPU.

Known residual gaps are strict xfails, by cause (`GAPS`): when a fix
closes one, its seed passes and the xfail fails, so the list only shrinks.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from hetc.passes.agreement import Agreement, build, compare
from hetc.errors import SpecError
from hetc.frontend.load import load_spec
from hetc.passes.plan.planner import PlanResult, plan_spec
from hetc.passes.plan.structures import SearchLimits
from tests.conftest import all_spec_files
from tests.random_jobs import random_job

TOLERANCE = 0.10
JOBS = 100
NARROW = SearchLimits(exhaustive=0, quick_layouts=8, layouts=2, structures=3, refine=1, local_evaluations=4,
                      exact_screen=False, window=2, cpsat_work=0.1)

# Causes of the gaps that remain, each measured on the seeds or specs listed with it (docs/costmodel.md,
# "Known limits"). When a fix closes one, its xfail fails: drop the entry.
FALLBACK_ORDER = ("uneven lanes (1 -> 2 -> 1 ...): with this many-to-many routing the strict 1F1B/ZB order waits "
                  "on itself, so lowering falls back to 'a ready op first' orders (Note [schedules by "
                  "simulation]), whose lanes idle beyond the estimate's fill and drain")
FILL_BOUND = ("8 microbatches over 4 stages with a stage of 8 one-microbatch lanes: the step is mostly fill and "
              "drain through the slow fan-out stage; the estimate, held to the lower bound, still misses its "
              "input-gradient backwards queued behind the bottleneck")
INTERLEAVED_LOCKSTEP = ("interleaved 1F1B with ZeRO-3 lockstep stages of uneven widths: its in-flight limit is "
                        "Megatron's fixed warm-up, not the timed one (Note [in-flight limit]), and the lockstep "
                        "slots wait for each other beyond the estimate's fill")
GAPS: dict[int, str] = {15: FALLBACK_ORDER, 56: FALLBACK_ORDER, 48: FILL_BOUND,
                        39: INTERLEAVED_LOCKSTEP, 81: INTERLEAVED_LOCKSTEP}


def _planned(path: Path, limits: SearchLimits | None) -> tuple[PlanResult, Agreement] | None:
    """The plan and its compiled program beside its estimate; None when nothing fits (said with a
    location)."""
    loaded = load_spec(path)
    try:
        result = plan_spec(loaded.spec, None, loaded.path.parent, limits=limits)
    except SpecError as err:
        message = err.diagnostics[0].message
        assert err.diagnostics[0].span.file, f"the 'nothing fits' error has no location: {message}"
        return None
    return result, compare(build(result.checked))


def _agreement(path: Path, limits: SearchLimits | None) -> Agreement | None:
    """The planned program beside its estimate; None when nothing fits (said with a location)."""
    got = _planned(path, limits)
    return None if got is None else got[1]


def _outcome(path: Path, limits: SearchLimits | None) -> str | None:
    """None when the plan (explain's estimate and the planner's own score) agrees with its compiled
    program, else what does not."""
    got = _planned(path, limits)
    if got is None:
        return None
    result, agreement = got
    problems = [] if agreement.within(TOLERANCE) else [agreement.describe()]
    if result.score is not None:
        problems += _score_problems(result, agreement)
    return "; ".join(problems) or None


def _score_problems(result: PlanResult, agreement: Agreement) -> list[str]:
    """The planner's own class-by-class score held to the compiled program, as explain's estimate is."""
    score, out = result.score, []
    assert score is not None
    gap = score.step_time_s / agreement.simulated_s - 1
    if abs(gap) > TOLERANCE:
        out.append(f"step: plan {score.step_time_s:.4g} s vs compiled {agreement.simulated_s:.4g} s "
                   f"({100 * gap:+.1f}%)")
    rank_of = {g.id: r for r, g in enumerate(result.checked.pipeline.world)}
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
def test_random_job_plans_compile_and_agree(seed, tmp_path):
    path = tmp_path / f"job{seed}.het"
    path.write_text(random_job(random.Random(seed), max_gpus=8))
    problem = _outcome(path, NARROW)
    assert problem is None, f"{path.read_text()}\n{problem}"


SPECS = [p for p in all_spec_files()
         if p.name not in ("job.het", "moe_job.het", "catalog.het") and "cluster" not in p.name]
ASYNC_SENDS = ("latency-bound borders on CPU (gloo's loopback latency, 0.5 ms a transfer, against 0.2-0.5 ms "
               "of compute): hetc's sends are asynchronous and overlap the next microbatch's compute, the "
               "estimate counts border transfers as blocking (Megatron's behaviour, which Sailor's measured "
               "runs validate)")
SPEC_GAPS: dict[str, str] = {
    "demo/gpipe.het": ASYNC_SENDS, "demo/hetero_tp.het": ASYNC_SENDS, "demo/tp_to_cp.het": ASYNC_SENDS,
    "examples/sailor_multizone.het": (
        "the step's tail: the estimate exposes stage 0's ZeRO-1 gradient all-reduce over the cross-zone ring "
        "whole after its last backward (7.7 s); the compiled timeline ends 4.8 s sooner, not yet explained"),
    "zorse/c_auto.het": (
        "many-to-many routing over stages of 8, 16, 20 and 24 lanes: each stage of the compiled ZB pipeline "
        "is busy 27-34 s of 77 s (the estimate: 36.7 s), its lanes waiting for inputs that arrive staggered "
        "from several upstream lanes; the estimate assumes lanes that flow freely"),
}


def _specs() -> list:
    out = []
    for path in SPECS:
        name = path.relative_to(path.parents[1]).as_posix()
        reason = SPEC_GAPS.get(name)
        out.append(pytest.param(path, id=name,
                                marks=[pytest.mark.xfail(strict=True, reason=reason)] if reason else []))
    return out


@pytest.mark.parametrize("path", _specs())
def test_every_spec_compiles_and_agrees(path):
    problem = _outcome(path, None)
    assert problem is None, problem


# A known gap is still bounded: the explicit plans among them keep their step within a wider band, so a
# regression inside a listed gap does not go unseen while its xfail waits for the fix.
WIDER = 0.20
EXPLICIT_GAPS = ["demo/gpipe.het", "demo/hetero_tp.het", "demo/tp_to_cp.het", "examples/sailor_multizone.het"]


@pytest.mark.parametrize("name", EXPLICIT_GAPS)
def test_a_known_gap_keeps_the_step_within_the_wider_band(name):
    assert name in SPEC_GAPS, f"{name} agrees now: drop it here"
    agreement = _agreement(Path(__file__).parents[1] / "specs" / name, None)
    assert agreement is not None and abs(agreement.step_gap) <= WIDER, agreement and agreement.describe()
