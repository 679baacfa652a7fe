"""Does a plan a command printed fit? A warning near capacity, exit 2 beyond it (issue 33, item 4).

explain and plan print the plan's numbers first, whatever they are (a user reads the breakdown to see
what to change), then ask here: ranks above NEAR_CAPACITY of their device get one warning line on
stderr, and stages that do not fit are the located errors `hetc check` gives (passes/validate_fit.py),
so the command exits 2, as check and compile do for the same plan.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from hetc.ir.errors import SpecError
from hetc.passes.validate_fit import RankUse, estimate_uses, near_capacity_warning, stage_overflows
from hetc.ir.plan import Plan

if TYPE_CHECKING:     # the cost model loads where a command needs it, not when the CLI starts
    from hetc.passes.cost.estimate import Estimate

__all__ = ["enforce_estimate_fit", "enforce_fit"]


def enforce_estimate_fit(verb: str, plan: Plan, estimate: Estimate) -> None:
    """`enforce_fit` on the memory `estimate` prints: the compiled programs' peaks where they were simulated,
    else the closed form's (Note [one step time] in passes/simulated_step.py)."""
    source = "the cost model estimates" if estimate.closed_form_memory is None else "the compiled programs show"
    enforce_fit(verb, plan, estimate_uses(estimate.memory), source)


def enforce_fit(verb: str, plan: Plan, uses: list[RankUse], source: str) -> None:
    """Warn about ranks near capacity; raise SpecError for the stages over it. `source`: where `uses` come
    from ("the cost model estimates", "the verifier finds")."""
    warning = near_capacity_warning(plan.pipeline, uses, source)
    if warning is not None:
        print(f"hetc {verb}: warning: {warning}", file=sys.stderr)
    overflows = stage_overflows(plan, uses, source)
    if overflows:
        raise SpecError(overflows)
