"""The files of a checkpoint directory, without torch (the launcher reads them): which checkpoints are
complete, and the checksums of their files, written at save and checked before anything reads them.

Note [Checkpoint checksums]
DCP reads whatever bytes a shard holds: a flipped bit in a `.distcp` file
loads as a NaN or a 1e36 weight without a word, a truncated one as a bare
`EOFError`, a damaged `.metadata` as a pickle traceback. So the last act of
a save before it is published (Note [Atomic saves] in runtime/checkpoint.py),
once every rank's data and DCP's metadata are on disk, is rank 0 hashing
every file of step-N.tmp into step-N.tmp/checksums.json (its size and
blake2b digest; blake2b because it is hashlib's fastest cryptographic hash in
software), in the thread that completes the save (an async save's writer,
so the training loop does not wait for it). Rank 0 already renames the
directory, so it sees every file (one shared file system, as DCP's
FileSystemWriter assumes). Every reader checks
the files against it first (`verify_manifest`): resume, `hetc export hf`,
`read_params`; a missing, truncated or changed file is a CheckpointError
naming it. A checkpoint saved before this existed has no checksums.json and
is read unchecked, with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from hetc.ir.errors import Span

__all__ = ["LATEST", "MANIFEST_FILE", "CheckpointError", "check_writable", "complete_steps", "has_checkpoint",
           "nothing_to_resume", "verify_manifest", "write_manifest"]

log = logging.getLogger("hetc.runtime")

LATEST = "latest"      # DIR/latest: one line naming the newest published step-N (Note [Atomic saves])
MANIFEST_FILE = "checksums.json"
ALGORITHM = "blake2b"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or read: missing, incomplete, corrupt or of another model or run.

    `path` is the file the problem is in, when there is one: the CLI prints it as `FILE:1:1: error: ...`."""

    def __init__(self, message: str, path: Path | None = None):
        super().__init__(message)
        self.path = path

    def render(self) -> str:
        """The one-line message a user sees: located at the file, when there is one."""
        where = f"{Span.file_start(self.path)}: " if self.path is not None else ""
        return f"{where}error: {self}"


def complete_steps(directory: Path) -> list[int]:
    """The steps of the complete checkpoints in `directory` (their metadata written), oldest first."""
    return sorted(int(number) for path in Path(directory).glob("step-*")
                  if (number := path.name.removeprefix("step-")).isdigit() and (path / ".metadata").is_file())


def has_checkpoint(directory: Path) -> bool:
    """Whether `directory` holds anything to resume from (a `latest` file or a complete step-N)."""
    return (Path(directory) / LATEST).is_file() or bool(complete_steps(directory))


def nothing_to_resume(directory: Path) -> str:
    """The error of `--resume` when `directory` holds nothing to resume from (Note [Which checkpoint --resume
    loads] in runtime/checkpoint.py)."""
    state = "does not exist" if not Path(directory).exists() else "holds no checkpoint"
    return (f"--resume: {directory} {state}; drop --resume to start at step 0, or use --resume-if-present "
            "to resume only when there is a checkpoint")


def check_writable(directory: Path) -> None:
    """Make `directory` (and its parents) and write a file there, or raise CheckpointError naming it: a run
    learns that it cannot save before its first step, not after its last one."""
    probe = Path(directory) / f".hetc-write-test-{os.getpid()}"
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise CheckpointError(f"cannot write checkpoints into {directory}: {err.strerror or err} "
                              f"({err.filename or directory}); choose a writable --checkpoint DIR") from None


def write_manifest(directory: Path) -> None:
    """Record the size and digest of every file in `directory` in its checksums.json (fsynced)."""
    files = {p.name: {"bytes": p.stat().st_size, ALGORITHM: _digest(p)}
             for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST_FILE}
    target = directory / MANIFEST_FILE
    with open(target, "w") as f:
        json.dump({"algorithm": ALGORITHM, "files": files}, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def verify_manifest(directory: Path) -> None:
    """Check every file checksums.json lists (see Note [Checkpoint checksums]); raise CheckpointError naming
    the first one that is missing, truncated or changed."""
    manifest = directory / MANIFEST_FILE
    if not manifest.is_file():
        log.warning("%s has no %s (saved by an older hetc): its files are read unchecked", directory, MANIFEST_FILE)
        return
    for name, want in _read(manifest).items():
        _check_file(directory / name, want, manifest)


def _read(manifest: Path) -> dict[str, dict]:
    try:
        files = json.loads(manifest.read_text())["files"]
        if not all(isinstance(w, dict) and ALGORITHM in w and "bytes" in w for w in files.values()):
            raise ValueError("an entry without bytes or digest")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"the checkpoint's list of checksums is unreadable ({err}); the checkpoint "
                              "cannot be trusted", manifest) from None
    return files


def _check_file(path: Path, want: dict, manifest: Path) -> None:
    if not path.is_file():
        raise CheckpointError(f"missing: {manifest.name} lists it, so the checkpoint is incomplete", path)
    size = path.stat().st_size
    if size != want["bytes"]:
        cut = "truncated" if size < want["bytes"] else "longer than written"
        raise CheckpointError(f"{cut}: {size} bytes, {want['bytes']} were saved", path)
    if _digest(path) != want[ALGORITHM]:
        raise CheckpointError(f"corrupt: its {ALGORITHM} checksum differs from the one {manifest.name} "
                              "recorded when it was saved (the bytes changed on disk)", path)


def _digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, ALGORITHM).hexdigest()
