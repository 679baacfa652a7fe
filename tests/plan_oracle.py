"""Exhaustive search over the planner's space, for tests: every plan, scored exactly.

The space is the planner's own (`Search.layouts`, `Search.variants`,
`knob_options`): every idle set and stage layout, schedule, micro-batch size,
every split of the layer units over the stages and every stage
configuration. Microbatches follow the planner's routing rule (`spread`
over the stage's lane classes), so a plan is fixed by those choices.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hetc.passes.plan.assign import Assignment
from hetc.passes.plan.search import Found, Search

__all__ = ["Exhaustive", "compositions"]


def compositions(total: int, parts: int, limits: list[int]):
    """Every way to write `total` as `parts` positive counts, count i at most limits[i]."""
    if parts == 1:
        if 1 <= total <= limits[0]:
            yield (total,)
        return
    for first in range(1, min(total - parts + 1, limits[0]) + 1):
        for rest in compositions(total - first, parts - 1, limits[1:]):
            yield (first, *rest)


@dataclass
class Exhaustive:
    search: Search
    evaluated: int = 0

    def run(self) -> Found | None:
        s = self.search
        best: Found | None = None
        for idle, layout in s.layouts():
            for st in s.variants(idle, layout, s.space.schedules, s.space.micro_batches, s.space.tp):
                for got in self._structure(st):
                    if best is None or s.rank(got) < s.rank(best):
                        best = got
        return best

    def _structure(self, st):
        s = self.search
        limits = s._limits(st)
        tables = [s._table(st, i, range(1, most + 1), s.knobs(st, i, full=True))
                  for i, most in enumerate(limits)]
        by_n = [t.by_layers() for t in tables]
        for split in compositions(s.units, len(st.layout), limits):
            choices = [by_n[i].get(n, []) for i, n in enumerate(split)]
            for options in itertools.product(*choices):
                if any(o.work is None for o in options):
                    continue
                got = s.found(st, Assignment(tuple(options), 0.0))
                self.evaluated += 1
                if got is not None:
                    yield got
