"""A forked worker: a copy of this process that runs calls on its copy of one object.

Note [a forked worker]: `hetc plan` is held to wall time, and most of its work on a large cluster is
scoring structures one independent of another. Where this process may run on two cores and can fork,
`forked_worker(target)` forks it once; the child waits on a pipe for calls (a module-level function and
its arguments), runs each on its copy of `target` and sends the pickled result back while the caller
works on its own share. Both copies start equal and each keeps its own memo caches, so a call
must answer from its arguments and what `target` held at the fork alone (a cache may make it faster,
never different): then an answer is the same whichever process gives it, the caller merges answers in
a fixed order, and what hetc prints does not depend on timing or on whether a worker ran. Where the
child fails (an exception, or it died), `Worker.collect` raises `WorkerLost` and the caller does that
share itself. The two spend a few per cent more CPU than one, and a second process gains nothing where
the other cores are busy: Linux shares the machine's CPU between sessions (autogroups), not processes,
so another session's test run on one core of two leaves `hetc plan` one core however many processes it
runs (two processes of hetc then take the wall time of one, plus their overhead). So a worker is
forked only where other processes left about a core and a half free while this process got ready
(`spare_core`: the machine's busy time, less this process's and its reaped workers', since hetc.ir.worker
was imported as `hetc plan` starts planning, or since the previous look). The child ends
with `os._exit` (it must not flush the parent's buffered output or run its exit handlers) when the
parent closes the pipe, or dies with it.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

__all__ = ["Worker", "WorkerLost", "can_fork", "forked_worker", "spare_core"]

_LENGTH = struct.Struct("<Q")


class _Window:
    """What the machine's cores did since the last look: how much of them went to other processes."""

    def __init__(self) -> None:
        self.last = _ticks()

    def others(self) -> float | None:
        """Cores other processes kept busy, on average, since the last call (or since hetc.ir.worker was imported);
        None where the machine does not say (no /proc/stat, or no tick passed)."""
        now, last = _ticks(), self.last
        self.last = now
        if now is None or last is None or now[1] <= last[1]:
            return None
        cores = os.cpu_count() or 1
        seconds = (now[1] - last[1]) / cores / os.sysconf("SC_CLK_TCK")
        busy = (1 - (now[0] - last[0]) / (now[1] - last[1])) * cores
        return busy - (now[2] - last[2]) / seconds


def _ticks() -> tuple[float, float, float] | None:
    """(idle, all) time of the machine's cores so far in clock ticks (/proc/stat), and the CPU seconds of this
    process and of the children it reaped; None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            ticks = [float(x) for x in f.readline().split()[1:9]]   # user .. steal (guest time is inside user)
    except (OSError, ValueError):
        return None
    if len(ticks) != 8:
        return None
    import resource   # POSIX (as /proc/stat is): imported here, so that hetc.ir.worker imports everywhere

    own = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return ticks[3] + ticks[4], sum(ticks), sum(r.ru_utime + r.ru_stime for r in own)


_WINDOW = _Window()   # spare_core's window opens as hetc.ir.worker is imported, and again at each look


class WorkerLost(Exception):
    """The worker could not answer a call; the caller computes it itself."""


def can_fork() -> bool:
    """Whether a worker can run beside this process: fork exists and this process may use two cores."""
    return hasattr(os, "fork") and _cores() >= 2


def spare_core() -> bool:
    """Whether other processes left this one and a worker about a core and a half, on average, since the last
    look (Note [a forked worker]); True where the machine does not say."""
    others = _WINDOW.others()
    return others is None or (os.cpu_count() or 1) - others >= 1.5


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class Worker:
    """The parent's end of a forked copy of `target` (Note [a forked worker])."""

    def __init__(self, target: object):
        calls_r, calls_w = os.pipe()
        answers_r, answers_w = os.pipe()
        pid = os.fork()
        if pid == 0:   # the child: serve calls until the parent closes its end
            os.close(calls_w)
            os.close(answers_r)
            _serve(target, calls_r, answers_w)
        os.close(calls_r)
        os.close(answers_w)
        self.pid = pid
        self._calls = os.fdopen(calls_w, "wb")
        self._answers = os.fdopen(answers_r, "rb")
        self._pending = 0
        self._lost = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Ask the worker to run `fn(target, *args)` (`fn` defined at a module's top level, so that it pickles);
        `collect` returns its answer. One call at a time: with two in flight, each end could block writing a
        long message the other is not reading."""
        assert self._pending == 0   # the previous answer was collected
        self._pending = 1
        if self._lost:
            return
        try:
            _send(self._calls, (fn, args))
        except Exception:   # noqa: BLE001 - it does not pickle, or the pipe broke: computed here (WorkerLost)
            self._lost = True

    def collect(self) -> Any:
        """The answer to the call submitted (WorkerLost: compute it here)."""
        assert self._pending == 1   # a call was submitted
        self._pending = 0
        if self._lost:
            raise WorkerLost()
        try:
            ok, value = _receive(self._answers)
        except (OSError, EOFError, pickle.UnpicklingError):
            self._lost = True
            raise WorkerLost() from None
        if not ok:
            raise WorkerLost()
        return value

    def close(self) -> None:
        """End the worker: close the pipe it reads; kill it if it is still busy; reap it."""
        for f in (self._calls, self._answers):
            try:
                f.close()
            except OSError:
                pass
        if self._pending and not self._lost:
            os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)


@contextmanager
def forked_worker(target: object, wanted: bool = True) -> Iterator[Worker | None]:
    """A worker for `target` where one is `wanted`, `can_fork` and there is a `spare_core`; else None (the
    caller does all the work)."""
    worker = Worker(target) if wanted and can_fork() and spare_core() else None
    try:
        yield worker
    finally:
        if worker is not None:
            worker.close()


def _serve(target: object, calls: int, answers: int) -> NoReturn:
    status = 0
    try:
        with os.fdopen(calls, "rb") as reader, os.fdopen(answers, "wb") as writer:
            while True:
                try:
                    fn, args = _receive(reader)
                except EOFError:
                    break
                try:
                    answer: tuple[bool, Any] = (True, fn(target, *args))
                except Exception:   # noqa: BLE001 - the parent computes this call itself (WorkerLost)
                    answer = (False, None)
                _send(writer, answer)
    except BaseException:   # noqa: BLE001 - a broken pipe or an interrupt: the parent copes (WorkerLost)
        status = 1
    finally:
        os._exit(status)


def _send(f: Any, obj: object) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(_LENGTH.pack(len(data)))
    f.write(data)
    f.flush()


def _receive(f: Any) -> Any:
    head = f.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        raise EOFError
    (size,) = _LENGTH.unpack(head)
    data = f.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)
