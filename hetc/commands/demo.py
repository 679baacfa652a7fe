"""`hetc demo`: the quickstart job on the bundled demo spec.

Checks every plan in specs/demo/ and summarises each. (This grows into
compile + train + visualise as those parts land.)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hetc.commands.check import summary
from hetc.frontend import load_checked
from hetc.load import BUNDLED_SPECS

__all__ = ["register", "DEMO_DIR", "DEMO_SPEC"]

DEMO_DIR = BUNDLED_SPECS / "demo"
DEMO_SPEC = DEMO_DIR / "pp.het"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the quickstart demo job",
                       description="Check every plan of the bundled demo job (specs/demo/).")
    p.add_argument("--dir", type=Path, default=DEMO_DIR, help="the demo folder (default: bundled)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    plans = sorted(p for p in args.dir.glob("*.het") if p.name != "job.het")
    print(f"demo job: {args.dir / 'job.het'}; {len(plans)} plans")
    for path in plans:
        _, checked = load_checked(path, require_complete=True)
        print(f"  {path.name:<22} {summary(checked)}")
    return 0
