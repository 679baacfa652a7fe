"""The cost model's stage quantities for one rank of a resolved Pipeline (`CostModel`).

What `pipeline_stage.PipelineStage` answers the composition (classes.py)
with: a lane's per-microbatch compute and border transfers, its ZeRO
collectives (`zero_time`) with the rank's own groups, the flush tail of a
stage (Megatron-DeepSpeed: `ReduceGrads`, then `OptimizerStep`), Zorse's
units. The composition is the same the planner's class-by-class view of a
candidate feeds (passes/plan/candidate_stage.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence

from hetc.passes.cost.experts import expert_group, sharded_numel
from hetc.passes.cost.memory import offloaded
from hetc.passes.cost.schedule import Unit, UnitLane, UnitOp, unit_ops
from hetc.passes.cost.transfers import Borders
from hetc.passes.cost.zero_time import (ZeroRings, across_nodes, fetch_time, first_gather_time, flush_time,
                                       optimizer_step_time, piece_collectives, publish_time, sync_time,
                                       zero_collectives)
from hetc.passes.cost.zero_units import gathers_per_block, ministage_units
from hetc.ir.pipeline import Lane, Stage
from hetc.ir.program import Phase
from hetc.ir.program import Unit as GatherUnit
from hetc.ir.spec import OffloadTarget, ZeroShard, ZeroSpec

if TYPE_CHECKING:     # the cost model imports this module
    from hetc.passes.cost.model import CostModel

__all__ = ["border_time", "collectives", "first_gather", "kind_reps", "lane_borders", "lane_unit_ops", "ministage_borders",
           "p2p_per_microbatch", "peer_lanes", "shares", "stage_borders", "stage_flush", "stage_sync_time",
           "stage_units", "step_end_time", "unit_lane", "unit_numels", "zero_rings", "zorse_unit"]


# what the all-reduces of the step's loss and squared gradient norm carry (one float64 each)
SCALAR_BYTES = 8.0


def step_end_time(clips: bool, all_reduce: Callable[[float], float], tied: float = 0.0) -> float:
    """The step's last collectives: the loss report, and the norm when clipping, over every rank; before them
    the sum of a tied embedding's copies (`tied`: its seconds, `CostModel.tied_time`), which waits for both
    copies' last backward.

    The world's are latency-bound (8 bytes), so on slow links or many ranks
    they show; `all_reduce(nbytes)` times one over the whole world.
    """
    return all_reduce(SCALAR_BYTES) * (2 if clips else 1) + tied


def kind_reps(cm: CostModel, ranks: Iterable[int]) -> list[int]:
    """One rank per device kind and core share among `ranks`: such ranks time alike."""
    seen: dict[tuple[str, float], int] = {}
    for r in sorted(ranks):
        seen.setdefault((cm.gpu(r).device.name, cm.slowdown(r)), r)
    return list(seen.values())


def peer_lanes(mine: Sequence[int], theirs: Sequence[int], num_lanes: int) -> tuple[int, ...]:
    """For each of one stage's `num_lanes` lanes, the lane of another stage serving most of its
    microbatches (the lowest on ties): the peer its border transfers are timed with. `mine`, `theirs`:
    each microbatch's lane in the two stages."""
    shared = Counter(zip(mine, theirs))
    best: dict[int, tuple[int, int]] = {}
    for (la, lb), n in shared.items():
        if la not in best or (n, -lb) > (best[la][0], -best[la][1]):
            best[la] = (n, lb)
    return tuple(best.get(la, (0, 0))[1] for la in range(num_lanes))


def _peer_lane(cm: CostModel, stage: Stage, lane: Lane) -> Lane:
    """The lane of `stage` that serves most of `lane`'s microbatches."""
    return stage.lanes[cm.peer_lanes(cm.stage_of(lane.ranks[0]).index, stage.index)[lane.index]]


def border_time(cm: CostModel, stage: Stage, lane: Lane, other: Stage, ms: int) -> float:
    """One transfer (each rank its share of the activation) that `lane` receives from its peer in `other`,
    timed as the simulator times the message: at the sender's streams on its node (`CostModel.message_time`).

    The share is 1/(tp·cp), sent by the lane's ranks at once: with sequence
    parallelism each holds that share; without it each sends its tp part and
    the receiving tp group all-gathers the parts inside its compute
    (Note [scatter-gather borders] in hetc/ir/layout.py;
    `CostModel.border_gathers`), as Megatron does (validated on Sailor's
    measured runs).
    """
    peer = _peer_lane(cm, other, lane)
    share = cm.boundary_bytes(ms) / (stage.tp * stage.cp)
    return cm.message_time(peer.ranks[0], lane.ranks[0], share)   # the sender's streams share its node's link


def ministage_borders(ms: int, stage: int, stage_of: Callable[[int], int], count: int
                      ) -> tuple[int | None, int | None]:
    """(the stage after ministage `ms`'s outgoing border, the stage before its incoming one): None where
    the neighbouring ministage is absent or of the same `stage`; `count` ministages in all."""
    out = stage_of(ms + 1) if ms + 1 < count and stage_of(ms + 1) != stage else None
    back = stage_of(ms - 1) if ms > 0 and stage_of(ms - 1) != stage else None
    return out, back


def border_crossings(ms: int, stage: int, stage_of: Callable[[int], int], count: int) -> tuple[int, int]:
    """(1 if ministage `ms` receives its activation from another stage, 1 if its gradient): the boundary
    tensors its forward and its input-gradient take over a border (and gather, Note [scatter-gather borders]
    in hetc/ir/layout.py)."""
    out, back = ministage_borders(ms, stage, stage_of, count)
    return int(back is not None), int(out is not None)


def stage_borders(ministages: Sequence[int], stage: int, stage_of: Callable[[int], int], count: int
                  ) -> Iterator[tuple[int, int]]:
    """(other stage, ministage whose activation crosses) for every border a stage's microbatch crosses:
    one transfer each, per microbatch, activation or gradient (docs/costmodel.md)."""
    for ms in ministages:
        out, back = ministage_borders(ms, stage, stage_of, count)
        if back is not None:
            yield back, ms - 1
        if out is not None:
            yield out, ms


def lane_borders(ministages: Sequence[int], stage: int, stage_of: Callable[[int], int], count: int,
                 time: Callable[[int, int], float]) -> Borders:
    """A lane's border transfers (`time(other stage, ministage whose activation crosses)`), the activations
    it receives apart from the gradients (Note [async sends])."""
    activations, gradients, later = [], [], 0.0
    for ms in ministages:
        out, back = ministage_borders(ms, stage, stage_of, count)
        if back is not None:
            activations.append(time(back, ms - 1))
            later += activations[-1] if back > stage else 0.0
        if out is not None:
            gradients.append(time(out, ms))
            later += gradients[-1] if out > stage else 0.0
    return Borders(tuple(activations), tuple(gradients), len(ministages), later)


def p2p_per_microbatch(cm: CostModel, stage: Stage, lane: Lane) -> Borders:
    p = cm.pipeline
    return lane_borders(stage.ministages, stage.index, _stage_of(cm), len(p.ministages),
                        lambda other, ms: border_time(cm, stage, lane, p.stages[other], ms))


def _stage_of(cm: CostModel) -> Callable[[int], int]:
    return lambda ms: cm.pipeline.ministages[ms].stage


def _stage_numel(cm: CostModel, stage: Stage, rank: int) -> float:
    return sum(cm.numel(ms, rank) for ms in stage.ministages)


def zero_rings(cm: CostModel, rank: int) -> ZeroRings:
    """This rank's ZeRO groups, the stage's alike groups on its node sharing the node's link
    (`CostModel.groups_at_once`)."""
    group = cm.zero_group(rank)
    timer = lambda kind, ranks, nbytes: cm.collective_time(kind, ranks, nbytes, cm.groups_at_once(rank, ranks))
    if cm.stage_of(rank).zero.shard is not ZeroShard.NODE:
        return ZeroRings(timer, cm.states, group)
    return ZeroRings(timer, cm.states, group, cm.node_group(rank), across_nodes(group, lambda r: cm.gpu(r).host, rank))


def _copier(cm: CostModel, rank: int) -> Callable[[float], float]:
    """Seconds to copy bytes between this rank's device and its host."""
    return lambda nbytes: cm.copy_time(rank, nbytes)


def shares(cm: CostModel, stage: Stage, rank: int) -> tuple[float, float]:
    """The fractions of the stage's parameters in its first and in its largest ministage (unit, where
    it gathers per block: each unit reduces on its own, Note [zero-3 units])."""
    whole = max(_stage_numel(cm, stage, rank), 1.0)
    each = unit_numels(cm, stage, rank) or [cm.numel(ms, rank) for ms in stage.ministages]
    return each[0] / whole, max(each) / whole


def stage_units(cm: CostModel, stage: Stage, ms: int) -> tuple[GatherUnit, ...]:
    """The units lowering splits ministage `ms` into (Note [zero-3 units]); none: the ministage whole."""
    per_block = gathers_per_block(cm.pipeline.schedule, stage.zero, stage.offload, stage.ep)
    return ministage_units(cm.model, cm.ministage(ms).layers, per_block)


def unit_numels(cm: CostModel, stage: Stage, rank: int) -> list[float]:
    """The parameters of each unit the stage gathers per block, in layer order; empty: none split."""
    return [cm.layers_numel(u.layers, rank) for ms in stage.ministages for u in stage_units(cm, stage, ms)]


def lane_unit_ops(cm: CostModel, stage: Stage, lane: Lane) -> tuple[UnitOp, ...]:
    """`schedule.unit_ops` of the lane (its slowest device kind's compute, its first rank's collectives); empty
    where the stage gathers none per block."""
    rank = lane.ranks[0]
    units = [(ms, u) for ms in stage.ministages for u in stage_units(cm, stage, ms)]
    if not units:
        return ()
    reps = kind_reps(cm, lane.ranks)
    computes = [tuple(max(cm.op_time(r, ms, ph, u) for r in reps) for ph in (Phase.FORWARD, Phase.BACKWARD))
                for ms, u in units]
    pieces = piece_collectives(stage.zero, zero_rings(cm, rank), [cm.layers_numel(u.layers, rank) * cm.delta
                                                                   for _, u in units])
    return unit_ops([(f, b) for f, b in computes], pieces)


def collectives(cm: CostModel, stage: Stage, lane: Lane) -> tuple[float, float, float]:
    """`zero_time.zero_collectives` for the lane's first rank."""
    rank = lane.ranks[0]
    return zero_collectives(cm.pipeline.schedule, stage.zero, stage.offload.params is not OffloadTarget.NONE,
                           _stage_numel(cm, stage, rank) * cm.delta, zero_rings(cm, rank),
                           _copier(cm, rank), cm.shard(rank).params,
                           [n * cm.delta for n in unit_numels(cm, stage, rank)])


def first_gather(cm: CostModel, stage: Stage) -> float:
    """The first unit's gather: the first ministage's, or its first layer's where it gathers per block."""
    rank = stage.lanes[0].ranks[0]
    units = unit_numels(cm, stage, rank)
    first = units[0] if units else cm.numel(stage.ministages[0], rank)
    return first_gather_time(stage.zero, first * cm.delta, zero_rings(cm, rank))


def stage_sync_time(cm: CostModel, stage: Stage, rank: int, ms: int | None = None, publish: bool = True) -> float:
    """`zero_time.sync_time` for `rank` of `stage`, or (`ms`) of its ministage `ms` alone, as Zorse syncs
    each ministage after its backward (a call of its own: its latency and core wait are its own). Under
    expert parallelism lowering keeps the experts in a buffer of their own, synced over their expert group
    beside the dense parameters' sync over the ZeRO group (both posted, then both waited:
    passes/lower/zero.py `_parts`): the longer of the two. `publish`: with the gather of the stepped shard
    (Zorse without it: `zorse_publish_time`)."""
    ministages = stage.ministages if ms is None else (ms,)
    per_ministage = ms is not None
    numel = sum(cm.numel(m, rank) for m in ministages)
    experts = sum(cm.numel(m, rank) * cm.expert_fraction(m, rank) for m in ministages)
    dense = sync_time(stage.zero, (numel - experts) * cm.delta, zero_rings(cm, rank),
                      per_ministage, [n * cm.delta for n in unit_numels(cm, stage, rank)], publish)
    if not experts:
        return dense
    flat, rings = _expert_rings(cm, stage, rank)
    return max(dense, sync_time(flat, experts * cm.delta, rings, per_ministage, publish=publish))


def _expert_rings(cm: CostModel, stage: Stage, rank: int) -> tuple[ZeroSpec, ZeroRings]:
    """The experts' ZeRO (flat: their shard has no outer group) and the expert group they sync over."""
    rings = ZeroRings(lambda kind, ranks, nbytes: cm.collective_time(kind, ranks, nbytes, cm.groups_at_once(rank, ranks)),
                      cm.states, expert_group(cm, rank))
    return dataclasses.replace(stage.zero, shard=ZeroShard.ALL), rings


def zorse_publish_time(cm: CostModel, stage: Stage, rank: int, ms: int) -> float:
    """`zero_time.publish_time` of Zorse's ministage `ms`: its dense and its experts' gathers, the longer."""
    experts = cm.numel(ms, rank) * cm.expert_fraction(ms, rank)
    dense = publish_time(stage.zero, (cm.numel(ms, rank) - experts) * cm.delta, zero_rings(cm, rank))
    if not experts:
        return dense
    flat, rings = _expert_rings(cm, stage, rank)
    return max(dense, publish_time(flat, experts * cm.delta, rings))


def _opt_time(cm: CostModel, stage: Stage, rank: int) -> float:
    return optimizer_step_time(lambda numel: cm.optimizer_time(rank, numel), _copier(cm, rank),
                               sum(sharded_numel(cm, ms, rank, "optimizer") for ms in stage.ministages),
                               offloaded(stage.offload)[1], cm.states)


def stage_flush(cm: CostModel, stage: Stage) -> float:
    """`zero_time.flush_time`: lane 0's ranks stand for the positions, one rank of each device kind."""
    return flush_time((stage_sync_time(cm, stage, r) for r in stage.lanes[0].ranks),
                      (_opt_time(cm, stage, r) for r in kind_reps(cm, stage.ranks)))


# ------------------------------------------------------------------ Zorse units


def zorse_unit(cm: CostModel, stage: Stage, ms: int) -> Unit:
    """Ministage `ms` of `stage` over every lane, and what it costs once per step."""
    rank = stage.lanes[0].ranks[0]
    lanes = tuple(unit_lane(cm, stage, lane, ms) for lane in stage.lanes)
    numel = cm.numel(ms, rank)
    fetch = fetch_time(stage.zero, stage.offload.params is not OffloadTarget.NONE, numel * cm.delta,
                       zero_rings(cm, rank), _copier(cm, rank), cm.shard(rank).params)
    return Unit.of(stage.index, lanes, fetch, numel, _stage_numel(cm, stage, rank),
                   stage_sync_time(cm, stage, rank, ms, publish=False), _opt_time(cm, stage, rank),
                   zorse_publish_time(cm, stage, rank, ms))


def unit_lane(cm: CostModel, stage: Stage, lane: Lane, ms: int) -> UnitLane:
    p = cm.pipeline
    rank = lane.ranks[0]
    reps = kind_reps(cm, lane.ranks)
    f = max(cm.op_time(r, ms, Phase.FORWARD) for r in reps)
    b = max(cm.compute_time(r, ms, Phase.BACKWARD) for r in reps)
    copy = cm.copy_time(rank, cm.held_boundary_bytes(ms, stage)) \
        if stage.offload.activations is not OffloadTarget.NONE else 0.0
    after, before = ministage_borders(ms, stage.index, _stage_of(cm), len(p.ministages))
    out = border_time(cm, stage, lane, p.stages[after], ms) if after is not None else 0.0
    back = border_time(cm, stage, lane, p.stages[before], ms - 1) if before is not None else 0.0
    return UnitLane.of(lane.microbatches, f, b, copy, out, back)
