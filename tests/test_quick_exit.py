"""`hetc plan` as a process ends at once after its output (Note [ending a one-shot process at once] in
hetc/cli.py): what it prints and writes is complete, and its exit status is the verb's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "specs" / "examples" / "auto_demo.het"

__all__: list[str] = []


def _hetc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hetc", *args], check=False, capture_output=True,
                          text=True, cwd=ROOT, timeout=600)


def test_plan_as_a_process_prints_and_writes_everything_before_it_ends(tmp_path: Path) -> None:
    out = tmp_path / "planned.het"
    done = _hetc("plan", str(DEMO), "-o", str(out), "--json")
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip().endswith("}")   # the whole JSON object, flushed
    assert out.read_text().rstrip().endswith("}")
    assert _hetc("check", str(out)).returncode == 0


def test_plan_as_a_process_keeps_the_status_of_a_user_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.het"
    bad.write_text("model {\n")
    done = _hetc("plan", str(bad))
    assert done.returncode == 2
    assert f"{bad}:" in done.stderr and "Traceback" not in done.stderr


def test_plan_under_a_profiler_ends_the_usual_way_so_the_profile_is_written(tmp_path: Path) -> None:
    stats = tmp_path / "plan.prof"
    done = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(stats), "-m", "hetc", "plan", str(DEMO)],
                          check=False, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr
    assert stats.stat().st_size > 0
