"""Layers to stages and microbatches to lanes: a CP-SAT model over the stages' option tables.

Given each stage's options (`tables`: a layer count with a ZeRO level,
offload and ministage count; per lane class the seconds per microbatch and
the microbatches that fit), choose one option per stage and a microbatch
count per lane class so that

    every layer unit is owned:           Σ_s n_s = U
    every microbatch has a lane:         Σ_j lanes_j · c_sj ≥ M,  1 ≤ c_sj ≤ cap_sj(option)
    lockstep lanes serve alike:          c_sj = M / lanes_s under per-microbatch ZeRO collectives
    T bounds every lane's work:          c_sj · cycle_sj(option) ≤ T

minimising T + Σ_s fill_s + max_s (tail_s − Σ_{s'<s} drain_s'): the
bottleneck lane, the fill and drain it waits for (the bubble), and the
gradient sync and optimizer step after the flush, which each stage starts
when its own backward ends, the drains of the stages before it earlier.
`assign_fast` solves the bottleneck alone exactly (the least T whose
feasible layer counts can sum to U, by bisection over the options' own
bottlenecks), then spends spare capacity on a lower bubble and tail;
CP-SAT starts from it and trades the terms against each other.
The exact per-lane counts are spread by `routing.spread` afterwards.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from hetc.passes.plan import cpsat
from hetc.passes.plan.candidate import Knobs
from hetc.passes.plan.routing import spread
from hetc.passes.plan.tables import Option, StageTable

__all__ = ["Assignment", "assign_cpsat", "assign_fast", "cpsat_model", "feasible_levels", "model_objective"]

log = logging.getLogger(__name__)

# Distinct bottleneck values above the least one that the fast path also tries (bubble vs bottleneck).
FAST_THRESHOLDS = 6
# Integer resolution of the CP-SAT model: this many steps to the fast solution's objective.
RESOLUTION = 200_000


@dataclass(frozen=True)
class Assignment:
    options: tuple[Option, ...]     # one per stage, in pipeline order
    objective: float                # T + Σ fill + max tail, seconds (the model's, not the exact score)


@dataclass(frozen=True)
class _Entry:
    work: float          # rounded: float noise does not decide
    rank: tuple[float, Knobs]
    option: Option


def _entries(tables: list[StageTable]) -> list[list[_Entry]]:
    """Per stage, its placeable options, least work first."""
    return [sorted((_Entry(_rounded(o.work), _rank(o), o) for o in t.options if o.work is not None),
                   key=lambda e: e.work) for t in tables]


def model_objective(options: list[Option] | tuple[Option, ...]) -> float:
    """T + Σ fill + the tail after the flush, where a stage's tail hides behind the drains of the
    stages before it (they finish their backward later): the cost model's `_tail`."""
    tail, lead, work, fill = 0.0, 0.0, -math.inf, 0.0
    # one pass, without a call of max() per option: the local search asks this of every move it tries, and
    # the calls were a fifth of the fast assignment's time at 2048 GPUs
    for o in options:
        if o.tail - lead > tail:  # noqa: PLR1730
            tail = o.tail - lead
        lead += o.drain
        if o.placed_work > work:  # noqa: PLR1730
            work = o.placed_work
        fill += o.fill
    return work + fill + tail


def _polish(options: list[Option], per_stage: list[list[_Entry]], grain: int, rounds: int = 64) -> list[Option]:
    """Local moves under the objective: `grain` units from one stage to another (each keeping its
    configuration where it can), or another configuration at a stage's count."""
    by_n: list[dict[int, list[Option]]] = [{} for _ in per_stage]
    for table, entries in zip(by_n, per_stage):
        for e in sorted(entries, key=lambda e: e.rank):
            table.setdefault(e.option.layers, []).append(e.option)
    best, value = list(options), model_objective(options)
    for _ in range(rounds):
        for moved in _moves(best, by_n, grain):
            v = model_objective(moved)
            if v < value * (1 - 1e-12):
                best, value = moved, v
                break
        else:
            break
    return best


def _like(choices: list[Option], was: Option) -> Option | None:
    return next((o for o in choices if o.knobs == was.knobs), choices[0] if choices else None)


def _moves(options: list[Option], by_n: list[dict[int, list[Option]]], grain: int) -> Iterator[list[Option]]:
    n = len(options)
    for a in range(n):
        for b in range(n):
            if a != b:
                oa = _like(by_n[a].get(options[a].layers - grain, []), options[a])
                ob = _like(by_n[b].get(options[b].layers + grain, []), options[b])
                if oa is not None and ob is not None:
                    yield [oa if i == a else ob if i == b else o for i, o in enumerate(options)]
    for s in range(n):
        for o in by_n[s].get(options[s].layers, []):
            if o is not options[s]:
                yield options[:s] + [o] + options[s + 1:]


def assign_fast(tables: list[StageTable], units: int, m: int, grain: int = 1) -> Assignment | None:
    """Least bottleneck exactly; among the layer splits that reach it (and a few looser bounds), least
    bubble and tail, polished by local moves (of `grain` units: the tables' counts are that far apart, Note
    [a grid of layer counts] in grid.py)."""
    per_stage = _entries(tables)
    if any(not entries for entries in per_stage):
        return None
    best: Assignment | None = None
    works = [[(e.option.layers, e.work) for e in entries] for entries in per_stage]
    for bound in feasible_levels(works, units)[:FAST_THRESHOLDS]:
        chosen = _split(per_stage, units, bound)
        if chosen is not None:
            got = Assignment(tuple(chosen), model_objective(chosen))
            if best is None or got.objective < best.objective:
                best = got
    if best is None:
        return None
    polished = _polish(list(best.options), per_stage, grain)
    return Assignment(tuple(polished), model_objective(polished))


def feasible_levels(works: Sequence[Sequence[tuple[int, float]]], units: int) -> list[float]:
    """The work levels at which layer counts summing to `units` keep every stage within the level, least
    first (`works`: each stage's (layer count, work) options); empty where no counts reach `units`."""
    levels = sorted({w for work in works for _, w in work})
    lo, hi = 0, len(levels)
    while lo < hi:  # the least feasible level: a higher one admits more options
        mid = (lo + hi) // 2
        if _reachable(works, units, levels[mid]):
            hi = mid
        else:
            lo = mid + 1
    return levels[lo:]


def _reachable(works: Sequence[Sequence[tuple[int, float]]], units: int, bound: float) -> bool:
    """Whether layer counts of options within `bound` can sum to `units` (reachable sums as bits)."""
    reach, mask = 1, (1 << (units + 1)) - 1
    for work in works:
        nxt = 0
        for n in {n for n, w in work if w <= bound}:
            nxt |= reach << n
        reach = nxt & mask
        if not reach:
            return False
    return bool(reach >> units & 1)


def _split(per_stage: list[list[_Entry]], units: int, bound: float) -> list[Option] | None:
    """Options within `bound` whose layer counts sum to `units`, least Σ fill + tail (a DP over stages)."""
    best_at = []
    for entries in per_stage:
        by_n: dict[int, _Entry] = {}
        for e in entries:
            if e.work > bound:
                break
            n = e.option.layers
            if n not in by_n or e.rank < by_n[n].rank:
                by_n[n] = e
        if not by_n:
            return None
        best_at.append([(n, e.option, e.option.fill + e.option.tail) for n, e in by_n.items()])
    # reach[u]: (cost, choices) of the best way for the stages so far to own u units
    reach: dict[int, tuple[float, tuple[Option, ...]]] = {0: (0.0, ())}
    for choices in best_at:
        nxt: dict[int, tuple[float, tuple[Option, ...]]] = {}
        for u, (cost, chosen) in reach.items():
            for n, o, extra in choices:
                total = u + n
                if total > units:
                    continue
                if total not in nxt or cost + extra < nxt[total][0]:
                    nxt[total] = (cost + extra, chosen + (o,))
        reach = nxt
    got = reach.get(units)
    return list(got[1]) if got else None


def _rank(o: Option) -> tuple[float, Knobs]:
    """Least fill + tail; within float noise of each other, the plainer configuration."""
    return (_rounded(o.fill + o.tail), o.knobs)


def _rounded(x: float) -> float:
    return float(f"{x:.9g}")


def assign_cpsat(tables: list[StageTable], units: int, m: int, hint: Assignment | None,
                 work_limit: float = 1.0) -> Assignment | None:
    """The joint model; None when it finds nothing within `work_limit` (CP-SAT's deterministic time)."""
    keep = set(map(id, hint.options)) if hint else set()
    per_stage = [_undominated([(e.work, e.option) for e in entries], keep) for entries in _entries(tables)]
    if any(not opts for opts in per_stage):
        return None
    scale = RESOLUTION / (hint.objective if hint else max(t for opts in per_stage for t, _ in opts))

    def ticks(seconds: float) -> int:
        return math.ceil(seconds * scale)

    model, picks = cpsat_model(per_stage, units, m, hint, ticks)
    solved = cpsat.solve(model, work_limit)   # deterministic time, not wall time: the same answer on a busy machine
    if not solved.found:
        log.debug("CP-SAT: %s", solved.status_name)
        return None
    picked = [next(o for (_, o), xi in zip(opts, x) if solved.value(xi)) for opts, x in zip(per_stage, picks)]
    return Assignment(tuple(picked), model_objective(picked))


def cpsat_model(per_stage: list[list[tuple[float, Option]]], units: int, m: int, hint: Assignment | None,
                ticks: Callable[[float], int], new_model: Callable[[], Any] = cpsat.Model) -> tuple[Any, list[list[Any]]]:
    """The joint model over the stages' undominated options, and each stage's option literals; `new_model`
    makes an empty model (cp_model.CpModel has the same methods: tests/test_plan_assign.py)."""
    model = new_model()
    horizon = ticks(max(t for opts in per_stage for t, _ in opts)) + 1
    bound = model.new_int_var(0, horizon, "T")
    tail = model.new_int_var(0, ticks(max(o.tail for opts in per_stage for _, o in opts)) + 1, "tail")
    picks: list[list[Any]] = []
    count_vars: list[list[Any]] = []
    layer_terms: list[Any] = []
    fill_terms: list[Any] = []
    lead: list[Any] = []   # CP-SAT linear expressions
    for s, opts in enumerate(per_stage):
        x = [model.new_bool_var(f"x{s}_{k}") for k in range(len(opts))]
        model.add_exactly_one(x)
        picks.append(x)
        layer_terms += [o.layers * xi for (_, o), xi in zip(opts, x)]
        fill_terms += [ticks(o.fill) * xi for (_, o), xi in zip(opts, x)]
        # a stage's tail shows beyond the drains of the stages before it
        model.add(tail >= sum(ticks(o.tail) * xi for (_, o), xi in zip(opts, x)) - sum(lead))
        lead += [ticks(o.drain) * xi for (_, o), xi in zip(opts, x)]
        count_vars.append(_lanes(model, s, opts, x, bound, m, ticks))
    model.add(sum(layer_terms) == units)
    model.minimize(bound + sum(fill_terms) + tail)
    if hint is not None:
        _hint(model, hint, per_stage, picks, count_vars, m)
    return model, picks


# Note [dominated options]: an option enters the model only through its layer count, fill, tail, drain,
# lockstep flag and each lane class's cycle and cap. Another option of the same layer count that is no
# worse in each (a lower fill, tail and cycles, a longer drain, which hides later stages' tails, a larger
# cap, no lockstep) can replace it in any solution without raising the objective, so the model keeps its
# optimum without it; of equal options the first stays. The hint's options stay whatever they are, so the
# complete hint (`_hint`) remains a solution and CP-SAT never answers worse than it.


def _undominated(opts: list[tuple[float, Option]], keep: set[int]) -> list[tuple[float, Option]]:
    """The options no other option of the same layer count beats or ties in every term of the model
    (fill, tail, drain, and each lane class's cycle and cap), the first of equals, and those in `keep`:
    the model's optimum is the same without the rest (Note [dominated options])."""
    out: list[tuple[float, Option]] = []
    for k, (work, o) in enumerate(opts):
        if id(o) in keep or not any(_dominates(p, o, j < k) for j, (_, p) in enumerate(opts) if j != k):
            out.append((work, o))
    return out


def _dominates(a: Option, b: Option, earlier: bool) -> bool:
    """Whether `a` is at least as good as `b` in every term (strictly in one, or `a` comes first)."""
    if a.layers != b.layers or len(a.classes) != len(b.classes) or (a.equal_counts and not b.equal_counts):
        return False
    ours = (a.fill, a.tail, -a.drain, *(x for c in a.classes for x in (c.cycle, -c.cap)))
    theirs = (b.fill, b.tail, -b.drain, *(x for c in b.classes for x in (c.cycle, -c.cap)))
    if any(x > y for x, y in zip(ours, theirs)):
        return False
    return earlier or ours != theirs or a.equal_counts != b.equal_counts


def _hint(model: cpsat.Model, hint: Assignment, per_stage: list[list[tuple[float, Option]]],
          picks: list[list[Any]], count_vars: list[list[Any]], m: int) -> None:
    """The whole hint: its options and, per lane class, the most microbatches `spread` gives a lane (a
    complete feasible start, so that CP-SAT's answer is never worse than the hint's)."""
    for opts, x, counts, chosen in zip(per_stage, picks, count_vars, hint.options):
        for (_, o), xi in zip(opts, x):
            model.add_hint(xi, o is chosen)
        rows = spread(m, chosen.lane_classes(), chosen.equal_counts)
        if rows is not None:
            for c, row in zip(counts, rows):
                model.add_hint(c, max(row))


def _lanes(model: cpsat.Model, s: int, opts: list[tuple[float, Option]], x: list[cpsat.IntVar],
           bound: cpsat.IntVar, m: int, ticks: Callable[[float], int]) -> list[Any]:
    """Microbatch counts per lane class of stage s, tied to the option its x picks."""
    shapes = {tuple(len(c.lanes) for c in o.classes) for _, o in opts}
    (sizes,) = shapes  # every option of a stage has the same lane classes
    counts = [model.new_int_var(1, m, f"c{s}_{j}") for j in range(len(sizes))]
    model.add(sum(n * c for n, c in zip(sizes, counts)) >= m)
    total = sum(sizes)
    for (_, o), xi in zip(opts, x):
        for c, cls in zip(counts, o.classes):
            model.add(c <= max(cls.cap, 1)).only_enforce_if(xi)
            model.add(c * ticks(cls.cycle) <= bound).only_enforce_if(xi)
            if o.equal_counts:
                model.add(c == m // total).only_enforce_if(xi)
    return counts
