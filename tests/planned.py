"""The agreement family and specs/, planned and built once per test session.

tests/test_plan_agreement.py (the estimate against the compiled program) and
tests/test_step_bound.py (the compiled program against its lower bound)
read the same plans: `PlanCache` plans a random job (tests/random_jobs.py,
small clusters), a deep pipeline (`deep_job`, planned already) or a spec
under specs/ once, lowers, verifies and
simulates it (`hetc.passes.agreement.build`) and keeps the result for the other
module. The job specs are written under the session's pytest tmp dir.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from hetc.passes.agreement import Built, build
from hetc.ir.errors import NO_SPAN, SpecError
from hetc.frontend.load import load_spec
from hetc.passes.plan.planner import PlanResult, plan_spec
from hetc.passes.plan.structures import SearchLimits
from hetc.passes.plan.would_fit import QUICK
from tests.conftest import all_spec_files
from tests.llama_jobs import llama_two_regions
from tests.random_jobs import deep_job, random_job

__all__ = ["DEEP_JOBS", "JOBS", "LLAMA_JOBS", "NARROW", "SPECS", "PlanCache", "Planned", "spec_name"]

JOBS = 100
# deep TP pipelines of many microbatches (issue 32, 2): a few, each built in seconds
DEEP_JOBS = 14
# Llama-3 on H100 + A100-40 in one region and L4 in another (issue 32: explain's memory against the compiled peak
# on realistic three-kind jobs), each planned on all three kinds: 8B on 2 + 2 + 4 GPUs (three stages, one a kind);
# 70B with activation checkpointing searched on 8 + 4 + 96 (108 ranks: 16-lane L4 stages before H100 and A100).
LLAMA_JOBS = {
    "llama8b_2_2_4": llama_two_regions("8b", 2, 2, 4, 64),
    # bf16 gradients, as 70B trained on these kinds must: with fp32 ones (the default), no layout the narrow
    # search looks at fits an L4 or an A100-40, and the plan runs on the H100s alone
    "llama70b_8_4_96": llama_two_regions("70b", 8, 4, 96, 192, activation_checkpoint="auto", grad_dtype="bf16"),
}
# The planner searches narrowly here (the agreement of what it prints is under test, not how well it searches),
# so the family stays within a minute or two of CPU.
NARROW = QUICK   # the look `hetc plan` takes when nothing fits (passes/plan/would_fit.py)
SPECS = [p for p in all_spec_files()
         if p.name not in ("job.het", "moe_job.het", "tied_job.het", "catalog.het") and "cluster" not in p.name]


def spec_name(path: Path) -> str:
    """`demo/gpipe.het` for specs/demo/gpipe.het."""
    return path.relative_to(path.parents[1]).as_posix()


@dataclass(frozen=True)
class Planned:
    path: Path
    result: PlanResult
    built: Built


class PlanCache:
    """Plans built once per session; None where nothing fits (the error's location is checked)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._jobs: dict[int, Planned | None] = {}
        self._deep: dict[int, Planned | None] = {}
        self._specs: dict[Path, Planned | None] = {}
        self._llama: dict[str, Planned | None] = {}

    def job(self, seed: int) -> Planned | None:
        if seed not in self._jobs:
            path = self.folder / f"job{seed}.het"
            path.write_text(random_job(random.Random(seed), max_gpus=8))
            self._jobs[seed] = _planned(path, NARROW)
        return self._jobs[seed]

    def deep(self, seed: int) -> Planned | None:
        if seed not in self._deep:
            path = self.folder / f"deep{seed}.het"
            path.write_text(deep_job(random.Random(seed)))
            self._deep[seed] = _planned(path, None)
        return self._deep[seed]

    def llama(self, name: str) -> Planned | None:
        if name not in self._llama:
            path = self.folder / f"{name}.het"
            path.write_text(LLAMA_JOBS[name])
            self._llama[name] = _planned(path, None)
        return self._llama[name]

    def spec(self, path: Path) -> Planned | None:
        if path not in self._specs:
            self._specs[path] = _planned(path, None)
        return self._specs[path]


def _planned(path: Path, limits: SearchLimits | None) -> Planned | None:
    loaded = load_spec(path)
    try:
        result = plan_spec(loaded.spec, None, loaded.path.parent, limits=limits, keep_program=True)
    except SpecError as err:
        message = err.diagnostics[0].message
        # located in the spec: not a plan the planner wrote out and the validator refused (<generated>)
        assert err.diagnostics[0].span.file not in ("", NO_SPAN.file), f"not a located 'nothing fits': {message}"
        return None
    return Planned(path, result, build(result.plan, lowered=result.lowered))
