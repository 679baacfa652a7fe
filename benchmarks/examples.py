"""How fast the shipped specs check and plan; writes docs/benchmarks.md "Front-end and example plans".

    .venv/bin/python benchmarks/examples.py [--runs 3] [--no-write]

The figures the test suite used to assert (a duration asserted in a test
fails on the next, busier machine; here it is reported instead):

- *check*: `load_checked` of specs/zorse/c_llama13b.het (an explicit
  128-rank plan) in this process, the parser already built;
- *hetc check, fresh process*: `hetc check -q` of the same spec in a new
  interpreter (imports, parser, the check), which never imports torch;
- *plan*: `plan_spec` of each specs/zorse/*_auto.het, CPU seconds.

Best of `--runs`: the 2 CPU cores are shared, so the minimum is the least
disturbed run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.markdown import publish
from hetc.compiler import load_checked
from hetc.frontend.load import load_spec
from hetc.passes.plan.planner import plan_spec

HEADING = "## Front-end and example plans"
ZORSE = ROOT / "specs" / "zorse"
LARGEST = ZORSE / "c_llama13b.het"
AUTO_SPECS = tuple(ZORSE / f"{c}_auto.het" for c in "abc")
_FRESH_CHECK = """
import sys, time
started = time.perf_counter()
from hetc.cli import main
code = main(["check", "-q", sys.argv[1]])
print(time.perf_counter() - started if code == 0 else -1.0)
"""


def best_of(runs: int, fn) -> float:
    """The least of `runs` timings of `fn()`, which returns its own seconds."""
    return min(fn() for _ in range(runs))


def check_in_process() -> float:
    started = time.perf_counter()
    load_checked(LARGEST)
    return time.perf_counter() - started


def check_fresh_process() -> float:
    out = subprocess.run([sys.executable, "-c", _FRESH_CHECK, str(LARGEST)], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    seconds = float(out.stdout.strip().splitlines()[-1])
    if seconds < 0:
        raise SystemExit(f"hetc check {LARGEST} failed:\n{out.stderr}")
    return seconds


def plan_cpu(path: Path) -> float:
    spec = load_spec(path).spec
    started = time.process_time()
    plan_spec(spec, base_dir=path.parent)
    return time.process_time() - started


def section(runs: int) -> str:
    load_checked(LARGEST)  # builds the parser once per process
    rows = [("check", LARGEST.name, best_of(runs, check_in_process)),
            ("hetc check, fresh process", LARGEST.name, best_of(runs, check_fresh_process))]
    rows += [("plan (CPU)", p.name, best_of(runs, lambda p=p: plan_cpu(p))) for p in AUTO_SPECS]
    lines = [HEADING, "",
             ("`benchmarks/examples.py`: the shipped specs of specs/zorse/, best of "
              f"{runs} runs on 2 shared CPU cores. *check*: `load_checked` in-process, parser built; "
              "*hetc check, fresh process*: a new interpreter's imports, parser and check (torch is "
              "never imported, which tests/test_frontend_perf.py checks); *plan*: `plan_spec`, CPU "
              "seconds."), "",
             "| what | spec | seconds |", "|---|---|---|"]
    lines += [f"| {what} | {name} | **{seconds:.3f} s** |" for what, name, seconds in rows]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print the section only")
    args = parser.parse_args()
    return publish(HEADING, section(args.runs), write=not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
