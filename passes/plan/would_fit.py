"""When no plan fits in memory: which change to what the spec fixes would let one fit.

The planner searches what the spec leaves open. A spec that fixes a memory
knob (its ZeRO level or offload, or the model's activation checkpointing)
can leave nothing that fits where a freer spec would. So before saying
"nothing fits", the planner searches again, narrowly, with one change at a
time, least intrusive first:

1. ZeRO and offload left to the planner, where the spec fixes them;
2. stronger activation checkpointing (`selective`, then `full`) with the
   spec's ZeRO and offload;
3. both.

It names the first change that fits, with the plan it found, or says that
none does (then only more, or larger, GPUs help). This runs only on the
error path; the narrow search may miss a plan that a full one would find,
so "none does" is a statement about the changes tried at that width.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from hetc.passes.cost import Profiles
from hetc.passes.plan.deadline import Deadline
from hetc.passes.plan.objective import Goal
from hetc.passes.plan.search import Search, SearchLimits
from hetc.passes.plan.space import PLAIN_OFFLOADS, ZORSE_OFFLOADS, SearchSpace
from hetc.ir.spec import Auto, Checkpointing
from hetc.ir.units import human_seconds
from hetc.ir.plan import Job

__all__ = ["QUICK", "would_fit"]

# a look, not a search: seconds on the largest clusters, and only when nothing fits
QUICK = SearchLimits(exhaustive=0, quick_layouts=8, layouts=2, structures=3, refine=1, local_evaluations=4,
                     exact_screen=False, window=2, cpsat_work=0.1)

_STRONGER = {Checkpointing.NONE: (Checkpointing.SELECTIVE, Checkpointing.FULL),
             Checkpointing.SELECTIVE: (Checkpointing.FULL,), Checkpointing.FULL: ()}


@dataclass(frozen=True)
class _Change:
    says: str            # what the user would write
    job: Job
    space: SearchSpace


def would_fit(job: Job, profiles: Profiles | None, space: SearchSpace, goal: Goal,
              deadline: Deadline | None = None) -> str:
    """Advice that ends the "nothing fits" error: the first change that fits, or that none of them does; the
    looks stop at the planner's `deadline` (Note [an anytime search] in deadline.py)."""
    tried = []
    for change in _changes(job, space):
        found = Search(change.job, profiles, change.space, goal, QUICK, deadline).run()
        fitting = [f for f in found if f.score.fits]
        if not fitting and deadline is not None and deadline.passed():
            return "the planner's time limit left no time to look for a change to the spec that would fit"
        if fitting:
            best = fitting[0]
            return (f"with {change.says}, a plan fits ({len(best.candidate.stages)} stages, "
                    f"{best.candidate.schedule.value}, {human_seconds(best.score.step_time_s)}/step, fullest GPU at "
                    f"{100 * best.score.fullest.share:.0f} %)")
        tried.append(change.says)
    if not tried:
        return "add GPUs, or GPUs with more memory"
    return f"no plan fits with {' or with '.join(tried)} either: add GPUs, or GPUs with more memory"


def _changes(job: Job, space: SearchSpace) -> Iterator[_Change]:
    freed, frees = _freed(space)
    if freed is not None:
        yield _Change(frees, job, freed)
    written = job.model.activation_checkpoint   # `auto`: the search already tried every level
    for level in () if isinstance(written, Auto) else _STRONGER[written]:
        stronger = job.with_model(replace(job.model, activation_checkpoint=level))
        says = f"activation_checkpoint = {level.value} in the model block"
        yield _Change(says, stronger, _with_checkpoint(space, level))
        if freed is not None:
            yield _Change(f"{says} and {frees}", stronger, _with_checkpoint(freed, level))


def _with_checkpoint(space: SearchSpace, level: Checkpointing) -> SearchSpace:
    """The space of a spec whose model says `level` (`space_from_spec`'s reading of it)."""
    return replace(space, checkpoints=(level,), fixed=replace(space.fixed, checkpoint=level))


def _freed(space: SearchSpace) -> tuple[SearchSpace | None, str]:
    """The space with the ZeRO level and offload the spec fixes left open, and what the user writes for it.

    Offload is the planner's only where it designs the stages (the spec writes no stages)."""
    fixed = space.fixed
    zero, offload = fixed.zero is not None, fixed.offload is not None and not fixed.stages
    if not (zero or offload):
        return None, ""
    freed = replace(space, zero_levels=(0, 1, 2, 3) if zero else space.zero_levels,
                    offloads=PLAIN_OFFLOADS if offload else space.offloads,
                    zorse_offloads=ZORSE_OFFLOADS if offload else space.zorse_offloads,
                    fixed=replace(fixed, zero=None if zero else fixed.zero,
                                  offload=None if offload else fixed.offload))
    says = " and ".join(([] if not zero else ["`zero = auto`"]) +
                        ([] if not offload else ["no `offload` block in `parallel`"]))
    return freed, says
