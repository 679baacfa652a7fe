"""A hetc process's start-up, against another checkout of hetc (the peer: the same work with the code
before a change); writes docs/benchmarks.md "Process start-up".

    .venv/bin/python benchmarks/process_startup.py --peer DIR [--rounds 5] [--no-write]

DIR is a checkout of another commit (`git worktree add DIR COMMIT`); both run with this virtual
environment's Python and packages, each importing hetc from its own tree. In rounds, alternating the two
trees so that the machine's load falls on both alike, it times

- *1-rank run*: `hetc run PLAN --local 1 --steps 1 --quiet` of specs/demo/single.het, compiled by each
  tree: the launcher, one rank's start (torch, hetc, the process group, the model) and one step;
- *model build*: in a fresh process that has imported torch and hetc, `build_ministage` of the demo model
  whole (what each rank builds before its first step);
- *`hetc run --help`*: the command line alone (its imports and parser), in a fresh process.

Medians over the rounds, and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.markdown import publish

HEADING = "## Process start-up"
SPEC = Path("specs") / "demo" / "single.het"

BUILD = """
import sys, time
import torch
from hetc.frontend.load import load_spec
from hetc.runtime.nn.model import build_ministage
model = load_spec(sys.argv[1]).spec.model
t = time.perf_counter()
build_ministage(model, range(model.layers + 2), seed=1)
print(time.perf_counter() - t)
"""



def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}


def _seconds(tree: Path, argv: list[str]) -> float:
    """The wall time of a command run in `tree`, or what it printed as its own time."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *argv], cwd=tree, env=_env(tree), capture_output=True, text=True,
                          timeout=600, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{tree}: {' '.join(argv[:4])} exited {done.returncode}:\n{done.stderr[-2000:]}")
    printed = done.stdout.strip().splitlines()
    return float(printed[-1]) if argv[0] == "-c" else wall


def _measure(tree: Path, plan: Path) -> dict[str, float]:
    return {
        "1-rank run": _seconds(tree, ["-m", "hetc", "run", str(plan), "--local", "1", "--steps", "1", "--quiet"]),
        "model build": _seconds(tree, ["-c", BUILD, str(tree / SPEC)]),
        "`hetc run --help`": _seconds(tree, ["-m", "hetc", "run", "--help"]),
    }


def _commit(tree: Path) -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True,
                          check=False).stdout.strip() or "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", type=Path, required=True, help="another checkout of hetc to compare with")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-write", action="store_true", help="print the table, leave docs/benchmarks.md alone")
    args = ap.parse_args()
    trees = {"peer": args.peer.resolve(), "this": ROOT}
    with tempfile.TemporaryDirectory() as tmp:
        plans = {}
        for name, tree in trees.items():
            plans[name] = Path(tmp) / name
            subprocess.run([sys.executable, "-m", "hetc", "compile", str(tree / SPEC), "-o", str(plans[name])],
                           cwd=tree, env=_env(tree), check=True, capture_output=True)
        times: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
        for r in range(args.rounds):
            for name in (trees if r % 2 == 0 else reversed(list(trees))):
                for what, seconds in _measure(trees[name], plans[name]).items():
                    times[name].setdefault(what, []).append(seconds)
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
    rows = [f"| {what} | {statistics.median(times['peer'][what]):.3f} s | "
            f"**{statistics.median(times['this'][what]):.3f} s** | "
            f"{statistics.median(times['this'][what]) / statistics.median(times['peer'][what]):.2f} |"
            for what in times["this"]]
    load = os.getloadavg()
    intro = (f"`benchmarks/process_startup.py`, {time.strftime('%Y-%m-%d')}: this tree ({_commit(ROOT)}) against "
             f"{_commit(trees['peer'])}, medians of {args.rounds} rounds on 2 shared CPU cores (load average "
             f"{load[0]:.2f} at the end). *1-rank run*: `hetc run --local 1 --steps 1` of specs/demo/single.het; "
             "*model build*: `build_ministage` of the demo model in a fresh process; *`hetc run --help`*: the "
             "command line's imports and parser. Every rank of every run is such a process.")
    header = f"| what | {_commit(trees['peer'])} | {_commit(ROOT)} | ratio |"
    text = "\n".join([HEADING, "", intro, "", header, "|---|---:|---:|---:|", *rows, ""])
    sys.exit(publish(HEADING, text, not args.no_write))


if __name__ == "__main__":
    main()
