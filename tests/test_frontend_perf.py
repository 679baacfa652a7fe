"""The front-end is fast and light: the largest spec checks in well under a
second, and `hetc check` never imports torch (or the planner's solvers)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from hetc.frontend import load_checked
from tests.conftest import ROOT, SPECS

LARGEST = SPECS / "zorse" / "c_llama13b.het"  # cluster C: an explicit 128-rank plan
HEAVY_MODULES = ("torch", "ortools", "networkx", "jinja2")


def test_largest_spec_checks_in_well_under_a_second():
    load_checked(LARGEST)  # builds the parser once per process
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        _, checked = load_checked(LARGEST)
        best = min(best, time.perf_counter() - started)
    assert checked.pipeline is not None and checked.pipeline.world_size == 128
    assert best < 0.25, f"checking {LARGEST.name} took {best:.3f} s"


_PROBE = """
import json, sys, time
started = time.perf_counter()
from hetc.cli import main
code = main(["check", "-q", sys.argv[1]])
print(json.dumps({"code": code, "seconds": time.perf_counter() - started,
                  "loaded": sorted(m for m in sys.modules if m.split(".")[0] in sys.argv[2:])}))
"""


def test_check_does_not_import_torch():
    out = subprocess.run([sys.executable, "-c", _PROBE, str(LARGEST), *HEAVY_MODULES], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["code"] == 0
    assert report["loaded"] == [], f"hetc check imported {report['loaded']}"
    # A fresh process: imports, the parser, the 128-rank check.
    assert report["seconds"] < 1.0, report
