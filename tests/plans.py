"""Compiled plans for the lowering, verifier and export tests (shared, cached per process).

`compile_plan(path, schedule)` loads a spec, optionally swaps its schedule
kind (so every demo plan can be lowered under every schedule), lowers and
returns the program with the plan; it does not verify, so tests can.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from hetc.compiler import load_checked
from hetc.passes.lower import lower
from hetc.passes.validate import check_spec
from hetc.ir.pipeline import Pipeline
from hetc.ir.plan import Plan
from hetc.ir.program import Program, RankProgram, Recv, Send, Wait
from hetc.ir.spec import ScheduleKind, Spec
from hetc.ir.topology import Topology
from tests.conftest import DEMO, ROOT

__all__ = ["DEMO_PLANS", "TEST_PLANS", "Lowered", "compile_plan", "plan_id"]

TEST_SPECS = ROOT / "tests" / "specs"
DEMO_PLANS = sorted(p for p in DEMO.glob("*.het") if not p.name.endswith("job.het"))   # job.het, moe_job.het
TEST_PLANS = sorted(p for p in TEST_SPECS.glob("*.het") if not p.name.startswith(("job", "base")))


@dataclasses.dataclass(frozen=True)
class Lowered:
    plan: Plan
    program: Program

    @property
    def spec(self) -> Spec:
        return self.plan.spec

    @property
    def pipeline(self) -> Pipeline:
        return self.plan.pipeline

    @property
    def topology(self) -> Topology:
        return self.plan.topology


def plan_id(path: Path) -> str:
    return f"{path.parent.name}/{path.stem}"


@functools.cache
def compile_plan(path: Path, schedule: ScheduleKind | None = None) -> Lowered:
    loaded, checked = load_checked(path, require_complete=True)
    if schedule is not None and schedule is not checked.spec.parallel.schedule:
        parallel = dataclasses.replace(checked.spec.parallel, schedule=schedule)
        checked = check_spec(dataclasses.replace(checked.spec, parallel=parallel), loaded.path.parent)
    plan = checked.explicit()
    return Lowered(plan, lower(plan))


def waits_for_its_gradient_first(rp: RankProgram) -> RankProgram:
    """Rank 0 of tests/listings/pp_receives_ahead.txt (specs/demo/pp.het), waiting for microbatch 2's gradient before it sends microbatch 2's activation."""
    instrs = list(rp.instrs)
    recv = next(i for i in instrs if isinstance(i, Recv) and i.mb == 2)
    send = next(i for i in instrs if isinstance(i, Send) and i.mb == 2)
    instrs.remove(recv)
    wait = next(i for i in instrs if isinstance(i, Wait) and i.handle == recv.handle)
    instrs.remove(wait)
    at = instrs.index(send)
    instrs[at:at] = [recv, wait]
    return dataclasses.replace(rp, instrs=tuple(instrs))
