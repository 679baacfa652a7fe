"""hetc.ir.gc_pause: the collector is off inside the block and as it was after it, even on an error."""

from __future__ import annotations

import gc

import pytest

from hetc.ir.gc_pause import paused_collector


@pytest.mark.parametrize("enabled", [True, False])
def test_paused_collector_restores_the_previous_state(enabled: bool) -> None:
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        with paused_collector():
            assert not gc.isenabled()
        assert gc.isenabled() is enabled
        with pytest.raises(RuntimeError), paused_collector():
            raise RuntimeError("inside")
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
