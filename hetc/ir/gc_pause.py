"""Pause Python's cyclic garbage collector around a large batch of allocations that stays alive.

Note [pausing the collector]: planning a large cluster builds hundreds of
thousands of small objects that live until the work ends (option tables,
the winner's per-rank programs, the verifier's posted ops). Every so many
allocations the cyclic collector walks the objects it tracks, and while
they pile up it walks them again and again: about a quarter of the
winner's check at 2048 GPUs (benchmarks/planner.py). Reference counting
still frees everything acyclic at once; what waits for the collector's
next run is the few cycles (a cost table's closures over itself), a few
tens of MB at 2048 GPUs. The previous state is restored on the way out, so
a caller that disabled the collector keeps it disabled.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["paused_collector"]


@contextmanager
def paused_collector() -> Iterator[None]:
    """Run the block with the cyclic collector off (Note [pausing the collector])."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
