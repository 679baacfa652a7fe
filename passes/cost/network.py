"""Bandwidth models and the ring formulas for collectives.

A link's bandwidth may depend on the message size (measured fits: Sailor's
`GB/s = a·log2(MB)² + b·log2(MB) + c`, capped; hetc profile points,
interpolated) and on how many GPUs of a node send at once: a fit measured
for k concurrent GPUs gives their *aggregate* rate, which the k streams
share.

Ring model (survey O.II; NCCL's ring algorithm): all-gather and
reduce-scatter of an X-byte buffer over n ranks take n−1 steps of X/n each;
all-reduce is a reduce-scatter then an all-gather (2(n−1) steps). The
slowest link of the ring sets the pace. All-to-all sends (n−1)/n·X from
every rank in n−1 pairwise exchanges.

Tree model (NCCL's double binary tree, its other all-reduce algorithm across
nodes): the buffer is reduced up two complementary binary trees and
broadcast back down, pipelined, so it pays 2·⌈log2 n⌉ link latencies instead
of the ring's 2(n−1), and moves 2X at TREE_BANDWIDTH_FRACTION of the link's
rate (each rank both receives from its children and sends to its parent on
one link). NCCL's tuner takes the faster of the two by size and rank count;
so does `CostModel.collective_time` for an all-reduce whose ring crosses
nodes: the tree for small buffers over many nodes, the ring for large ones.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass
from typing import Protocol

from hetc.ir.program import Collective

__all__ = [
    "COLLECTIVES",
    "Bandwidth",
    "MeasuredPoints",
    "QuadraticLogFit",
    "collective_bytes_per_rank",
    "ring_chunk",
    "ring_steps",
    "tree_all_reduce_time",
]

COLLECTIVES = tuple(Collective)
# A fit never drops below this fraction of its cap: guards against a quadratic
# that turns negative far outside the sizes it was measured on.
MIN_FIT_FRACTION = 0.01
# What of a link's rate NCCL's tree all-reduce reaches on large buffers: below the ring's (NCCL's tuning model
# rates the tree's bus bandwidth under the ring's across nodes), so the ring keeps the bandwidth-bound case.
TREE_BANDWIDTH_FRACTION = 0.9


class Bandwidth(Protocol):
    @property
    def source(self) -> str:
        """Where it was measured: the profile file or data folder."""
        ...

    def rate(self, nbytes: float) -> float:
        """Aggregate bytes/s for messages of `nbytes`."""
        ...


@dataclass(frozen=True, slots=True)
class QuadraticLogFit:
    """Sailor's network fit: GB/s = a·x² + b·x + c with x = log2(MB), capped at `cap` bytes/s.

    Past the parabola's vertex (a < 0) the rate is held at the vertex: a link
    does not slow down for larger messages; the fit just was not measured there.
    """

    a: float
    b: float
    c: float
    cap: float
    source: str = ""

    def rate(self, nbytes: float) -> float:
        x = math.log2(max(nbytes, 1.0) / 1e6)
        if self.a < 0:
            x = min(x, -self.b / (2 * self.a))
        gbs = (self.a * x + self.b) * x + self.c
        return max(min(gbs * 1e9, self.cap), self.cap * MIN_FIT_FRACTION)


@dataclass(frozen=True, slots=True)
class MeasuredPoints:
    """Measured (message bytes, bytes/s) points, interpolated in log(size); flat outside."""

    sizes: tuple[float, ...]
    rates: tuple[float, ...]
    source: str = ""

    def rate(self, nbytes: float) -> float:
        i = bisect_left(self.sizes, nbytes)
        if i == 0:
            return self.rates[0]
        if i == len(self.sizes):
            return self.rates[-1]
        lo, hi = math.log(self.sizes[i - 1]), math.log(self.sizes[i])
        t = (math.log(nbytes) - lo) / (hi - lo)
        return self.rates[i - 1] + t * (self.rates[i] - self.rates[i - 1])


def ring_steps(kind: str, n: int) -> int:
    """Sequential ring steps of one chunk (X/n bytes) each."""
    if n <= 1:
        return 0
    if kind == Collective.ALL_REDUCE:
        return 2 * (n - 1)
    if kind in COLLECTIVES:
        return n - 1
    raise ValueError(f"unknown collective '{kind}'; one of {', '.join(COLLECTIVES)}")


def ring_chunk(nbytes: float, n: int) -> float:
    return nbytes / max(n, 1)


def collective_bytes_per_rank(kind: str, n: int, nbytes: float) -> float:
    """Bytes each rank sends for a collective over the full buffer `nbytes` (ring algorithms)."""
    return ring_steps(kind, n) * ring_chunk(nbytes, n)


def tree_all_reduce_time(n: int, nbytes: float, rate: float, latency: float) -> float:
    """An all-reduce of `nbytes` over `n` ranks on NCCL's double binary tree (module docstring), over links of
    `rate` bytes/s and `latency` seconds."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * latency + 2 * nbytes / (TREE_BANDWIDTH_FRACTION * rate)
