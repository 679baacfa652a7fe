"""The front-end is light: `hetc check` never imports torch (or the planner's solvers), and the
largest spec checks. How fast it checks is benchmarks/examples.py's figure, not an assertion."""

from __future__ import annotations

import json
import subprocess
import sys

from hetc.compiler import load_checked
from tests.conftest import ROOT, SPECS

LARGEST = SPECS / "zorse" / "c_llama13b.het"  # cluster C: an explicit 128-rank plan
HEAVY_MODULES = ("torch", "ortools", "networkx", "jinja2")


def test_largest_spec_checks():
    _, checked = load_checked(LARGEST)
    assert checked.pipeline is not None and checked.pipeline.world_size == 128


_PROBE = """
import json, sys
from hetc.cli import main
code = main(["check", "-q", sys.argv[1]])
print(json.dumps({"code": code,
                  "loaded": sorted(m for m in sys.modules if m.split(".")[0] in sys.argv[2:])}))
"""


def test_check_does_not_import_torch():
    out = subprocess.run([sys.executable, "-c", _PROBE, str(LARGEST), *HEAVY_MODULES], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["code"] == 0
    assert report["loaded"] == [], f"hetc check imported {report['loaded']}"
