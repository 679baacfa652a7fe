"""The search: structures (idle GPUs, stage layout, schedule, micro-batch size) × assignment.

Coarse to fine, since the space is a product of many choices:

1. layouts: every (idle set, layout) under a default schedule and the
   smallest micro-batch (every size, on small clusters), with a few stage
   configurations (`base_knobs`);
2. schedules: the best layouts under every schedule and micro-batch size;
3. configurations: the best structures with every stage configuration
   (ZeRO level, offload, ministages), solved by `assign_fast` and refined
   by the CP-SAT model (`assign_cpsat`).

Steps 1 and 2 rank structures by the assignment model's objective; step 3
scores its plans exactly (`evaluate`). Option tables are built for a window
of layer counts around each stage's share of the cluster's speed, widened
while the assignment presses against the window's edge.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from hetc.passes.cost import Profiles
from hetc.passes.plan.assign import Assignment, assign_cpsat, assign_fast
from hetc.passes.plan.candidate import Candidate, Knobs
from hetc.passes.plan.costs import Primitives
from hetc.passes.plan.evaluate import Score, evaluate
from hetc.passes.plan.improve import improve
from hetc.passes.plan.layouts import Layout, group_speed, layouts
from hetc.passes.plan.objective import Goal
from hetc.passes.plan.partition import bandwidth_domains
from hetc.passes.plan.routing import spread
from hetc.passes.plan.space import SearchSpace, knob_options
from hetc.passes.plan.tables import Option, StageTable, stage_table
from hetc.passes.plan.views import Resolver, view_of

from hetc.spec import Objective, ScheduleKind, Spec
from hetc.topology import Topology

__all__ = ["Found", "Search", "SearchLimits", "Structure"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SearchLimits:
    exhaustive: int = 96      # at most this many structures: configure every one, skip steps 1 and 2
    layouts: int = 12         # layouts kept after step 1
    structures: int = 10      # structures kept after step 2
    refine: int = 3           # best configured structures refined by CP-SAT and local search
    exact_screen_gpus: int = 256
    local_evaluations: int = 80
    local_evaluations_large: int = 16
    window: int = 2           # layer counts tried on each side of a stage's share, at first
    cpsat_seconds: float = 0.5


@dataclass(frozen=True)
class Structure:
    idle: tuple[str, ...]
    layout: Layout
    schedule: ScheduleKind
    micro_batch: int
    interleave: int = 0


@dataclass(frozen=True)
class Found:
    candidate: Candidate
    score: Score
    structure: Structure


class Search:
    def __init__(self, spec: Spec, topo: Topology, profiles: Profiles | None, space: SearchSpace, goal: Goal,
                 limits: SearchLimits = SearchLimits()):
        self.spec, self.topo, self.space, self.goal, self.limits = spec, topo, space, goal, limits
        self.resolve = Resolver(topo)
        self.prims = {b: Primitives(spec, topo, profiles, b) for b in space.micro_batches}
        self.units = spec.model.num_model_layers
        self.visited = 0
        self._options: dict[tuple, list[Option]] = {}
        self._assigned: dict[Structure, tuple[Assignment, list[StageTable]]] = {}

    # ------------------------------------------------------------ structures

    def layouts(self) -> Iterator[tuple[tuple[str, ...], Layout]]:
        for idle in self.space.idle_sets:
            if self.space.stages is not None:
                yield idle, self.space.stages
                continue
            used = [g for g in self.topo.groups if g not in idle]
            if used:
                max_stages = min(self.space.max_stages, self.units)
                for layout in layouts(self.topo, bandwidth_domains(self.topo, used), max_stages,
                                      self.spec.model.dtype):
                    yield idle, layout

    def variants(self, idle: tuple[str, ...], layout: Layout, schedules, micro_batches) -> Iterator[Structure]:
        for b in micro_batches:
            if max(st.num_lanes for st in layout) > self.prims[b].num_microbatches:
                continue
            for schedule in schedules:
                for v in (self.space.interleave if schedule is ScheduleKind.INTERLEAVED else (0,)):
                    if not v or len(layout) * v <= self.units:
                        yield Structure(idle, layout, schedule, b, v)

    # ------------------------------------------------------------ tables

    def _limits(self, st: Structure) -> list[int]:
        """The most layer units each stage may own (the others need one each; middle stages no embed/head)."""
        n = len(st.layout)
        most = self.units - (n - 1)
        return [most if s in (0, n - 1) else min(most, self.units - 2) for s in range(n)]

    def _centres(self, st: Structure) -> list[int]:
        """Each stage's share of the units by its GPUs' speed."""
        dtype = self.spec.model.dtype
        speeds = []
        for stage in st.layout:
            speeds.append(sum(group_speed(self.topo, b.group, dtype) * b.size /
                              (self.topo.groups[b.group].count * self.topo.groups[b.group].gpus)
                              for b in stage.blocks))
        return [max(1, round(self.units * v / sum(speeds))) for v in speeds]

    def _table(self, st: Structure, s: int, layers: range, knobs: list[Knobs]) -> StageTable:
        res = self.resolve(st.layout[s])
        table = StageTable(s, res)
        n_stages = len(st.layout)
        neighbours = {o % n_stages: self.resolve(st.layout[o % n_stages]).lanes[0][0]
                      for o in (s - 1, s + 1) if n_stages > 1}
        for n in layers:
            key = (st.layout, s, st.schedule, st.micro_batch, st.interleave, n, tuple(knobs))
            got = self._options.get(key)
            if got is None:
                got = self._options[key] = stage_table(
                    self.prims[st.micro_batch], res, s, n_stages, range(n, n + 1), knobs, st.schedule,
                    neighbours, st.interleave, self.space.prefetch, self.space.zero_base).options
            table.options += got
        return table

    def knobs(self, st: Structure, s: int, full: bool) -> list[Knobs]:
        options = knob_options(self.space, st.schedule, st.interleave, len(self.resolve(st.layout[s]).lanes))
        return options if full else base_knobs(options)

    def assign(self, st: Structure, full: bool, around: tuple[int, ...] | None = None
               ) -> tuple[Assignment, list[StageTable]] | None:
        """The fast assignment over windows of layer counts, widened until it settles inside them."""
        limits = self._limits(st)
        centres = list(around) if around else self._centres(st)
        knobs = [self.knobs(st, s, full) for s in range(len(st.layout))]
        m = self.prims[st.micro_batch].num_microbatches
        width = self.limits.window
        while True:
            windows = [range(max(1, c - width), min(most, c + width) + 1) for c, most in zip(centres, limits)]
            tables = [self._table(st, s, w, knobs[s]) for s, w in enumerate(windows)]
            a = assign_fast(tables, self.units, m)
            whole = all(w.start == 1 and w.stop == most + 1 for w, most in zip(windows, limits))
            if whole or (a is not None and not _at_edge(a, windows, limits)):
                return (a, tables) if a is not None else None
            width *= 2

    # ------------------------------------------------------------ plans

    def candidate(self, st: Structure, a: Assignment) -> Candidate | None:
        m = self.prims[st.micro_batch].num_microbatches
        counts = []
        for o in a.options:
            per_class = spread(m, o.lane_classes(), o.equal_counts)
            if per_class is None:
                return None
            lane_counts = [0] * sum(len(c.lanes) for c in o.classes)
            for cls, row in zip(o.classes, per_class):
                for lane, count in zip(cls.lanes, row):
                    lane_counts[lane] = count
            counts.append(tuple(lane_counts))
        return Candidate(st.layout, tuple(o.layers for o in a.options), tuple(o.knobs for o in a.options),
                         tuple(counts), st.schedule, st.micro_batch, self.space.prefetch, st.idle)

    def score(self, c: Candidate) -> Score:
        zero = tuple(replace(self.space.zero_base, level=k.zero) for k in c.knobs)
        return evaluate(self.prims[c.micro_batch], view_of(c, self.resolve, zero))

    def found(self, st: Structure, a: Assignment | None) -> Found | None:
        c = None if a is None else self.candidate(st, a)
        return None if c is None else Found(c, self.score(c), st)

    # ------------------------------------------------------------ the run

    def run(self, progress: Callable[[str], None] | None = None) -> list[Found]:
        """Plans found, best first."""
        start = time.perf_counter()

        def tell(step: str) -> None:
            if progress:
                progress(f"{step}: {self.visited} structures, {time.perf_counter() - start:.1f} s")

        pairs = list(self.layouts())
        every = [st for idle, layout in pairs
                 for st in self.variants(idle, layout, self.space.schedules, self.space.micro_batches)]
        if len(every) <= self.limits.exhaustive:
            shortlist = every   # few enough to configure every one
        else:
            first = self._first_schedules()
            sizes = self.space.micro_batches if self.exact_screen else (min(self.space.micro_batches),)
            ranked = self._screen(st for idle, layout in pairs for st in self.variants(idle, layout, first, sizes))
            tell("layouts")
            best = _top_distinct(ranked, self.limits.layouts, key=lambda st: (st.idle, st.layout))
            ranked = self._screen(st for idle, layout in best
                                  for st in self.variants(idle, layout, self.space.schedules, self.space.micro_batches))
            tell("schedules")
            shortlist = _top_distinct(ranked, self.limits.structures, key=lambda st: st)
        found = sorted((f for st in shortlist for f in self._configure(st)), key=self.rank)
        tell("configurations")
        for st in _to_refine(found, self.limits.refine):
            found += self._refine(st)
        tell("refinement")
        return sorted(found, key=self.rank)

    def _first_schedules(self) -> tuple[ScheduleKind, ...]:
        """Step 1's schedules: the space's first plain schedule, and Zorse's if allowed (it fits where others cannot)."""
        plain = [s for s in self.space.schedules if s is not ScheduleKind.ZORSE]
        out = plain[:1] + [s for s in self.space.schedules if s is ScheduleKind.ZORSE]
        return tuple(out)

    @property
    def exact_screen(self) -> bool:
        """Rank structures by their exact score while that is cheap, else by the assignment model."""
        return self.topo.num_gpus <= self.limits.exact_screen_gpus

    def _screen(self, structures) -> list[tuple[tuple, Structure]]:
        out = []
        for st in structures:
            self.visited += 1
            got = self.assign(st, full=False)
            if got is None:
                continue
            if self.exact_screen:
                f = self.found(st, got[0])
                if f is not None:
                    out.append((self.rank(f)[:3], st))
            else:
                price = sum(g.device.price for s in st.layout for g in self.resolve(s).gpus)
                value = got[0].objective * (price if self.goal.kind is Objective.COST else 1.0)
                out.append(((False, False, value), st))
        return out

    def _configure(self, st: Structure) -> list[Found]:
        """The structure with every stage configuration: the fast assignment, scored exactly."""
        self.visited += 1
        coarse = self.assign(st, full=False)
        around = tuple(o.layers for o in coarse[0].options) if coarse else None
        got = self.assign(st, full=True, around=around)
        if got is None:
            return []
        self._assigned[st] = got
        return [f for f in (self.found(st, got[0]),) if f is not None]

    def _refine(self, st: Structure) -> list[Found]:
        """CP-SAT's joint assignment, then a local search over both, scored exactly."""
        a, tables = self._assigned[st]
        m = self.prims[st.micro_batch].num_microbatches
        starts = [a]
        refined = assign_cpsat(tables, self.units, m, a, self.limits.cpsat_seconds)
        if refined is not None and refined.options != a.options:
            starts.append(refined)
        budget = self.limits.local_evaluations if self.exact_screen else self.limits.local_evaluations_large
        return [f for start in starts for f in (improve(self, st, start, budget),) if f is not None]

    def rank(self, f: Found) -> tuple:
        return (not self.goal.admits(f.score), not f.score.fits, self.goal.value(f.score), f.candidate.key())


def base_knobs(options: list[Knobs]) -> list[Knobs]:
    """A few configurations for the coarse steps: the lightest, ZeRO's most sharded without offload, the most frugal."""
    def weight(k: Knobs) -> tuple:
        return (k.offload.params + k.offload.optimizer + k.offload.activations, k.zero, k.ministages)

    by_weight = sorted(options, key=weight)
    plain = [k for k in by_weight if k.offload == by_weight[0].offload and k.ministages == by_weight[0].ministages]
    return list(dict.fromkeys([by_weight[0], plain[-1], by_weight[-1]]))


def _at_edge(a: Assignment, windows: list[range], limits: list[int]) -> bool:
    return any((o.layers == w.start and w.start > 1) or (o.layers == w.stop - 1 and w.stop - 1 < most)
               for o, w, most in zip(a.options, windows, limits))


def _to_refine(found: list[Found], k: int) -> list[Structure]:
    """The k best structures, and the best of every schedule kind (the model times them differently)."""
    picks = _top_distinct([(i, f.structure) for i, f in enumerate(found)], k, key=lambda st: st)
    for kind in dict.fromkeys(f.structure.schedule for f in found):
        best = next(f.structure for f in found if f.structure.schedule is kind)
        if best not in picks:
            picks.append(best)
    return picks


def _top_distinct(ranked: list[tuple[float, Structure]], k: int, key) -> list:
    out: dict = {}
    for _, st in sorted(ranked, key=lambda r: (r[0], len(r[1].layout))):
        out.setdefault(key(st), None)
        if len(out) == k:
            break
    return list(out)
