"""The plan: a checked spec with no `auto` left, the one value every back-end pass and the runtime take;
and the job: a checked whole spec whose plan may still say `auto`, what the planner searches.

Validation makes both (`Checked.explicit()` and `Checked.job()` in passes/validate.py), the plan after
resolving the spec's parallel block into a pipeline on its cluster. Their blocks are the spec's own,
typed as present, so code holding one checks nothing; a plan's rank geometry (each rank's place and
groups, Note [rank geometry] in hetc/ir/geometry.py) is derived once, on first use.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hetc.ir.geometry import Geometry
from hetc.ir.memo import cached_property
from hetc.ir.pipeline import Pipeline
from hetc.ir.spec import ClusterSpec, ModelSpec, ParallelSpec, Spec, TrainSpec
from hetc.ir.topology import Topology

__all__ = ["Job", "Plan"]


@dataclass(frozen=True)
class Job:
    """A checked whole spec (model, cluster, train and parallel blocks), its plan perhaps still `auto`."""

    spec: Spec
    topology: Topology
    model: ModelSpec
    train: TrainSpec
    parallel: ParallelSpec
    cluster: ClusterSpec

    @classmethod
    def of(cls, spec: Spec, topology: Topology) -> Job | None:
        """The job of a checked spec on its cluster's `topology`; None for a part of a spec (a catalog)."""
        if spec.model is None or spec.train is None or spec.parallel is None or spec.cluster is None:
            return None
        return cls(spec, topology, spec.model, spec.train, spec.parallel, spec.cluster)

    def with_model(self, model: ModelSpec) -> Job:
        """The job with another model block (a stronger activation checkpointing, say)."""
        return replace(self, spec=replace(self.spec, model=model), model=model)

    def plan(self, pipeline: Pipeline) -> Plan:
        """The job with its parallel block resolved into `pipeline` (by validation; or a probe of per-GPU times
        by the planner, on a pipeline of every GPU and no stage)."""
        return Plan(self.spec, self.topology, self.model, self.train, self.parallel, self.cluster, pipeline)


@dataclass(frozen=True)
class Plan(Job):
    """A checked, resolved plan: the job and its pipeline."""

    pipeline: Pipeline

    @cached_property
    def geometry(self) -> Geometry:
        return Geometry(self.pipeline, self.model)
