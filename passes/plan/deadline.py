"""The planner's time limit: a deadline that the search's loops look at.

Note [an anytime search]: `hetc plan` (and `hetc compile` of a spec with `auto`) is held to a time limit,
`--time-limit S`, DEFAULT_TIME_LIMIT_S unless given. The search (search.py) is a few coarse-to-fine steps
over structures, and each structure's work is one call (`Search._quick`, `_bound`, `_screen_value`,
`_exact_rank`, `_configure`, `_refine`). Each call looks at its step's deadline first and, once that has
passed, answers at once as for a structure where nothing fits; while it works, its option tables stop
growing at that deadline (`Structures.until`: a call cut short there is dropped, not half-used), and the
local search looks at it between moves. So the steps run on, quickly, with what they have, and the search
ends with the plans it scored before the limit; the best of them (or a baseline that beats it) is the plan,
with a note naming the steps that ran out of time (`Search.cut_short`, `PlanResult.time_limit_note`).

Plans are scored only from the configurations step on, after the screens (steps 1-3). So the screens
stop at SCREEN_SHARE of the limit and the structures they ranked so far go on to be configured and
refined in the rest: the limit yields a configured plan, not an empty search. (A screen the limit stopped
before its first structure leaves the previous screen's ranking.) Where no plan fits by the limit, the
plan is a located error saying so (exit 2), never a plan nobody checked.

Nothing is killed from outside. The deadline is a point on the monotonic clock, which a forked worker
(Note [a forked worker] in hetc/ir/worker.py) shares with its parent, so the worker stops its share at the
same moment; the overshoot is about one option table entry or exact score (tens of ms on a 10,000-block
model), then the checks after the search (baselines, the re-timing of its best few plans and the
baselines on their compiled programs, the winner's lowering and verification, the estimate), each bounded
in size (Note [one number] in final.py, Note [the planner checks its winner], Note [one step time]). Within the
limit the search is what it was without one: the printed plan depends on timing only where the note says
the limit was reached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from time import monotonic

__all__ = ["DEFAULT_TIME_LIMIT_S", "SCREEN_SHARE", "Deadline"]

# `hetc plan`'s time limit unless --time-limit says otherwise: minutes, far above the 1-10 s a search of
# the specs in this repository takes, so that only a search that would run away meets it.
DEFAULT_TIME_LIMIT_S = 300.0

# The screens (the search's steps 1-3) end by this share of the limit, leaving the rest to configure and
# refine the structures they kept (Note [an anytime search]).
SCREEN_SHARE = 0.5


@dataclass(frozen=True)
class Deadline:
    """When the planner's time is up: `limit_s` seconds (None: never) after it was set."""

    limit_s: float | None
    at: float   # on the monotonic clock (time.monotonic); inf where there is no limit

    @classmethod
    def after(cls, limit_s: float | None) -> Deadline:
        return cls(limit_s, math.inf if limit_s is None else monotonic() + limit_s)

    def passed(self) -> bool:
        return monotonic() >= self.at

    def share(self, fraction: float) -> Deadline:
        """The point `fraction` of the way from when this deadline was set to it."""
        if self.limit_s is None:
            return self
        return Deadline(self.limit_s * fraction, self.at - self.limit_s * (1 - fraction))
