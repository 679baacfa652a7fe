"""The layer counts the search weighs: every count on models of a few hundred blocks, a grid on larger ones.

Note [a grid of layer counts]: the search's work grows with the layer counts it weighs per stage. Its
windows of counts (`Structures.assign`) are a few counts wide, but the screen's lower bound
(screen_bound.py) takes every count from 1 to the units, its least fill is a sum over pairs of counts, and
a window that misses the answer doubles until it reaches it: at 1,000 blocks a plan took 2 s, at 4,000
23 s, and at 10,000 `hetc plan` ran 1,115 s without an end (issue 28). Yet blocks are alike for the cost
model (a stage's costs depend on how many it owns, not which), so on a long model neighbouring counts
cost almost the same and weighing each of them buys little. Where the model has more than GRID_BLOCKS
blocks the search weighs counts on a grid of `grain` = ⌈blocks / GRID_BLOCKS⌉ units instead: each stage's
count is a multiple of the grain but the last free stage's, which takes the remainder (so the counts can
still sum to the units, and the stages' borders fall on multiples of the grain). That caps the counts per
stage at about GRID_BLOCKS, whatever the model's length. The local search (improve.py) then moves borders
by the grain and by ever smaller steps down to one unit, so the plan is not held to the grid, only the
search's coarse steps are. Counts a spec writes stay as written.
"""

from __future__ import annotations

import math

__all__ = ["GRID_BLOCKS", "grid_counts", "layer_grain", "residues", "steps_down"]

# The most blocks the search weighs one count at a time; above, a grid (Note [a grid of layer counts]).
GRID_BLOCKS = 256


def layer_grain(blocks: int) -> int:
    """The grid's step in layer units for a model of `blocks` blocks (1: every count)."""
    return max(1, math.ceil(blocks / GRID_BLOCKS))


def residues(fixed: list[int | None], units: int, grain: int) -> list[int]:
    """Each stage's count modulo the grain: 0, but the last free stage's, which takes what the others leave."""
    free = [s for s, n in enumerate(fixed) if n is None]
    left = units - sum(n for n in fixed if n is not None)
    return [left % grain if free and s == free[-1] else 0 for s in range(len(fixed))]


def grid_counts(lo: int, hi: int, grain: int, residue: int) -> range:
    """The counts in [lo, hi] that are `residue` modulo `grain`."""
    return range(lo + (residue - lo) % grain, hi + 1, grain)


def steps_down(grain: int) -> list[int]:
    """The local search's step sizes: the grain, then halves down to one unit."""
    out = [grain]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out
