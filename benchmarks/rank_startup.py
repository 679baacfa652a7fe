"""A rank's start-up with its plan directory, as issues 30 and 31 changed it; writes docs/benchmarks.md
"Rank start-up".

    .venv/bin/python benchmarks/rank_startup.py [--runs 3] [--ranks 256 1024] [--gpus 16384] [--no-write]

Plans: those of benchmarks/compile.py at `--ranks` (8 stages of H100 lanes, a 14-block Llama; 1F1B with
ZeRO-1, and Zorse with ZeRO-3 and offload), and issue 31's Llama-70B-class job of
benchmarks/compile_scale.py on `--gpus` (H100 + A100-40 + L4, two regions; `hetc plan`, then
`hetc compile`). Each is compiled once; then the last rank (its listing as long as any) starts, in a
process of its own that has imported torch before the clock starts: the import of hetc's runtime, and
what the rank does with the plan directory before it builds its model —

- *verify all*: read plan.het and every listing, verify every rank's program (until Note [verified
  once] in hetc/plandir.py);
- *read all*: read plan.het and every listing, check the rank's files against the marker (until Note
  [a rank reads its own]);
- *own*: read plan.het and the group table, check the rank's files, read its own listings (now).

Best of `--runs` (2 shared CPU cores: the minimum is the least disturbed run).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.compile import NUM_STAGES, POLICIES, plan_text
from benchmarks.compile_scale import GPUS_PER_NODE, job_text
from benchmarks.markdown import publish
from hetc.cli import main as hetc_main

HEADING = "## Rank start-up"

# what a rank runs, after `import torch`, in each way; argv: plan directory, rank
_START = {
    "verify_all": """
from hetc.rank import run_worker
from hetc.passes.verify import verify
from hetc.plandir import read_plan, read_program
_, checked = read_plan(plan_dir)
verify(read_program(plan_dir), checked)
""",
    "read_all": """
from hetc.rank import run_worker
from hetc.plandir import read_plan, read_program, require_verified
_, checked = read_plan(plan_dir)
program = read_program(plan_dir)
require_verified(plan_dir, [rank], program, checked)
""",
    "own": """
from hetc.rank import run_worker
from hetc.plandir import open_program, read_eval_rank, read_plan, require_verified
_, checked = read_plan(plan_dir)
program = open_program(plan_dir, len(checked.pipeline.world))
require_verified(plan_dir, [rank], program, checked)
program.ranks[rank], read_eval_rank(plan_dir, rank)
""",
}
_CHILD = """
import sys, time
from pathlib import Path
import torch
plan_dir, rank = Path(sys.argv[1]), int(sys.argv[2])
start = time.perf_counter()
{body}
print(time.perf_counter() - start)
"""


def _started(plan_dir: Path, rank: int, way: str, runs: int) -> float:
    """Best of `runs` start-ups of rank `rank` in `way`, each a fresh process, in seconds."""
    times = []
    for _ in range(runs):
        child = subprocess.run([sys.executable, "-c", _CHILD.format(body=_START[way]), str(plan_dir), str(rank)],
                               cwd=ROOT, capture_output=True, text=True, check=True)
        times.append(float(child.stdout.split()[-1]))
    return min(times)


def _hetc(argv: list[str]) -> None:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        if hetc_main(argv) != 0:
            raise SystemExit(f"hetc {' '.join(argv)} failed")


def _compiled(tmp: Path, job: str, text: str) -> Path:
    spec = tmp / f"{job}.het"
    spec.write_text(text)
    if "auto" in text or "parallel" not in text:
        planned = tmp / f"{job}-planned.het"
        _hetc(["plan", str(spec), "-o", str(planned)])
        spec = planned
    _hetc(["compile", str(spec), "-o", str(tmp / job)])
    return tmp / job


def measure(job: str, text: str, runs: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        plan_dir = _compiled(Path(tmp), "plan", text)
        ranks = len(list((plan_dir / "programs").glob("rank-*.txt")))
        row = {"job": job, "ranks": ranks}
        for way in _START:
            row[way] = _started(plan_dir, ranks - 1, way, runs)
            print(row, file=sys.stderr, flush=True)
        return row


def section(results: list[dict], runs: int) -> str:
    rows = "\n".join(f"| {m['ranks']:,} | {m['job']} | {m['verify_all']:.2f} s | {m['read_all']:.2f} s | "
                     f"**{m['own']:.2f} s** |" for m in results)
    return f"""{HEADING}

`benchmarks/rank_startup.py`: one rank of `hetc run` starting, in a process that has imported torch
before the clock starts: hetc's runtime imported, then what the rank does with its plan directory
before it builds its model. *verify all*: read plan.het and every listing and verify every program (as
each rank did before Note [verified once] in hetc/plandir.py); *read all*: read every listing, check
the rank's files against what `hetc compile` verified (before Note [a rank reads its own]); *own*: read
plan.het and the group table, check the rank's files, read its own listings (now). The last rank, best
of {runs} runs on 2 shared CPU cores. The 1F1B and Zorse plans are those of "Compile and verify"; the
Llama-70B-class job is that of "Compile at scale" (`hetc plan`, then `hetc compile`).

| ranks | plan | verify all | read all | own |
|---|---|---|---|---|
{rows}
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="*", default=[256, 1024],
                        help=f"plans of benchmarks/compile.py (multiples of {NUM_STAGES * GPUS_PER_NODE})")
    parser.add_argument("--gpus", type=int, nargs="*", default=[16384],
                        help="clusters of benchmarks/compile_scale.py's job")
    parser.add_argument("--no-write", action="store_true", help="print, do not update docs/benchmarks.md")
    args = parser.parse_args()
    results = [measure(policy, plan_text(ranks, policy), args.runs) for ranks in args.ranks for policy in POLICIES]
    results += [measure("Llama-70B class, 3 kinds", job_text(gpus), args.runs) for gpus in args.gpus]
    return publish(HEADING, section(results, args.runs), write=not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
