"""Note [a Ctrl-C an import swallows]: a SIGINT inside importlib's frames is delivered again, not raised there."""

from __future__ import annotations

import signal
import sys
import time
import types

import pytest

from hetc.ir import interrupt


def _cb():
    return sys._getframe()


def _frame_in(filename: str):
    """A frame of a function whose code says it is in `filename`."""
    return types.FunctionType(_cb.__code__.replace(co_filename=filename), globals())()


@pytest.fixture
def watched():
    previous = signal.getsignal(signal.SIGINT)
    interrupt.watch()
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_in_importlibs_callbacks_comes_again_outside_them(watched):
    """Raised there, importlib prints "Exception ignored in ..." with a traceback and carries on."""
    returned = False
    with pytest.raises(KeyboardInterrupt):
        interrupt._on_sigint(signal.SIGINT, _frame_in("<frozen importlib._bootstrap>"))
        returned = True
        time.sleep(5)               # the signal sent again a moment later interrupts the sleep

    assert returned and interrupt.seen()


def test_a_ctrl_c_anywhere_else_raises_where_it_lands(watched):
    with pytest.raises(KeyboardInterrupt):
        interrupt._on_sigint(signal.SIGINT, sys._getframe())
