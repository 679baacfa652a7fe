"""The forked worker (Note [a forked worker] in hetc/ir/worker.py) and the search's shares of work
(passes/plan/shares.py): answers come from the worker's copy, in the caller's order, and whatever the
worker fails to answer the caller computes itself."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

import hetc.ir.worker
from hetc.passes.plan.shares import Shares
from hetc.ir.worker import Worker, WorkerLost, can_fork, forked_worker

pytestmark = pytest.mark.skipif(not can_fork(), reason="no fork, or one core: hetc runs without a worker")


class Box:
    def __init__(self) -> None:
        self.value = 1
        self.pid = os.getpid()

    def plus(self, n: int) -> tuple[int, int]:
        """(value + n, the process that computed it)."""
        if n < 0:
            raise ValueError(n)
        return self.value + n, os.getpid()


@contextmanager
def worker_of(target: object) -> Iterator[Worker]:
    """A worker whether or not the machine has a core to spare now (`forked_worker` asks)."""
    worker = Worker(target)
    try:
        yield worker
    finally:
        worker.close()


def read(box: Box, add: int) -> int:
    return box.value + add


def fail(box: Box) -> None:
    raise ValueError("no")


def die(box: Box) -> None:
    os._exit(3)


def test_the_worker_answers_from_its_copy_of_the_target():
    box = Box()
    with worker_of(box) as worker:
        box.value = 100   # after the fork: the worker's copy still holds 1
        worker.submit(read, 2)
        assert worker.collect() == 3
        worker.submit(read, 5)
        assert worker.collect() == 6


def test_a_failing_call_is_lost_and_the_worker_answers_the_next():
    with worker_of(Box()) as worker:
        worker.submit(fail)
        with pytest.raises(WorkerLost):
            worker.collect()
        worker.submit(read, 1)
        assert worker.collect() == 2


def test_a_worker_that_dies_is_lost_for_good():
    with worker_of(Box()) as worker:
        worker.submit(die)
        with pytest.raises(WorkerLost):
            worker.collect()
        worker.submit(read, 1)
        with pytest.raises(WorkerLost):
            worker.collect()


def test_no_worker_where_none_is_wanted_or_no_core_is_spare(monkeypatch):
    with forked_worker(Box(), wanted=False) as worker:
        assert worker is None
    monkeypatch.setattr(hetc.ir.worker, "spare_core", lambda: False)
    with forked_worker(Box()) as worker:
        assert worker is None
    monkeypatch.setattr(hetc.ir.worker, "spare_core", lambda: True)
    with forked_worker(Box()) as worker:
        assert worker is not None


def test_shares_answer_in_order_half_on_the_worker():
    box = Box()
    with worker_of(box) as worker:
        shares = Shares(box, worker)
        got = shares.each(Box.plus, list(range(10)))
        assert [value for value, _ in got] == [n + 1 for n in range(10)]
        pids = [pid for _, pid in got]
        assert pids.count(box.pid) == 5   # half here, half on the worker
        again = shares.each(Box.plus, list(range(10)))
        assert [pid for _, pid in again] == pids   # each item goes where it went before


def test_shares_keep_no_more_than_half_on_one_process():
    box = Box()
    with worker_of(box) as worker:
        shares = Shares(box, worker)
        before = shares.each(Box.plus, list(range(6)))
        there = [n for n, (_, pid) in enumerate(before) if pid != box.pid]
        assert len(there) == 3
        got = shares.each(Box.plus, there)   # all three went to the worker before: one comes here
        assert [pid == box.pid for _, pid in got] == [False, False, True]


def test_what_the_worker_cannot_answer_is_answered_here():
    box = Box()
    with worker_of(box) as worker:
        shares = Shares(box, worker)
        with pytest.raises(ValueError):
            shares.each(Box.plus, [0, -1])   # the worker's call fails; computed here, it raises here
        got = shares.each(Box.plus, [0, 1, 2, 3])
        assert [value for value, _ in got] == [1, 2, 3, 4]
