"""`hetc run --local`'s exit status when ranks fail: a rank's own answer over a peer's death by signal."""

from __future__ import annotations

import signal

from hetc.runtime.local import _Signals, _supervise


class _Rank:
    """A rank process that exits with `code` (negative: killed by that signal) at its `at`-th poll."""

    def __init__(self, code: int, at: int):
        self.code, self.at, self.polls = code, at, 0

    def poll(self) -> int | None:
        self.polls += 1
        return self.code if self.polls >= self.at else None

    def wait(self) -> int:
        return self.code


def _status(*ranks: _Rank) -> int:
    signals = _Signals()
    signals.ranks = list(ranks)    # type: ignore[arg-type]
    return _supervise(signals, stop_timeout_s=30.0)


def test_a_diverged_run_exits_3_though_a_peer_aborted_first_as_they_parted(capsys):
    """As a clean-clone run once saw: rank 1 aborted in its teardown before rank 0 reported the divergence."""
    assert _status(_Rank(3, at=3), _Rank(-signal.SIGABRT, at=1)) == 3
    err = capsys.readouterr().err
    assert "rank 1 exited with status 6 (killed by SIGABRT)" in err and "rank 0 exited with status 3" in err


def test_a_death_by_signal_alone_is_the_status():
    assert _status(_Rank(0, at=1), _Rank(-signal.SIGKILL, at=2)) == 128 + signal.SIGKILL


def test_the_first_of_the_ranks_own_answers_is_the_status():
    assert _status(_Rank(2, at=2), _Rank(1, at=1)) == 1
