"""The explicit parallel plan, resolved to ranks and layer indices.

`passes.resolve` builds a `Pipeline` from a complete Spec whose plan has no
`auto` left; lowering, the cost model and the runtime read it instead of
re-deriving rank sets, ministage layer ranges and microbatch routing.
Layers are indexed over [embed, block0, ..., block{L-1}, head].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby

from hetc.ir.memo import cached_property
from hetc.ir.spec import Checkpointing, CPKind, ModelSpec, OffloadSpec, ScheduleKind, ZeroSpec
from hetc.ir.topology import Gpu

__all__ = ["Lane", "Ministage", "Pipeline", "Stage", "first_positions", "route_microbatches"]


@dataclass(frozen=True, slots=True)
class Ministage:
    """A contiguous run of layers that one stage runs as a unit."""

    index: int         # position along the model: the order microbatches visit
    stage: int
    chunk: int         # index among its stage's ministages
    first_layer: int
    stop_layer: int    # exclusive

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.stop_layer)


@dataclass(frozen=True, slots=True)
class Lane:
    """N_intra = cp × tp ranks that together serve one microbatch."""

    index: int
    ranks: tuple[int, ...]   # world ranks, cp-major: rank of (part p, rep r) = ranks[p * tp + r]
    microbatches: tuple[int, ...]  # global microbatch indices routed here, in order


@dataclass(frozen=True, slots=True)
class Stage:
    index: int
    name: str
    ministages: tuple[int, ...]   # global ministage indices, in the stage's own order
    lanes: tuple[Lane, ...]
    tp: int
    cp: int
    cp_kind: CPKind
    sequence_parallel: bool
    zero: ZeroSpec
    offload: OffloadSpec
    ep: int = 1        # expert parallelism: lanes i·ep..(i+1)·ep−1 share the experts of MoE blocks
    checkpoint: Checkpointing = Checkpointing.NONE   # activation checkpointing of the stage's blocks

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(r for lane in self.lanes for r in lane.ranks)

    @property
    def lane_size(self) -> int:
        return self.tp * self.cp

    def lane_of_microbatch(self, mb: int) -> Lane:
        for lane in self.lanes:
            if mb in lane.microbatches:
                return lane
        raise KeyError(mb)


@dataclass(frozen=True)
class Pipeline:
    stages: tuple[Stage, ...]
    ministages: tuple[Ministage, ...]   # in model order
    world: tuple[Gpu, ...]               # world rank -> GPU
    num_microbatches: int
    micro_batch: int
    schedule: ScheduleKind
    prefetch: int

    @property
    def world_size(self) -> int:
        return len(self.world)

    @cached_property
    def stage_of_rank(self) -> dict[int, Stage]:
        return {r: s for s in self.stages for r in s.ranks}

    @cached_property
    def lane_of_rank(self) -> dict[int, Lane]:
        return {r: lane for s in self.stages for lane in s.lanes for r in lane.ranks}

    @cached_property
    def first_stage_positions(self) -> dict[int, int]:
        """Each microbatch's position in its lane of the first stage (`first_positions`)."""
        return first_positions([lane.microbatches for lane in self.stages[0].lanes])

    def layer_runs(self, stage: int) -> tuple[tuple[int, int], ...]:
        """(first, stop) of each contiguous run of `stage`'s layers, in model order: one for a stage of
        consecutive chunks, one a chunk for Megatron's virtual stages."""
        runs: list[tuple[int, int]] = []
        for m in sorted((self.ministages[i] for i in self.stages[stage].ministages), key=lambda m: m.first_layer):
            if runs and runs[-1][1] == m.first_layer:
                runs[-1] = (runs[-1][0], m.stop_layer)
            else:
                runs.append((m.first_layer, m.stop_layer))
        return tuple(runs)

    def layers_text(self, model: ModelSpec, stage: int) -> str:
        """`stage`'s layers as a spec lists them: 'embed..block7, block16..block24'."""
        return ", ".join(model.span_name(a, b) for a, b in self.layer_runs(stage))

    def ministage_of_layer(self, layer: int) -> Ministage:
        for m in self.ministages:
            if m.first_layer <= layer < m.stop_layer:
                return m
        raise KeyError(layer)

    def chunks_after(self, stage: int) -> tuple[int, ...]:
        """How many chunks each stage holds after `stage`'s last one, in the order a microbatch meets them
        (Note [chunks after a stage] in passes/cost/memory.py): Megatron's loop gives one per later stage."""
        return self._chunks_after[stage]

    @cached_property
    def _chunks_after(self) -> tuple[tuple[int, ...], ...]:
        """`chunks_after` of every stage (asked per lane and per rank)."""
        def after(last: int) -> tuple[int, ...]:
            counts: dict[int, int] = {}
            for m in self.ministages[last + 1:]:
                counts[m.stage] = counts.get(m.stage, 0) + 1
            return tuple(counts.values())
        return tuple(after(max(s.ministages)) for s in self.stages)

    @cached_property
    def revisits_stages(self) -> bool:
        """Whether a microbatch comes back to a stage it left (Megatron's virtual stages loop over the stages);
        False where every stage's chunks are consecutive layers."""
        runs = [stage for stage, _ in groupby(m.stage for m in self.ministages)]
        return len(runs) > len(set(runs))

    def tied_ministages(self, model: ModelSpec) -> tuple[int, ...]:
        """The ministages holding a copy of `model`'s tied embedding, whose gradients `all_reduce tied` sums
        (Note [tied gradients] in hetc/ir/program.py): the embedding's and the head's where they differ."""
        if not model.tied_embeddings:
            return ()
        first, last = (self.ministage_of_layer(i).index for i in (0, model.layers + 1))
        return () if first == last else (first, last)

    def tied_ranks(self, model: ModelSpec) -> tuple[int, ...]:
        """Every rank of the stages holding the tied copies: the group `all_reduce tied` runs on."""
        stages = {self.ministages[ms].stage for ms in self.tied_ministages(model)}
        return tuple(sorted(r for s in stages for r in self.stages[s].ranks))


def first_positions(first_lanes: Sequence[Sequence[int]]) -> dict[int, int]:
    """Each microbatch's position in its lane of the first stage (`first_lanes`: each lane's microbatches)."""
    return {mb: i for lane in first_lanes for i, mb in enumerate(lane)}


def route_microbatches(counts: list[int]) -> list[list[int]]:
    """Spread microbatches 0..sum-1 over lanes with the given counts.

    Lane l takes its i-th microbatch at position (i + 0.5) / counts[l]; merging
    by position interleaves lanes so every lane starts early and a faster lane
    (more microbatches) is never starved behind a slower one.
    """
    keys = sorted(((i + 0.5) / c, lane) for lane, c in enumerate(counts) for i in range(c))
    out: list[list[int]] = [[] for _ in counts]
    for mb, (_, lane) in enumerate(keys):
        out[lane].append(mb)
    return out
