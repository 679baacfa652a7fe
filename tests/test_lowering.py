"""Lowering: every plan under every schedule kind lowers to programs the verifier accepts.

Also: heterogeneous lanes (many-to-many routing, uneven microbatches),
hierarchical ZeRO groups, random plans, `hetc compile --dump-after`, and the
exit codes of `hetc verify` on hand-edited listings.
"""

from __future__ import annotations

import logging
import math
import random
import re
from collections import Counter

import pytest

from hetc.cli import main
from hetc.ir.errors import NO_SPAN, SpecError
from hetc.compiler import load_checked
from hetc.passes.cost import CostModel
from hetc.passes.cost.pipeline_stage import lane_group
from hetc.passes.cost.schedule import Grouping
from hetc.passes.lower import PASS_NAMES, lower
from hetc.passes.lower.context import LowerContext
from hetc.passes.verify import verify
from hetc.ir.program import (COMPUTE_TYPES, PHASE_OF, AllGather, Backward, BackwardInput, BackwardWeight, Forward, Load,
                          Recv, ReduceScatter, Send, Step, Wait)
from hetc.ir.spec import ScheduleKind
from tests.conftest import DEMO
from tests.plans import DEMO_PLANS, TEST_PLANS, TEST_SPECS, compile_plan, plan_id
from tests.random_plans import random_plan

KINDS = list(ScheduleKind)
# plans whose ZeRO-2/3 lanes serve different microbatch patterns: only Zorse can run them
ZORSE_ONLY = {"specs/zorse16"}


@pytest.mark.parametrize("kind", KINDS, ids=str)
@pytest.mark.parametrize("path", DEMO_PLANS + TEST_PLANS, ids=plan_id)
def test_every_plan_lowers_and_verifies_under_every_schedule(path, kind):
    if plan_id(path) in ZORSE_ONLY and kind is not ScheduleKind.ZORSE:
        with pytest.raises(SpecError, match="must run the same sequence of ops"):
            compile_plan(path, kind)
        return
    lowered = compile_plan(path, kind)
    verify(lowered.program, lowered.plan)
    assert lowered.pipeline.schedule is kind


def _compute(rp):
    return [i for i in rp.instrs if isinstance(i, COMPUTE_TYPES)]


@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_compute_counts_match_the_plan(kind):
    """Each rank runs each of its ministages forward and backward once per microbatch of its lane."""
    lowered = compile_plan(DEMO / "hetero.het", kind)
    for rp in lowered.program.ranks:
        stage, lane = lowered.pipeline.stages[rp.stage], lowered.pipeline.stages[rp.stage].lanes[rp.lane]
        counts = Counter((type(i), i.ms) for i in _compute(rp))
        backward = [BackwardInput, BackwardWeight] if kind is ScheduleKind.ZB else [Backward]
        expected = Counter({(t, ms): len(lane.microbatches) for ms in stage.ministages for t in [Forward, *backward]})
        assert counts == expected


def test_schedule_shapes():
    """GPipe runs all forwards first; 1F1B keeps its in-flight limit: Megatron's (stages - stage) or more, where
    the round trip over latency-bound borders outlasts that many microbatches (Note [in-flight limit])."""
    gpipe = _compute(compile_plan(DEMO / "gpipe.het").program.ranks[0])
    kinds = [type(i) for i in gpipe]
    assert kinds == sorted(kinds, key=lambda t: t is not Forward)
    lowered = compile_plan(DEMO / "gpipe.het", ScheduleKind.ONE_F_ONE_B)
    limits = CostModel(lowered.plan).in_flight_limits
    peaks = []
    for rp in lowered.program.ranks:
        in_flight, peak = 0, 0
        for op in _compute(rp):
            in_flight += 1 if isinstance(op, Forward) else -1
            peak = max(peak, in_flight)
        assert peak == limits[rp.stage] >= 4 - rp.stage
        peaks.append(peak)
    assert peaks[-1] == 1 and peaks[1] > 4 - 1   # 0.5 ms borders against 0.2 ms layers: stage 1 keeps one more


def test_zorse_sweeps_ministages_and_steps_each_right_after_its_backward():
    rp = compile_plan(DEMO / "zero3_offload.het").program.ranks[0]
    sweep = [(type(i), i.ms) for i in _compute(rp)]
    assert sweep == [(Forward, ms) for ms in (0, 1, 2) for _ in range(2)] + \
        [(Backward, ms) for ms in (2, 1, 0) for _ in range(2)]
    steps = [k for k, i in enumerate(rp.instrs) if isinstance(i, Step)]
    backwards = [k for k, i in enumerate(rp.instrs) if isinstance(i, Backward)]
    assert steps[0] < backwards[-1], "the interleaved optimizer step comes before the last backward"
    gathers = Counter(i.ms for i in rp.instrs if isinstance(i, AllGather))
    assert gathers == {0: 2, 1: 2, 2: 1}, "gather once per ministage sweep (forward, then backward)"


def test_zorse_posts_each_receive_as_far_ahead_as_its_transfer_takes():
    """Note [p2p placement]: under Zorse the compute ops between a receive's post and its wait last at least its
    transfer, unless it was posted before the rank's first op; one op ahead would leave the consumer waiting."""
    lowered = compile_plan(TEST_SPECS / "zorse16.het")
    costs = CostModel(lowered.plan)
    further = 0
    for rp in lowered.program.ranks:
        posted: dict[int, tuple[int, Recv]] = {}
        for k, instr in enumerate(rp.instrs):
            if isinstance(instr, Recv):
                posted[instr.handle] = (k, instr)
            elif isinstance(instr, Wait) and instr.handle in posted:
                start, recv = posted.pop(instr.handle)
                ops = [i for i in rp.instrs[start:k] if isinstance(i, COMPUTE_TYPES)]
                ahead = sum(costs.op_time(rp.rank, i.ms, PHASE_OF[type(i)]) for i in ops)
                transfer = costs.p2p_time(recv.peer_from, rp.rank, math.prod(recv.shape) * costs.delta)
                first = not any(isinstance(i, COMPUTE_TYPES) for i in rp.instrs[:start])
                assert ahead >= transfer or first, (rp.rank, recv)
                further += len(ops) > 1
    assert further, "some transfer outlasts the op before its consumer"


def test_zero3_under_1f1b_gathers_every_microbatch():
    rp = compile_plan(DEMO / "zero3_offload.het", ScheduleKind.ONE_F_ONE_B).program.ranks[0]
    assert sum(isinstance(i, AllGather) for i in rp.instrs) == len(_compute(rp))


def test_heterogeneous_lanes_route_many_to_many():
    lowered = compile_plan(TEST_SPECS / "zorse16.het")
    middle = lowered.pipeline.stages[1]
    counts = sorted(len(lane.microbatches) for lane in middle.lanes)
    assert counts[0] < counts[-1], "uneven microbatches per lane"
    for rank in middle.lanes[0].ranks:
        rp = lowered.program.ranks[rank]
        senders = {i.peer_from for i in rp.instrs if isinstance(i, Recv) and i.what.value == "act"}
        assert len(senders) > 1, "one middle lane takes activations from several front lanes"
    verify(lowered.program, lowered.plan)


def test_hierarchical_zero_groups():
    lowered = compile_plan(DEMO / "hsdp.het")
    groups = {g.name: g.ranks for g in lowered.program.groups}
    assert groups["dp.s0.p0.n0"] == (0, 1) and groups["dp.s0.p0.n1"] == (2, 3)
    assert groups["dpx.s0.p0.i0"] == (0, 2) and groups["dpx.s0.p0.i1"] == (1, 3)
    rp = lowered.program.ranks[3]
    assert {(s.group, s.outer, s.level, s.outer_level) for s in rp.shards} == {("dp.s0.p0.n1", "dpx.s0.p0.i1", 3, 1)}
    reductions = [i.group for i in rp.instrs if isinstance(i, ReduceScatter)]
    assert reductions[-1] == "dpx.s0.p0.i1" and reductions.index("dpx.s0.p0.i1") > 0, \
        "inner reduce-scatter first, then across nodes"


def test_p2p_pairs_post_in_the_same_order():
    """Between two ranks, the k-th send of one is the k-th receive of the other (Note [channel order])."""
    program = compile_plan(DEMO / "interleaved.het", ScheduleKind.ONE_F_ONE_B).program
    for a in program.ranks:
        for b in program.ranks:
            sent = [(i.what, i.ms, i.mb) for i in a.instrs if isinstance(i, Send) and i.peer_to == b.rank]
            got = [(i.what, i.ms, i.mb) for i in b.instrs if isinstance(i, Recv) and i.peer_from == a.rank]
            assert sent == got


def test_stuck_lanes_lift_a_limit_instead_of_failing(caplog, monkeypatch):
    """Megatron's S − s limits against lanes in lockstep need a lane to run beyond its limit (Note [lifting
    a limit]); the timed limits (Note [in-flight limit]) are set to S − s here to get there."""
    monkeypatch.setattr(LowerContext, "in_flight_limit", lambda self, stage: len(self.pipeline.stages) - stage)
    compile_plan.cache_clear()
    try:
        with caplog.at_level(logging.DEBUG, logger="hetc.passes.lower.lane_sim"):
            lowered = compile_plan(TEST_SPECS / "zero3_fan_out.het")
    finally:
        compile_plan.cache_clear()
    assert "beyond its in-flight limit" in caplog.text
    verify(lowered.program, lowered.plan)


def test_timed_limits_keep_a_fan_out_from_getting_stuck(caplog):
    """With the in-flight limits timed from the lanes (a lockstep slot waits for its microbatches), the
    same fan-out runs its strict order with no limit lifted."""
    compile_plan.cache_clear()
    with caplog.at_level(logging.DEBUG, logger="hetc.passes.lower.lane_sim"):
        lowered = compile_plan(TEST_SPECS / "zero3_fan_out.het")
    assert "beyond its in-flight limit" not in caplog.text
    verify(lowered.program, lowered.plan)


def test_an_interleaved_fan_in_runs_its_strict_order(caplog):
    """A lane taking 8 microbatches of every interleaved group warms up over its whole group (Note
    [interleaved warm-up]): its strict order runs with no limit lifted, and it stashes what the estimate
    counts for it."""
    compile_plan.cache_clear()
    with caplog.at_level(logging.DEBUG, logger="hetc.passes.lower.lane_sim"):
        lowered = compile_plan(TEST_SPECS / "interleaved_fan_in.het")
    assert "beyond its in-flight limit" not in caplog.text
    verify(lowered.program, lowered.plan)
    narrow = lowered.pipeline.stages[1].lanes[0]
    assert lane_group(lowered.pipeline, narrow, Grouping.DEPTH_FIRST) == 8     # p = 2 positions of 4 first-stage lanes
    ops = _compute(lowered.program.ranks[narrow.ranks[0]])
    first_backward = next(i for i, op in enumerate(ops) if isinstance(op, Backward))
    assert first_backward == 8 + 1, "8 forwards of its first chunk and one of its second before a backward"


@pytest.mark.parametrize("schedule, zero", [("1f1b", 3), ("zb", 2), ("gpipe", 2)])
def test_lanes_in_lockstep_that_no_order_runs_are_a_located_error(tmp_path, capsys, schedule, zero):
    """Four ZeRO-2/3 lanes in lockstep feeding one lane through chunks of layers that loop back (the fan-in of
    tests/specs/interleaved_fan_in.het under a per-microbatch schedule): each waits for an input the
    one-lane stage sends only after a sibling's next op. `hetc compile` said "internal error: schedule
    generation is stuck"; it names the stage and what to change (explicit-plan fuzzing, 2026-12-06)."""
    text = (TEST_SPECS / "interleaved_fan_in.het").read_text().replace('use "job16.het"', f'use "{TEST_SPECS}/job16.het"')
    spec = tmp_path / "fan_in.het"
    spec.write_text(text.replace("schedule = interleaved", f"schedule = {schedule}").replace("zero = 1", f"zero = {zero}"))
    assert main(["compile", str(spec), "-o", str(tmp_path / "plan")]) == 2
    err = capsys.readouterr().err
    assert f"{spec}:12:3: error: the lanes of stage 's0' run their ops in lockstep (ZeRO-{zero} under {schedule}" in err
    assert "internal error" not in err


def test_coupled_lanes_run_the_same_ops():
    """ZeRO-3 lanes that gather every op move in lockstep (Note [coupled lanes]) and stay deadlock-free."""
    lowered = compile_plan(TEST_SPECS / "zero3_coupled.het")
    middle = lowered.pipeline.stages[1]
    patterns = {tuple((type(i), i.ms) for i in _compute(lowered.program.ranks[lane.ranks[0]]))
                for lane in middle.lanes}
    assert len(patterns) == 1
    verify(lowered.program, lowered.plan)


def test_a_smaller_lane_serves_every_rank_of_a_larger_one():
    """Across a tp 1 -> 2 border the single upstream rank sends to both ranks of the downstream lane."""
    lowered = compile_plan(TEST_SPECS / "zero3_coupled.het")
    lane = lowered.pipeline.stages[1].lanes[0]
    for rank in lane.ranks:
        assert any(isinstance(i, Recv) and i.peer_from == 0 for i in lowered.program.ranks[rank].instrs)


RANDOM_SEEDS = range(40)


@pytest.mark.parametrize("seed", RANDOM_SEEDS)
def test_random_plans_lower_and_verify(seed, tmp_path):
    """Any plan the front-end accepts lowers to verified programs, or gets a located error."""
    path = tmp_path / f"plan{seed}.het"
    path.write_text(random_plan(random.Random(seed)))
    try:
        _, checked = load_checked(path, require_complete=True)
        program = lower(checked.explicit())
    except SpecError as err:
        assert err.diagnostics
        for d in err.diagnostics:   # located in the user's files, never the placeholder
            assert d.span != NO_SPAN and d.span.line >= 1, d
        return
    verify(program, checked.explicit())


def test_random_plans_mostly_compile(tmp_path):
    """Guard against the generator drifting into plans that all fail validation."""
    ok = 0
    for seed in RANDOM_SEEDS:
        path = tmp_path / f"plan{seed}.het"
        path.write_text(random_plan(random.Random(seed)))
        try:
            load_checked(path, require_complete=True)
            ok += 1
        except SpecError:
            pass
    assert ok >= len(RANDOM_SEEDS) // 2


# ---------------------------------------------------------------- the CLI


def test_dump_after_schedule_shows_only_loads_and_compute(tmp_path, capsys):
    assert main(["compile", str(DEMO / "pp.het"), "-o", str(tmp_path / "plan"), "--dump-after", "schedule"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# after pass schedule\n")
    ops = {line.split()[1] for line in out.splitlines() if re.match(r"\s+\d+\s", line)}
    assert ops == {Load.OP, Forward.OP, Backward.OP}
    assert (tmp_path / "plan" / "programs" / "rank-0000.txt").is_file()


def test_dump_after_all_names_every_pass(tmp_path, capsys):
    assert main(["compile", str(DEMO / "zb.het"), "-o", str(tmp_path / "plan"), "--dump-after", "all"]) == 0
    out = capsys.readouterr().out
    assert re.findall(r"^# after pass (\w+)$", out, re.MULTILINE) == PASS_NAMES


def test_dump_after_unknown_pass_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["compile", str(DEMO / "pp.het"), "-o", str(tmp_path / "plan"), "--dump-after", "nonsense"])
    assert exit_.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.fixture
def plan_dir(tmp_path, capsys):
    out = tmp_path / "plan"
    assert main(["compile", str(DEMO / "pp.het"), "-o", str(out)]) == 0
    capsys.readouterr()
    return out


def _edit(plan_dir, rank: int, edit) -> None:
    path = plan_dir / "programs" / f"rank-{rank:04d}.txt"
    path.write_text(edit(path.read_text()))


def test_verify_accepts_a_compiled_plan(plan_dir, capsys):
    assert main(["verify", str(plan_dir)]) == 0
    assert "ok: 4 ranks" in capsys.readouterr().out


def test_verify_rejects_a_dropped_receive_naming_rank_and_instruction(plan_dir, capsys):
    lines = (plan_dir / "programs" / "rank-0002.txt").read_text().splitlines(True)
    dropped = next(k for k, line in enumerate(lines) if " recv " in line)
    _edit(plan_dir, 2, lambda text: "".join(lines[:dropped] + lines[dropped + 1:]))
    assert main(["verify", str(plan_dir)]) == 2
    err = capsys.readouterr().err
    assert re.search(r"error: rank 2, instruction 2 `fwd ms=1 mb=0`: the input activation \(act ms=0 mb=0\) "
                     r"has not arrived", err)
    assert "<-- ERROR HERE" in err


def test_verify_rejects_a_swapped_peer(plan_dir, capsys):
    _edit(plan_dir, 0, lambda text: text.replace("send act ms=0 mb=0 to=2", "send act ms=0 mb=0 to=3", 1))
    assert main(["verify", str(plan_dir)]) == 2
    err = capsys.readouterr().err
    assert re.search(r"error: rank 2, instruction 0 `recv act ms=0 mb=0 from=0 .*`: receives a different message "
                     r"than is sent; the next message from rank 0 is `send act ms=0 mb=2 ", err)


def test_verify_reports_a_syntax_error_with_file_and_line(plan_dir, capsys):
    _edit(plan_dir, 1, lambda text: text.replace("fwd ms=0 mb=1", "fwd ms=0 mb=one", 1))
    assert main(["verify", str(plan_dir)]) == 2
    err = capsys.readouterr().err
    assert re.search(r"rank-0001\.txt:\d+: error: 'mb' must be a whole number, not 'one'", err)


def test_verify_without_a_plan_directory_is_a_usage_error(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["verify", str(tmp_path / "empty")]) == 2
    assert "no plan.het" in capsys.readouterr().err
