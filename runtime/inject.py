"""Fault injection for tests and demos: `hetc run ... --inject 'slow rank=R factor=F from=S [until=U]'`.

A slowed rank computes `factor` times slower from step S (0-based, the step index the run prints as S+1)
until step U (exclusive; for good when absent): after each of its compute instructions it waits
(factor - 1) times as long as the instruction took, as a throttled GPU or a noisy neighbour would
stretch it. The rest of the run is untouched, so the losses are those of an unperturbed run; only the
time changes (what live rebalancing, runtime/rebalance.py, must notice).

On a GPU the host times a kernel launch, not the kernel, so an injected rank synchronizes its device
around each compute instruction to measure it: an injected run is a test of the job's reaction, not a
measurement of its speed.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hetc.errors import UsageError

if TYPE_CHECKING:
    import torch

__all__ = ["Slowdown", "compute_factor", "parse_injection", "stretch", "synchronize"]

_KEYS = {"rank", "factor", "from", "until"}


@dataclass(frozen=True)
class Slowdown:
    """One `slow` injection: `rank` computes `factor` times slower over steps [start, until)."""

    rank: int
    factor: float
    start: int = 0
    until: int | None = None

    def active(self, step: int) -> bool:
        return self.start <= step and (self.until is None or step < self.until)


def parse_injection(text: str) -> Slowdown:
    """`slow rank=R factor=F [from=S] [until=U]`, or a UsageError that quotes it and says what is wrong."""
    words = text.split()
    if not words or words[0] != "slow":
        raise UsageError(f"--inject '{text}': expected `slow rank=R factor=F [from=S] [until=U]`")
    fields: dict[str, str] = {}
    for word in words[1:]:
        m = re.fullmatch(r"([a-z]+)=(\S+)", word)
        if m is None or m[1] not in _KEYS:
            raise UsageError(f"--inject '{text}': '{word}' is not one of {', '.join(sorted(k + '=' for k in _KEYS))}")
        fields[m[1]] = m[2]
    missing = [k for k in ("rank", "factor") if k not in fields]
    if missing:
        raise UsageError(f"--inject '{text}': {' and '.join(missing)} missing")
    try:
        got = Slowdown(int(fields["rank"]), float(fields["factor"]), int(fields.get("from", 0)),
                       int(fields["until"]) if "until" in fields else None)
    except ValueError as err:
        raise UsageError(f"--inject '{text}': {err}") from None
    if got.rank < 0 or got.factor < 1 or got.start < 0 or (got.until is not None and got.until <= got.start):
        raise UsageError(f"--inject '{text}': needs rank >= 0, factor >= 1 and 0 <= from < until")
    return got


def compute_factor(injections: tuple[Slowdown, ...], rank: int, step: int) -> float:
    """How many times slower `rank` computes in `step`."""
    factor = 1.0
    for inj in injections:
        if inj.rank == rank and inj.active(step):
            factor *= inj.factor
    return factor


def stretch(seconds: float, factor: float) -> None:
    """Wait out the extra time of an instruction that took `seconds` at `factor` times slower."""
    if factor > 1 and seconds > 0:
        time.sleep((factor - 1) * seconds)


def synchronize(device: torch.device) -> None:
    """Finish the device's queued work (a slowed GPU rank times its compute on the device)."""
    if device.type == "cuda":
        import torch     # here: `hetc run --help` and the CLI's parser read this module without torch

        torch.cuda.synchronize(device)
