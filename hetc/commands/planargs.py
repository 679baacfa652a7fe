"""The planner's options on every verb that plans a spec with `auto`: `--time-limit S`.

`hetc plan` and `hetc compile` take it through `add_time_limit_option`, so the flag, its default and its
help are one definition (Note [an anytime search] in passes/plan/deadline.py).
"""

from __future__ import annotations

import argparse

from hetc.commands.argtypes import positive_seconds
from hetc.passes.plan.deadline import DEFAULT_TIME_LIMIT_S

__all__ = ["add_time_limit_option"]


def add_time_limit_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--time-limit", type=positive_seconds, default=DEFAULT_TIME_LIMIT_S, metavar="S",
                   help=f"stop the plan search after S seconds (default {DEFAULT_TIME_LIMIT_S:g}; its coarse "
                        "screens get the first half) and use the best plan found by then, with a note of what "
                        "was cut short; exit 2 if no plan was found by then. A spec without `auto` is not "
                        "searched (docs/planner.md \"Time limit\")")
