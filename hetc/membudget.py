"""A memory budget for one-shot commands: `hetc compile --max-memory 8GiB` stops with a message instead of
being killed by the kernel.

Note [a memory budget]: the kernel's out-of-memory killer ends a process with SIGKILL, which nothing can
catch: the user sees "Killed" and no word of what ran out. So a command with a budget starts a watcher
thread that reads the process's resident set (/proc/self/statm) every POLL_S seconds; when it passes the
budget, the watcher sends the process SIGUSR1, whose handler (on the main thread, between two bytecodes)
raises MemoryBudgetExceeded where the work is (a BaseException: nothing on the way catches it as an error
of its own). The command then ends as any error does: its temporary
output removed by the code that made it, a message saying the phase, the resident set and the budget.
A poll can miss a spike shorter than POLL_S; a budget some way under the machine's memory leaves room
for that.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from hetc.ir.units import UNITS, Dim, human_bytes

__all__ = ["MemoryBudgetExceeded", "memory_budget", "parse_memory", "resident_bytes"]

POLL_S = 0.05


class MemoryBudgetExceeded(BaseException):
    """The process's resident set passed the budget (`memory_budget`).

    A BaseException, as KeyboardInterrupt is, since it too is raised asynchronously, wherever the main thread
    is: code that catches Exception there (lark's transformer wraps it in a VisitError, a worker pool falls
    back to computing itself) must let it through to the command, which says what stopped."""

    def __init__(self, used: float, budget: float):
        super().__init__(f"the resident set reached {human_bytes(used)}, over --max-memory {human_bytes(budget)}")
        self.used, self.budget = used, budget


def resident_bytes() -> float:
    """This process's resident set, in bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0.0


def parse_memory(text: str) -> float:
    """`8GiB`, `8 GiB`, `512MB`: bytes (argparse turns the error into a usage error, exit 2)."""
    number = text.rstrip("KMGTiB ")
    unit = text[len(number):].strip()
    dim, factor = UNITS.get(unit, (None, 0.0))
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if dim is not Dim.MEMORY or not value > 0:
        raise argparse.ArgumentTypeError(f"wants a memory size such as 8GiB or 512MB, not {text!r}")
    return value * factor


@contextmanager
def memory_budget(budget: float | None) -> Iterator[None]:
    """Raise MemoryBudgetExceeded in this (the main) thread once the resident set passes `budget` bytes;
    nothing where `budget` is None (Note [a memory budget])."""
    if budget is None:
        yield
        return
    over: list[float] = []
    done = threading.Event()

    def watch() -> None:
        while True:     # a look at once, then every POLL_S: work shorter than a poll is looked at too
            used = resident_bytes()
            if used > budget:
                over.append(used)
                os.kill(os.getpid(), signal.SIGUSR1)
                return
            if done.wait(POLL_S):
                return

    def handler(_signum: int, _frame: FrameType | None) -> None:
        raise MemoryBudgetExceeded(over[0] if over else resident_bytes(), budget)

    previous = signal.signal(signal.SIGUSR1, handler)
    watcher = threading.Thread(target=watch, name="hetc-memory-budget", daemon=True)
    watcher.start()
    try:
        yield
        if (used := resident_bytes()) > budget:     # it ended between two looks
            raise MemoryBudgetExceeded(used, budget)
    finally:
        done.set()
        watcher.join()
        signal.signal(signal.SIGUSR1, previous)
