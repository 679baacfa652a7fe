"""The verifier at scale: each fault kind put into one member of a class of alike ranks is found; writes
docs/benchmarks.md "Faults at scale".

    .venv/bin/python benchmarks/verify_scale.py [--gpus 16384] [--no-write]

Issue 31's Llama-70B-class job (benchmarks/compile_scale.py) is planned (`hetc plan`) and lowered as
`hetc compile` lowers it: one representative per class of alike ranks, the others renamed from it (Note
[lowering by class] in passes/lower/classes.py). The programs verify. Then every fault kind of the
mutation tests (tests/test_verifier_mutations.py: a dropped receive or wait, two collectives swapped, a
changed peer, a duplicated forward, a removed optimizer step, a device smaller than the rank's peak) is
put, one at a time, into the last member of the largest class — a rank whose program no lowering pass
built, only the renaming — and the whole job verified again: the verifier must reject each, naming
that rank. Wall time of each verification on this 2-core machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import contextlib
import io
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.compile import timed_call
from benchmarks.compile_scale import job_text
from benchmarks.markdown import publish
from hetc.cli import main as hetc_main
from hetc.compiler import load_checked
from hetc.passes.cost import CostModel
from hetc.passes.lower.by_class import lower_by_class
from hetc.passes.verify import VerifyError, verify
from hetc.passes.verify.memory import rank_peaks
from tests.test_verifier_mutations import faults_on, names_rank

HEADING = "## Faults at scale"


def _planned(tmp: Path, gpus: int) -> Path:
    job, planned = tmp / "job.het", tmp / "planned.het"
    job.write_text(job_text(gpus))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        if hetc_main(["plan", str(job), "-o", str(planned)]) != 0:
            raise SystemExit(f"hetc plan of {gpus} GPUs failed")
    return planned


def measure(gpus: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        _, checked = load_checked(_planned(Path(tmp), gpus), require_complete=True)
    plan = checked.explicit()
    assert plan is not None, "hetc plan writes an explicit plan"
    costs = CostModel(plan)
    lowered = lower_by_class(plan, costs)
    program = lowered.program
    _, clean_s = timed_call(lambda: verify(program, plan, costs))
    largest = max(lowered.classes, key=lambda c: len(c.members))
    member = largest.members[-1][0]
    peaks = rank_peaks(program, plan.pipeline, costs)
    rows = []
    for mutant in faults_on(member, program, plan.pipeline, peaks, f"{gpus}"):
        found, seconds = timed_call(lambda m=mutant: _finding(m, plan, costs, member))
        rows.append({"fault": mutant.fault, "found": found, "seconds": seconds})
        print(rows[-1], file=sys.stderr, flush=True)
    return {"gpus": gpus, "ranks": program.world_size, "classes": len(lowered.classes), "rep": largest.rep,
            "members": len(largest.members), "member": member, "clean_s": clean_s, "faults": rows}


def _finding(mutant, plan, costs: CostModel, member: int) -> str:
    """What the verifier says of `mutant`: its check and first finding, or that it missed the fault."""
    try:
        verify(mutant.program, dataclasses.replace(plan, pipeline=mutant.pipeline), costs)
    except VerifyError as err:
        if not names_rank(err, member):
            return f"**rejected without naming rank {member}**"
        first = str(err.findings[0]).splitlines()[0]
        return f"{err.check}: {first if len(first) <= 110 else first[:110] + '…'}"
    return "**not found**"


def section(m: dict) -> str:
    rows = "\n".join(f"| {f['fault']} | {f['found']} | {f['seconds']:.1f} s |" for f in m["faults"])
    return f"""{HEADING}

`benchmarks/verify_scale.py`: issue 31's Llama-70B-class job at {m['gpus']:,} GPUs (as in "Compile at
scale": {m['ranks']:,} ranks in {m['classes']:,} classes), lowered by class as `hetc compile` lowers it; the
programs verify in {m['clean_s']:.1f} s. Each fault kind of tests/test_verifier_mutations.py is then put
into rank {m['member']:,}, the last of the {m['members']:,} members renamed from representative rank
{m['rep']:,} (the largest class), and the whole job verified again: each is found, naming that rank.

| fault in rank {m['member']:,} | the verifier's finding | verify |
|---|---|---|
{rows}
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=16384)
    parser.add_argument("--no-write", action="store_true", help="print, do not update docs/benchmarks.md")
    args = parser.parse_args()
    result = measure(args.gpus)
    missed = [f["fault"] for f in result["faults"] if f["found"].startswith("**")]
    status = publish(HEADING, section(result), write=not args.no_write)
    return 1 if missed else status


if __name__ == "__main__":
    sys.exit(main())
