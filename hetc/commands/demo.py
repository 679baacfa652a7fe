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
from hetc.ir.errors import UsageError
from hetc.commands.check import summary
from hetc.compiler import load_checked
from hetc.frontend.load import BUNDLED_SPECS
from hetc.ir.outdir import Legacy, OutputKind, check_output_dir, write_marker
from hetc.plandir import LEGACY_PLAN

__all__ = ["DEMO_DIR", "DEMO_PLAN", "register"]

DEMO_DIR = BUNDLED_SPECS / "demo"
DEMO_PLAN = "hetero"
DEMO_FILES = ("metrics.jsonl", "trace.json", "schedule.html", "schedule.chrome.json")   # beside plan/
# what `hetc demo` wrote before its OUT carried a marker (Note [output directories] in hetc/ir/outdir.py)
LEGACY_DEMO = Legacy(patterns=(*DEMO_FILES, *(f"plan/{p}" for p in LEGACY_PLAN.patterns)),
                     required=(*(f"plan/{r}" for r in LEGACY_PLAN.required), DEMO_FILES[0]))


def register(sub: Subparsers) -> None:
    p = sub.add_parser("demo", help="compile, train and visualise the demo job",
                       description="Check the bundled demo job's plans (specs/demo/), compile one, train it "
                                   "on local CPU ranks and write the schedule page. Outputs go to OUT.")
    p.add_argument("--plan", default=DEMO_PLAN, help=f"which demo plan to run (default {DEMO_PLAN}); "
                   "one of the .het files in specs/demo/")
    p.add_argument("--steps", type=int, help="optimizer steps (default: the job's)")
    p.add_argument("-o", "--out", type=Path, default=Path("out/demo"), metavar="OUT",
                   help="where the outputs go (default out/demo): a new or empty directory, or an earlier demo's")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    plans = sorted(p for p in DEMO_DIR.glob("*.het") if not p.name.endswith("job.het"))
    spec_path = DEMO_DIR / f"{args.plan}.het"
    if spec_path not in plans:
        raise UsageError(f"no demo plan '{args.plan}'; choose from {', '.join(p.stem for p in plans)}")
    if args.steps is not None and args.steps < 1:
        raise UsageError(f"--steps must be positive, got {args.steps}")
    print(f"[1/4] checking the demo job's {len(plans)} plans ({DEMO_DIR})")
    for path in plans:
        _, checked = load_checked(path, require_complete=True)
        print(f"      {path.stem:<14} {summary(checked).split('; ', 2)[-1]}")
    out = args.out
    _claim(out)
    plan_dir = out / "plan"
    print(f"[2/4] compiling {spec_path.name} -> {plan_dir}")
    _hetc(["compile", str(spec_path), "-o", str(plan_dir)])
    print("[3/4] training on local CPU ranks")
    metrics, trace = out / DEMO_FILES[0], out / DEMO_FILES[1]
    argv = ["run", str(plan_dir), "--local", "--metrics", str(metrics), "--trace", str(trace)]
    if args.steps is not None:
        argv += ["--steps", str(args.steps)]
    _hetc(argv)
    page = out / DEMO_FILES[2]
    print("[4/4] drawing the schedule (predicted and measured)")
    _hetc(["viz", str(plan_dir), "--trace", str(trace), "--compare", "-o", str(page),
           "--chrome-trace", str(out / DEMO_FILES[3])])
    write_marker(out, OutputKind.DEMO)
    _report(out, metrics, page)
    return 0


def _claim(out: Path) -> None:
    """Make `out` the demo's: refused unless new, empty or an earlier demo's (hetc/ir/outdir.py); marked first,
    with the files still to come, so a demo stopped half-way can be run again into it."""
    check_output_dir(out, OutputKind.DEMO, legacy=LEGACY_DEMO)
    out.mkdir(parents=True, exist_ok=True)
    write_marker(out, OutputKind.DEMO, planned=(*DEMO_FILES, "plan/"))


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
