"""`hetc explain SPEC`: what a plan costs: memory per rank, traffic per group, step time."""

from __future__ import annotations

import argparse
import json
import sys

from hetc.commands import Subparsers
from hetc.commands.fitreport import enforce_estimate_fit
from hetc.commands.planwarnings import print_plan_warnings
from hetc.ir.errors import SpecError, UsageError
from hetc.compiler import load_checked
from hetc.passes.validate_fit import cost_error
from hetc.plandir import PROFILE_ENV
from hetc.commands.profileargs import add_profile_option, load_profile_args

__all__ = ["register"]


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "explain", help="predict memory, traffic and step time of a plan",
        description="Per-rank memory (parameters, gradients, optimizer, activations, buffers, reserve), "
                    "traffic per group and the predicted step time, tokens/s, MFU and HFU of SPEC's plan; exits 2 "
                    "after them when a stage does not fit, and warns about ranks above 95% of their memory. "
                    f"Measured profiles come from --profile and ${PROFILE_ENV}.")
    p.add_argument("spec", metavar="SPEC", help="a .het spec with an explicit plan")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_profile_option(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hetc.passes.cost import CostError, CostModel
    from hetc.passes.simulated_step import simulated_estimate

    _, checked = load_checked(args.spec, require_complete=True)
    plan = checked.explicit()
    if plan is None:
        raise UsageError(f"the plan in {args.spec} still has `auto` in it; run `hetc plan {args.spec} -o "
                         "OUT.het` first and explain OUT.het")
    profiles = load_profile_args(args.profile)
    try:
        costs = CostModel(plan, profiles)
        estimate = simulated_estimate(costs, costs.estimate())   # Note [one step time]
    except CostError as err:   # located at the device kind, as check and compile say it
        raise SpecError(cost_error(plan, err)) from None
    if args.json:
        print(json.dumps({"spec": args.spec, **estimate.to_json()}, indent=1))
    else:
        from hetc.commands.costreport import report

        print(report(args.spec, plan, estimate))
    sys.stdout.flush()   # the breakdown before the verdict on it
    print_plan_warnings(plan)
    enforce_estimate_fit("explain", plan, estimate)
    return 0
