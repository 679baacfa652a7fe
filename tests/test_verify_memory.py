"""The memory check: each rank's timeline from its instructions, sized by the cost model."""

from __future__ import annotations

import dataclasses
import re

import pytest

from hetc.cli import main
from hetc.compiler import load_checked
from hetc.passes.cost import CostModel
from hetc.passes.lower import lower
from hetc.passes.validate import check_spec
from hetc.passes.verify import VerifyError, verify
from hetc.passes.verify.memory import _Rank, check_memory, format_bytes, group_sizes, rank_peaks
from hetc.ir.program import Forward, Load, Recv, Step, Tensor, Wait
from hetc.ir.spec import DType, ScheduleKind
from tests.conftest import DEMO
from tests.plans import DEMO_PLANS, TEST_PLANS, TEST_SPECS, compile_plan, plan_id


def _peaks(path, kind=None):
    lowered = compile_plan(path, kind)
    costs = CostModel(lowered.plan)
    return lowered, costs, rank_peaks(lowered.program, lowered.pipeline, costs)


@pytest.mark.parametrize("path", DEMO_PLANS + TEST_PLANS, ids=plan_id)
def test_every_plan_fits_and_agrees_with_the_cost_estimate(path):
    lowered, costs, peaks = _peaks(path)
    assert check_memory(lowered.program, lowered.pipeline, costs) == []
    estimate = costs.estimate()
    for peak, rank_memory in zip(peaks, estimate.memory):
        assert peak.total <= peak.capacity
        assert peak.total == pytest.approx(rank_memory.total, rel=0.25), f"rank {peak.rank}"


def test_static_states_follow_the_zero_level():
    """Before the first instruction a rank holds its parameter and optimizer shards and its reserve."""
    for name, params, optimizer in [("zero1", 1, 1 / 4), ("zero3", 1 / 4, 1 / 4), ("dp", 1, 1)]:
        lowered, costs, _ = _peaks(DEMO / f"{name}.het")
        rp = lowered.program.ranks[0]
        first = dataclasses.replace(rp, instrs=())
        program = lowered.program.replace_rank(0, ())
        start = rank_peaks(dataclasses.replace(program, ranks=(first, *program.ranks[1:])), lowered.pipeline,
                           costs)[0]
        assert start.parts["params"] == pytest.approx(costs.param_bytes(0, 0) * params), name
        assert start.parts["optimizer"] == pytest.approx(costs.optimizer_bytes(0, 0) * optimizer), name
        assert start.parts["reserve"] == costs.reserve_bytes(0)


def test_gpipe_stashes_every_microbatch_and_1f1b_only_the_ones_in_flight():
    """1F1B's in flight: its stage's limit (Note [in-flight limit]), at least Megatron's stages - stage."""
    for kind in (ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B):
        lowered, costs, peaks = _peaks(DEMO / "gpipe.het", kind)
        limits = costs.in_flight_limits
        assert all(limits[s] >= 4 - s for s in range(4))
        for peak in peaks:
            rp = lowered.program.ranks[peak.rank]
            ms = lowered.pipeline.stages[rp.stage].ministages[0]
            n = len(lowered.pipeline.stages[rp.stage].lanes[0].microbatches)
            held = n if kind is ScheduleKind.GPIPE else min(n, limits[rp.stage])
            assert peak.parts["activations"] == pytest.approx(held * costs.activation_bytes(ms, rp.rank))


def test_activation_offload_keeps_less_than_every_microbatch_on_the_device():
    lowered, costs, offloaded = _peaks(DEMO / "offload_act.het")
    assert lowered.pipeline.schedule is ScheduleKind.GPIPE
    for peak in offloaded:
        ms = lowered.pipeline.stages[lowered.program.ranks[peak.rank].stage].ministages[0]
        n = len(lowered.pipeline.stages[0].lanes[0].microbatches)
        assert peak.parts["activations"] < n * costs.activation_bytes(ms, peak.rank)


def test_parameter_offload_keeps_few_ministages_resident():
    """Zorse: full parameters of two ministages (the current one and the next, gathered ahead); shards
    of those two, the one prefetched for the next gather (prefetch depth 1) and one still copying out."""
    lowered, costs, peaks = _peaks(TEST_SPECS / "offload8.het")
    assert lowered.pipeline.prefetch == 1
    for peak in peaks:
        mss = lowered.pipeline.stages[lowered.program.ranks[peak.rank].stage].ministages
        largest = max(costs.param_bytes(ms, peak.rank) for ms in mss)
        assert 0 < peak.parts["gathered"] <= 2 * largest
        assert 0 < peak.parts["params"] <= 4 * largest / 4     # ZeRO-3 shards over four lanes
        assert peak.parts["params"] < sum(costs.param_bytes(ms, peak.rank) for ms in mss) / 4   # not all eight


def test_memory_error_points_at_the_first_overflow():
    lowered, costs, peaks = _peaks(DEMO / "pp.het")
    rank = 1
    first_fwd = next(i for i, x in enumerate(lowered.program.ranks[rank].instrs) if isinstance(x, Forward))
    before = rank_peaks(lowered.program.replace_rank(rank, lowered.program.ranks[rank].instrs[:first_fwd]),
                        lowered.pipeline, costs)[rank].total
    capacity = (before + peaks[rank].total) / 2
    world = tuple(dataclasses.replace(g, device=dataclasses.replace(g.device, memory=capacity)) if r == rank else g
                  for r, g in enumerate(lowered.pipeline.world))
    with pytest.raises(VerifyError) as caught:
        verify(lowered.program, dataclasses.replace(lowered.plan, pipeline=dataclasses.replace(lowered.pipeline, world=world)), costs)
    err = caught.value
    assert err.check == "memory" and [f.rank for f in err.findings] == [rank]
    assert err.findings[0].index >= first_fwd
    assert f"holds {format_bytes(capacity)}" in str(err)


def _shrink_device(plan_text: str, memory: str) -> str:
    return re.sub(r"(device cpu \{\n  memory = )[^\n]+", rf"\g<1>{memory}", plan_text)


def test_cli_reports_a_plan_that_does_not_fit(tmp_path, capsys):
    out = tmp_path / "plan"
    assert main(["compile", str(DEMO / "pp.het"), "-o", str(out)]) == 0
    plan = out / "plan.het"
    plan.write_text(_shrink_device(plan.read_text(), "66 MiB"))
    assert main(["verify", str(out)]) == 2
    err = capsys.readouterr().err
    assert re.search(r"error: rank 0, instruction \d+ `.*`: out of device memory: the rank needs [\d.]+ MiB at its "
                     r"peak \(instruction \d+: params .*\) but its cpu holds 66.0 MiB", err)
    assert main(["compile", str(plan), "-o", str(tmp_path / "again")]) == 2
    lines = capsys.readouterr().err.splitlines()
    # one located summary per stage, on the stage's block, not one line per rank
    summaries = [line for line in lines if ": error: " in line]
    text = plan.read_text().splitlines()
    stage_lines = [str(text.index(f"  stage {name} {{") + 1) for name in ("first", "second")]
    assert [s.split(": error: ")[0].rsplit(":", 2)[1:] for s in summaries] == [[n, "3"] for n in stage_lines]
    assert re.fullmatch(r".*plan\.het:\d+:3: error: stage 'first' does not fit in device memory: the verifier finds "
                        r"that rank 0 needs [\d.]+ MiB \(params .*\) but its cpu host\[0, 0\] holds 66\.0 MiB; all 2 "
                        r"of its ranks overflow; to fit, try a higher ZeRO level \(zero = 2\.\.3\), offload "
                        r"\{ params = cpu, optimizer = cpu \}, .*", summaries[0])
    assert lines[1:3] == ["      stage first {", "      ^"] and lines[-1] == "2 errors"
    # `hetc check` says the same from the cost model's estimate, before anything is lowered
    assert main(["check", str(plan)]) == 2
    estimated = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
    assert [e.split(": error: ")[0] for e in estimated] == [s.split(": error: ")[0] for s in summaries]
    assert all("the cost model estimates that rank" in e for e in estimated)


def test_receive_pieces_are_sized_by_their_shape_and_freed_by_their_consumer():
    lowered, costs, _ = _peaks(DEMO / "pp.het")
    pieces = [Recv(Tensor.ACT, 0, 0, 0, (2, 16, 64), handle=0, seq=(0, 16)),
              Recv(Tensor.ACT, 0, 0, 0, (2, 16, 64), handle=1, seq=(16, 32))]
    instrs = (*pieces, Wait(0), Wait(1), Load(0), Forward(1, 0))
    peak = rank_peaks(lowered.program.replace_rank(2, instrs), lowered.pipeline, costs)[2]
    assert peak.index == len(instrs) - 1, "the forward adds its stash while the pieces are still held"
    assert peak.parts["buffers"] == 2 * (2 * 16 * 64) * costs.delta
    smaller = Recv(Tensor.ACT, 0, 2, 0, (2, 31, 64), handle=2)
    later = rank_peaks(lowered.program.replace_rank(2, instrs + (smaller,)), lowered.pipeline, costs)[2]
    assert later.index == peak.index, "the consumed pieces were given back, so a smaller buffer is no new peak"


def _bf16(path, schedule=None):
    """The plan lowered with a bf16 model (the demo's is fp32: the shard's dtype shows apart from the
    optimizer's), and microbatches of one sample (two a lane where four lanes share the demo's batch of 8)."""
    loaded, checked = load_checked(path, require_complete=True)
    spec = checked.spec
    parallel = spec.parallel if schedule is None else dataclasses.replace(spec.parallel, schedule=schedule)
    spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, dtype=DType.BF16), parallel=parallel,
                               train=dataclasses.replace(spec.train, micro_batch=1))
    checked = check_spec(spec, loaded.path.parent)
    program = lower(checked.explicit())
    return program, checked.pipeline, CostModel(checked.explicit())


def _held_before_step(program, pipeline, costs, rank=0):
    """What rank `rank` holds as its first `step` runs, by key."""
    rp = program.ranks[rank]
    walker = _Rank(rp, pipeline, costs, group_sizes(program.groups))
    for i, instr in enumerate(rp.instrs):
        if isinstance(instr, Step):
            return walker.walk.live
        walker.run(i, instr)
    raise AssertionError("no step")


@pytest.mark.parametrize("name, schedule", [("zero2", ScheduleKind.GPIPE), ("zero3", ScheduleKind.ONE_F_ONE_B),
                                            ("zero2", ScheduleKind.ZORSE), ("zero1", None)])
def test_the_reduced_gradient_shard_is_what_a_rank_holds_at_its_step(name, schedule):
    """Note [reduced shard] in runtime/buffers.py: what the step's reduce-scatters leave the rank, its 1/N of
    the ministage's gradients in the compute dtype, is held to the step however many reductions summed it;
    ZeRO-2/3 hold no full gradients then, ZeRO-1 holds both."""
    program, pipeline, costs = _bf16(DEMO / f"{name}.het", schedule)
    assert len(pipeline.lane_of_rank[0].microbatches) == 2
    live = _held_before_step(program, pipeline, costs)
    ms = next(i.ms for i in program.ranks[0].instrs if isinstance(i, Step))
    lanes = len(pipeline.stages[0].lanes)
    shards = sum(nbytes for key, (part, nbytes) in live.items() if key[0] == "reduced" and key[1] == ms)
    assert shards == pytest.approx(costs.grad_bytes(ms, 0) / lanes, rel=1e-6)
    assert (("grads", ms) in live) is (name == "zero1")
    assert not any(key[0] in ("full grads", "reduced out") for key in live)


def test_each_further_reduction_holds_its_output_until_its_wait():
    """A reduce-scatter after the first of the step writes a shard-sized output of its own, added to the
    rank's shard when the wait completes: counted from its post to its wait."""
    program, pipeline, costs = _bf16(DEMO / "zero2.het", ScheduleKind.GPIPE)
    rp = program.ranks[0]
    walker = _Rank(rp, pipeline, costs, group_sizes(program.groups))
    outputs = []
    for i, instr in enumerate(rp.instrs):
        walker.run(i, instr)
        outputs.append(sum(1 for key in walker.walk.live if key[0] == "reduced out"))
    assert max(outputs) >= 1 and outputs[-1] == 0
