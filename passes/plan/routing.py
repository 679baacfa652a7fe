"""Microbatches to lanes: the counts that minimise a stage's slowest lane.

A lane serving c microbatches of `cycle` seconds each is busy c·cycle; the
stage is as slow as its busiest lane. Water-filling gives every lane the
most microbatches it can take under a common bound T, for the least T that
places all of them (each lane at least one, none beyond what fits in its
memory), then takes the surplus back from the busiest lanes. Under
per-microbatch ZeRO collectives (ZeRO-2/3 outside the Zorse schedule) every
lane runs in lockstep with the others and must serve the same number.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

__all__ = ["bottleneck", "spread"]

_REL = 1e-12   # float slack when comparing c·cycle with T


def bottleneck(m: int, classes: Sequence[tuple[int, float, int]], equal: bool = False) -> float | None:
    """The least max c·cycle over lanes; `classes` are (lanes, cycle, cap). None: cannot place m."""
    got = _bound(m, classes, equal)
    return None if got is None else got[0]


def spread(m: int, classes: Sequence[tuple[int, float, int]], equal: bool = False) -> list[list[int]] | None:
    """Counts per lane of each class (a class's busier lanes first), or None when m cannot be placed."""
    got = _bound(m, classes, equal)
    if got is None:
        return None
    top = list(got[1])                       # the class's highest count
    at_top = [n for n, _, _ in classes]      # lanes of the class at that count (its first lanes)
    excess = sum(n * c for (n, _, _), c in zip(classes, top)) - m
    while excess > 0:
        # take microbatches back from the busiest lanes that can spare one
        j = max((j for j in range(len(classes)) if top[j] > 1), key=lambda j: (top[j] * classes[j][1], -j))
        taken = min(excess, at_top[j])
        at_top[j] -= taken
        excess -= taken
        if at_top[j] == 0:
            top[j], at_top[j] = top[j] - 1, classes[j][0]
    return [[c] * k + [c - 1] * (n - k) for (n, _, _), c, k in zip(classes, top, at_top)]


def _bound(m: int, classes: Sequence[tuple[int, float, int]], equal: bool) -> tuple[float, list[int]] | None:
    lanes = sum(n for n, _, _ in classes)
    if lanes == 0 or m < lanes or any(cap < 1 for _, _, cap in classes):
        return None
    if equal:
        if m % lanes or any(cap < m // lanes for _, _, cap in classes):
            return None
        c = m // lanes
        return max(c * cycle for _, cycle, _ in classes), [c] * len(classes)
    if sum(n * cap for n, _, cap in classes) < m:
        return None
    if len(classes) == 1:
        (n, cycle, _), = classes
        c = -(-m // n)
        return c * cycle, [c]

    def placed(t: float) -> int:
        return sum(n * _take(t, cycle, cap) for n, cycle, cap in classes)

    lo = max(cycle for _, cycle, _ in classes)          # every lane serves at least one
    if placed(lo) >= m:
        return lo, [_take(lo, cycle, cap) for _, cycle, cap in classes]
    got = _between_breakpoints(m, classes, placed, lo)
    if got is not None:
        return got
    hi = max(cycle * cap for _, cycle, cap in classes)  # every lane at its cap
    for _ in range(100):
        if hi - lo <= _REL * hi:
            break
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if placed(mid) >= m else (mid, hi)
    per_class = [_take(hi, cycle, cap) for _, cycle, cap in classes]
    return max(c * cycle for c, (_, cycle, _) in zip(per_class, classes)), per_class


def _between_breakpoints(m: int, classes: Sequence[tuple[int, float, int]], placed: Callable[[float], int],
                         lo: float) -> tuple[float, list[int]] | None:
    """The least bound when no cap binds: it lies within one slowest cycle above the fluid bound
    m / Σ(lanes / cycle), where every class has only a few count steps (breakpoints c · cycle) to try."""
    fluid = max(lo, m / sum(n / cycle for n, cycle, _ in classes if cycle > 0))
    hi = fluid + max(cycle for _, cycle, _ in classes)
    if any(cycle <= 0 for _, cycle, _ in classes) or placed(hi) < m:
        return None  # a cap binds: bisect instead
    points = sorted({c * cycle for _, cycle, _ in classes
                     for c in range(max(1, math.floor(fluid / cycle)), math.floor(hi / cycle) + 2)})
    for t in points:
        if t >= fluid * (1 - _REL) and placed(t) >= m:
            per_class = [_take(t, cycle, cap) for _, cycle, cap in classes]
            return max(c * cycle for c, (_, cycle, _) in zip(per_class, classes)), per_class
    return None


def _take(t: float, cycle: float, cap: int) -> int:
    if cycle <= 0:
        return cap
    return max(1, min(cap, math.floor(t / cycle * (1 + _REL))))
