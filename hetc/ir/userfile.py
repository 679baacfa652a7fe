"""Files a user names on the command line (a timeline, a metrics file, another system's JSON), read only when
they are regular files.

Note [untrusted paths] (hetc/frontend/load.py) for the ones a spec names: `/dev/zero` streams for ever and
a named pipe without a writer blocks at open, so a device or a pipe is refused before it is opened, as a
spec's `use` does. A directory is named as one, not an internal IsADirectoryError.
"""

from __future__ import annotations

import stat
from pathlib import Path

from hetc.ir.errors import UsageError

__all__ = ["file_kind", "read_user_text", "regular_file_problem", "require_regular_file"]


def file_kind(mode: int) -> str:
    """What a path that is not a regular file is, for a message."""
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def regular_file_problem(path: Path, what: str, shown: str | None = None) -> str:
    """'' where `path` is a regular file, else why it is not one, naming `what` it should be (and the path as
    `shown`, where the user wrote it otherwise)."""
    name = path if shown is None else shown
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return f"cannot find the {what} '{name}'"
    except OSError as err:
        return f"cannot read the {what} '{name}': {err.strerror or err}"
    return "" if stat.S_ISREG(mode) else f"the {what} '{name}' is {file_kind(mode)}, not a regular file"


def require_regular_file(path: Path, what: str) -> None:
    """A UsageError naming `what` `path` should be, unless it is a regular file."""
    problem = regular_file_problem(path, what)
    if problem:
        raise UsageError(problem)


def read_user_text(path: Path, what: str) -> str:
    """The UTF-8 text of the regular file `path`, or a UsageError naming `what` it should be and why it is
    not (bytes that are not UTF-8: at their line)."""
    require_regular_file(path, what)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise UsageError(f"cannot read the {what} '{path}': {err.strerror or err}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise UsageError(f"{path}:{line}: the {what} is not UTF-8 text") from None
