"""`hetc demo`: the quickstart job, end to end, on local CPU ranks.

Checks every plan of the bundled demo job, compiles one (by default the
heterogeneous pipeline: one lane, then two, then one), trains it on the
bundled text for the spec's steps (the loss falls), and draws the predicted
and measured schedules side by side. Everything lands in OUT (default
out/demo).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hetc.commands import Subparsers
from hetc.errors import UsageError
from hetc.commands.check import summary
from hetc.compiler import load_checked
from hetc.frontend.load import BUNDLED_SPECS

__all__ = ["DEMO_DIR", "DEMO_PLAN", "register"]

DEMO_DIR = BUNDLED_SPECS / "demo"
DEMO_PLAN = "hetero"


def register(sub: Subparsers) -> None:
    p = sub.add_parser("demo", help="compile, train and visualise the demo job",
                       description="Check the bundled demo job's plans (specs/demo/), compile one, train it "
                                   "on local CPU ranks and write the schedule page. Outputs go to OUT.")
    p.add_argument("--plan", default=DEMO_PLAN, help=f"which demo plan to run (default {DEMO_PLAN}); "
                   "one of the .het files in specs/demo/")
    p.add_argument("--steps", type=int, help="optimizer steps (default: the job's)")
    p.add_argument("-o", "--out", type=Path, default=Path("out/demo"), metavar="OUT")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    plans = sorted(p for p in DEMO_DIR.glob("*.het") if not p.name.endswith("job.het"))
    spec_path = DEMO_DIR / f"{args.plan}.het"
    if spec_path not in plans:
        raise UsageError(f"no demo plan '{args.plan}'; choose from {', '.join(p.stem for p in plans)}")
    print(f"[1/4] checking the demo job's {len(plans)} plans ({DEMO_DIR})")
    for path in plans:
        _, checked = load_checked(path, require_complete=True)
        print(f"      {path.stem:<14} {summary(checked).split('; ', 2)[-1]}")
    out = args.out
    plan_dir = out / "plan"
    print(f"[2/4] compiling {spec_path.name} -> {plan_dir}")
    _hetc(["compile", str(spec_path), "-o", str(plan_dir)])
    print("[3/4] training on local CPU ranks")
    metrics, trace = out / "metrics.jsonl", out / "trace.json"
    argv = ["run", str(plan_dir), "--local", "--metrics", str(metrics), "--trace", str(trace)]
    if args.steps is not None:
        argv += ["--steps", str(args.steps)]
    _hetc(argv)
    page = out / "schedule.html"
    print("[4/4] drawing the schedule (predicted and measured)")
    _hetc(["viz", str(plan_dir), "--trace", str(trace), "--compare", "-o", str(page),
           "--chrome-trace", str(out / "schedule.chrome.json")])
    _report(out, metrics, page)
    return 0


def _hetc(argv: list[str]) -> None:
    from hetc.cli import main

    status = main(argv)
    if status:
        raise SystemExit(status)


def _report(out: Path, metrics: Path, page: Path) -> None:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    if rows:
        first, last = rows[0]["loss"], rows[-1]["loss"]
        print(f"\nloss {first:.3f} -> {last:.3f} over {len(rows)} steps", file=sys.stdout)
    print(f"outputs in {out}/: plan/ (programs, timeline), metrics.jsonl, trace.json, "
          f"{page.name} (open in a browser), schedule.chrome.json (ui.perfetto.dev)")
