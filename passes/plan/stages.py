"""Written stage blocks: what each fixes, and what its `auto` fields leave to the planner.

A spec may write its stages and leave some of their fields `auto`:
`layers`, `ranks`, `lanes`, `tp`, `ministages`, `microbatches`,
`activation_checkpoint`, or a stage's `zero { level = auto }`. The planner keeps everything written — the
number of stages, their names and order, their GPUs, their layer ranges,
their routing — and chooses the rest. Either every stage writes its `ranks`
(the layout is fixed) or none does (the planner picks layouts with that
many stages). Context parallelism is not planned: `cp` must be 1 or `auto`.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetc.ir.errors import Diagnostic, SpecError
from hetc.passes.plan.candidate import GpuBlock, Offload, StageGpus
from hetc.passes.resolve import layer_index, proportional_counts
from hetc.ir.spec import AUTO, Auto, Checkpointing, DType, ModelSpec, RankSlice, Routing, RoutingKind, StageSpec
from hetc.ir.topology import Gpu, Topology
from hetc.ir.plan import Job

__all__ = ["StageRule", "stage_rules", "written_counts"]


@dataclass(frozen=True)
class StageRule:
    """One written stage: None where the planner chooses."""

    name: str
    gpus: StageGpus | None
    layers: int | None
    tp: int | None
    ministages: int | None
    zero: int | None
    offload: Offload | None
    routing: Routing | None
    checkpoint: Checkpointing | Auto | None = None   # the stage's own key (None: the model's, the space's)


def stage_rules(job: Job) -> tuple[StageRule, ...]:
    """The rules of the job's written stages."""
    stages = job.parallel.resolved_stages
    rules = tuple(_rule(job, st) for st in stages)
    with_ranks = [r for r in rules if r.gpus is not None]
    if with_ranks and len(with_ranks) != len(rules):
        st = next(s for s, r in zip(stages, rules) if r.gpus is None)
        raise SpecError([Diagnostic(st.span, f"stage '{st.name}' leaves its ranks to the planner but other "
                                    "stages write theirs; write every stage's ranks, or none")])
    return rules


def _rule(job: Job, st: StageSpec) -> StageRule:
    if st.cp is not AUTO and st.cp != 1:
        raise SpecError([Diagnostic(st.span_of("cp"), f"stage '{st.name}' fixes cp = {st.cp}; the planner "
                                    "plans cp = 1: plan without context parallelism, or write the whole "
                                    "stage")])
    tp = None if st.tp is AUTO else st.tp
    gpus = None
    if st.ranks is not AUTO:
        blocks = tuple(_block(job.topology, r) for r in st.ranks)
        size = sum(b.size for b in blocks)
        if tp is None and st.lanes is not AUTO and size % st.lanes == 0:
            tp = size // st.lanes
        gpus = StageGpus(blocks, tp or 1)
    zero = None
    if st.zero is not None and st.zero.level is not AUTO:
        zero = int(st.zero.level)
    return StageRule(
        name=st.name, gpus=gpus, layers=_layers(job.model, st), tp=tp,
        ministages=None if st.ministages is AUTO else st.ministages, zero=zero,
        offload=None if st.offload is None else Offload.from_spec(st.offload),
        routing=None if st.microbatches is AUTO else st.microbatches,
        checkpoint=st.activation_checkpoint)


def _layers(model: ModelSpec, st: StageSpec) -> int | None:
    if st.layers is AUTO:
        return None
    if len(st.layers) != 1:
        raise SpecError([Diagnostic(st.span_of("layers"), f"stage '{st.name}' lists {len(st.layers)} layer "
                                    "ranges; the planner keeps written layers only as one range a stage")])
    r = st.layers[0]
    errors: list[Diagnostic] = []
    first, last = layer_index(model, r.first, r.span, errors), layer_index(model, r.last, r.span, errors)
    if first is None or last is None:   # a layer the model does not have
        raise SpecError(errors)
    return last - first + 1


def _block(topo: Topology, r: RankSlice) -> GpuBlock:
    g = topo.groups[r.group]
    n0, n1 = _range(r.node_start, r.node_stop, r.node_is_slice, g.count)
    g0, g1 = _range(r.gpu_start, r.gpu_stop, r.gpu_is_slice, g.gpus)
    return GpuBlock(r.group, n0, n1, g0, g1)


def _range(start: int | None, stop: int | None, is_slice: bool, size: int) -> tuple[int, int]:
    if not is_slice:
        assert start is not None   # a single index (`group[n]`) has its start
        return start, start + 1
    return (0 if start is None else start), (size if stop is None else stop)


def written_counts(routing: Routing, lanes: list[list[Gpu]], num_microbatches: int, dtype: DType) -> tuple[int, ...]:
    """Microbatches per lane as `resolve` derives them from a written routing."""
    n = len(lanes)
    if routing.kind is RoutingKind.COUNTS:
        return tuple(routing.counts)
    if routing.kind is RoutingKind.EVEN:
        return tuple(num_microbatches // n + (1 if i < num_microbatches % n else 0) for i in range(n))
    return tuple(proportional_counts(lanes, num_microbatches, dtype))
