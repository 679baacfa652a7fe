"""A lower bound on a structure's assignment objective, found before any of its option tables is built.

Note [bounding a screen]: on large clusters steps 1 and 2 of the search (search.py) rank structures by
the objective of their fast assignment, `assign.model_objective` (the busiest lane's work, every stage's
fill, the tail after the flush), and keep the best k. Building the option tables of the many structures
far from the best is most of the search's time. A structure whose lower bound exceeds the k-th best
objective found so far cannot be among the best k, so `Search._screen` assigns structures in the order
of their bounds and stops at the first bound above it: the structures kept, and their order, are the
ones assigning every structure gives (a structure left out has an objective strictly above every one
kept).

The bound relaxes the assignment model, so it is at most the objective of any option choice. For each
stage and layer count it takes the least over the configurations the screen's assignment may choose
(`Structures.knobs`, its fallback included) of:

- a lane class's cycle: at least its compute F + I + W (`Primitives.lane_compute`, without the cores'
  slowdown, which only slows it, with the configuration's recompute setting) plus, under the
  per-microbatch schedules, what its thread waits for its border transfers (`transfer_waits`; fewest
  with one ministage, since more ministages leave each transfer less compute to hide behind); under
  Zorse's schedule the sum of its ministages' compute, at least the stage's, with the engine's overhead
  per microbatch. Memory, lockstep counts and the collectives beside the compute drop out;
- the stage's work, `routing.bottleneck` of the cycles (the least max over lanes of count × cycle): at
  least the fluid bound m / Σ lanes / cycle, where no count is whole and no memory caps it, rounded up to
  the next count step c × cycle of some class (the least max is one), and at least every cycle;
- its fill, what `option_costs` counts from the same compute and transfers: under ZB-H1 F + I +
  transfers − W, under 1F1B and interleaved one microbatch's compute and transfers; under Zorse's schedule
  at least one microbatch's cycle (its fetch and transfers are dropped) plus the (k − 1)/k of its work
  that its k ministages serialise;
- under Zorse's schedule a configuration that keeps its activations on the device holds every
  microbatch's at a rank's peak, so a lane holds at most (its memory − its reserve) / one microbatch's
  activations: where its lanes cannot hold the m microbatches between them, the configuration cannot
  place them and is left out (without this, the one-ministage configurations' small fill makes the bound
  of a Zorse structure far below its objective, and most of a screen's Zorse structures are assigned);
- the tail: at least 0;

and over the layer counts: the least bound T that every stage's work bound can meet with counts summing
to the units, plus the least Σ fill over counts summing to the units, each minimised on its own.

The borders are read once per stage (they do not depend on its layer count) and the rest is the cost
model's per-layer arithmetic, so a bound costs a small part of one assignment. tests/test_planner.py
holds the bound under the objective of every structure of a layout of 64 GPUs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from hetc.passes.plan.assign import feasible_levels
from hetc.passes.plan.candidate_view import ResolvedStage
from hetc.passes.plan.primitives import Primitives
from hetc.passes.cost.shapes import LayerKind
from hetc.passes.cost.transfers import Borders, transfer_waits
from hetc.passes.plan.structures import Structure, Structures
from hetc.passes.plan.tables import stage_costs
from hetc.ir.spec import Checkpointing, ScheduleKind

__all__ = ["screen_bound"]

# float slack: the bound is arithmetic of the same numbers the objective sums, in another order
_SLACK = 1e-9


def screen_bound(search: Structures, st: Structure) -> float:
    """A lower bound on `search.assign(st, full=False)`'s objective (Note [bounding a screen]); inf where
    no layer counts place every stage."""
    limits = search._limits(st)
    works, fills = [], []
    for s in range(len(st.layout)):
        fixed = search._fixed_layers(s)
        counts = range(fixed, fixed + 1) if fixed is not None else search.counts(st, s, 1, limits[s])
        work, fill = _stage_bounds(search, st, s, counts)
        works.append(work)
        fills.append(fill)
    levels = feasible_levels([list(work.items()) for work in works], search.units)
    least = (levels[0] if levels else math.inf) + _least_fill(fills, search.units)
    return least * search._price_factor(st) * (1 - _SLACK)


def _stage_bounds(search: Structures, st: Structure, s: int, counts: range
                  ) -> tuple[dict[int, float], dict[int, float]]:
    """Stage s's bounds on its work and its fill for each layer count."""
    prims = search.prims[st.micro_batch]
    n_stages, schedule = len(st.layout), st.schedule
    res = search.resolve(st.layout[s])
    knobs = search.knobs(st, s, full=False)   # what assign(full=False) may choose from, its fallback included
    if not knobs:   # the stage allows no configuration: nothing places it
        return {}, {}
    # the recompute settings to bound: (activations offloaded, so the ministage reruns; activation checkpointing)
    recomputes = sorted({(k.offload.activations, k.checkpoint) for k in knobs})
    neighbours = search.neighbours(st, s)
    # the borders, with one ministage (interleaved: its chunks), and whether the stage holds the embedding
    # and the head (read at its most units: a lone stage holds both only with all of them); the same at
    # every layer count
    most = max(counts[-1], st.interleave)
    sc = stage_costs(prims, res, s, n_stages, most, replace(knobs[0], ministages=1), schedule,
                     neighbours, st.interleave, search.space.prefetch, search.space.zero_base)
    embed, _, head = sc.layer_counts
    units = [(n, (embed, n - embed - head, head)) for n in counts if n >= embed + head]
    per_class = [_LaneCosts(prims, schedule, res.lane_devices[lanes[0]], res.tp, recomputes, sc.p2p(lanes[0]),
                            sc.overhead(lanes[0])).over([u for _, u in units]) for lanes in res.classes]
    m = prims.num_microbatches
    sizes = [len(lanes) for lanes in res.classes]
    holds = _Holds(prims, res, m, sizes) if schedule is ScheduleKind.ZORSE else None
    serialised = schedule is ScheduleKind.ZORSE and n_stages > 1
    choices = dict.fromkeys(((k.offload.activations, k.checkpoint), k.ministages) for k in knobs)
    works: dict[int, float] = {}
    fills: dict[int, float] = {}
    for i, (n, u) in enumerate(units):
        got = []   # (work, fill) of each configuration that may place the microbatches
        for recompute, ministages in choices:
            rerun, checkpoint = recompute
            if holds is not None and not rerun and not holds.all(u, checkpoint):
                continue
            work = _least_work(m, sizes, [by_setting[recompute][0][i] for by_setting in per_class])
            fill = max(by_setting[recompute][1][i] for by_setting in per_class)
            got.append((work, fill + ((ministages - 1) / ministages * work if serialised else 0.0)))
        if got:
            works[n], fills[n] = min(w for w, _ in got), min(f for _, f in got)
    return works, fills


class _Holds:
    """Zorse's schedule holds every microbatch's activations at a rank's peak (unless they are offloaded), so
    a lane holds at most (its device's memory − its reserve − what the plan leaves spare) / (one microbatch's
    activations) of them (`memory.activation_memory`, `zorse_backward_peak`: the rest of its memory only
    lowers that)."""

    def __init__(self, prims: Primitives, res: ResolvedStage, m: int, sizes: list[int]):
        self.m, self.sizes = m, sizes
        self.rooms = [min(g.device.memory - prims.context(g) - prims.spare(g) for g in res.lanes[lanes[0]])
                      for lanes in res.classes]
        self.prims, self.tp = prims, res.tp

    def all(self, units: tuple[int, int, int], checkpoint: Checkpointing) -> bool:
        """Whether the lanes may hold the m microbatches between them, one each at least."""
        per_kind = [self.prims.activations(kind, self.tp, checkpoint)
                    for kind in (LayerKind.EMBED, LayerKind.BLOCK, LayerKind.HEAD)]
        per_microbatch = sum(n * a for n, a in zip(units, per_kind))
        if per_microbatch <= 0:
            return True
        caps = [min(self.m, math.floor(room / per_microbatch * (1 + _SLACK))) for room in self.rooms]
        return min(caps) >= 1 and sum(n * c for n, c in zip(self.sizes, caps)) >= self.m


class _LaneCosts:
    """One lane class's compute per layer kind (compute is linear in the units) for each recompute setting
    and device kind of the lane, and its border transfers."""

    def __init__(self, prims: Primitives, schedule: ScheduleKind, lane: tuple[tuple[str, ...], tuple[int, ...]],
                 tp: int, recomputes: list[tuple[bool, Checkpointing]], borders: Borders, overhead: float):
        devices, ids = lane
        self.prims, self.schedule, self.borders, self.overhead = prims, schedule, borders, overhead
        self.total = borders.total
        self.recomputes = recomputes
        kinds = ((1, 0, 0), (0, 1, 0), (0, 0, 1))
        # per recompute setting and device kind: per phase, (embed, block, head) seconds
        self.per_kind = [[tuple(zip(*(prims.lane_compute((d,), tp, ids, rerun, checkpoint, k, 1.0) for k in kinds)))
                          for d in dict.fromkeys(devices)] for rerun, checkpoint in recomputes]

    def over(self, units: list[tuple[int, int, int]]
             ) -> dict[tuple[bool, Checkpointing], tuple[list[float], list[float]]]:
        """Per recompute setting, bounds on the class's cycle and fill with each of these (embed, blocks, head)
        units."""
        out = {}
        for recompute, per_device in zip(self.recomputes, self.per_kind):
            cycles, fills = [], []
            for e, b, h in units:
                # each phase on each device kind of the lane; the lane's is its slowest kind's
                phases = [[e * x[0] + b * x[1] + h * x[2] for x in costs] for costs in per_device]
                least = phases[0] if len(phases) == 1 else [min(p) for p in zip(*phases)]
                most = phases[0] if len(phases) == 1 else [max(p) for p in zip(*phases)]
                c, f = _cycle_and_fill(self.prims, self.schedule, least, most, self.borders, self.total, self.overhead)
                cycles.append(c)
                fills.append(f)
            out[recompute] = (cycles, fills)
        return out


def _least_work(m: int, sizes: list[int], cycles: list[float]) -> float:
    """At most `routing.bottleneck` of lane classes of `sizes` lanes and these cycles without caps: its least
    max count × cycle is a count step c × cycle of some class at or above the fluid bound m / Σ lanes /
    cycle, and each lane serves one at least."""
    if len(sizes) == 1:
        return math.ceil(m / sizes[0]) * cycles[0]
    fluid = m / sum(n / c for n, c in zip(sizes, cycles))
    return max(max(cycles), min(math.ceil(fluid / c) * c for c in cycles))


def _cycle_and_fill(prims: Primitives, schedule: ScheduleKind, least: list[float], most: list[float],
                    border: Borders, total: float, overhead: float) -> tuple[float, float]:
    """Bounds on a lane class's cycle and fill, from each phase's least and most over its device kinds (one
    kind: the same), its border transfers (`total` of them) and, under Zorse's schedule, its engine's
    overhead per microbatch (`unit_lane_times` spreads it over the ministages). Waits and ZB-H1's fill fall
    as compute grows: they take the most."""
    f, i, w = least
    compute = f + i + w
    if schedule is ScheduleKind.ZORSE:   # transfers delay the next stage, not the lane (`option_costs`)
        return compute + overhead, compute + overhead
    cycle = compute + transfer_waits(prims.engine, schedule, border, (most[0], most[1], most[2]))
    fill = max(0.0, f + i + total - most[2]) if schedule is ScheduleKind.ZB else compute + total
    return cycle, fill


def _least_fill(fills: Sequence[dict[int, float]], units: int) -> float:
    """The least Σ fill over counts summing to `units`: a DP over the sums the stages so far can own, kept
    sparse, since on a grid of counts (Note [a grid of layer counts] in grid.py) few of the sums occur."""
    best = {0: 0.0}   # by the units the stages so far own
    for fill in fills:
        nxt: dict[int, float] = {}
        for u, total in best.items():
            for n, f in fill.items():
                if u + n <= units and total + f < nxt.get(u + n, math.inf):
                    nxt[u + n] = total + f
        best = nxt
    return best.get(units, math.inf)
