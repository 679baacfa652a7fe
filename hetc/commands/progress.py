"""Progress lines of the long one-shot commands (`hetc plan`, `hetc compile`) on stderr."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

__all__ = ["PROGRESS_AFTER_S", "progress_printer"]

# Work that takes longer than this reports its progress; quick runs stay quiet.
PROGRESS_AFTER_S = 1.0


def progress_printer(verb: str, start: float, elapsed: bool = True) -> Callable[[str], None]:
    """A `progress(message)` that prints `hetc VERB: message [N s]` once the command has run
    PROGRESS_AFTER_S since `start` (perf_counter); `elapsed=False` where the message says it."""
    def progress(message: str) -> None:
        took = time.perf_counter() - start
        if took > PROGRESS_AFTER_S:
            print(f"hetc {verb}: {message}" + (f" [{took:.1f} s]" if elapsed else ""), file=sys.stderr, flush=True)
    return progress
