"""`hetc plan SPEC`: fill every `auto` of the plan; print or write the explicit spec."""

from __future__ import annotations

import argparse
import json
import sys
import time

from hetc.commands import Subparsers
from hetc.commands.argtypes import file_or_stdout
from hetc.commands.progress import progress_printer
from hetc.commands.fitreport import enforce_estimate_fit
from hetc.commands.planargs import add_time_limit_option
from hetc.commands.profileargs import add_profile_option, load_profile_args
from hetc.plandir import PROFILE_ENV
from hetc.compiler import load_checked
from hetc.passes.validate_fit import HEADROOM_PRICE, NEAR_CAPACITY
from hetc.ir.jsontypes import JsonObject, JsonValue
from hetc.ir.units import human_seconds

__all__ = ["register"]


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "plan", help="choose every `auto` of a plan: stages, layers, lanes, schedule, ZeRO, offload",
        description="Search stage layouts over the cluster's bandwidth domains, the schedule, "
                    "micro-batch size, tensor parallelism, ZeRO level, offload and ministages of every "
                    "stage, and the GPUs to leave idle, under the spec's objective (throughput, or $ per "
                    "token within a budget), and compare the plan with baselines under the same cost model. "
                    f"Plans keep a headroom: within {NEAR_CAPACITY:.0%} of each device's memory where that "
                    f"costs at most {HEADROOM_PRICE:.0%} of the objective (the summary says what it gave up). "
                    "Prints the explicit spec (or writes it with -o) and a summary; docs/planner.md. "
                    f"Measured profiles come from --profile and ${PROFILE_ENV}.")
    p.add_argument("spec", metavar="SPEC")
    p.add_argument("-o", "--out", type=file_or_stdout, metavar="OUT.het",
                   help="write the explicit spec here (`-`: print it, as without -o)")
    p.add_argument("--json", action="store_true", help="print one JSON object (the spec's text in \"text\")")
    add_profile_option(p)
    add_time_limit_option(p)
    p.set_defaults(func=run, quick_exit=True)   # Note [ending a one-shot process at once]


def run(args: argparse.Namespace) -> int:
    from hetc.passes.plan.output import planned_text
    from hetc.passes.plan.planner import plan_spec
    from hetc.commands.planreport import plan_json, plan_provenance, plan_summary

    loaded, _ = load_checked(args.spec, require_complete=True, plan_missing=True)
    if args.out is not None:
        from hetc.ir.outdir import check_output_file

        check_output_file(args.out, "-o", loaded.inputs())   # Note [output files]
    profiles = load_profile_args(args.profile)
    start = time.perf_counter()

    progress = progress_printer("plan", start, elapsed=False)    # the search's lines say their time
    result = plan_spec(loaded.spec, profiles, loaded.path.parent, progress, time_limit_s=args.time_limit)
    note = "" if not result.planned else (f"planned by hetc plan: {human_seconds(result.step_time_s)}/step, "
                                          f"{result.tokens_per_s:,.0f} tokens/s predicted")
    text = planned_text(loaded, result.plan if result.planned else None, args.out, note)
    if args.out is not None:
        args.out.write_text(text)
    prov = plan_provenance(result, profiles)
    summary = plan_summary(args.spec, result, prov)
    if result.time_limit_note is not None:   # Note [an anytime search]
        print(f"hetc plan: note: {result.time_limit_note}; the plan is the best found by then "
              "(--time-limit S allows more)", file=sys.stderr)
    if args.json:
        obj = plan_json(args.spec, result, text, prov)
        obj["planning"] = {**_object(obj["planning"]), "time_limit_s": args.time_limit,
                           "time_limit_reached": result.time_limit_note}
        print(json.dumps(obj, indent=1))
    elif args.out is not None:
        print(summary)
    else:
        sys.stdout.write(text)
        print(summary, file=sys.stderr)
    if result.estimate is not None:   # None above FULL_ESTIMATE_RANKS: the planner's own fit check stands
        sys.stdout.flush()
        enforce_estimate_fit("plan", result.plan, result.estimate)
    return 0


def _object(value: JsonValue) -> JsonObject:
    assert isinstance(value, dict)   # plan_json's "planning" is an object
    return value
