"""Name a dead rank instead of hanging: heartbeats through the rendezvous store.

Every rank bumps a counter `hetc/hb/RANK` once a second and watches the
next rank's counter (a ring, so every rank is watched by one other). A
counter that stops moving for `timeout` seconds means that rank is gone:
the watcher publishes `hetc/dead` and every rank, seeing it at its next
beat, prints which rank died and exits non-zero. A rank whose collective
fails publishes the culprit the same way: the error reaches only the ranks
wired to the dead one, and the rest would otherwise wait out the whole
process-group timeout. A rank that finishes normally marks `hetc/done/RANK`
so its watcher does not mistake it for dead; one that fails does not, so its
own silence is noticed.

The heartbeats travel on a connection of their own to the rendezvous store
(`store_client`): a store request of the main thread that waits for a key a
dead rank will never write must not hold up the beats behind it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time

__all__ = ["Watchdog", "attempt_prefix", "store_client"]

log = logging.getLogger("hetc.runtime")


def attempt_prefix() -> str:
    """The store prefix of this start of the workers. torchrun's shared agent store outlives a
    restart, and the keys of the start before (heartbeats, `hetc/dead`) must not reach this one;
    a store the workers host (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) is new at every start and needs
    none, and must not have one: an agent that joins later counts its restarts from 0."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return ""
    return f"hetc/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


STORE_TIMEOUT_S = 30.0      # how long a store call of the watchdog's connection may take


def store_client(timeout_s: float = STORE_TIMEOUT_S):
    """A new client connection to the rendezvous store torchrun (or `hetc run --local`) hosts."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(attempt_prefix(), store)


class Watchdog(threading.Thread):
    def __init__(self, store, rank: int, world: int, interval: float = 1.0, timeout: float = 10.0):
        super().__init__(name="hetc-watchdog", daemon=True)
        self.store, self.rank, self.world = store, rank, world
        self.interval, self.timeout = interval, timeout
        self.watched = (rank + 1) % world
        self._halt = threading.Event()

    def run(self) -> None:
        last_value, last_change = None, time.monotonic()
        while not self._halt.wait(self.interval):
            try:
                self.store.add(f"hetc/hb/{self.rank}", 1)
                if self.store.check(["hetc/dead"]):
                    self._die(int(self.store.get("hetc/dead")), "reported by another rank")
                if self.world == 1 or self.store.check([f"hetc/done/{self.watched}"]):
                    continue
                value = self.store.add(f"hetc/hb/{self.watched}", 0)
            except Exception as err:  # noqa: BLE001 - the store itself is gone
                if self._halt.is_set():
                    return
                self._die(0, f"the rendezvous store stopped answering ({type(err).__name__})")
            now = time.monotonic()
            if value != last_value:
                last_value, last_change = value, now
            elif now - last_change > self.timeout:
                self.declare_dead(self.watched)
                self._die(self.watched, f"no heartbeat for {self.timeout:.0f} s")

    def declare_dead(self, dead: int) -> None:
        """Tell every rank that `dead` is gone; each one's watchdog exits at its next beat."""
        with contextlib.suppress(Exception):  # the store is gone: every rank notices that by itself
            self.store.set("hetc/dead", str(dead))

    def _die(self, dead: int, why: str) -> None:
        if self._halt.is_set():
            return
        print(f"[rank {self.rank}] error: rank {dead} stopped responding ({why}); exiting", file=sys.stderr,
              flush=True)
        os._exit(3)

    def silent_ranks(self, settle_s: float = 3.0) -> list[int]:
        """Ranks whose heartbeat does not move for `settle_s` seconds (and that have not finished).

        Used after a failed collective or message, to say which peer is gone.
        """
        try:
            if self.store.check(["hetc/dead"]):
                return [int(self.store.get("hetc/dead"))]
            others = [r for r in range(self.world) if r != self.rank]
            before = {r: self.store.add(f"hetc/hb/{r}", 0) for r in others}
            time.sleep(settle_s)
            return [r for r in others if self.store.add(f"hetc/hb/{r}", 0) == before[r]
                    and not self.store.check([f"hetc/done/{r}"])]
        except Exception:  # noqa: BLE001 - the store (hosted with rank 0) is gone
            return [0]

    def finish(self, completed: bool = True) -> None:
        """Stop watching; if this rank `completed` its work, tell its watcher not to worry."""
        self._halt.set()
        if completed:
            with contextlib.suppress(Exception):  # the store is gone: nobody is left to mistake us for dead
                self.store.set(f"hetc/done/{self.rank}", "1")
        # Wait out a store call in flight (its own timeout bounds it): a daemon thread still inside one when
        # the interpreter ends is stopped as it takes the GIL back (pthread_exit), and that unwinding through
        # the store's C++ frames ends in std::terminate, "terminate called without an active exception", a
        # SIGABRT after a finished run. A full test run on a loaded machine once saw that abort on a rank of
        # tests/test_elastic.py that had trained every step; a join that gave up after 5 beats (as it did)
        # is how this thread could still be in a store call then.
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=STORE_TIMEOUT_S + self.interval)
