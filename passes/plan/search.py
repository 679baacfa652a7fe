"""The search: structures (idle GPUs, stage layout, schedule, micro-batch size) × assignment.

Coarse to fine, since the space is a product of many choices:

1. layouts: every (idle set, layout) under a default schedule and the
   smallest micro-batch (every size, on small clusters), with a few stage
   configurations (`base_knobs`);
2. schedules: the best layouts under every schedule, micro-batch size and
   tensor-parallel degree (TP groups inside a node: `intra_lane.tp_degrees`);
3. configurations: the best structures with every stage configuration
   (ZeRO level, offload, ministages), solved by `assign_fast` and refined
   by the CP-SAT model (`assign_cpsat`).

Steps 1 and 2 rank structures by the assignment model's objective; step 3
scores its plans exactly (`evaluate`). Option tables are built for a window
of layer counts around each stage's share of the cluster's speed, widened
while the assignment presses against the window's edge.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import replace
from typing import Any, TypeVar

from hetc.passes.cost import Profiles
from hetc.passes.plan.assign import Assignment, assign_cpsat, model_objective
from hetc.passes.plan.baselines import Baseline, baselines
from hetc.passes.plan.candidate import Candidate
from hetc.passes.plan.deadline import SCREEN_SHARE, Deadline
from hetc.passes.plan.improve import improve
from hetc.passes.plan.layouts import Layout
from hetc.passes.plan.objective import Goal
from hetc.passes.plan.screen_bound import screen_bound
from hetc.passes.plan.shares import Call, Shares
from hetc.passes.plan.space import SearchSpace
from hetc.passes.plan.structures import Found, SearchLimits, Structure, Structures
from hetc.passes.plan.tables import StageTable
from hetc.ir.spec import ScheduleKind
from hetc.ir.worker import forked_worker
from hetc.ir.plan import Job

__all__ = ["Found", "Search", "SearchLimits", "Structure"]

log = logging.getLogger(__name__)

_K = TypeVar("_K", bound=Hashable)


class Search(Structures):
    """The coarse-to-fine search over structures (module docstring)."""

    def __init__(self, job: Job, profiles: Profiles | None, space: SearchSpace, goal: Goal,
                 limits: SearchLimits | None = None, deadline: Deadline | None = None, fill: float = 1.0,
                 options_to_fill: bool = False):
        super().__init__(job, profiles, space, goal, limits, deadline, fill, options_to_fill)
        self.screens_until = self.deadline.share(SCREEN_SHARE)   # Note [an anytime search] in deadline.py
        # the steps that ended after their share of the time limit: cut short, or skipped (empty: none)
        self.cut_short: list[str] = []
        self.visited = 0
        self._assigned: dict[Structure, tuple[Assignment, list[StageTable]]] = {}
        self._shares = Shares(self, None)
        self._baselines: list[Baseline] | None = None
        # what `run`'s `aside` said of the best configured plan (Note [the check beside the refinement])
        self.aside: tuple[Candidate, Any] | None = None

    def run(self, progress: Callable[[str], None] | None = None,
            aside: tuple[Callable[[Search, Candidate, Any], Any], Any] | None = None) -> list[Found]:
        """Plans found, best first; on large clusters with a second process (Note [a forked worker]) that takes
        about half of each step (passes/plan/shares.py), scores the baselines and, with `aside` = (fn, arg), runs
        `fn(self, best, arg)` on the best plan the configurations found while this process refines (module
        level `fn`, so that it pickles); its answer is `self.aside` then (the planner's check of its winner)."""
        with forked_worker(self, wanted=self.limits.workers > 1) as worker:
            self._shares = Shares(self, worker)
            try:
                return self._run(progress, aside)
            finally:
                self._shares = Shares(self, None)

    def _run(self, progress: Callable[[str], None] | None,
             aside: tuple[Callable[[Search, Candidate, Any], Any], Any] | None) -> list[Found]:
        start = time.perf_counter()

        def tell(step: str) -> None:
            until = self.deadline if step in ("configurations", "refinement") else self.screens_until
            if until.passed():
                self.cut_short.append(step)
            if progress:
                progress(f"{step}: {self.visited} structures, {time.perf_counter() - start:.1f} s")

        pairs = list(self.layouts())
        every = [st for idle, layout in pairs
                 for st in self._every_variant(idle, layout)]
        if len(every) <= self.limits.exhaustive:
            shortlist = every   # few enough to configure every one
        else:
            first = self._first_schedules()
            smallest = (min(self.space.micro_batches),)
            if len(pairs) > self.limits.quick_layouts:
                looks = [st for idle, layout in pairs for st in self.variants(idle, layout, first[:1], smallest)]
                quick = list(zip(self._shares.each(Search._quick, looks), looks))
                pairs = _top_distinct(quick, self.limits.quick_layouts, key=lambda st: (st.idle, st.layout))
                tell("quick look")
            every_size = len(pairs) * len(first) * len(self.space.micro_batches) <= self.limits.exhaustive
            sizes = self.space.micro_batches if every_size else smallest
            firsts = [st for idle, layout in pairs for st in self.variants(idle, layout, first, sizes)]
            by_layout = self._screen(firsts, self.limits.layouts, _layout_of)
            tell("layouts")
            best = _top_distinct(by_layout, self.limits.layouts, key=_layout_of)
            # the model ranks roughly on large clusters: a wider shortlist is scored exactly
            wide = self.limits.structures if self.exact_screen else 3 * self.limits.structures
            kept = self._screen([st for idle, layout in best for st in self._every_variant(idle, layout)],
                                wide, _itself)
            ranked = kept or by_layout   # the time limit stopped the screen before its first structure
            if not self.exact_screen:   # and each idle set's best (Note [every idle set screened])
                others = self._other_idle_sets(by_layout, best)
                ranked = self._rescore(_top_distinct(ranked, wide, key=_itself) + others)
            tell("schedules")
            shortlist = _top_distinct(ranked, self.limits.structures, key=_itself)
        self.visited += len(shortlist)
        found = []
        for st, (got, assigned) in zip(shortlist, self._shares.each(Search._configure, shortlist)):
            found += got
            if assigned is not None:
                self._assigned[st] = assigned
        found.sort(key=self.rank)
        tell("configurations")
        picks = _to_refine(found, self.limits.refine, by_depth=self.exact_screen)
        found += [f for got in self._last_step(picks, found[0].candidate if aside and found else None, aside)
                  for f in got]
        tell("refinement")
        return sorted(found, key=self.rank)

    def _last_step(self, picks: list[Structure], best: Candidate | None,
                   aside: tuple[Callable[[Search, Candidate, Any], Any], Any] | None) -> list[list[Found]]:
        """The refinement of `picks`; with a worker, beside it the baselines and `aside` of `best`, which
        the worker takes alone where there is one (the planner's check is the longest of these)."""
        jobs: list[Call[Search]] = [(Search._refine, (st, self._assigned[st])) for st in picks]
        if self._shares.worker is None:
            return self._shares.calls(jobs, key=_job_key)
        jobs.append((Search._score_baselines, None))
        if aside is not None and best is not None:
            jobs.append((Search._aside, (aside[0], best, aside[1])))
        sides = [0] * (len(jobs) - 1) + [1] if jobs[-1][0] is Search._aside else None
        answers = self._shares.calls(jobs, key=_job_key, sides=sides)
        if aside is not None and best is not None:
            self.aside = (best, answers.pop())
        self._baselines = answers.pop()
        return answers

    def _aside(self, job: tuple[Callable[[Search, Candidate, Any], Any], Candidate, Any]) -> Any:
        fn, best, arg = job
        return fn(self, best, arg)

    def refill(self, found: list[Found], fill: float) -> list[Found]:
        """`found` held to `fill` of each device's memory instead, best first; the baselines and every later
        score too (Note [planning headroom]: the stage options stay as they were built)."""
        for prims in self.prims.values():
            prims.fill = fill
        self._baselines = None
        return sorted((replace(f, score=replace(f.score, fill=fill)) for f in found), key=self.rank)

    def baselines(self) -> list[Baseline]:
        """The baselines (baselines.py), under the search's cost model."""
        if self._baselines is None:
            self._baselines = baselines(self)
        return self._baselines

    def _score_baselines(self, _: None) -> list[Baseline]:
        return baselines(self)

    def _quick(self, st: Structure) -> tuple[bool, float]:
        """A first look at a structure: layers split by speed, each stage's lightest or most frugal option."""
        if self._out_of_time(self.screens_until):
            return (True, math.inf)
        options = []
        for s, n in enumerate(self._speed_split(st)):
            knobs = self.knobs(st, s, full=False)   # already `base_knobs`; none where the stage allows none
            if not knobs:   # (a tied embedding and head in one stage of interleaved 1F1B's two chunks)
                return (True, math.inf)
            table = self._table(st, s, range(n, n + 1), knobs[:1], knobs[-1] if len(knobs) > 1 else None)
            placeable = [o for o in table.options if o.work is not None]
            if not placeable:
                return (True, math.inf)
            options.append(min(placeable, key=lambda o: (o.placed_work + o.fill + o.tail, o.knobs)))
        return (False, model_objective(options) * self._price_factor(st))

    def _every_variant(self, idle: tuple[str, ...], layout: Layout) -> Iterator[Structure]:
        space = self.space
        return self.variants(idle, layout, space.schedules, space.micro_batches, space.tp)

    def _first_schedules(self) -> tuple[ScheduleKind, ...]:
        """Step 1's schedules: the space's first plain schedule, and Zorse's if allowed (it fits where
        others cannot)."""
        plain = [s for s in self.space.schedules if s is not ScheduleKind.ZORSE]
        out = plain[:1] + [s for s in self.space.schedules if s is ScheduleKind.ZORSE]
        return tuple(out)

    @property
    def exact_screen(self) -> bool:
        return self.limits.exact_screen

    def _screen(self, structures: list[Structure], keep: int, key: Callable[[Structure], Hashable]
                ) -> list[tuple[tuple[object, ...], Structure]]:
        """Each structure's rank by its assignment (by its exact score where the screen is exact), for the
        best `keep` of distinct `key` (`_top_distinct`): on large clusters only those that can be among
        them are assigned (Note [bounding a screen]); the others are left out. With a worker two are assigned
        at a time, each against the best found before both: the second may be one a screen of one at a time
        leaves out, whose objective is then above the keep-th best, so the best `keep` are the same."""
        self.visited += len(structures)
        if self.exact_screen:
            return self._rescore(structures)
        bounds = self._shares.each(Search._bound, structures)
        kept: list[tuple[int, tuple[object, ...]]] = []
        best: dict[Hashable, float] = {}   # the least objective of each key so far
        order = iter(sorted(range(len(structures)), key=lambda i: bounds[i]))
        while batch := list(itertools.islice(order, self._shares.width)):
            if len(best) >= keep:   # a bound above the keep-th best: so is every later one, none can be kept
                batch = [i for i in batch if bounds[i] <= sorted(best.values())[keep - 1]]
            for i, value in zip(batch, self._shares.each(Search._screen_value, [structures[i] for i in batch])):
                if value is not None:
                    kept.append((i, (False, False, value)))
                    best[key(structures[i])] = min(value, best.get(key(structures[i]), math.inf))
            if len(batch) < self._shares.width:
                break
        return [(rank, structures[i]) for i, rank in sorted(kept, key=lambda ir: ir[0])]

    def _other_idle_sets(self, ranked: list[tuple[Any, Structure]], kept: list[tuple[tuple[str, ...], Layout]]
                         ) -> list[Structure]:
        """The best structure of the best-ranked layout of each idle set none of `kept` leaves idle (each
        layout's variants screened alone, kept 1).

        Note [every idle set screened]: on large clusters the layouts and
        schedules steps rank by the assignment model, which times the borders
        to a slow group and the knobs memory forces roughly; which node groups
        run at all is the choice it misjudges most. Llama-3-70B on 8 H100 + 8
        A100-40 + 96 L4 (tests/llama_jobs.py): the model ranked every layout
        using all three kinds (46.7 s) above any leaving the H100s idle (71.4 s),
        so the search printed 81.9 s where the plan it never scored, the H100s
        idle, runs 73.1 s. So each idle set's best layout goes on to the exactly
        scored shortlist with its best structure."""
        have = {idle for idle, _ in kept}
        out: list[Structure] = []
        for _, st in sorted(ranked, key=lambda r: (r[0], len(r[1].layout))):
            if st.idle not in have:
                have.add(st.idle)
                screened = self._screen(list(self._every_variant(st.idle, st.layout)), 1, _itself)
                out += [best for _, best in screened[:1]]
        return out

    def _bound(self, st: Structure) -> float:
        return math.inf if self._out_of_time(self.screens_until) else screen_bound(self, st)

    def _screen_value(self, st: Structure) -> float | None:
        """The structure's assignment objective (priced under a cost objective; None: nothing fits, or the
        deadline has passed)."""
        got = None if self._out_of_time(self.screens_until) else self.assign(st, full=False)
        return None if got is None else got[0].objective * self._price_factor(st)

    def _rescore(self, structures: list[Structure]) -> list[tuple[tuple[object, ...], Structure]]:
        ranks = self._shares.each(Search._exact_rank, structures)
        return [(rank, st) for rank, st in zip(ranks, structures) if rank is not None]

    def _exact_rank(self, st: Structure) -> tuple[object, ...] | None:
        """The structure's rank by the exact score of its fast assignment (None: nothing fits, or the deadline
        has passed); the screens' share of the time does not stop it, as the screen built its tables."""
        got = None if self._out_of_time(self.deadline) else self.assign(st, full=False)
        f = None if got is None else self.found(st, got[0])
        return None if f is None else self.rank(f)[:3]

    def _configure(self, st: Structure) -> tuple[list[Found], tuple[Assignment, list[StageTable]] | None]:
        """The structure with every stage configuration: the fast assignment, scored exactly; and the
        assignment with its tables, for `_refine`."""
        if self._out_of_time(self.deadline):
            return [], None
        coarse = self.assign(st, full=False)
        around = tuple(o.layers for o in coarse[0].options) if coarse else None
        got = self.assign(st, full=True, around=around)
        if got is None:
            return [], None
        return [f for f in (self.found(st, got[0]),) if f is not None], got

    def _refine(self, job: tuple[Structure, tuple[Assignment, list[StageTable]]]) -> list[Found]:
        """CP-SAT's joint assignment, then a local search over both, scored exactly (`job`: a structure and its
        configured assignment with its tables)."""
        st, (a, tables) = job
        if self._out_of_time(self.deadline):
            return []
        m = self.prims[st.micro_batch].num_microbatches
        starts = [a]
        refined = assign_cpsat(tables, self.units, m, a, self.limits.cpsat_work)
        if refined is not None and refined.options != a.options:
            starts.append(refined)
        if not self.exact_screen:  # large: search on from the better start only
            scored = [f for f in (self.found(st, x) for x in starts) if f is not None]
            starts = [min(zip(scored, starts), key=lambda fs: self.rank(fs[0]))[1]] if scored else []
        return [f for start in starts for f in (improve(self, st, start, self.limits.local_evaluations),)
                if f is not None]

    def _out_of_time(self, until: Deadline) -> bool:
        """Whether `until` has passed; else the structure's work starts, and its option tables stop there
        (Note [an anytime search])."""
        self.until = until
        return until.passed()

    def rank(self, f: Found) -> tuple[object, ...]:
        return (not self.goal.admits(f.score), not f.score.fits, self.goal.value(f.score), f.candidate.key())


def _to_refine(found: list[Found], k: int, by_depth: bool = False) -> list[Structure]:
    """The k best structures, and the best of every schedule kind (the model times them differently);
    `by_depth` (small searches): of every schedule kind, lanes of each stage (the pipeline's depth and
    what each stage shards over) and micro-batch size, since the fast assignment's model paces a pipeline by its busiest lane where the exact
    score paces it by its longest chain (Note [paced pipeline]), and misjudges uneven depths most; and
    it picks a stage's ZeRO level and ministages on that model too, which only matter beside other lanes
    (tests/test_planner_optimality.py cluster 0: a tp-1 pipeline configured ZeRO-3 on both stages, 4 %
    slower than with ZeRO-1 on its last, ranked below the tp-2 ones and left unrefined; cluster 1: 1F1B at
    micro-batch 2 split its layers 3 + 2 under ZeRO-3 there, below micro-batch 1's and left unrefined, 1.6 %
    slower than 4 + 1 under ZeRO-1, which is what the exact score ranks first; seed 6 with borders sharing
    their node's link: a Zorse plan of one lane and four left under ZeRO-1, 1.6 % behind ZeRO-3 there, as
    one lane and two stood for every two-stage Zorse plan with lanes, Note [node links])."""
    structures = [f.structure for f in found if f.structure is not None]   # the search's (not baselines)
    picks = _top_distinct(list(enumerate(structures)), k, key=lambda st: st)
    firsts: dict[object, Structure] = {}   # `structures` is best first: a group's first is its best
    for st in structures:
        lanes = tuple(s.num_lanes for s in st.layout)
        firsts.setdefault((st.schedule, lanes, st.micro_batch) if by_depth else st.schedule, st)
    picks += [st for st in firsts.values() if st not in picks]
    return picks


def _job_key(job: Call[Search]) -> Hashable:
    """A job's structure, where it has one (the shares send it where its tables are), else its function."""
    fn, arg = job
    return arg[0] if fn is Search._refine else fn


def _layout_of(st: Structure) -> tuple[tuple[str, ...], Layout]:
    return (st.idle, st.layout)


def _itself(st: Structure) -> Structure:
    return st


def _top_distinct(ranked: list[tuple[Any, Structure]], k: int, key: Callable[[Structure], _K]) -> list[_K]:
    out: dict[_K, None] = {}
    for _, st in sorted(ranked, key=lambda r: (r[0], len(r[1].layout))):
        out.setdefault(key(st), None)
        if len(out) == k:
            break
    return list(out)
