"""Per-stage option tables: what a stage costs for each layer count and configuration.

For a fixed stage layout, schedule and micro-batch size, a stage's cost
depends on how many layer units it owns (n) and on its `Knobs`. For each
(n, knobs) an `Option` records the cost model's terms for it
(passes/plan/stage_option.py: per class of alike lanes the seconds of one
microbatch and the microbatches that still fit in memory; the stage's
pipeline fill, gradient-sync-and-step tail and drain) and the least
busiest-lane work of placing every microbatch (`routing.bottleneck`).
`assign` chooses one option per stage and the microbatches per lane class.

Entries read the stage on a stand-in pipeline (`StageContext`): the stage
itself, exact, between one-rank stand-ins for its neighbours (their first
GPU receives its activations). Only the border peers are approximate; the
chosen plan is scored exactly afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

from hetc.ir.errors import InternalError
from hetc.passes.plan.candidate_stage import StageCosts
from hetc.passes.plan.candidate_view import ResolvedStage, StageContext, StageView
from hetc.passes.plan.primitives import Primitives
from hetc.passes.plan.stage_option import LaneClass, lockstep, option_costs, serialised_fill
from hetc.passes.plan.candidate import Knobs, split_evenly
from hetc.passes.plan.routing import bottleneck
from hetc.ir.spec import ScheduleKind, ZeroSpec
from hetc.ir.topology import Gpu

__all__ = ["Option", "StageTable", "holds_all", "placeable", "stage_costs", "stage_option"]


@dataclass(frozen=True, slots=True)
class Option:
    layers: int
    knobs: Knobs
    classes: tuple[LaneClass, ...]
    fill: float                 # this stage's share of the pipeline bubble
    tail: float                 # gradient sync + optimizer step after the flush
    drain: float                # backward + p2p of one microbatch (what later stages' tails hide behind)
    equal_counts: bool          # per-microbatch collectives: every lane must serve as many microbatches
    work: float | None          # least busiest-lane seconds over all microbatches (None: cannot place them)

    def lane_classes(self) -> list[tuple[int, float, int]]:
        return [(len(c.lanes), c.cycle, c.cap) for c in self.classes]

    @property
    def placed_work(self) -> float:
        """`work` of an option that can place its microbatches (the only ones the search keeps)."""
        if self.work is None:
            raise InternalError(f"an option that cannot place its microbatches was kept: {self.knobs}")
        return self.work


@dataclass
class StageTable:
    index: int
    res: ResolvedStage
    options: list[Option] = field(default_factory=list)

    def by_layers(self) -> dict[int, list[Option]]:
        out: dict[int, list[Option]] = {}
        for o in self.options:
            out.setdefault(o.layers, []).append(o)
        return out


def _context(prims: Primitives, index: int, num_stages: int, n: int, ministages: int, interleave: int,
             neighbours: dict[int, Gpu], schedule: ScheduleKind, prefetch: int) -> tuple[StageContext, tuple[int, ...]]:
    """Stand-in ministages: this stage's own, at their true layer kinds, between neighbour stand-ins.

    Only the kinds of a ministage's layers matter (blocks are alike), so a
    chunk is placed at the model's start if it holds the embedding, at its
    end if it holds the head, and right after the embedding otherwise.
    """
    units = prims.model.num_model_layers
    last_stage = index == num_stages - 1
    sizes = split_evenly(n, interleave or ministages)
    out: list[tuple[int, int, int]] = []
    own = []
    lo = 0 if index == 0 else (units - n if last_stage and not interleave else 1)
    for j, size in enumerate(sizes):
        first_chunk, last_chunk = j == 0, j == len(sizes) - 1
        if interleave:
            lo = 0 if index == 0 and first_chunk else (units - size if last_stage and last_chunk else 1)
        if num_stages > 1 and (first_chunk or interleave) and not (index == 0 and first_chunk):
            out.append((0, 0, (index - 1) % num_stages))
        own.append(len(out))
        out.append((lo, lo + size, index))
        lo += size
        if num_stages > 1 and (last_chunk or interleave) and not (last_stage and last_chunk):
            out.append((0, 0, (index + 1) % num_stages))
    ctx = StageContext(tuple(out), schedule, prefetch, num_stages, prims.micro_batch, neighbours)
    return ctx, tuple(own)


def stage_costs(prims: Primitives, res: ResolvedStage, index: int, num_stages: int, n: int, knobs: Knobs,
                schedule: ScheduleKind, neighbours: dict[int, Gpu], interleave: int = 0, prefetch: int = 1,
                zero_base: ZeroSpec | None = None) -> StageCosts:
    """The cost model's view of stage `index` owning n layer units under `knobs`, between stand-ins."""
    m = prims.num_microbatches
    nominal = _nominal_counts(m, len(res.lanes))
    ctx, own = _context(prims, index, num_stages, n, knobs.ministages, interleave, neighbours, schedule,
                        prefetch)
    view = StageView(index, res, knobs, _zero_at(zero_base or ZeroSpec(), knobs.zero), own, nominal)
    return StageCosts(prims, ctx, view)


@lru_cache(maxsize=256)
def _nominal_counts(m: int, num_lanes: int) -> tuple[int, ...]:
    """The microbatches per lane an option table reads its stage with: `m` split evenly (one each when
    there are more lanes than microbatches); memoised, as every option of a stage asks."""
    return tuple(split_evenly(m, num_lanes)) if num_lanes <= m else (1,) * num_lanes


@lru_cache(maxsize=256)
def _zero_at(base: ZeroSpec, level: int) -> ZeroSpec:
    return replace(base, level=level)


def stage_option(prims: Primitives, res: ResolvedStage, index: int, num_stages: int, n: int, knobs: Knobs,
                 schedule: ScheduleKind, neighbours: dict[int, Gpu], interleave: int = 0, prefetch: int = 1,
                 zero_base: ZeroSpec | None = None) -> Option | None:
    """Stage `index`'s option of n layer units under `knobs`; None where its ministages or chunks do not fit
    in n units, or where it cannot place the microbatches (Note [options that cannot be placed])."""
    if knobs.ministages > n or (interleave and interleave > n) or \
            not placeable(prims.num_microbatches, res, knobs, schedule, zero_base):
        return None
    sc = stage_costs(prims, res, index, num_stages, n, knobs, schedule, neighbours, interleave, prefetch,
                     zero_base)
    return _option(sc, n, knobs, res.classes, prims.num_microbatches)


# Note [options that cannot be placed]: lanes in lockstep (ZeRO-2/3 collectives per microbatch, `lockstep`)
# serve equal counts, so where the m microbatches do not split evenly over a stage's lanes no assignment can
# use the option, whatever it costs (its work would be None; at 128 GPUs that is most ZeRO-2/3 options, as
# 512 microbatches do not split over 20 lanes). It is not built. The one thing the search asks of it is
# whether it would hold all m microbatches on every lane (a stage takes its fallback configuration at a
# layer count only where none of its configurations does, `Structures._table`): `holds_all`, the stage's
# memory at m alone, asked only where no option that can be placed holds them.


def placeable(m: int, res: ResolvedStage, knobs: Knobs, schedule: ScheduleKind,
              zero_base: ZeroSpec | None = None) -> bool:
    """Whether the stage's lanes can share the m microbatches under `knobs` (Note [options that cannot be
    placed])."""
    lanes = len(res.lanes)
    return not (lockstep(schedule, knobs.zero, (zero_base or ZeroSpec()).shard, lanes) and m % lanes)


def holds_all(sc: StageCosts, classes: list[tuple[int, ...]], m: int) -> bool:
    """Whether every lane of the stage holds all m microbatches in memory."""
    return all(sc.fits(lanes[0], m) for lanes in classes)


def _option(sc: StageCosts, n: int, knobs: Knobs, classes: list[tuple[int, ...]], m: int) -> Option:
    costs = option_costs(sc, classes, m)
    work = bottleneck(m, [(len(c.lanes), c.cycle, c.cap) for c in costs.classes], costs.equal_counts)
    return Option(n, knobs, costs.classes, costs.fill + serialised_fill(sc, work), costs.tail, costs.drain,
                  costs.equal_counts, work)
