"""The cost model against measured iterations; writes docs/benchmarks.md "Cost model".

    .venv/bin/python benchmarks/sailor_runs.py [--runs DIR] [--data DIR] [--no-write]

`--runs` is searched recursively for Sailor plan files that carry a measured
`real` (seconds per iteration of Megatron-DeepSpeed): by default the four in
../shared/data/sailor/validation-samples; Sailor's repository keeps the rest
of its validation runs under sailor/Planner/simulations/validation. Each plan
is imported as `hetc import sailor` does (its model is the one whose layer
count the plan covers) and timed as `hetc explain --profile DATA` does, with
Sailor's per-layer profiles and network fits from `--data`.

Reported per run: pipeline shape, micro-batch size, microbatches per lane and
the signed error of the prediction; then the median and mean absolute error
and how many runs land within 10%. Measured times themselves are not
reprinted: they are Sailor's data.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.markdown import publish
from hetc.ir.errors import UsageError
from hetc.importers.sailor import explain_plan, plan_model
from hetc.passes.cost.sources import load_profiles

HEADING = "## Cost model"
SAILOR = ROOT.parent / "shared" / "data" / "sailor"
TOLERANCE = 0.10


@dataclass(frozen=True)
class Result:
    name: str
    model: str
    shape: str          # stages × lanes per stage, TP
    mbs: int
    microbatches: int   # per lane
    error: float | None  # (predicted − measured) / measured; None when the plan could not be timed
    why: str = ""


def measured_plans(folder: Path) -> list[Path]:
    """Plan files under `folder` with a measured iteration time (a `real` of 0 is a run never measured)."""
    found = []
    for path in sorted(folder.rglob("*.json")):
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        real = raw.get("real") if isinstance(raw, dict) else None
        if "pipeline_list" in raw and isinstance(real, (int, float)) and real > 0:
            found.append(path)
    return found


def time_plan(data: Path, plan: Path, root: Path, profiles) -> Result:
    raw = json.loads(plan.read_text())
    pipe = raw["pipeline_list"][0]
    lanes, stages = pipe["dp"][0], pipe["num_stages"]
    shape = f"{stages}×{lanes}, tp {pipe['tmp_per_stage'][0][0][1]}"
    mbs = int(raw["mbs"])
    per_lane = int(raw["gbs"]) // (mbs * lanes)
    name = str(plan.relative_to(root))
    try:
        model = plan_model(str(data), str(plan))
        predicted = explain_plan(str(data), str(plan), profiles, model).step_time_s
    except UsageError as err:
        return Result(name, "?", shape, mbs, per_lane, None, str(err))
    return Result(name, model, shape, mbs, per_lane, (predicted - raw["real"]) / raw["real"])


def section(results: list[Result], runs: Path) -> str:
    timed = [r for r in results if r.error is not None]
    errors = [abs(r.error) for r in timed]
    within = sum(e <= TOLERANCE for e in errors)
    lines = [HEADING, "",
             (f"`benchmarks/sailor_runs.py --runs {runs.name}/`: Sailor's plans that ran on Megatron-DeepSpeed "
              "(1F1B, TP inside a node, DP all-reduce) with their measured seconds per iteration, imported with "
              "`hetc import sailor` and timed by `hetc explain` from Sailor's per-layer profiles and network "
              "fits. Error = (predicted − measured) / measured. Sailor's repository keeps its measured runs in "
              "sailor/Planner/simulations/validation/; ../shared/data/sailor/validation-samples/ (the default) "
              "holds four of them."), ""]
    if errors:
        lines += [(f"**{len(timed)} runs: median |error| {statistics.median(errors):.1%}, mean "
                   f"{statistics.fmean(errors):.1%}, {within} of {len(timed)} within {TOLERANCE:.0%}.**"), ""]
    lines += ["| run | model | stages × lanes, TP | micro-batch | microbatches per lane | error |",
              "|---|---|---|---|---|---|"]
    for r in results:
        error = f"{r.error:+.1%}" if r.error is not None else f"not timed: {r.why}"
        lines.append(f"| {r.name} | {r.model} | {r.shape} | {r.mbs} | {r.microbatches} | {error} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, default=SAILOR / "validation-samples",
                        help="a folder of Sailor plans with measured `real` (searched recursively)")
    parser.add_argument("--data", type=Path, default=SAILOR, help="the Sailor data folder (profiles, fits)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args(argv)
    if not args.data.is_dir():
        print(f"needs Sailor's data folder: {args.data} is not there (--data)", file=sys.stderr)
        return 2
    plans = measured_plans(args.runs) if args.runs.is_dir() else []
    if not plans:
        print(f"no Sailor plans with a measured `real` under {args.runs} (--runs)", file=sys.stderr)
        return 2
    profiles = load_profiles([args.data])
    results = []
    for i, plan in enumerate(plans, 1):
        print(f"[{i}/{len(plans)}] {plan.relative_to(args.runs)}", file=sys.stderr, flush=True)
        results.append(time_plan(args.data, plan, args.runs, profiles))
    text = section(results, args.runs)
    return publish(HEADING, text, write=not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
