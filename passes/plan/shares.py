"""A search step's work split between this process and a forked worker (Note [a forked worker] in
hetc/ir/worker.py).

Each step hands the worker about half of its structures. A structure goes back to the process that
took it in an earlier step, where its option tables are cached (the tables of one structure serve it
in every step: step 1's structures return in step 2, step 2's in the rescoring and the configurations),
unless that would give one process more than half of the step; the others go to whichever process has
fewer so far. The answers are merged in the order of the items, so the step's result is the one a
single process computes.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

from hetc.ir.worker import Worker, WorkerLost

__all__ = ["Call", "Shares"]

T = TypeVar("T")
A = TypeVar("A")
R = TypeVar("R")

# One call: a function of the target (a method named as `Search._quick`: pickled by its qualified name, so the
# worker calls the same function on its copy of the target) and its argument.
Call = tuple[Callable[[T, Any], Any], Any]


class Shares(Generic[T]):
    """Calls of functions of `target`, each on one of two processes."""

    def __init__(self, target: T, worker: Worker | None):
        self.target, self.worker = target, worker
        self._side: dict[Hashable, int] = {}   # a job's key -> the process that took it last (1: the worker)

    @property
    def width(self) -> int:
        """How many processes share the work."""
        return 1 if self.worker is None else 2

    def each(self, fn: Callable[[T, A], R], items: list[A],
             key: Callable[[A], Hashable] = lambda item: item) -> list[R]:
        """`[fn(target, item) for item in items]`."""
        return self.calls([(fn, item) for item in items], lambda job: key(job[1]))

    def calls(self, jobs: list[Call[T]], key: Callable[[Call[T]], Hashable],
              sides: list[int] | None = None) -> list[Any]:
        """`[fn(target, arg) for fn, arg in jobs]`: the worker's share on the worker if there is one and it
        answers, else here. `sides`: each job's process (1: the worker), where the caller knows better than
        an even count."""
        if self.worker is None:
            sides = [0] * len(jobs)
        elif sides is None:
            sides = self._sides([key(job) for job in jobs])
        theirs = [job for job, side in zip(jobs, sides) if side]
        worker = self.worker if theirs else None
        if worker is not None:
            worker.submit(_call, theirs)
        here = _call(self.target, [job for job, side in zip(jobs, sides) if not side])
        there = None
        if worker is not None:
            try:
                there = worker.collect()
            except WorkerLost:
                pass
        if there is None:
            there = _call(self.target, theirs)
        answers = [iter(here), iter(there)]
        return [next(answers[side]) for side in sides]

    def _sides(self, keys: list[Hashable]) -> list[int]:
        """Each job's process (module docstring)."""
        most = -(-len(keys) // 2)
        counts = [0, 0]
        kept: list[int | None] = []
        for side in (self._side.get(k) for k in keys):
            if side is not None and counts[side] < most:
                counts[side] += 1
                kept.append(side)
            else:
                kept.append(None)
        sides = []
        for k, side in zip(keys, kept):
            if side is None:
                side = 0 if counts[0] <= counts[1] else 1
                counts[side] += 1
            self._side[k] = side
            sides.append(side)
        return sides


def _call(target: T, jobs: list[Call[T]]) -> list[Any]:
    return [fn(target, arg) for fn, arg in jobs]
