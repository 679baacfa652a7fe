"""SIGTERM preemption: finish the step in flight, save, exit so that torchrun restarts.

Note [Preemption]
A cloud sends SIGTERM before it takes a spot VM; torchrun forwards it to
its workers, and so does an agent that restarts its workers because a node
joined. Often only some ranks get it. The save is a collective, so every
rank must stop after the *same* step. A signalled rank announces, at the end
of its next step (having done d steps), "stop after d + 1" in the rendezvous
store with compare_set, so the first announcement wins. No rank can have
done more than d steps then: finishing step d needs the step-end all-reduce
every rank enters, and this one has not entered it yet. Every rank looks at
the key after each step and stops once it has done that many, so all stop
together, save (waiting for the save to complete) and exit with
PREEMPTED_STATUS, which torchrun counts as a failure and restarts while
--max-restarts allows. A rank that cannot finish within `grace_s` of the
signal exits anyway with the same status; the checkpoint it could not
complete never becomes `latest` (Note [Atomic saves]).

A time limit (`--exit-after`, Megatron-LM's --exit-duration-in-mins) stops
the same way: the first rank whose clock passes it announces, with the
reason beside the step, and every rank stops after that step, saves and
exits 0 (the run is not failed: a job script resumes it in its next
allocation).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from enum import StrEnum

__all__ = ["PREEMPTED_STATUS", "Preemption", "StopReason"]

PREEMPTED_STATUS = 143      # 128 + SIGTERM, what a shell reports for a process SIGTERM ended
STOP_KEY = "hetc/preempt/stop_after"


class StopReason(StrEnum):
    SIGTERM = "sigterm"
    TIME_LIMIT = "time-limit"


class Preemption:
    def __init__(self, store, rank: int, grace_s: float = 30.0, time_limit_s: float | None = None):
        self.store, self.rank, self.grace_s = store, rank, grace_s
        self.requested = threading.Event()
        self.deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
        self.reason: StopReason | None = None     # why every rank stops, once one announced it
        self._announced = False
        self._stop_after: int | None = None
        self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        # held since `hetc run --local` started this rank (Note [signals under --local]); a no-op elsewhere
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})

    def _on_signal(self, signum, frame) -> None:
        if self.requested.is_set():
            return
        self.requested.set()
        timer = threading.Timer(self.grace_s, self._give_up)
        timer.daemon = True
        timer.start()

    def _give_up(self) -> None:
        print(f"[rank {self.rank}] error: SIGTERM: the step in flight and its checkpoint did not finish within "
              f"{self.grace_s:.0f} s; exiting without them", file=sys.stderr, flush=True)
        os._exit(PREEMPTED_STATUS)

    def should_stop(self, done: int) -> bool:
        """After a step, with `done` steps done: whether every rank stops here (see Note [Preemption])."""
        why = StopReason.SIGTERM if self.requested.is_set() else \
            StopReason.TIME_LIMIT if self.deadline is not None and time.monotonic() >= self.deadline else None
        if why is not None and not self._announced:
            self._announced = True
            self.store.compare_set(STOP_KEY, "", f"{done + 1} {why.value}")
        if self._stop_after is None and self.store.check([STOP_KEY]):
            after, reason = self.store.get(STOP_KEY).decode().split()
            self._stop_after, self.reason = int(after), StopReason(reason)
        return self._stop_after is not None and done >= self._stop_after

    def close(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)
