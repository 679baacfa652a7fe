"""`hetc calibrate DIR`: run a few steps here and say which term of the prediction is off, and by how much.

The plan's ranks run on this machine as `hetc run DIR --local --metrics`
does (or `--measured FILE` names the metrics of a run made elsewhere, on the
cluster itself); the median per TimeClass of the steps after the first
(Note [time classes] in hetc/ir/timeline.py) is set against DIR's prediction,
split the same way (hetc/viz/classgap.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from hetc.viz.classgap import class_gaps, gap_table, measured_from_metrics, read_measured, worst_gap
from hetc.commands import Subparsers
from hetc.ir.errors import UsageError
from hetc.commands.prediction import plan_prediction
from hetc.plandir import PROFILE_ENV
from hetc.commands.profileargs import add_profile_option
from hetc.ir.timeline import mean_class_times

__all__ = ["register"]

DEFAULT_STEPS = 4


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "calibrate", help="run a few steps locally and compare them with the prediction, per time class",
        description="Run DIR's ranks on this machine for a few steps (as `hetc run DIR --local --metrics`), "
                    "and compare the measured time per class (compute, comm_wait, optimizer, offload; the "
                    "median of the steps after the first, mean per rank) with DIR's prediction: a table and "
                    "the term most off. The prediction is DIR's own, or made again with --profile / "
                    f"${PROFILE_ENV} when those differ from the profiles DIR was compiled with.")
    p.add_argument("dir", type=Path, metavar="DIR", help="a plan directory from `hetc compile`")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"steps to run (default {DEFAULT_STEPS})")
    p.add_argument("--metrics", type=Path, metavar="FILE", help="keep the run's metrics here")
    p.add_argument("--measured", type=Path, metavar="FILE",
                   help="run nothing: compare the metrics FILE of an earlier `hetc run DIR --metrics FILE` "
                        "(on the cluster, say) with the prediction")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_profile_option(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hetc.cli import main

    if not (args.dir / "plan.het").is_file():
        raise UsageError(f"{args.dir} is not a plan directory (write one with `hetc compile SPEC -o DIR`)")
    if args.steps < 1:
        raise UsageError("--steps must be positive")
    if args.measured is not None and args.metrics is not None:
        raise UsageError("--measured names the metrics of a run made before; --metrics keeps a new run's")
    if args.metrics is not None:
        from hetc.ir.outdir import check_output_file

        check_output_file(args.metrics, "--metrics")     # Note [output files]
    predicted = plan_prediction(args.dir, args.profile, "calibrate", True)
    if predicted is None:
        raise UsageError(f"{args.dir} has no timeline.json to compare with (compile it again)")
    if args.measured is not None:
        measured, measured_step = read_measured(args.measured)
        where = f"the run of {args.measured}"
    else:
        with tempfile.TemporaryDirectory(prefix="hetc-calibrate-") as tmp:
            metrics = args.metrics or Path(tmp) / "metrics.jsonl"
            code = main(["run", str(args.dir), "--local", "--steps", str(args.steps), "--metrics", str(metrics),
                         "--quiet"])
            if code != 0:
                print(f"hetc calibrate: the run failed (exit {code})", file=sys.stderr)
                return code
            measured, measured_step = measured_from_metrics(metrics)
        where = f"{args.steps} steps here"
    gaps = class_gaps(mean_class_times(list(predicted.classes)), measured)
    if args.json:
        off = worst_gap(gaps)
        print(json.dumps({"plan": str(args.dir), "measured": where,
                          "steps": None if args.measured else args.steps, "predicted_step_s": predicted.step_time,
                          "measured_step_s": measured_step, "classes": [g.to_json() for g in gaps],
                          "most_off": off.time_class if off else None}, indent=1))
    else:
        print(f"{args.dir}: {where}; time per class, mean per rank, one step "
              "(measured: median of the steps after the first)")
        print(gap_table(gaps, predicted.step_time, measured_step))
    return 0
