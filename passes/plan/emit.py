"""Turn a chosen candidate into the explicit `parallel` block (and micro-batch size) of a Spec.

Stage-level ZeRO and offload blocks are written only where a stage differs
from the plan-wide setting, which is the most common one among the stages.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from hetc.passes.plan.candidate import Candidate, GpuBlock, Offload

from hetc.spec import LayerRange, ParallelSpec, RankSlice, Routing, RoutingKind, Spec, StageSpec, ZeroSpec
from hetc.topology import Topology

__all__ = ["emit_parallel", "emit_spec", "rank_slice"]


def rank_slice(block: GpuBlock, topo: Topology) -> RankSlice:
    group = topo.groups[block.group]
    node = _index(block.node_start, block.node_stop, group.count)
    gpu = _index(block.gpu_start, block.gpu_stop, group.gpus)
    return RankSlice(group=block.group, node_start=node[0], node_stop=node[1], node_is_slice=node[2],
                     gpu_start=gpu[0], gpu_stop=gpu[1], gpu_is_slice=gpu[2])


def _index(start: int, stop: int, size: int) -> tuple[int | None, int | None, bool]:
    if (start, stop) == (0, size):
        return None, None, True
    if stop == start + 1:
        return start, None, False
    return start, stop, True


def _routing(counts: tuple[int, ...]) -> Routing:
    if len(set(counts)) == 1:
        return Routing(kind=RoutingKind.EVEN)
    return Routing(kind=RoutingKind.COUNTS, counts=counts)


def emit_parallel(spec: Spec, c: Candidate, topo: Topology, zero_base: ZeroSpec | None = None) -> ParallelSpec:
    """The explicit parallel block of `c`; the spec's objective and fixed ZeRO hierarchy are kept."""
    par, model = spec.parallel, spec.model
    base = zero_base or ZeroSpec()
    levels = Counter(k.zero for k in c.knobs)
    offloads = Counter(k.offload for k in c.knobs)
    zero_level = max(levels, key=lambda lv: (levels[lv], -lv))
    common_off = max(offloads, key=lambda o: (offloads[o], o == Offload()))
    stages = []
    for i, (st, ranges, knobs, counts) in enumerate(zip(c.stages, c.ranges, c.knobs, c.counts)):
        contiguous = all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        if contiguous:
            layers = (LayerRange(first=model.layer_name(ranges[0][0]), last=model.layer_name(ranges[-1][1] - 1)),)
        else:
            layers = tuple(LayerRange(first=model.layer_name(a), last=model.layer_name(b - 1)) for a, b in ranges)
        stages.append(StageSpec(
            name=f"s{i}", layers=layers, ranks=tuple(rank_slice(b, topo) for b in st.blocks),
            lanes=st.num_lanes, tp=st.tp, ministages=knobs.ministages, microbatches=_routing(counts),
            zero=None if knobs.zero == zero_level else replace(base, level=knobs.zero),
            offload=None if knobs.offload == common_off else knobs.offload.to_spec()))
    idle = tuple(RankSlice(group=g) for g in c.idle)
    return ParallelSpec(schedule=c.schedule, zero=replace(base, level=zero_level), offload=common_off.to_spec(),
                        prefetch=c.prefetch, stages=tuple(stages), idle=idle, objective=par.objective)


def emit_spec(spec: Spec, c: Candidate, topo: Topology, zero_base: ZeroSpec | None = None) -> Spec:
    train = spec.train if spec.train.micro_batch == c.micro_batch else replace(spec.train, micro_batch=c.micro_batch)
    return replace(spec, parallel=emit_parallel(spec, c, topo, zero_base), train=train)
