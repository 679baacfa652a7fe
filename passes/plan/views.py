"""A candidate as the cost model reads it: `view_of` resolves it as `resolve` would.

The view types (`PlanView`, `StageView`, `ResolvedStage`) are the cost
model's (passes/plan/candidate_view.py); this module only translates the
planner's `Candidate` into them. `Resolver` resolves each `StageGpus` once
per planning run, so that building views for many candidates is cheap.
"""

from __future__ import annotations

from hetc.passes.plan.candidate_view import PlanView, ResolvedStage, StageView
from hetc.passes.plan.candidate import Candidate, StageGpus
from hetc.ir.spec import ZeroSpec
from hetc.ir.topology import Topology

__all__ = ["Resolver", "view_of"]


class Resolver:
    """Resolves `StageGpus` once per planning run."""

    def __init__(self, topo: Topology):
        self.topo = topo
        self._cache: dict[StageGpus, ResolvedStage] = {}

    def __call__(self, stage: StageGpus) -> ResolvedStage:
        got = self._cache.get(stage)
        if got is None:
            gpus = tuple(g for block in stage.blocks for g in block.gpus(self.topo))
            got = self._cache[stage] = ResolvedStage(gpus, stage.tp)
        return got


def view_of(c: Candidate, resolve: Resolver, zero_specs: tuple[ZeroSpec, ...]) -> PlanView:
    """Resolve `c`: its stages' GPUs in rank order and its ministages in model order."""
    chunks = sorted((first, stop, s) for s, ranges in enumerate(c.ranges) for first, stop in ranges)
    own: dict[int, list[int]] = {}
    for idx, (_, _, s) in enumerate(chunks):
        own.setdefault(s, []).append(idx)
    stages = tuple(StageView(s, resolve(st), c.knobs[s], zero_specs[s], tuple(own.get(s, ())), c.counts[s])
                   for s, st in enumerate(c.stages))
    return PlanView(stages, tuple(chunks), c.schedule, c.prefetch, c.micro_batch)
