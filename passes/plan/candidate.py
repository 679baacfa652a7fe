"""A plan candidate: the planner's compact form of an explicit parallel plan.

A `Candidate` names each stage's GPUs (rectangles of node groups, in rank
order), how many layers it owns, its per-stage configuration (`Knobs`: ZeRO
level, offload, ministages) and the microbatches of each lane. `emit` turns
it into a `ParallelSpec`; `evaluate` scores it with the cost model's formulas.

Layers are the units [embed, block0, ..., head]; stages own contiguous runs
of them in pipeline order, except under the interleaved schedule, where
every stage owns `v` chunks taken round-robin (Megatron's virtual stages).
"""

from __future__ import annotations

from dataclasses import dataclass

from hetc.ir.memo import cached_property
from hetc.ir.spec import Checkpointing, OffloadSpec, OffloadTarget, ScheduleKind
from hetc.ir.topology import Gpu, Topology

__all__ = ["Candidate", "GpuBlock", "Knobs", "Offload", "StageGpus", "ministage_ranges", "split_evenly"]


@dataclass(frozen=True, slots=True, order=True)
class GpuBlock:
    """GPUs gpu_start..gpu_stop-1 of nodes node_start..node_stop-1 of one node group."""

    group: str
    node_start: int
    node_stop: int
    gpu_start: int
    gpu_stop: int

    def gpus(self, topo: Topology) -> list[Gpu]:
        return [topo.gpu_at(self.group, n, g) for n in range(self.node_start, self.node_stop)
                for g in range(self.gpu_start, self.gpu_stop)]

    @property
    def size(self) -> int:
        return (self.node_stop - self.node_start) * (self.gpu_stop - self.gpu_start)


@dataclass(frozen=True, slots=True)
class StageGpus:
    """The GPUs of one stage, as blocks in rank order; `tp` consecutive GPUs form a lane."""

    blocks: tuple[GpuBlock, ...]
    tp: int = 1

    @property
    def size(self) -> int:
        return sum(b.size for b in self.blocks)

    @property
    def num_lanes(self) -> int:
        return self.size // self.tp

    @property
    def groups(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(b.group for b in self.blocks))


@dataclass(frozen=True, slots=True, order=True)
class Offload:
    """What a stage keeps on the host: inactive parameters, optimizer state, boundary activations."""

    params: bool = False
    optimizer: bool = False
    activations: bool = False

    def to_spec(self) -> OffloadSpec:
        cpu, none = OffloadTarget.CPU, OffloadTarget.NONE
        return OffloadSpec(params=cpu if self.params else none, optimizer=cpu if self.optimizer else none,
                           activations=cpu if self.activations else none)

    @classmethod
    def from_spec(cls, spec: OffloadSpec) -> Offload:
        none = OffloadTarget.NONE
        return cls(spec.params is not none, spec.optimizer is not none, spec.activations is not none)

    def __str__(self) -> str:
        parts = [name for name in ("params", "optimizer", "activations") if getattr(self, name)]
        return "+".join(parts) or "none"


@dataclass(frozen=True, slots=True, order=True)
class Knobs:
    """One stage's configuration."""

    zero: int = 0
    offload: Offload = Offload()
    ministages: int = 1
    checkpoint: Checkpointing = Checkpointing.NONE   # activation checkpointing of the stage's blocks


@dataclass(frozen=True)
class Candidate:
    stages: tuple[StageGpus, ...]          # pipeline order
    layers: tuple[int, ...]                # layer units per stage
    knobs: tuple[Knobs, ...]
    counts: tuple[tuple[int, ...], ...]    # microbatches per lane, per stage
    schedule: ScheduleKind
    micro_batch: int
    prefetch: int = 1
    idle: tuple[str, ...] = ()             # node groups left out

    @property
    def num_microbatches(self) -> int:
        return sum(self.counts[0])

    @cached_property
    def ranges(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per stage, its ministages' (first, stop) layer units, in the stage's order."""
        chunks = self.knobs[0].ministages if self.schedule is ScheduleKind.INTERLEAVED else 0
        return ministage_ranges(self.layers, tuple(k.ministages for k in self.knobs), chunks)

    def key(self) -> tuple[object, ...]:
        """A total order for ties, plainer plans first: fewer stages, the simpler schedule, less TP,
        less offload, less recomputation, fewer ministages, lower ZeRO; then the plain fields."""
        offloads = sum(k.offload.params + k.offload.optimizer + k.offload.activations for k in self.knobs)
        recompute = sum(_RECOMPUTE[k.checkpoint] for k in self.knobs)
        return (len(self.stages), _PLAINER[self.schedule], max(s.tp for s in self.stages), offloads, recompute,
                sum(k.ministages for k in self.knobs), sum(k.zero for k in self.knobs), self.micro_batch,
                self.layers, self.knobs, tuple(s.blocks for s in self.stages), self.counts)


_RECOMPUTE = {Checkpointing.NONE: 0, Checkpointing.SELECTIVE: 1, Checkpointing.FULL: 2}
_PLAINER = {ScheduleKind.ONE_F_ONE_B: 0, ScheduleKind.ZB: 1, ScheduleKind.GPIPE: 2,
            ScheduleKind.INTERLEAVED: 3, ScheduleKind.ZORSE: 4}


def split_evenly(total: int, parts: int) -> list[int]:
    """`resolve`'s rule for cutting `total` units into `parts` runs: bounds at total·i // parts."""
    bounds = [total * i // parts for i in range(parts + 1)]
    return [bounds[i + 1] - bounds[i] for i in range(parts)]


def ministage_ranges(layers: tuple[int, ...], ministages: tuple[int, ...],
                     interleave: int = 0) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Layer ranges of every stage's ministages.

    Contiguous stages are cut like `resolve` cuts `layers = a..b` with
    `ministages = k`. With `interleave = v`, stage s owns chunks s, s+S, ...
    of the model, its n_s units split into v chunks by the same rule.
    """
    if interleave:
        sizes = [split_evenly(n, interleave) for n in layers]
        out: list[list[tuple[int, int]]] = [[] for _ in layers]
        start = 0
        for chunk in range(interleave):
            for s, stage_sizes in enumerate(sizes):
                out[s].append((start, start + stage_sizes[chunk]))
                start += stage_sizes[chunk]
        return tuple(tuple(r) for r in out)
    result = []
    start = 0
    for n, k in zip(layers, ministages):
        pieces, lo = [], start
        for size in split_evenly(n, k):
            pieces.append((lo, lo + size))
            lo += size
        result.append(tuple(pieces))
        start += n
    return tuple(result)
