"""`hetc explain SPEC`: what a plan costs: memory per rank, traffic per group, step time."""

from __future__ import annotations

import argparse
import json
import os

from hetc.cli import UsageError
from hetc.errors import SpecError
from hetc.frontend import load_checked
from hetc.passes.validate_fit import cost_error

__all__ = ["PROFILE_ENV", "load_profile_args", "register"]

PROFILE_ENV = "HETC_PROFILES"   # os.pathsep-separated profile files / data folders used by default


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "explain", help="predict memory, traffic and step time of a plan",
        description="Per-rank memory (parameters, gradients, optimizer, activations, buffers, reserve), "
                    "traffic per group and the predicted step time, tokens/s, MFU and HFU of SPEC's plan. "
                    f"Measured profiles come from --profile and ${PROFILE_ENV}.")
    p.add_argument("spec", metavar="SPEC", help="a .het spec with an explicit plan")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--profile", action="append", default=[], metavar="FILE|DIR",
                   help="a `hetc profile` file, a Sailor data folder or a Zorse folder (repeatable)")
    p.set_defaults(func=run)


def load_profile_args(paths: list[str]):
    from hetc.passes.cost import ProfileError, load_profiles

    env = [x for x in os.environ.get(PROFILE_ENV, "").split(os.pathsep) if x]
    try:
        return load_profiles(env + list(paths))
    except ProfileError as err:
        raise UsageError(str(err)) from None


def run(args: argparse.Namespace) -> int:
    from hetc.passes.cost import CostError, CostModel

    _, checked = load_checked(args.spec, require_complete=True)
    if checked.pipeline is None:
        raise UsageError(f"the plan in {args.spec} still has `auto` in it; run `hetc plan {args.spec} -o "
                         "OUT.het` first and explain OUT.het")
    profiles = load_profile_args(args.profile)
    try:
        estimate = CostModel(checked.spec, checked.pipeline, checked.topology, profiles).estimate()
    except CostError as err:   # located at the device kind, as check and compile say it
        raise SpecError(cost_error(checked.spec, err)) from None
    if args.json:
        print(json.dumps({"spec": args.spec, **estimate.to_json()}, indent=1))
    else:
        from hetc.costreport import report

        print(report(args.spec, checked.pipeline, estimate))
    return 0
