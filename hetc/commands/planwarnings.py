"""The plan's warnings (passes/plan_warnings.py) on stderr, located and quoted as errors are."""

from __future__ import annotations

import sys

from hetc.ir.errors import Sources
from hetc.ir.plan import Plan
from hetc.passes.plan_warnings import plan_warnings

__all__ = ["print_plan_warnings"]


def print_plan_warnings(plan: Plan) -> None:
    sources = Sources()   # reads the quoted lines back from disk
    for diag in plan_warnings(plan):
        print(diag.render(sources), file=sys.stderr)
