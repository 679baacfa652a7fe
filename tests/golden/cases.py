"""The golden listings: which plan each one compiles, and how a listing file is rendered.

One case per schedule kind, plus ZeRO-3 and offload variants. A golden file
holds the group table and every rank's listing, exactly as `hetc compile`
writes them; `tests/test_golden_listings.py` compares it byte for byte and
`python -m tests.golden.regenerate` rewrites it after an intended change.
"""

from __future__ import annotations

from pathlib import Path

from hetc.ir.spec import ScheduleKind
from tests.conftest import DEMO, ROOT
from tests.plans import compile_plan

__all__ = ["CASES", "GOLDEN_DIR", "golden_path", "render"]

GOLDEN_DIR = Path(__file__).resolve().parent

# name -> (spec, schedule kind to lower it under, or None for the spec's own)
CASES: dict[str, tuple[Path, ScheduleKind | None]] = {
    "gpipe": (DEMO / "gpipe.het", None),
    "1f1b": (DEMO / "pp.het", None),
    "interleaved": (DEMO / "interleaved.het", None),
    "zb": (DEMO / "zb.het", None),
    "zorse": (GOLDEN_DIR / "zorse.het", None),
    "zero3_1f1b": (GOLDEN_DIR / "zero3_1f1b.het", None),
    "hetero_1f1b": (DEMO / "hetero.het", None),
    "hsdp": (DEMO / "hsdp.het", None),
    "offload_zorse_zero3": (DEMO / "zero3_offload.het", None),
    "offload_act_gpipe": (DEMO / "offload_act.het", None),
    "tied_1f1b": (DEMO / "tied_pp.het", None),       # the tied embedding's copies summed across stages
}


def golden_path(name: str) -> Path:
    return GOLDEN_DIR / f"{name}.txt"


def render(name: str) -> str:
    spec, schedule = CASES[name]
    program = compile_plan(spec, schedule).program
    source = spec.relative_to(ROOT).as_posix() + (f" under schedule {schedule.value}" if schedule else "")
    head = (f"# golden listing '{name}': {source}\n"
            "# regenerate with: .venv/bin/python -m tests.golden.regenerate\n\n")
    return head + program.groups_text() + "".join("\n" + rp.to_text() for rp in program.ranks)
