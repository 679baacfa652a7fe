"""The time of a stage's ZeRO collectives, host copies and optimizer step, for one rank.

One implementation for both readers of the cost model: `plan_time` (a
resolved Pipeline, rank by rank) and the planner's class-by-class
evaluation (passes/plan/candidate_stage.py). Each resolves the rank's groups
(`ZeroRings`) and its link times; the formulas are here.

- beside the compute, per microbatch (`zero_collectives`): ZeRO-2/3
  reduce the gradients after each backward, ZeRO-3 gathers the parameters
  around every compute op (`gathers_per_microbatch`), offloaded parameters
  come in and go back; `schedule.zero_cycle` places them (Note [zero cycle]);
- after the last backward (`sync_time`): the gradient reduction not already
  in the lanes' cycles (and ZeRO-1/2's parameter all-gather; hierarchical
  ZeRO's node-local reduce-scatter and gather plus the all-reduce across
  nodes);
- Zorse gathers and reduces once per ministage (`fetch_time`, `sync_time`
  with `per_ministage`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from hetc.passes.cost.memory import StateBytes
from hetc.ir.program import Collective
from hetc.ir.spec import ScheduleKind, ZeroShard, ZeroSpec

__all__ = ["ZeroRings", "across_nodes", "fetch_time", "first_gather_time", "flush_time", "gathers_per_microbatch",
           "optimizer_step_time", "piece_collectives", "publish_time", "sync_time", "zero_collectives"]

# (kind, ranks, bytes) -> seconds of a ring collective, the rank's node link shared by its lane's ranks
RingTime = Callable[[Collective, tuple[int, ...], float], float]


@dataclass(frozen=True)
class ZeroRings:
    """The groups one rank's ZeRO collectives run over, and how long one takes."""

    ring: RingTime                    # of the bytes the collective moves
    states: StateBytes
    group: tuple[int, ...]            # the whole ZeRO group (DP × CP)
    node: tuple[int, ...] = ()        # hierarchical ZeRO: the group's ranks on this rank's node
    across: tuple[int, ...] = ()      # hierarchical ZeRO: the ranks at its position on every node

    def time(self, kind: Collective, ranks: tuple[int, ...], param_bytes: float) -> float:
        """A ZeRO collective over a buffer of `param_bytes` parameters: a gather moves them, a reduction their
        gradients (`StateBytes.collective`)."""
        return self.ring(kind, ranks, self.states.collective(kind, param_bytes))

    def sharded(self, zero: ZeroSpec) -> tuple[int, ...]:
        """The ranks a level-2/3 shard spans: the node's under `shard = node`, else the whole group."""
        return self.node if zero.shard is ZeroShard.NODE else self.group


def across_nodes(group: Sequence[int], host_of: Callable[[int], object], rank: int) -> tuple[int, ...]:
    """Hierarchical ZeRO: the ranks of `group` at `rank`'s index among its node's members, in group order."""
    by_host: dict[object, list[int]] = {}
    for r in group:
        by_host.setdefault(host_of(r), []).append(r)
    idx = by_host[host_of(rank)].index(rank)
    chosen = {members[idx] for members in by_host.values() if idx < len(members)}
    return tuple(r for r in group if r in chosen)


def gathers_per_microbatch(schedule: ScheduleKind) -> int:
    """ZeRO-3 gathers a ministage's parameters around each of its compute ops: F and B, or F, I and W."""
    return 3 if schedule is ScheduleKind.ZB else 2


def zero_collectives(schedule: ScheduleKind, zero: ZeroSpec, offload_params: bool, nbytes: float,
                     rings: ZeroRings, copy: Callable[[float], float], param_shard: float,
                     units: Sequence[float] = ()) -> tuple[float, float, float]:
    """Per-microbatch work beside the compute for a stage of `nbytes` parameters (δΦ on this rank):
    (ZeRO-2/3 reduce-scatter, one ZeRO-3 gather, parameter copies from the host (`copy(bytes)`)), each in
    seconds; Note [zero cycle] in schedule.py says how the compute waits for them. `units`: the bytes of
    each unit a ZeRO-3 stage gathering per block gathers and reduces on its own (Note [zero-3 units]), one
    collective each; empty, the stage's at once."""
    level = zero.resolved_level
    if schedule is ScheduleKind.ZORSE:
        return 0.0, 0.0, 0.0  # Zorse gathers and reduces once per ministage (fetch_time, sync_time)
    if level < 2 and not offload_params:
        return 0.0, 0.0, 0.0
    each = piece_collectives(zero, rings, units if units and level >= 3 else (nbytes,))
    copies = 2 * copy(nbytes * param_shard) if offload_params else 0.0
    return sum(r for _, r in each), sum(g for g, _ in each), copies


def piece_collectives(zero: ZeroSpec, rings: ZeroRings, pieces: Sequence[float]) -> list[tuple[float, float]]:
    """Per buffer of `pieces` bytes (a unit, or the stage whole) that a per-microbatch ZeRO stage gathers and
    reduces on its own: (its ZeRO-3 gather, its ZeRO-2/3 reduce-scatter) seconds over the shard's ring."""
    level, ring = zero.resolved_level, rings.sharded(zero)

    def both(b: float) -> tuple[float, float]:
        return (rings.time(Collective.ALL_GATHER, ring, b) if level >= 3 else 0.0,
                rings.time(Collective.REDUCE_SCATTER, ring, b) if level >= 2 else 0.0)

    once = {b: both(b) for b in dict.fromkeys(pieces)}   # a model's blocks are units of one size
    return [once[b] for b in pieces]


def sync_time(zero: ZeroSpec, nbytes: float, rings: ZeroRings, per_ministage: bool = False,
              units: Sequence[float] = (), publish: bool = True) -> float:
    """Gradient reduction after the last backward (and ZeRO-1/2's parameter all-gather) for a stage of
    `nbytes` parameters; `units` as in `zero_collectives` (hierarchical ZeRO-3 reduces across nodes
    unit by unit).

    Under per-microbatch schedules ZeRO-2/3 reduce-scatter after every
    gradient op; the lane's cycle and trail count those (Note [zero cycle]).
    """
    level = zero.resolved_level
    if zero.shard is ZeroShard.NODE:
        inner = (rings.time(Collective.REDUCE_SCATTER, rings.node, nbytes) if level < 2 or per_ministage else 0.0) + \
            (rings.time(Collective.ALL_GATHER, rings.node, nbytes) if level <= 2 else 0.0)
        node = max(len(rings.node), 1)
        pieces = units if units and level >= 3 else (nbytes,)
        # Note [outer reductions beside the backward] (passes/lower/zero.py): released buffers reduce across
        # nodes beside the backward, but for those of the last two gradient ops (the first two, in layer order)
        beside = level >= 2 and not per_ministage
        return inner + sum(_reduced(zero.across, rings.across, b / node, rings, reduce=not beside or i < 2)
                           for i, b in enumerate(pieces))
    if not publish:   # Zorse's ministage before its step: the gather after it is `publish_time`
        return rings.time(Collective.ALL_REDUCE if level == 0 else Collective.REDUCE_SCATTER, rings.group, nbytes)
    if level <= 1:
        return _reduced(level, rings.group, nbytes, rings)
    gather = rings.time(Collective.ALL_GATHER, rings.group, nbytes) if level == 2 else 0.0
    if per_ministage:  # Zorse: one reduce-scatter per ministage, then (ZeRO-2) one gather
        return rings.time(Collective.REDUCE_SCATTER, rings.group, nbytes) + gather
    return gather


def publish_time(zero: ZeroSpec, nbytes: float, rings: ZeroRings) -> float:
    """Of a Zorse ministage's `sync_time`, the all-gather that publishes its stepped shard (ZeRO-1/2 over a
    flat group): posted after its step, not before it (Note [zero placement] in passes/lower/zero.py)."""
    if zero.shard is ZeroShard.NODE or zero.resolved_level not in (1, 2) or len(rings.group) < 2:
        return 0.0
    return rings.time(Collective.ALL_GATHER, rings.group, nbytes)


def _reduced(level: int, group: tuple[int, ...], nbytes: float, rings: ZeroRings, reduce: bool = True) -> float:
    """Gradients reduced over `group` and, sharded (level 1 and up), the parameters gathered back after the
    step, as lowering issues them (Note [zero placement]): one all-reduce at level 0, else a reduce-scatter
    and an all-gather. The ring model times both alike; each is a call of its own (Note [core wait]).
    `reduce=False`: the reduction ran beside the backward; only the gather back is left."""
    if level == 0:
        return rings.time(Collective.ALL_REDUCE, group, nbytes) if reduce else 0.0
    return (rings.time(Collective.REDUCE_SCATTER, group, nbytes) if reduce else 0.0) + \
        rings.time(Collective.ALL_GATHER, group, nbytes)


def first_gather_time(zero: ZeroSpec, first_bytes: float, rings: ZeroRings) -> float:
    """ZeRO-3: the first stage waits for its first ministage's gather before anything runs."""
    if zero.resolved_level < 3 or len(rings.group) < 2:
        return 0.0
    return rings.time(Collective.ALL_GATHER, rings.sharded(zero), first_bytes)


def fetch_time(zero: ZeroSpec, offload_params: bool, nbytes: float, rings: ZeroRings,
               copy: Callable[[float], float], param_shard: float) -> float:
    """Zorse brings one ministage's `nbytes` parameters in once per step: ZeRO-3 gather, host copy."""
    fetch = rings.time(Collective.ALL_GATHER, rings.group, nbytes) if zero.resolved_level >= 3 else 0.0
    if offload_params:
        fetch += copy(nbytes * param_shard)
    return fetch


def flush_time(syncs: Iterable[float], steps: Iterable[float]) -> float:
    """A stage's tail after its last backward: the ranks at one position of every lane sync together
    (`syncs`: one per position), then each device kind steps its shard (`steps`: one per kind)."""
    return max(syncs) + max(steps)


def optimizer_step_time(step: Callable[[float], float], copy: Callable[[float], float], numel: float,
                        on_host: bool, states: StateBytes) -> float:
    """One optimizer step over the `numel` parameters this rank keeps (`step(numel)`); on the host, the
    gradients go down and the parameters come back up."""
    t = step(numel)
    if on_host:
        t += copy(numel * (states.grads + states.params))
    return t
