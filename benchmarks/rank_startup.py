"""A rank's start-up before and after Note [verified once]; writes docs/benchmarks.md "Rank start-up".

    .venv/bin/python benchmarks/rank_startup.py [--runs 3] [--ranks 256 1024] [--no-write]

The plans of benchmarks/compile.py (8 stages of H100 lanes, a 14-block Llama; 1F1B with ZeRO-1, and
Zorse with ZeRO-3 and offload), compiled once. Then, per rank start-up, what one rank of `hetc run`
does with the plan directory before it builds its model (the same either way, so left out):

- *read*: read and check plan.het and read the listings (`read_plan`, `read_program`);
- *before*: read, then verify every rank's program, as each rank did until the plan was verified
  once (`verify`: dataflow, protocol, memory);
- *after*: read, then check that plan.het, groups.txt and the rank's listings are the ones
  `hetc compile` verified (`require_verified`: a few sha256 against the marker).

Best of `--runs` (2 shared CPU cores: the minimum is the least disturbed run).
"""

from __future__ import annotations

import contextlib
import io
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.compile import POLICIES, parse_sizes, plan_text
from benchmarks.markdown import publish
from hetc.cli import main as hetc_main
from hetc.passes.verify import verify
from hetc.plandir import read_plan, read_program, require_verified

HEADING = "## Rank start-up"


def _best(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(ranks: int, policy: str, runs: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        spec, plan_dir = Path(tmp) / "bench.het", Path(tmp) / "plan"
        spec.write_text(plan_text(ranks, policy))
        with contextlib.redirect_stdout(io.StringIO()):
            if hetc_main(["compile", str(spec), "-o", str(plan_dir)]) != 0:
                raise SystemExit(f"hetc compile of {ranks} ranks ({policy}) failed")
        rank = ranks - 1      # a last-stage rank: its listing is as long as any

        def read():
            _, checked = read_plan(plan_dir)
            return checked, read_program(plan_dir)

        def before() -> None:
            checked, program = read()
            verify(program, checked.pipeline, checked.spec)

        def after() -> None:
            checked, program = read()
            require_verified(plan_dir, [rank], program, checked)
        return {"ranks": ranks, "policy": policy, "read_s": _best(read, runs), "before_s": _best(before, runs),
                "after_s": _best(after, runs)}


def section(results: list[dict], runs: int) -> str:
    rows = "\n".join(f"| {m['ranks']} | {m['policy']} | {m['read_s']:.2f} s | {m['before_s']:.2f} s | "
                     f"**{m['after_s']:.2f} s** | {m['before_s'] / m['after_s']:.1f}x |" for m in results)
    return f"""{HEADING}

`benchmarks/rank_startup.py`: what one rank of `hetc run` does with its plan directory before it builds
its model, on the plans of "Compile and verify"; best of {runs} runs on 2 shared CPU cores. *before*:
read plan.het and the listings, then verify every rank's program (each rank did, until the plan was
verified once); *after*: read, then check its files against what `hetc compile` verified (Note
[verified once] in hetc/plandir.py). Reading every listing remains: issue 31 makes a rank read only
its own.

| ranks | plan | read | before (read + verify) | after (read + check) | ratio |
|---|---|---|---|---|---|
{rows}
"""


def main() -> int:
    args = parse_sizes(__doc__, [256, 1024])
    results = [measure(ranks, policy, args.runs) for ranks in args.ranks for policy in POLICIES]
    return publish(HEADING, section(results, args.runs), write=not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
