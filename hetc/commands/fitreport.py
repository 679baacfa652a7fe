"""Does a plan a command printed fit? A warning near capacity, exit 2 beyond it (issue 33, item 4).

explain and plan print the plan's numbers first, whatever they are (a user reads the breakdown to see
what to change), then ask here: ranks above NEAR_CAPACITY of their device get one warning line on
stderr, and stages that do not fit are the located errors `hetc check` gives (passes/validate_fit.py),
so the command exits 2, as check and compile do for the same plan.
"""

from __future__ import annotations

import sys

from hetc.ir.errors import SpecError
from hetc.passes.validate_fit import RankUse, near_capacity_warning, stage_overflows
from hetc.ir.plan import Plan

__all__ = ["enforce_fit"]


def enforce_fit(verb: str, plan: Plan, uses: list[RankUse], source: str) -> None:
    """Warn about ranks near capacity; raise SpecError for the stages over it. `source`: where `uses` come
    from ("the cost model estimates", "the verifier finds")."""
    warning = near_capacity_warning(plan.pipeline, uses, source)
    if warning is not None:
        print(f"hetc {verb}: warning: {warning}", file=sys.stderr)
    overflows = stage_overflows(plan, uses, source)
    if overflows:
        raise SpecError(overflows)
