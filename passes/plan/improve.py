"""Local search on an assignment, scored exactly.

The assignment model approximates a few things the exact score does not:
the bubble counts every stage's fill, the tail ignores the lead that later
stages' drains give earlier ones, Zorse's sequential schedule is treated
like a pipeline. Starting from an assignment, moves that change one stage's
configuration, or move layer units between two stages (one at a time; on
a long model the grid's step first, then halves of it: Note [a grid of
layer counts] in grid.py), are scored with `evaluate` and taken while they
improve the plan (first improvement), up to a budget of evaluations and the
search's deadline.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from hetc.passes.plan.assign import Assignment
from hetc.passes.plan.grid import steps_down
from hetc.passes.plan.tables import Option

if TYPE_CHECKING:
    from hetc.passes.plan.search import Found, Search, Structure

__all__ = ["improve"]


def improve(search: Search, st: Structure, start: Assignment, budget: int) -> Found | None:
    best = search.found(st, start)
    if best is None:
        return None
    current = list(start.options)
    seen = {tuple(current)}
    for step in steps_down(search.grain):   # moves of the grid's step, then finer (Note [a grid of layer counts])
        while budget > 0 and not search.deadline.passed():
            for options in _neighbours(search, st, current, step):
                if tuple(options) in seen:
                    continue
                seen.add(tuple(options))
                budget -= 1
                got = search.found(st, Assignment(tuple(options), 0.0))
                if got is not None and search.rank(got) < search.rank(best):
                    best, current = got, options
                    break
                if budget <= 0:
                    break
            else:
                break   # no neighbour improves
    return best


def _neighbours(search: Search, st: Structure, current: list[Option], step: int) -> Iterator[list[Option]]:
    limits = search._limits(st)
    n_stages = len(current)
    for a in range(n_stages):
        for b in range(n_stages):
            if a == b or current[a].layers <= step or current[b].layers + step > limits[b] or \
                    search._fixed_layers(a) is not None or search._fixed_layers(b) is not None:
                continue
            # a move keeps each stage's configuration where it can; with the lightest one too, since a
            # move can pay only once the stage that grew (or shrank) is configured for its new size
            for oa in _like(search, st, a, current[a], current[a].layers - step):
                for ob in _like(search, st, b, current[b], current[b].layers + step):
                    moved = list(current)
                    moved[a], moved[b] = oa, ob
                    yield moved
    for s in range(n_stages):
        for o in _options(search, st, s, current[s].layers):
            if o is not current[s]:
                yield current[:s] + [o] + current[s + 1:]


def _options(search: Search, st: Structure, s: int, n: int) -> list[Option]:
    table = search._table(st, s, range(n, n + 1), search.knobs(st, s, full=True))
    return [o for o in table.options if o.work is not None]


def _like(search: Search, st: Structure, s: int, was: Option, n: int) -> list[Option]:
    """Stage s's options for n units: the same configuration if it can take them, then the best-ranked."""
    options = _options(search, st, s, n)
    same = [o for o in options if o.knobs == was.knobs]
    lightest = min(options, key=lambda o: (o.placed_work + o.fill + o.tail, o.knobs), default=None)
    return list(dict.fromkeys(same[:1] + ([lightest] if lightest is not None else [])))
