"""Argument types for the command line: argparse turns their errors into usage errors (exit 2).

`float()` takes "nan" and "inf", which pass every `<= 0` check after it and then fail deep in the run
(a timedelta, a shard size in bytes), so the verbs' float options parse through these. A verb that prints
its output unless `-o FILE` names a file reads `-o -` as standard output, as Unix tools do (`file_or_stdout`).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from hetc.ir.outdir import STDOUT

__all__ = ["file_or_stdout", "finite_number", "positive_seconds"]


def file_or_stdout(text: str) -> Path | None:
    """A file to write, or None for `-`: the verb prints its output, as without `-o`."""
    return None if text == STDOUT else Path(text)


def finite_number(text: str) -> float:
    """A finite number; the verb checks its range and says which."""
    value = _float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"wants a finite number, not {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """A positive, finite number of seconds."""
    value = _float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"wants a positive number of seconds, not {text!r}")
    return value


def _float(text: str) -> float:
    """`text` as a float; nan for what is not one (refused by the callers' range checks)."""
    try:
        return float(text)
    except ValueError:
        return math.nan
