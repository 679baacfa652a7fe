"""NCCL's order on gloo (`HETC_EMULATE_NCCL=1`; Note [NCCL order on gloo] in runtime/nccl_order.py; issue 29, item 3).

With the emulation a rank's ops on one communicator (the direction of a send or receive, Note [one
communicator per direction] in runtime/comm.py; the group of a collective) start on gloo only once the earlier
ones completed, so a CPU run hangs where NCCL would, and fails fast instead of waiting out the collective
timeout. The old pipeline order (receives posted ahead, tests/listings/pp_receives_ahead.txt), which hung when
both directions of a pair shared a communicator, trains under the emulation; lowered programs train to the
same losses both ways.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from hetc.cli import main
from hetc.ir.errors import UsageError
from hetc.plandir import listing_name
from hetc.ir.program import RankProgram
from hetc.runtime.nccl_order import (EMULATE_ENV, STALL_ENV, NcclEmulation, NcclOrder, NcclOrderDeadlock,
                                     emulation_from_env)
from tests.conftest import DEMO, ROOT
from tests.plans import waits_for_its_gradient_first
from tests.rank_pool import COMM_ORDERS, PlanJob, agreed_losses, compile_plans

OLD_PP = ROOT / "tests" / "listings" / "pp_receives_ahead.txt"
HANG_GUARD_S = 240     # only against a hang: a run that fails fast ends long before
GUARD_S = 10.0         # the unit tests' waits: only against a hang


class _Work:
    """A stand-in for a gloo Work: completes when the test says so, records when it was started."""

    def __init__(self, name: str, started: list[str]) -> None:
        self.name = name
        self.finish = threading.Event()
        started.append(name)

    def wait(self) -> None:
        assert self.finish.wait(GUARD_S), f"{self.name} was never finished"


def _post(order: NcclOrder, comm, name: str, started: list[str], works: dict[str, _Work]):
    def start() -> _Work:
        works[name] = _Work(name, started)
        return works[name]
    return order.post(comm, name, start)


def _until(condition, what: str) -> None:
    done = threading.Event()
    for _ in range(int(GUARD_S / 0.01)):
        if condition():
            return
        done.wait(0.01)
    pytest.fail(f"never: {what}")


# ------------------------------------------------------------------ the lines, without processes

def test_ops_on_one_communicator_start_in_posting_order_one_at_a_time_and_posting_never_blocks():
    order, started, works = NcclOrder(0, NcclEmulation(stall_s=GUARD_S)), [], {}
    first = _post(order, (2, 0), "recv grad mb=0", started, works)
    second = _post(order, (2, 0), "recv grad mb=1", started, works)     # the same direction
    back = _post(order, (0, 2), "send act mb=2", started, works)       # the other direction: its own line
    other = _post(order, "dp", "all_reduce on group 'dp'", started, works)   # another communicator
    _until(lambda: len(started) == 3, "the heads of the three lines started")
    assert sorted(started) == ["all_reduce on group 'dp'", "recv grad mb=0", "send act mb=2"]
    for name, work in (("all_reduce on group 'dp'", other), ("send act mb=2", back)):
        works[name].finish.set()
        work.wait()
    assert "recv grad mb=1" not in started                               # it waits its turn
    works["recv grad mb=0"].finish.set()
    first.wait()
    _until(lambda: "recv grad mb=1" in started, "the second receive started once the first completed")
    works["recv grad mb=1"].finish.set()
    second.wait()


def test_a_stalled_wait_fails_fast_naming_rank_op_communicator_and_what_it_is_stuck_behind():
    order, started, works = NcclOrder(2, NcclEmulation(stall_s=0.2)), [], {}
    head = _post(order, (0, 2), "recv act ms=0 mb=2 from=0", started, works)
    queued = _post(order, (0, 2), "recv act ms=0 mb=4 from=0", started, works)
    with pytest.raises(NcclOrderDeadlock) as caught:
        queued.wait()
    assert ("deadlock under NCCL's order: rank 2's `recv act ms=0 mb=4 from=0` has not started after 0.2 s: on the "
            "direction 0 -> 2 it is queued behind `recv act ms=0 mb=2 from=0`, which has not completed"
            ) in str(caught.value)
    with pytest.raises(NcclOrderDeadlock) as caught:
        head.wait()
    assert ("rank 2's `recv act ms=0 mb=2 from=0` has not completed after 0.2 s: it holds the direction 0 -> 2, "
            "with `recv act ms=0 mb=4 from=0` queued behind it") in str(caught.value)
    works["recv act ms=0 mb=2 from=0"].finish.set()     # let the line's thread end
    _until(lambda: "recv act ms=0 mb=4 from=0" in started, "the queued op started")
    works["recv act ms=0 mb=4 from=0"].finish.set()


def test_a_failed_op_fails_its_wait_and_the_line_goes_on():
    order = NcclOrder(0, NcclEmulation(stall_s=GUARD_S))

    def fails():
        raise RuntimeError("Connection closed by peer")
    broken = order.post((1, 0), "recv act", fails)
    after = order.post((1, 0), "recv grad", lambda: _Finished())
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        broken.wait()
    after.wait()


class _Finished:
    def wait(self) -> None:
        return None


@pytest.mark.parametrize("environ, want", [({}, None), ({EMULATE_ENV: "0"}, None),
                                           ({EMULATE_ENV: "1"}, NcclEmulation()),
                                           ({EMULATE_ENV: "1", STALL_ENV: "3.5"}, NcclEmulation(3.5))])
def test_the_emulation_is_read_from_the_environment(environ, want):
    assert emulation_from_env(environ) == want


@pytest.mark.parametrize("environ, message", [
    ({EMULATE_ENV: "yes"}, "HETC_EMULATE_NCCL='yes': set it to 1"),
    ({EMULATE_ENV: "1", STALL_ENV: "soon"}, "HETC_EMULATE_NCCL_STALL_S='soon': give the seconds"),
    ({EMULATE_ENV: "1", STALL_ENV: "-2"}, "HETC_EMULATE_NCCL_STALL_S='-2': give the seconds")])
def test_a_bad_emulation_setting_is_a_usage_error(environ, message):
    with pytest.raises(UsageError, match=message):
        emulation_from_env(environ)


# ------------------------------------------------------------------ whole runs

def old_pp_plan(out: Path, edit: Callable[[RankProgram], RankProgram] | None = None) -> Path:
    """specs/demo/pp.het compiled, with the listings of the old order (receives posted ahead) in programs/;
    `edit` rewrites rank 0's."""
    plan_dir = out / "pp_old"
    assert main(["compile", str(DEMO / "pp.het"), "-o", str(plan_dir)]) == 0
    _, *rank_texts = OLD_PP.read_text().split("\nrank ")
    for rank, text in enumerate(rank_texts):
        rp = RankProgram.from_text("rank " + text)
        (plan_dir / "programs" / listing_name(rank)).write_text((edit(rp) if edit and rank == 0 else rp).to_text())
    return plan_dir


def _run_local(plan_dir: Path, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k not in (EMULATE_ENV, STALL_ENV)}
    return subprocess.run([sys.executable, "-m", "hetc", "run", str(plan_dir), "--local", "--steps", "1"],
                          cwd=cwd, env=dict(environ, OMP_NUM_THREADS="1", **env), capture_output=True, text=True,
                          timeout=HANG_GUARD_S, check=False)


@pytest.fixture(scope="module")
def old_pp(tmp_path_factory) -> Path:
    return old_pp_plan(tmp_path_factory.mktemp("old"))


@pytest.mark.parametrize("order", COMM_ORDERS)
def test_the_old_pipeline_order_trains_on_gloo_and_under_the_emulation(old_pp, rank_pool, order):
    """It hung under the emulation while a rank pair's two directions shared a line. On the rank pool, as
    `hetc run` would run its listings (that `hetc run` verifies edited listings first is the next test's)."""
    agreed_losses(rank_pool.run(PlanJob(old_pp, 1, emulation=COMM_ORDERS[order])))


@pytest.mark.slow
def test_a_program_that_would_hang_is_refused_before_it_runs(tmp_path):
    """Rank 0 waits for microbatch 2's gradient before it sends microbatch 2's activation: a hang under any
    order. `hetc run` verifies the listings it is given first and names the wait (exit 2), emulation or not."""
    plan = old_pp_plan(tmp_path, waits_for_its_gradient_first)
    done = _run_local(plan, tmp_path, **{EMULATE_ENV: "1", STALL_ENV: "3"})
    assert done.returncode == 2, done.stderr
    assert "programs are unsafe" in done.stderr and "rank 0, instruction 7 `wait h=1`: deadlock" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.fixture(scope="module")
def nccl_ordered_plans(tmp_path_factory) -> dict[str, Path]:
    """Demo plans whose programs are in NCCL's order: collectives only (dp), and the pipeline (pp)."""
    return compile_plans([DEMO / "dp.het", DEMO / "pp.het"], tmp_path_factory.mktemp("plans"))


@pytest.mark.parametrize("plan", ["dp", "pp"])
def test_a_program_in_nccl_order_trains_to_the_same_losses_under_the_emulation(plan, nccl_ordered_plans, rank_pool):
    losses = {order: agreed_losses(rank_pool.run(PlanJob(nccl_ordered_plans[plan], 3, emulation=emulation)))
              for order, emulation in COMM_ORDERS.items()}
    assert losses["nccl"] == losses["gloo"]
