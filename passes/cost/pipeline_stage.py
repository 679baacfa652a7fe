"""A stage of a resolved Pipeline as the composition reads it (`classes.StageSource`), rank by rank.

Every lane is its own class and every rank its own memory entry: what
`hetc explain` reports per rank. Its quantities are `plan_time`'s for the
lane's first rank (the device kinds of a lane each timed by one of their
ranks); its memory is `memory.state_memory` and `activation_memory` of the
rank's own states and groups.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from collections.abc import Sequence

from hetc.ir.memo import cached_property
from hetc.passes.cost import plan_time as pt
from hetc.passes.cost.classes import ClassEstimate, PlanShape, evaluate_classes
from hetc.passes.cost.experts import sharded_numel
from hetc.passes.cost.memory import (RankMemory, StatesHeld, activation_memory, rank_memory,
                                    ZorseParams, forwards_first, gpipe_backward_peak, state_memory, zorse_backward_peak,
                                    zorse_gathers)
from hetc.passes.cost.schedule import Grouping, Unit, UnitOp, group_width, interleaved_groups
from hetc.passes.cost.transfers import Borders
from hetc.ir.pipeline import Lane, Pipeline, Stage
from hetc.ir.program import Collective, Phase
from hetc.ir.spec import OffloadTarget, ScheduleKind, ZeroSpec

if TYPE_CHECKING:     # the cost model imports this module
    from hetc.passes.cost.model import CostModel

__all__ = ["PipelineStage", "evaluate_pipeline", "lane_group", "lane_groups", "pipeline_stages"]


class PipelineStage:
    def __init__(self, cm: CostModel, stage: Stage):
        self.cm, self.stage = cm, stage
        self.index: int = stage.index
        self.num_lanes: int = len(stage.lanes)
        self.zero: ZeroSpec = stage.zero

    def lane_classes(self) -> Sequence[Sequence[int]]:
        return [(lane.index,) for lane in self.stage.lanes]

    def count(self, lane: int) -> int:
        return len(self.stage.lanes[lane].microbatches)

    def compute(self, lane: int) -> tuple[float, float, float]:
        cm, mss = self.cm, self.stage.ministages
        reps = self._reps(lane)
        f, i, w = (max(sum(cm.compute_time(r, ms, ph) for ms in mss) for r in reps) for ph in (Phase.FORWARD, Phase.INPUT_GRAD, Phase.WEIGHT_GRAD))
        return f, i, w

    def overhead(self, lane: int) -> float:
        return max(self.cm.microbatch_overhead(r) for r in self._reps(lane))

    def p2p(self, lane: int) -> Borders:
        return pt.p2p_per_microbatch(self.cm, self.stage, self.stage.lanes[lane])

    def collectives(self, lane: int) -> tuple[float, float, float]:
        return pt.collectives(self.cm, self.stage, self.stage.lanes[lane])

    def shares(self) -> tuple[float, float]:
        return pt.shares(self.cm, self.stage, self.stage.lanes[0].ranks[0])

    def unit_ops(self, lane: int) -> Sequence[UnitOp]:
        return pt.lane_unit_ops(self.cm, self.stage, self.stage.lanes[lane])

    def flush(self) -> float:
        return pt.stage_flush(self.cm, self.stage)

    def first_gather(self) -> float:
        return pt.first_gather(self.cm, self.stage)

    def unit(self, ms: int) -> Unit:
        return pt.zorse_unit(self.cm, self.stage, ms)

    def memory_classes(self, limit: int, grouping: Grouping) -> Sequence[tuple[RankMemory, tuple[int, ...]]]:
        return [(rank_memory_of(self.cm, r, limit, grouping), (r,)) for r in sorted(self.stage.ranks)]

    def _reps(self, lane: int) -> list[int]:
        return self._lane_reps[lane]

    @cached_property
    def _lane_reps(self) -> list[list[int]]:
        return [pt.kind_reps(self.cm, lane.ranks) for lane in self.stage.lanes]


def pipeline_stages(cm: CostModel) -> list[PipelineStage]:
    return [PipelineStage(cm, s) for s in cm.pipeline.stages]


def evaluate_pipeline(cm: CostModel, memory: bool) -> ClassEstimate:
    """The composition over `cm`'s pipeline, rank by rank."""
    p = cm.pipeline
    shape = PlanShape(cm.engine, p.schedule, p.num_microbatches, cm.train.grad_clip,
                      tuple(ms.stage for ms in p.ministages), max(len(s.ministages) for s in p.stages))
    end = pt.step_end_time(cm.train.grad_clip > 0,
                           lambda nbytes: cm.collective_time(Collective.ALL_REDUCE, tuple(range(p.world_size)), nbytes),
                           cm.tied_time)
    return evaluate_classes(shape, pipeline_stages(cm), end, memory)


def lane_groups(pipeline: Pipeline, lane: Lane, grouping: Grouping) -> list[list[int]]:
    """The lane's microbatches in interleaved 1F1B's groups, in order (`schedule.interleaved_groups` at the
    first stage's width, Note [interleaved groups]): what lowering's schedule queues them by."""
    first = max(len(first_lane.microbatches) for first_lane in pipeline.stages[0].lanes)
    width = first if grouping is Grouping.BREADTH_FIRST else group_width(len(pipeline.stages), first)
    return interleaved_groups(pipeline.first_stage_positions, lane.microbatches, width)


def lane_group(pipeline: Pipeline, lane: Lane, grouping: Grouping) -> int:
    """The lane's microbatches in its largest group of interleaved 1F1B (`lane_groups`): what its warm-up
    counts (`memory.interleaved_warmup`), in lowering's schedule and the estimate's stash alike. Lanes of
    the first stage of different sizes share one width, so the formula of the planner's even lanes
    (`memory.interleaved_group`) does not give theirs (a Zorse-routed A100 lane of 18 microbatches in groups
    of 2 counted 3, and its warm-up stuck the schedule)."""
    return max(map(len, lane_groups(pipeline, lane, grouping)), default=1)


def rank_memory_of(cm: CostModel, rank: int, limit: int, grouping: Grouping) -> RankMemory:
    """One rank's memory at its peak, its lane holding `limit` microbatches in flight (interleaved 1F1B: its
    groups)."""
    stage = cm.stage_of(rank)
    mss = stage.ministages
    held = StatesHeld([cm.param_bytes(ms, rank) for ms in mss], [cm.grad_bytes(ms, rank) for ms in mss],
                      sum(sharded_numel(cm, ms, rank, "grads") for ms in mss) * cm.states.grads,
                      sum(sharded_numel(cm, ms, rank, "optimizer") for ms in mss) * cm.states.optimizer,
                      cm.shard(rank), stage.zero.resolved_level >= 3 and len(cm.zero_group(rank)) > 1,
                      len(stage.lanes), cm.largest_held_boundary(stage), cm.states.grads,
                      [n * cm.states.params for n in pt.unit_numels(cm, stage, rank)],
                      stage.zero.resolved_level in (1, 2) and len(cm.zero_group(rank)) > 1)
    p = cm.pipeline
    states = state_memory(held, stage.offload, p.schedule, cm.train.grad_clip, p.prefetch)
    lane = p.lane_of_rank[rank]
    per_microbatch = [cm.activation_bytes(ms, rank) for ms in mss]
    interleaved = p.schedule is ScheduleKind.INTERLEAVED
    groups = [len(g) for g in lane_groups(p, lane, grouping)] if interleaved else []
    offload_activations = stage.offload.activations is not OffloadTarget.NONE
    inputs = [cm.held_boundary_bytes(ms - 1, stage) for ms in mss if ms > 0]   # the boundaries it takes in
    acts = activation_memory(p.schedule, stage.index, len(p.stages), len(lane.microbatches), per_microbatch, limit,
                             offload_activations, sum(inputs), max(inputs, default=0.0), p.prefetch,
                             max(groups, default=1), p.chunks_after(stage.index) if interleaved else None, groups)
    offloaded = ZorseParams([b * held.shard.params for b in held.params], p.prefetch, held.regathers, held.gathers) \
        if stage.offload.params is not OffloadTarget.NONE else None
    tied = [k for k, ms in enumerate(mss) if ms in p.tied_ministages(cm.model)]
    zorse = zorse_backward_peak(p.schedule, cm.train.grad_clip, offload_activations, len(lane.microbatches),
                                per_microbatch, held.grads, held.grads_kept, held.shard.grads < 1.0,
                                (2 + p.prefetch) * max(inputs, default=0.0), offloaded, tied[0] if tied else None,
                                held.shard.reduced,
                                zorse_gathers(held, p.prefetch))
    gpipe = gpipe_backward_peak(offload_activations, acts[0], sum(per_microbatch), states) \
        if forwards_first(p.schedule, stage.index, len(p.stages), len(lane.microbatches), limit) else None
    return rank_memory(rank, cm.gpu(rank), stage.index, states, acts, zorse or gpipe)
