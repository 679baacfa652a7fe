"""A Ctrl-C that arrives while Python imports is remembered, not only raised.

Note [a Ctrl-C an import swallows]: Python's default SIGINT handler raises
KeyboardInterrupt wherever the main thread is. During an import that can be
inside importlib's own callbacks, which print "Exception ignored in ..." and
carry on: the launcher of `hetc run --local` then started its ranks as if
no one had pressed Ctrl-C, and trained until killed (tests/test_signals.py
caught it once in ten under load). So the first thing `hetc` does is install
a handler that records the signal before raising; code about to start
something that outlives it (the launcher, before its ranks) asks `seen()`.
"""

from __future__ import annotations

import signal
from types import FrameType

__all__ = ["seen", "watch"]

_seen = False


def watch() -> None:
    """Record every SIGINT from now on (and raise KeyboardInterrupt, as Python's own handler does)."""
    signal.signal(signal.SIGINT, _on_sigint)


def seen() -> bool:
    """Whether a SIGINT came since `watch`, even one whose KeyboardInterrupt something swallowed."""
    return _seen


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    global _seen
    _seen = True
    raise KeyboardInterrupt
