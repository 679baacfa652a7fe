"""The heartbeat watchdog on an in-process rendezvous store (no training, no subprocesses).

`_die` is replaced by a recorder, so the tests see whom each rank would name
instead of the process exiting.
"""

from __future__ import annotations

import datetime
import threading

import pytest
import torch.distributed as dist

from hetc.runtime.local import free_port
from hetc.runtime.watchdog import Watchdog


class RecordingWatchdog(Watchdog):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.named = threading.Event()
        self.verdict: tuple[int, str] | None = None

    def _die(self, dead: int, why: str) -> None:
        if self.verdict is None:
            self.verdict = (dead, why)
            self.named.set()
        self._halt.set()


@pytest.fixture
def store():
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    yield lambda: dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
    del master


# Waits for what must happen: only a guard against a hang, never a measure of speed.
HANG_GUARD_S = 60.0
# A silence long enough that a busy machine's scheduling never looks like one.
SILENCE_S = 2.0


def _dogs(store, world: int, timeout: float = 600.0) -> list[RecordingWatchdog]:
    return [RecordingWatchdog(store(), r, world, interval=0.05, timeout=timeout) for r in range(world)]


def test_a_rank_that_names_a_dead_peer_stops_every_other_rank(store):
    """Rank 1's collective failed because rank 2 died; ranks 0 and 3 are not wired to rank 2's
    failure and must hear of it through the store, long before any heartbeat timeout."""
    dogs = _dogs(store, 4)
    for d in (dogs[0], dogs[3]):
        d.start()
    dogs[1].declare_dead(2)
    for d in (dogs[0], dogs[3]):   # the heartbeat timeout is 600 s: the verdict came through the store
        assert d.named.wait(HANG_GUARD_S), f"rank {d.rank} never heard"
        assert d.verdict == (2, "reported by another rank")
    for d in dogs:
        d.finish()


def test_a_silent_rank_is_named_by_its_watcher(store):
    dogs = _dogs(store, 3, timeout=SILENCE_S)
    for d in dogs[:2]:     # rank 2 never beats
        d.start()
    assert dogs[1].named.wait(HANG_GUARD_S)
    assert dogs[1].verdict[0] == 2 and dogs[1].verdict[1].startswith("no heartbeat for")
    assert dogs[0].named.wait(HANG_GUARD_S) and dogs[0].verdict[0] == 2
    for d in dogs:
        d.finish()


def test_only_a_rank_that_completed_is_excused_from_watching(store):
    dogs = _dogs(store, 3, timeout=SILENCE_S)
    dogs[2].finish(completed=False)          # failed: its watcher must still notice the silence
    dogs[1].start()
    assert dogs[1].named.wait(HANG_GUARD_S) and dogs[1].verdict[0] == 2

    dogs = _dogs(store, 3, timeout=SILENCE_S)       # the same store: clear the verdict from before
    client = store()
    client.delete_key("hetc/dead")
    dogs[2].finish(completed=True)
    dogs[1].start()
    assert not dogs[1].named.wait(3 * SILENCE_S), dogs[1].verdict
    dogs[1].finish()
