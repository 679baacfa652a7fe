"""A lower bound on a structure's assignment objective, found before any of its option tables is built.

Note [bounding a screen]: on large clusters steps 1 and 2 of the search (search.py) rank structures by
the objective of their fast assignment, `assign.model_objective` (the busiest lane's work, every stage's
fill, the tail after the flush), and keep the best k. Building the option tables of the many structures
far from the best is most of the search's time. A structure whose lower bound exceeds the k-th best
objective found so far cannot be among the best k, so `Search._screen` assigns structures in the order
of their bounds and stops at the first bound above it: the structures kept, and their order, are the
ones assigning every structure gives (a structure left out has an objective strictly above every one
kept).

The bound relaxes the assignment model, so it is at most the objective of any option choice:

- memory, lockstep counts and the collectives beside the compute drop out: a lane class's cycle is at
  least its compute F + I + W (`Primitives.lane_compute`, without the cores' slowdown, which only slows
  it, and with either recompute setting that the stage's configurations take) plus, under the
  per-microbatch schedules, what its thread waits for its border transfers (`transfer_waits`; fewest
  with one ministage, since more ministages leave each transfer less compute to hide behind). Under
  Zorse's schedule the cycle sums the compute of its ministages, at least the stage's;
- a stage's work, `routing.bottleneck` of the cycles (the least max over lanes of count × cycle), is at
  least the fluid bound m / Σ lanes / cycle, where no count is whole and no memory caps it, rounded up to
  the next count step c × cycle of some class (the least max is one), and at least every cycle;
- a stage's fill is what `option_costs` counts from the same compute and transfers: under ZB-H1
  F + I + transfers − W, under 1F1B and interleaved one microbatch's compute and transfers; under
  Zorse's schedule at least one microbatch's compute (its fetch, transfers and serialised fill are
  dropped);
- the tail is at least 0;
- over the layer counts: the least bound T that every stage's work bound can meet with counts summing to
  the units, plus the least Σ fill over counts summing to the units, each minimised on its own.

The borders are read once per stage (they do not depend on its layer count) and the rest is the cost
model's per-layer arithmetic, so a bound costs a small part of one assignment. tests/test_planner.py
holds the bound under the objective of every structure of a layout of 64 GPUs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hetc.passes.cost.probe import Primitives
from hetc.passes.cost.transfers import Borders, transfer_waits
from hetc.passes.plan.candidate import Knobs
from hetc.passes.plan.structures import Structure, Structures
from hetc.passes.plan.tables import stage_costs
from hetc.spec import ScheduleKind

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
        counts = range(fixed, fixed + 1) if fixed is not None else range(1, limits[s] + 1)
        work, fill = _stage_bounds(search, st, s, counts)
        works.append(work)
        fills.append(fill)
    least = _least_bottleneck(works, search.units) + _least_fill(fills, search.units)
    return least * search._price_factor(st) * (1 - _SLACK)


def _stage_bounds(search: Structures, st: Structure, s: int, counts: range
                  ) -> tuple[dict[int, float], dict[int, float]]:
    """Stage s's bounds on its work and its fill for each layer count."""
    prims = search.prims[st.micro_batch]
    n_stages, schedule = len(st.layout), st.schedule
    res = search.resolve(st.layout[s])
    knobs = search.knobs(st, s, full=False)   # what assign(full=False) may choose from, its fallback included
    reruns = sorted({k.offload.activations for k in knobs})
    neighbours = search.neighbours(st, s)
    # the borders, with one ministage (interleaved: its chunks), and whether the stage holds the embedding
    # and the head (read at its most units: a lone stage holds both only with all of them); the same at
    # every layer count
    most = max(counts[-1], st.interleave)
    sc = stage_costs(prims, res, s, n_stages, most, Knobs(knobs[0].zero, knobs[0].offload, 1), schedule,
                     neighbours, st.interleave, search.space.prefetch, search.space.zero_base)
    embed, _, head = sc.layer_counts
    units = [(n, (embed, n - embed - head, head)) for n in counts if n >= embed + head]
    per_class = [_LaneCosts(prims, schedule, res.lane_devices[lanes[0]], res.tp, reruns, sc.p2p(lanes[0])
                            ).over([u for _, u in units]) for lanes in res.classes]
    m = prims.num_microbatches
    sizes = [len(lanes) for lanes in res.classes]
    works: dict[int, float] = {}
    fills: dict[int, float] = {}
    for k, (n, _) in enumerate(units):
        works[n] = _least_work(m, sizes, [cycles[k] for cycles, _ in per_class])
        fills[n] = max(fill[k] for _, fill in per_class)
    return works, fills


class _LaneCosts:
    """One lane class's compute per layer kind (compute is linear in the units) for each recompute setting
    and device kind of the lane, and its border transfers."""

    def __init__(self, prims: Primitives, schedule: ScheduleKind, lane: tuple[tuple[str, ...], tuple[int, ...]],
                 tp: int, reruns: list[bool], borders: Borders):
        devices, ids = lane
        self.prims, self.schedule, self.borders = prims, schedule, borders
        self.total = borders.total
        kinds = ((1, 0, 0), (0, 1, 0), (0, 0, 1))
        # per recompute setting and device kind: per phase, (embed, block, head) seconds
        self.per_kind = [[tuple(zip(*(prims.lane_compute((d,), tp, ids, rerun, k, 1.0) for k in kinds)))
                          for d in dict.fromkeys(devices)] for rerun in reruns]

    def over(self, units: list[tuple[int, int, int]]) -> tuple[list[float], list[float]]:
        """Bounds on the class's cycle and fill with each of these (embed, blocks, head) units."""
        cycles, fills = [math.inf] * len(units), [math.inf] * len(units)
        for per_device in self.per_kind:
            for k, (e, b, h) in enumerate(units):
                # each phase on each device kind of the lane; the lane's is its slowest kind's
                phases = [[e * x[0] + b * x[1] + h * x[2] for x in costs] for costs in per_device]
                least = phases[0] if len(phases) == 1 else [min(p) for p in zip(*phases)]
                most = phases[0] if len(phases) == 1 else [max(p) for p in zip(*phases)]
                c, f = _cycle_and_fill(self.prims, self.schedule, least, most, self.borders, self.total)
                cycles[k], fills[k] = min(cycles[k], c), min(fills[k], f)
        return cycles, fills


def _least_work(m: int, sizes: list[int], cycles: list[float]) -> float:
    """At most `routing.bottleneck` of lane classes of `sizes` lanes and these cycles without caps: its least
    max count × cycle is a count step c × cycle of some class at or above the fluid bound m / Σ lanes /
    cycle, and each lane serves one at least."""
    if len(sizes) == 1:
        return math.ceil(m / sizes[0]) * cycles[0]
    fluid = m / sum(n / c for n, c in zip(sizes, cycles))
    return max(max(cycles), min(math.ceil(fluid / c) * c for c in cycles))


def _cycle_and_fill(prims: Primitives, schedule: ScheduleKind, least: list[float], most: list[float],
                    border: Borders, total: float) -> tuple[float, float]:
    """Bounds on a lane class's cycle and fill, from each phase's least and most over its device kinds (one
    kind: the same) and its border transfers (`total` of them). Waits and ZB-H1's fill fall as compute
    grows: they take the most."""
    f, i, w = least
    compute = f + i + w
    if schedule is ScheduleKind.ZORSE:   # transfers delay the next stage, not the lane (`option_costs`)
        return compute, compute
    cycle = compute + transfer_waits(prims.engine, schedule, border, (most[0], most[1], most[2]))
    fill = max(0.0, f + i + total - most[2]) if schedule is ScheduleKind.ZB else compute + total
    return cycle, fill


def _least_bottleneck(works: Sequence[dict[int, float]], units: int) -> float:
    """The least T such that counts summing to `units` keep every stage's work within T."""
    levels = sorted({v for work in works for v in work.values()})
    lo, hi = 0, len(levels)
    while lo < hi:
        mid = (lo + hi) // 2
        if _reachable(works, units, levels[mid]):
            hi = mid
        else:
            lo = mid + 1
    return levels[lo] if lo < len(levels) else math.inf


def _reachable(works: Sequence[dict[int, float]], units: int, bound: float) -> bool:
    reach, mask = 1, (1 << (units + 1)) - 1
    for work in works:
        nxt = 0
        for n, v in work.items():
            if v <= bound:
                nxt |= reach << n
        reach = nxt & mask
        if not reach:
            return False
    return bool(reach >> units & 1)


def _least_fill(fills: Sequence[dict[int, float]], units: int) -> float:
    """The least Σ fill over counts summing to `units`."""
    best = [0.0] + [math.inf] * units   # by the units the stages so far own
    for fill in fills:
        nxt = [math.inf] * (units + 1)
        for u, total in enumerate(best):
            if total < math.inf:
                for n, f in fill.items():
                    if u + n <= units and total + f < nxt[u + n]:
                        nxt[u + n] = total + f
        best = nxt
    return best[units]
