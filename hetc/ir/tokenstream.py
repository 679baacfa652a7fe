"""A file's ids read a window at a time with os.pread, so a file that shrinks is an error, not SIGBUS.

Note [reading a file that may shrink]
Training reads its windows from a file it does not own: a user may rewrite
or truncate the corpus while a run is reading it. Through a memory map, a
page past the file's new end is a SIGBUS that kills the rank without naming
anything (finding 13 of issue 28), and checking the size before each read
still races with the writer. `os.pread` cannot fault: it returns fewer bytes
than asked, which names the file in one line. A window is a few kilobytes
(seq + 1 ids), so one system call per sequence costs microseconds against a
training step of milliseconds, and the page cache serves repeated reads
just as it serves a map; the data is never held whole in memory either way.

A `TokenStream` behaves like the read-only 1-D array it stands for where
runtime/data.py uses one: `len`, `dtype`, slicing with step 1 (a view,
nothing read) and `numpy.asarray` (the read).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import overload

import numpy as np

__all__ = ["TokenStream", "TruncatedError"]


class TruncatedError(ValueError):
    """The file ends before ids it held when it was opened: the message is for the user."""


class TokenStream:
    """Ids [start, stop) of the `dtype` ids stored from byte `offset` of `path`."""

    def __init__(self, path: Path, dtype: str | np.dtype, offset: int, start: int, stop: int) -> None:
        self.path, self.dtype, self.offset = path, np.dtype(dtype), offset
        self.start, self.stop = start, stop

    @classmethod
    def of_file(cls, path: Path, dtype: str | np.dtype, offset: int, count: int) -> TokenStream:
        return cls(path, dtype, offset, 0, count)

    def __len__(self) -> int:
        return self.stop - self.start

    @overload
    def __getitem__(self, key: slice) -> TokenStream: ...

    @overload
    def __getitem__(self, key: int) -> int: ...

    def __getitem__(self, key: slice | int) -> TokenStream | int:
        if isinstance(key, slice):
            first, last, step = key.indices(len(self))
            if step != 1:
                raise IndexError("a TokenStream is sliced with step 1 only")
            return TokenStream(self.path, self.dtype, self.offset, self.start + first,
                               self.start + max(first, last))
        index = key + len(self) if key < 0 else key
        if not 0 <= index < len(self):
            raise IndexError(f"id {key} of a stream of {len(self)}")
        return int(self._read(self.start + index, self.start + index + 1)[0])

    def __array__(self, dtype: np.dtype | None = None, copy: bool | None = None) -> np.ndarray:
        ids = self._read(self.start, self.stop)
        return ids if dtype is None else ids.astype(dtype)

    def _read(self, first: int, last: int) -> np.ndarray:
        width = self.dtype.itemsize
        want = (last - first) * width
        fd = os.open(self.path, os.O_RDONLY)
        try:
            raw = os.pread(fd, want, self.offset + first * width)
            size = os.fstat(fd).st_size if len(raw) < want else 0
        finally:
            os.close(fd)
        if len(raw) < want:
            raise TruncatedError(f"'{self.path}' ends at byte {size}, before ids {first}..{last - 1} (which end at "
                                 f"byte {self.offset + last * width}): was it cut short or rewritten while the run "
                                 "was reading it?")
        return np.frombuffer(raw, dtype=self.dtype.newbyteorder("<"))
