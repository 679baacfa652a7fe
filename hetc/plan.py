"""The plan: a checked spec with no `auto` left, the one value every back-end pass and the runtime take.

Validation makes it (`Checked.explicit()` in passes/validate.py) after resolving the spec's parallel block
into a pipeline on its cluster. Its blocks are the spec's own, typed as present, so code holding one
checks nothing; its rank geometry (each rank's place and groups, Note [rank geometry] in
hetc/geometry.py) is derived once, on first use.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetc.errors import InternalError
from hetc.geometry import Geometry
from hetc.memo import cached_property
from hetc.pipeline import Pipeline
from hetc.spec import Auto, ModelSpec, ParallelSpec, Spec, StageSpec, TrainSpec
from hetc.topology import Topology

__all__ = ["Plan"]


@dataclass(frozen=True)
class Plan:
    """A checked, resolved plan: the spec, its cluster's topology and the pipeline."""

    spec: Spec
    topology: Topology
    pipeline: Pipeline
    model: ModelSpec
    train: TrainSpec
    parallel: ParallelSpec
    stages: tuple[StageSpec, ...]    # the parallel block's; none while `auto` (the planner probing per-GPU times)

    @classmethod
    def of(cls, spec: Spec, topology: Topology, pipeline: Pipeline) -> Plan:
        """The plan of a spec validation resolved `pipeline` for (so its blocks are all there)."""
        if spec.model is None or spec.train is None or spec.parallel is None:
            raise InternalError("a resolved pipeline without a model, train or parallel block")
        stages = () if isinstance(spec.parallel.stages, Auto) else spec.parallel.stages
        return cls(spec, topology, pipeline, spec.model, spec.train, spec.parallel, stages)

    @cached_property
    def geometry(self) -> Geometry:
        return Geometry(self.pipeline, self.model)
