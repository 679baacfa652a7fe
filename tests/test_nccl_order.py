"""NCCL's ordering rule in the blocking machine (Note [NCCL order], passes/verify/machine.py; issue 29).

Under gloo a posted op completes as soon as its partners are posted; under NCCL a rank's ops on one
communicator (the direction of a send or receive, the group of a collective or of a compute op's tp/cp/ep
part) also start in posting order, one at a time. With one communicator a rank pair, both directions, the
lowering that posted receives ahead made pipeline programs that verified under gloo and hung under NCCL in
their first step (tests/listings/pp_receives_ahead.txt keeps that order); the runtime now gives each
direction a communicator of its own (Note [one communicator per direction] in runtime/comm.py), under which
NCCL's order hangs nothing gloo's runs: these tests hold the machine to that, and to the time the order adds.
"""

from __future__ import annotations

import random
import re

import pytest

from hetc.cli import main
from hetc.compiler import load_checked
from hetc.passes.cost import CostModel
from hetc.passes.lower import lower
from hetc.passes.simulate import simulate, timed_machine
from hetc.passes.verify import Backend, verify
from hetc.passes.verify.machine import Machine
from hetc.passes.verify.protocol import check_protocol
from hetc.plandir import listing_name
from hetc.ir.program import AllReduce, Forward, Group, Program, RankProgram, Recv, Send, Shard, Tensor, Wait
from hetc.ir.spec import ScheduleKind
from tests.conftest import DEMO, ROOT
from tests.plans import DEMO_PLANS, compile_plan, plan_id, waits_for_its_gradient_first
from tests.random_jobs import deep_job

OLD_PP = ROOT / "tests" / "listings" / "pp_receives_ahead.txt"
SHAPE = (1, 4, 8)
PLAIN = Shard(0, 0)   # a ministage without tp/cp/ep groups: its compute is local

def _old_pp() -> Program:
    groups_text, *rank_texts = OLD_PP.read_text().split("\nrank ")
    return Program(tuple(RankProgram.from_text("rank " + text) for text in rank_texts),
                   Program.parse_groups(groups_text))


def _two_ranks(rank0, rank1, shard: Shard = PLAIN, groups: tuple[Group, ...] = ()) -> Program:
    ranks = (RankProgram(0, 0, 0, 0, 0, (shard,), tuple(rank0)), RankProgram(1, 1, 0, 0, 0, (shard,), tuple(rank1)))
    return Program(ranks, (Group("world", (0, 1)), *groups))


def _messages(*findings) -> str:
    return "\n".join(f"rank {f.rank}, instruction {f.index}: {f.message}" for f in findings)


class _Clock:
    """Compute 1 s, a message 2 s, a collective 3 s: enough to see what starts when."""

    def local(self, rank, instr) -> float:
        return 1.0

    def copy(self, rank, instr) -> float:
        return 0.0

    def p2p(self, send, recv) -> float:
        return 2.0

    def collective(self, ops) -> float:
        return 3.0


def _times(program: Program, backend: Backend) -> dict[tuple[int, int], tuple[float, float]]:
    machine = Machine(program, _Clock(), record=True, backend=backend)
    assert machine.run() is None and not machine.unfinished()
    return {(op.rank, op.index): (op.start, op.end) for op in machine.ran if op.end is not None}


# ------------------------------------------------------------------ the old pipeline order (finding 1)

def test_old_pp_order_verifies_under_nccl_now_that_each_direction_has_its_communicator():
    """With one communicator a pair, rank 0's `recv grad mb=0` held the pair's stream ahead of its `send act
    mb=2` while rank 2's `recv act mb=2` held its own ahead of `send grad mb=0`: a cycle. A direction's line
    holds only the messages that match in its order, so the cycle cannot form."""
    lowered = compile_plan(DEMO / "pp.het")
    for backend in Backend:
        verify(_old_pp(), lowered.plan, backend=backend)


def test_hetc_verify_backend_flag_takes_the_old_order_and_refuses_a_real_deadlock_under_both(tmp_path, capsys):
    plan_dir = tmp_path / "plan"
    assert main(["compile", str(DEMO / "pp.het"), "-o", str(plan_dir)]) == 0
    listings = plan_dir / "programs"
    for rp in _old_pp().ranks:                                            # the listings in the old order
        (listings / listing_name(rp.rank)).write_text(rp.to_text())
    capsys.readouterr()
    assert main(["verify", str(plan_dir)]) == 0
    assert "gloo rules" in capsys.readouterr().out
    assert main(["verify", str(plan_dir), "--backend", "nccl"]) == 0
    (listings / listing_name(0)).write_text(waits_for_its_gradient_first(_old_pp().ranks[0]).to_text())
    for backend in Backend:
        capsys.readouterr()
        assert main(["verify", str(plan_dir), "--backend", backend.value]) == 2
        err = capsys.readouterr().err
        assert "error: rank 0, instruction 7 `wait h=1`: deadlock: waits for `recv grad ms=1 mb=2" in err, err
        assert "Traceback" not in err


def test_hetc_verify_refuses_an_unknown_backend(tmp_path, capsys):
    with pytest.raises(SystemExit) as caught:
        main(["verify", str(tmp_path), "--backend", "mpi"])
    assert caught.value.code == 2 and "invalid choice: 'mpi'" in capsys.readouterr().err


# ------------------------------------------------------------------ hand-written point-to-point

def test_the_two_directions_of_a_pair_overlap_and_one_directions_messages_take_turns_under_nccl():
    program = _two_ranks([Send(Tensor.ACT, 0, 0, 1, SHAPE, 1), Send(Tensor.ACT, 0, 1, 1, SHAPE, 2),
                          Recv(Tensor.GRAD, 1, 0, 1, SHAPE, 3), Wait(1), Wait(2), Wait(3)],
                         [Recv(Tensor.ACT, 0, 0, 0, SHAPE, 1), Recv(Tensor.ACT, 0, 1, 0, SHAPE, 2),
                          Send(Tensor.GRAD, 1, 0, 0, SHAPE, 3), Wait(1), Wait(2), Wait(3)])
    for backend in Backend:
        assert check_protocol(program, backend=backend) == []
    gloo, nccl = _times(program, Backend.GLOO), _times(program, Backend.NCCL)
    assert gloo[(0, 1)] == gloo[(0, 2)] == (0.0, 2.0)     # gloo: every message when both ends are posted
    assert nccl[(0, 0)] == (0.0, 2.0) and nccl[(0, 1)] == (2.0, 4.0)   # NCCL: one direction, one at a time ...
    assert nccl[(0, 2)] == (0.0, 2.0)                      # ... the other direction on its own communicator


def test_both_ranks_sending_first_runs_under_nccl():
    """NVIDIA/nccl#479: send-then-recv posted on both ranks hangs when both directions share one communicator
    (each send holds the pair's stream); with one communicator a direction it runs, as under gloo."""
    program = _two_ranks([Send(Tensor.ACT, 0, 0, 1, SHAPE, 1), Recv(Tensor.GRAD, 1, 0, 1, SHAPE, 2), Wait(1), Wait(2)],
                         [Send(Tensor.GRAD, 1, 0, 0, SHAPE, 1), Recv(Tensor.ACT, 0, 0, 0, SHAPE, 2), Wait(1), Wait(2)])
    for backend in Backend:
        assert check_protocol(program, backend=backend) == [], backend


def test_a_gradient_awaited_before_the_activation_it_needs_is_sent_deadlocks_under_both():
    """NCCL's order adds no deadlock, and takes none away: a wait on a message the peer can only send after
    this rank's next send is refused under either rule, naming the wait."""
    program = _two_ranks([Recv(Tensor.GRAD, 1, 0, 1, SHAPE, 1), Wait(1), Send(Tensor.ACT, 0, 0, 1, SHAPE)],
                         [Recv(Tensor.ACT, 0, 0, 0, SHAPE), Send(Tensor.GRAD, 1, 0, 0, SHAPE)])
    for backend in Backend:
        text = _messages(*check_protocol(program, backend=backend))
        assert "rank 0, instruction 1: deadlock: waits for `recv grad ms=1 mb=0 from=1 shape=1x4x8 h=1` " \
               "(instruction 0), which never completes" in text, (backend, text)


# ------------------------------------------------------------------ collectives and compute collectives

def test_two_groups_called_in_opposite_orders_are_refused_naming_the_groups():
    groups = (Group("a", (0, 1)), Group("b", (0, 1)))
    program = _two_ranks([AllReduce(Tensor.GRADS, "a", 0), AllReduce(Tensor.GRADS, "b", 0)],
                         [AllReduce(Tensor.GRADS, "b", 0), AllReduce(Tensor.GRADS, "a", 0)], groups=groups)
    for backend in Backend:
        text = _messages(*check_protocol(program, backend=backend))
        assert "rank 0, instruction 0: deadlock: blocks forever: rank 1 of 'a' are blocked before this " \
               "collective" in text, text
        assert "rank 1, instruction 0: deadlock: blocks forever: rank 0 of 'b'" in text


def test_a_groups_calls_start_in_posting_order_under_nccl():
    groups = (Group("g", (0, 1)),)
    calls = [AllReduce(Tensor.GRADS, "g", 0, 1), AllReduce(Tensor.NORM, "g", None, 2), Wait(1), Wait(2)]
    program = _two_ranks(calls, calls, groups=groups)
    assert _times(program, Backend.GLOO)[(0, 1)] == (0.0, 3.0)            # gloo: both start when posted
    assert _times(program, Backend.NCCL)[(0, 1)] == (3.0, 6.0)            # NCCL: one at a time on g's stream


def test_a_tensor_parallel_compute_op_waits_for_the_groups_earlier_collective_under_nccl():
    """Note [compute collectives]: a compute op of a ministage with a tp group is a call on that group, so on
    NCCL it starts only once the group's earlier all-reduce has completed."""
    groups = (Group("tp", (0, 1)),)
    ops = [AllReduce(Tensor.GRADS, "tp", 0, 1), Forward(0, 0), Wait(1)]
    program = _two_ranks(ops, ops, shard=Shard(0, 0, tp_group="tp"), groups=groups)
    assert _times(program, Backend.GLOO)[(0, 1)] == (0.0, 1.0)
    assert _times(program, Backend.NCCL)[(0, 1)] == (3.0, 4.0)


# ------------------------------------------------------------------ the demo plans

def test_a_one_rank_plan_passes_under_both():
    lowered = compile_plan(DEMO / "single.het")
    for backend in Backend:
        verify(lowered.program, lowered.plan, backend=backend)


@pytest.mark.parametrize("path", DEMO_PLANS, ids=plan_id)
def test_demo_plan_verifies_under_nccl(path):
    """Every demo plan is lowered in an order NCCL runs (Note [NCCL channel order] in
    passes/lower/channel_order.py), though on CPU it runs on gloo; the specs under specs/ are held to it in
    tests/test_plan_agreement.py `test_every_spec_compiles_and_agrees`."""
    lowered = compile_plan(path)
    verify(lowered.program, lowered.plan, backend=Backend.NCCL)


def test_compile_verifies_a_gpu_plan_under_nccl_and_a_cpu_plan_under_gloo():
    from hetc.passes.verify import plan_backend

    assert plan_backend(compile_plan(DEMO / "pp.het").pipeline) is Backend.GLOO
    assert plan_backend(compile_plan(ROOT / "specs" / "zorse" / "b_llama7b.het").pipeline) is Backend.NCCL


# ------------------------------------------------------------------ a deep pipeline on slow links

def test_a_deep_pipelines_two_directions_overlap_under_nccl_as_under_gloo(tmp_path):
    """Note [one communicator per direction] in runtime/comm.py: 1F1B over 8 stages of 2 lanes with tp 4
    (tests/random_jobs.py `deep_job` 13) across 25 Gb/s links, where a border's transfers are long beside its
    ops. With one communicator a rank pair each lane's gradient out and the activation it waits for next took
    turns: NCCL's step was 22 % longer than gloo's (41.1 against 33.8 ms, with the programs ordered for it).
    With one a direction, NCCL's order adds no time to these programs."""
    path = tmp_path / "deep13.het"
    path.write_text(re.sub(r"inter_bandwidth = \d+ Gb/s", "inter_bandwidth = 25 Gb/s", deep_job(random.Random(13))))
    plan = load_checked(path, require_complete=True)[1].explicit()
    assert plan is not None and plan.pipeline.schedule is ScheduleKind.ONE_F_ONE_B
    costs = CostModel(plan)
    program = lower(plan, costs=costs)
    steps = {}
    for backend in Backend:
        machine = timed_machine(program, costs, backend)
        assert machine.run() is None and not machine.unfinished()
        steps[backend] = simulate(program, plan, costs, ran=machine).step_time
    assert steps[Backend.NCCL] <= 1.01 * steps[Backend.GLOO], steps
