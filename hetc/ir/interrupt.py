"""A Ctrl-C that arrives while Python imports is remembered, not only raised.

Note [a Ctrl-C an import swallows]: Python's default SIGINT handler raises
KeyboardInterrupt wherever the main thread is. During an import that can be
inside importlib's own callbacks, which print "Exception ignored in ..." and
carry on: the launcher of `hetc run --local` then started its ranks as if
no one had pressed Ctrl-C, and trained until killed (tests/test_signals.py
caught it once in ten under load). So the first thing `hetc` does is install
a handler that records the signal before raising; code about to start
something that outlives it (the launcher, before its ranks) asks `seen()`.
Inside importlib's frames the handler does not raise but has the signal
sent again a moment later, so that the KeyboardInterrupt comes once the
import is out of them, without the printed traceback (tests/test_signals.py
saw one, once).
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

__all__ = ["seen", "watch"]

_seen = False
_AGAIN_S = 0.01    # a Ctrl-C inside importlib's frames comes again this much later


def watch() -> None:
    """Record every SIGINT from now on (and raise KeyboardInterrupt, as Python's own handler does)."""
    signal.signal(signal.SIGINT, _on_sigint)


def seen() -> bool:
    """Whether a SIGINT came since `watch`, even one whose KeyboardInterrupt something swallowed."""
    return _seen


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    global _seen
    _seen = True
    if frame is not None and frame.f_code.co_filename.startswith("<frozen importlib"):
        # raised inside importlib's own callbacks it would be printed as "Exception ignored in ..." (a
        # traceback after Ctrl-C) and swallowed: deliver it again a moment later, outside them (not from
        # here: raise_signal runs this handler again at once, still inside them)
        threading.Timer(_AGAIN_S, os.kill, (os.getpid(), signal.SIGINT)).start()
        return
    raise KeyboardInterrupt
