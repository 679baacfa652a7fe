"""Layers to stages and microbatches to lanes: a CP-SAT model over the stages' option tables.

Given each stage's options (`tables`: a layer count with a ZeRO level,
offload and ministage count; per lane class the seconds per microbatch and
the microbatches that fit), choose one option per stage and a microbatch
count per lane class so that

    every layer unit is owned:           Σ_s n_s = U
    every microbatch has a lane:         Σ_j lanes_j · c_sj ≥ M,  1 ≤ c_sj ≤ cap_sj(option)
    lockstep lanes serve alike:          c_sj = M / lanes_s under per-microbatch ZeRO collectives
    T bounds every lane's work:          c_sj · cycle_sj(option) ≤ T

minimising T + Σ_s fill_s + max_s tail_s: the bottleneck lane, the fill and
drain it waits for (the bubble), and the gradient sync and optimizer step
after the flush. `assign_fast` solves the bottleneck alone exactly (the
least T whose feasible layer counts can sum to U, by bisection over the
options' own bottlenecks) and then spends spare capacity on a lower
bubble; CP-SAT starts from it and trades the terms against each other.
The exact per-lane counts are spread by `routing.spread` afterwards.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from ortools.sat.python import cp_model

from hetc.passes.plan.tables import Option, StageTable

__all__ = ["Assignment", "assign_cpsat", "assign_fast"]

log = logging.getLogger(__name__)

# Distinct bottleneck values above the least one that the fast path also tries (bubble vs bottleneck).
FAST_THRESHOLDS = 6
# Integer resolution of the CP-SAT model: this many steps to the fast solution's objective.
RESOLUTION = 200_000


@dataclass(frozen=True)
class Assignment:
    options: tuple[Option, ...]     # one per stage, in pipeline order
    objective: float                # T + Σ fill + max tail, seconds (the model's, not the exact score)


def _stage_bottlenecks(table: StageTable) -> list[tuple[float, Option]]:
    return [(o.work, o) for o in table.options if o.work is not None]


def _objective(options: list[Option]) -> float:
    return max(o.work for o in options) + sum(o.fill for o in options) + max(o.tail for o in options)


def assign_fast(tables: list[StageTable], units: int, m: int) -> Assignment | None:
    """Least bottleneck exactly; among the layer splits that reach it (and a few looser bounds), least bubble."""
    per_stage = [_stage_bottlenecks(t) for t in tables]
    if any(not opts for opts in per_stage):
        return None
    levels = sorted({_rounded(t) for opts in per_stage for t, _ in opts})
    lo, hi = 0, len(levels)
    while lo < hi:  # least feasible level
        mid = (lo + hi) // 2
        if _split(per_stage, units, levels[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    best: Assignment | None = None
    for bound in levels[lo:lo + FAST_THRESHOLDS]:
        chosen = _split(per_stage, units, bound)
        if chosen is not None:
            got = Assignment(tuple(chosen), _objective(chosen))
            if best is None or got.objective < best.objective:
                best = got
    return best


def _split(per_stage: list[list[tuple[float, Option]]], units: int, bound: float) -> list[Option] | None:
    """Options within `bound` whose layer counts sum to `units`, least Σ fill + tail (a DP over stages)."""
    best_at = []
    for opts in per_stage:
        by_n: dict[int, Option] = {}
        for t, o in opts:
            if _rounded(t) <= bound and (o.layers not in by_n or _rank(o) < _rank(by_n[o.layers])):
                by_n[o.layers] = o
        if not by_n:
            return None
        best_at.append(by_n)
    # reach[u]: (cost, choices) of the best way for the stages so far to own u units
    reach: dict[int, tuple[float, tuple[Option, ...]]] = {0: (0.0, ())}
    for by_n in best_at:
        nxt: dict[int, tuple[float, tuple[Option, ...]]] = {}
        for u, (cost, chosen) in reach.items():
            for n, o in by_n.items():
                if u + n > units:
                    continue
                cand = (cost + o.fill + o.tail, chosen + (o,))
                if u + n not in nxt or cand[0] < nxt[u + n][0]:
                    nxt[u + n] = cand
        reach = nxt
    got = reach.get(units)
    return list(got[1]) if got else None


def _rank(o: Option) -> tuple:
    """Least fill + tail; within float noise of each other, the plainer configuration."""
    return (_rounded(o.fill + o.tail), o.knobs)


def _rounded(x: float) -> float:
    return float(f"{x:.9g}")


def assign_cpsat(tables: list[StageTable], units: int, m: int, hint: Assignment | None,
                 time_limit: float = 1.0) -> Assignment | None:
    """The joint model; None when it finds nothing within `time_limit` seconds."""
    per_stage = [_stage_bottlenecks(t) for t in tables]
    if any(not opts for opts in per_stage):
        return None
    scale = RESOLUTION / (hint.objective if hint else max(t for opts in per_stage for t, _ in opts))

    def ticks(seconds: float) -> int:
        return int(math.ceil(seconds * scale))

    model = cp_model.CpModel()
    horizon = ticks(max(t for opts in per_stage for t, _ in opts)) + 1
    bound = model.NewIntVar(0, horizon, "T")
    tail = model.NewIntVar(0, ticks(max(o.tail for opts in per_stage for _, o in opts)) + 1, "tail")
    picks, layer_terms, fill_terms = [], [], []
    for s, opts in enumerate(per_stage):
        x = [model.NewBoolVar(f"x{s}_{k}") for k in range(len(opts))]
        model.AddExactlyOne(x)
        picks.append(x)
        layer_terms += [o.layers * xi for (_, o), xi in zip(opts, x)]
        fill_terms += [ticks(o.fill) * xi for (_, o), xi in zip(opts, x)]
        model.Add(tail >= sum(ticks(o.tail) * xi for (_, o), xi in zip(opts, x)))
        _lanes(model, s, opts, x, bound, m, ticks)
    model.Add(sum(layer_terms) == units)
    model.Minimize(bound + sum(fill_terms) + tail)
    if hint is not None:
        for (opts, x), chosen in zip(zip(per_stage, picks), hint.options):
            for (_, o), xi in zip(opts, x):
                model.AddHint(xi, o is chosen)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        log.debug("CP-SAT: %s", solver.StatusName(status))
        return None
    chosen = [next(o for (_, o), xi in zip(opts, x) if solver.Value(xi)) for opts, x in zip(per_stage, picks)]
    return Assignment(tuple(chosen), _objective(chosen))


def _lanes(model: cp_model.CpModel, s: int, opts, x, bound, m: int, ticks) -> None:
    """Microbatch counts per lane class of stage s, tied to the option its x picks."""
    shapes = {tuple(len(c.lanes) for c in o.classes) for _, o in opts}
    (sizes,) = shapes  # every option of a stage has the same lane classes
    counts = [model.NewIntVar(1, m, f"c{s}_{j}") for j in range(len(sizes))]
    model.Add(sum(n * c for n, c in zip(sizes, counts)) >= m)
    total = sum(sizes)
    for (_, o), xi in zip(opts, x):
        for c, cls in zip(counts, o.classes):
            model.Add(c <= max(cls.cap, 1)).OnlyEnforceIf(xi)
            model.Add(c * ticks(cls.cycle) <= bound).OnlyEnforceIf(xi)
            if o.equal_counts:
                model.Add(c == m // total).OnlyEnforceIf(xi)
