"""How far a compiled step is from its lower bound, and where the difference goes.

`bound_gap(built)` puts the compiled program's simulated step beside the
lower bound of its plan (passes/cost/bound.py, Note [step lower bound]) and
splits the difference over the rank whose chain sets the bound, read from
the simulated timeline: its first compute op starts later than the bound's
fill (`fill`), its compute span holds idle time, waiting for the
pipeline's inputs (`bubbles`: uneven lanes, in-flight limits) or for
collectives (`comm`: ZeRO), and its last op is followed by more than the
bound's drain and tail (`tail`). The four parts sum to the difference.
tests/test_step_bound.py and benchmarks/plan_agreement.py read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetc.passes.agreement import Built
from hetc.passes.cost.bound import StepBound, programs_forwards_first, programs_in_flight, step_bound
from hetc.ir.timeline import Event, EventKind, Stream, Timeline

__all__ = ["BoundGap", "bound_gap"]

_WORK = frozenset({EventKind.FORWARD, EventKind.BACKWARD, EventKind.BACKWARD_INPUT, EventKind.BACKWARD_WEIGHT})
_EPS = 1e-12


@dataclass(frozen=True)
class BoundGap:
    bound: StepBound
    compiled_s: float
    fill: float      # seconds of the difference before the rank's first compute op
    bubbles: float   # idle inside its compute span, waiting for inputs from other stages
    comm: float      # idle inside its compute span, waiting for collectives
    tail: float      # after its last compute op, beyond the bound's drain and tail

    @property
    def ratio(self) -> float:
        """Compiled step over the bound (at least 1 for a true bound)."""
        return self.compiled_s / self.bound.total if self.bound.total > 0 else 1.0

    @property
    def reason(self) -> str:
        """The part that holds most of the difference."""
        parts = {"fill/drain": self.fill, "bubbles": self.bubbles, "comm": self.comm, "tail": self.tail}
        return max(parts, key=lambda k: parts[k])

    def describe(self) -> str:
        b = self.bound
        return (f"compiled {self.compiled_s:.4g} s = {self.ratio:.3f} x bound {b.total:.4g} s (rank {b.rank}: "
                f"fill {b.fill:.3g} + busy {b.busy:.3g} + drain {b.drain:.3g} + tail {b.tail:.3g}); beyond it: "
                f"fill {self.fill:.3g}, bubbles {self.bubbles:.3g}, comm {self.comm:.3g}, tail {self.tail:.3g} "
                f"({self.reason})")


def bound_gap(built: Built) -> BoundGap:
    """The compiled step of `built` (simulated) beside its plan's lower bound."""
    timeline = built.timeline
    assert timeline is not None, "bound_gap() needs a simulated step"
    bound = step_bound(built.costs, programs_in_flight(built.program), programs_forwards_first(built.program))
    work = sorted((e for e in timeline.events if e.rank == bound.rank and e.kind in _WORK), key=lambda e: e.start)
    first, last = work[0].start, max(e.end for e in work)
    idle = _idle_gaps(work)
    comm = sum(b - a for a, b in idle if _waited_on_collective(timeline, bound.rank, b))
    inside = (last - first) - bound.busy
    comm = min(comm, max(inside, 0.0))
    return BoundGap(bound, timeline.step_time, first - bound.fill, inside - comm, comm,
                    timeline.step_time - last - bound.drain - bound.tail)


def _idle_gaps(work: list[Event]) -> list[tuple[float, float]]:
    gaps, end = [], work[0].end
    for e in work[1:]:
        if e.start > end + _EPS:
            gaps.append((end, e.start))
        end = max(end, e.end)
    return gaps


def _waited_on_collective(timeline: Timeline, rank: int, resume: float) -> bool:
    """The rank resumed at `resume` when one of its collectives ended: it was waiting on it."""
    return any(e.rank == rank and e.stream is Stream.COLLECTIVE and abs(e.end - resume) <= 1e-9 * max(resume, 1.0)
               for e in timeline.events)
