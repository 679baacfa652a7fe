"""Turn a chosen candidate into the explicit `parallel` block (and micro-batch size) of a Spec.

Stage-level ZeRO and offload blocks are written only where a stage differs
from the plan-wide setting, which is the most common one among the stages;
a stage's `activation_checkpoint` only where it differs from the model's
(on every stage where the model says `auto`).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from hetc.passes.plan.candidate import Candidate, GpuBlock, Knobs, Offload
from hetc.ir.spec import (AUTO, LayerRange, ParallelSpec, RankSlice, Routing, RoutingKind, Spec, StageSpec,
                       ZeroSpec)
from hetc.ir.topology import Topology
from hetc.ir.plan import Job

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


def emit_parallel(job: Job, c: Candidate, zero_base: ZeroSpec | None = None) -> ParallelSpec:
    """The explicit parallel block of `c`; the spec's objective, fixed ZeRO hierarchy and written stages
    are kept."""
    par, model, topo = job.parallel, job.model, job.topology
    base = zero_base or ZeroSpec()
    levels = Counter(k.zero for k in c.knobs)
    offloads = Counter(k.offload for k in c.knobs)
    zero_level = max(levels, key=lambda lv: (levels[lv], -lv))
    common_off = max(offloads, key=lambda o: (offloads[o], o == Offload()))
    if par.stages is not AUTO:  # written stages: fill their `auto` fields, keep the rest as written
        zero_level = zero_level if par.zero.level is AUTO else par.zero.level
        common_off = Offload.from_spec(par.offload)
    written: Sequence[StageSpec | None] = par.stages if par.stages is not AUTO else [None] * len(c.stages)
    stages = []
    for i, (st, ranges, knobs, counts, old) in enumerate(zip(c.stages, c.ranges, c.knobs, c.counts, written)):
        contiguous = all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
        pieces = [(ranges[0][0], ranges[-1][1])] if contiguous else ranges
        layers = tuple(LayerRange(first=model.layer_name(a), last=model.layer_name(b - 1)) for a, b in pieces)
        fields: dict[str, Any] = {"layers": layers, "ranks": tuple(rank_slice(b, topo) for b in st.blocks),
                  "lanes": st.num_lanes, "tp": st.tp, "cp": 1, "ministages": knobs.ministages,
                  "microbatches": _routing(counts),
                  "zero": None if knobs.zero == zero_level else replace(base, level=knobs.zero),
                  "offload": None if knobs.offload == common_off else knobs.offload.to_spec(),
                  "activation_checkpoint": None if knobs.checkpoint == model.activation_checkpoint else knobs.checkpoint}
        if old is None:
            stages.append(StageSpec(name=f"s{i}", **fields))
        else:
            stages.append(_filled(old, fields, knobs))
    idle = tuple(RankSlice(group=g) for g in c.idle) if par.stages is AUTO else par.idle
    zero = replace(par.zero if par.zero.level is not AUTO else base, level=zero_level)
    return replace(par, schedule=c.schedule, zero=zero, offload=common_off.to_spec(), prefetch=c.prefetch,
                   stages=tuple(stages), idle=idle)


def _filled(old: StageSpec, fields: dict[str, Any], knobs: Knobs) -> StageSpec:   # fields: for `replace`
    """A written stage with its `auto` fields filled (written values stay as written)."""
    keep = {name: getattr(old, name) for name in ("layers", "ranks", "lanes", "tp", "cp", "ministages",
                                                 "microbatches", "activation_checkpoint")
            if getattr(old, name) not in (AUTO, None)}
    out = replace(old, **{**fields, **keep})
    if old.zero is not None:
        out = replace(out, zero=replace(old.zero, level=knobs.zero))
    if old.offload is not None:
        out = replace(out, offload=old.offload)
    return out


def emit_spec(job: Job, c: Candidate, zero_base: ZeroSpec | None = None) -> Spec:
    """The job's spec with `c` as its explicit plan (and `c`'s micro-batch size)."""
    train = job.train
    if train.micro_batch != c.micro_batch:
        train = replace(train, micro_batch=c.micro_batch)
    return replace(job.spec, parallel=emit_parallel(job, c, zero_base), train=train)
