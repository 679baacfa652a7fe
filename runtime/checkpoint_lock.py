"""One run at a time writes a checkpoint directory: an advisory lock held by plan rank 0.

Note [Checkpoint directory lock]
Two runs given the same `--checkpoint DIR` used to interleave their saves:
one run's `latest` could name the other's step, and `--keep` pruned the other
run's checkpoints. Plan rank 0 (the rank that publishes and prunes, Note
[Atomic saves]) takes an exclusive `flock` on DIR/.lock before the first step
and holds it until its process ends; the kernel releases it however the
process ends (exit, crash, SIGKILL), so a lock can never outlive its run on
this host. flock on NFS is carried as a POSIX byte-range lock by Linux, so
ranks 0 of two runs on different hosts of a shared file system exclude each
other too.

The file's text names the holder (`host pid started-at`), for the message the
second run prints. A run that ends cleanly empties it; a run that was killed
leaves its line behind, so a run that gets the lock and finds a line there
took over a stale lock and says whose.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LOCK_FILE", "CheckpointBusy", "CheckpointDirLock", "lock_checkpoint_dir"]

log = logging.getLogger("hetc.runtime")

LOCK_FILE = ".lock"


class CheckpointBusy(RuntimeError):
    """Another run holds the checkpoint directory (a user error: exit 2)."""


@dataclass
class CheckpointDirLock:
    """The held lock: an open descriptor of DIR/.lock with an exclusive flock on it."""

    path: Path
    fd: int
    took_over: str = ""          # the stale holder's line, when a killed run left one

    def release(self) -> None:
        """Empty the holder line (a clean end) and drop the lock; idempotent."""
        if self.fd < 0:
            return
        # a read-only or vanished directory: the kernel still drops the lock below
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)
        os.close(self.fd)
        self.fd = -1


def lock_checkpoint_dir(directory: Path) -> CheckpointDirLock:
    """Take DIR/.lock (creating DIR), or raise CheckpointBusy naming the run that holds it."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise CheckpointBusy(f"cannot use {directory} as the checkpoint directory: "
                             f"{err.strerror or err}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(fd)
        os.close(fd)
        raise CheckpointBusy(f"{directory} is in use by another run ({holder or 'holder unknown'}): two runs "
                             "writing one checkpoint directory would overwrite each other's steps; wait for "
                             "it to end or give this run another --checkpoint DIR") from None
    stale = _read_holder(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{_me()}\n".encode(), 0)
    os.fsync(fd)
    if stale:
        log.warning("took over the lock of %s left by %s, which is no longer running", directory, stale)
    return CheckpointDirLock(directory / LOCK_FILE, fd, stale)


def _me() -> str:
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return f"host {socket.gethostname()} pid {os.getpid()} since {started}"


def _read_holder(fd: int) -> str:
    return os.pread(fd, 512, 0).decode(errors="replace").strip()
