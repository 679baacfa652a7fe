"""Expert parallelism in the compiler: groups and shard lines, the lockstep rule, the simulator, the cost model.

The runtime side (the MoE demo plans train to the 1-rank losses and
parameters) is tests/test_plan_invariance.py; the MoE block itself is
tests/test_moe.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from hetc.ir.errors import SpecError
from hetc.compiler import load_checked
from hetc.passes.cost import CostModel, traffic
from hetc.passes.lower import lower
from hetc.passes.cost.params import expert_params, model_params
from hetc.passes.simulate import simulate
from hetc.passes.verify import VerifyError, verify
from hetc.passes.verify.memory import rank_peaks
from hetc.ir.program import RankProgram, Shard
from hetc.ir.spec import ScheduleKind
from hetc.ir.timeline import EventKind
from tests.conftest import DEMO
from tests.plans import compile_plan

EP2, EP2_CP2 = DEMO / "moe_ep2.het", DEMO / "moe_ep2_cp2.het"


def _groups(path) -> dict[str, tuple[int, ...]]:
    return {g.name: g.ranks for g in compile_plan(path).program.groups}


def test_an_ep_group_is_one_lane_position_of_consecutive_lanes_and_experts_replicate_across_groups():
    groups = _groups(EP2)
    assert groups["ep.s0.g0.p0"] == (0, 1) and groups["ep.s0.g1.p0"] == (2, 3)
    assert groups["dpe.s0.e0"] == (0, 2) and groups["dpe.s0.e1"] == (1, 3)
    shard = compile_plan(EP2).program.ranks[1].shards[0]
    assert (shard.group, shard.ep_group, shard.expert_group) == ("dp.s0.p0", "ep.s0.g0.p0", "dpe.s0.e1")


def test_with_cp_each_cp_rank_exchanges_with_its_peer_and_the_cp_ranks_replicate_the_experts():
    groups = _groups(EP2_CP2)
    assert groups["ep.s0.g0.p0"] == (0, 2) and groups["ep.s0.g0.p1"] == (1, 3)
    assert groups["dpe.s0.e0"] == (0, 1) and groups["dp.s0.t0"] == (0, 1, 2, 3)


def test_the_shard_line_round_trips_and_routes_collectives_to_the_expert_buffer():
    shard = Shard(0, 1, "dp.s0.p0", ep_group="ep.s0.g0.p0", expert_group="dpe.s0.e1")
    alone = Shard(1, 1, "dp.s0.p0", ep_group="ep.s0.g0.p0")
    rp = RankProgram(1, 0, 1, 0, 0, (shard, alone), ())
    assert "ep_group=ep.s0.g0.p0 expert_group=dpe.s0.e1" in rp.to_text()
    assert "expert_group=-" in str(alone)
    assert RankProgram.from_text(rp.to_text()) == rp
    assert shard.part("dpe.s0.e1.b") == shard.experts and shard.experts.group == "dpe.s0.e1"
    assert shard.part("dp.s0.p0") is shard and alone.experts.group is None
    assert shard.compute_groups == ("ep.s0.g0.p0",)


def _compile_text(tmp_path, stage: str, after: str = ""):
    path = tmp_path / "plan.het"
    path.write_text(f'use "{DEMO / "moe_job.het"}"\nparallel {{\n  stage all {{\n{stage}  }}\n{after}}}\n')
    _, checked = load_checked(path, require_complete=True)
    return checked, lower(checked.explicit())


def test_only_ministages_with_moe_blocks_name_the_ep_group(tmp_path):
    checked, program = _compile_text(tmp_path, "    layers = [embed..embed, block0..head]\n"
                                               "    ranks = host\n    lanes = 4\n    ep = 2\n")
    first, second = program.ranks[0].shards
    assert first.ep_group is None and second.ep_group == "ep.s0.g0.p0"
    verify(program, checked.explicit())


def test_lanes_of_an_ep_group_with_unequal_microbatches_are_a_located_error(tmp_path):
    with pytest.raises(SpecError) as err:
        _compile_text(tmp_path, "    layers = embed..head\n    ranks = host[0]\n    lanes = 2\n"
                                "    microbatches = [3, 1]\n    ep = 2\n", after="  idle = [host[1]]\n")
    (diag,) = err.value.diagnostics
    assert "form an expert-parallel group" in diag.message and "microbatch counts 3 and 1" in diag.message
    assert (diag.span.line, diag.span.col) == (8, 10)


def test_the_verifier_rejects_ep_lanes_that_run_different_ops():
    one_f_one_b = compile_plan(EP2_CP2, ScheduleKind.ONE_F_ONE_B)
    gpipe = compile_plan(EP2_CP2, ScheduleKind.GPIPE)
    ranks = list(one_f_one_b.program.ranks)
    ranks[2], ranks[3] = gpipe.program.ranks[2], gpipe.program.ranks[3]     # lane 1 runs F F B B, lane 0 F B F B
    with pytest.raises(VerifyError, match="collective #1 on group 'ep.s0.g0.p0' differs"):
        verify(dataclasses.replace(one_f_one_b.program, ranks=tuple(ranks)), one_f_one_b.plan)


def test_the_simulator_runs_an_ep_groups_compute_in_lockstep(monkeypatch):
    """Rank 1 computes three times slower: its EP partner, rank 0, waits for it; the other group does not."""
    lowered = compile_plan(EP2)
    costs = CostModel(lowered.plan)
    alone = costs.compute_time
    monkeypatch.setattr(costs, "compute_time", lambda r, ms, ph, unit=None: alone(r, ms, ph, unit) * (3 if r == 1 else 1))
    timeline = simulate(lowered.program, lowered.plan, costs)
    forwards = {e.rank: (e.start, e.end) for e in timeline.events if e.kind is EventKind.FORWARD}
    assert forwards[0] == forwards[1] and forwards[2] == forwards[3]
    assert forwards[0][1] - forwards[0][0] == pytest.approx(3 * (forwards[2][1] - forwards[2][0]))


def _costs(path) -> CostModel:
    lowered = compile_plan(path)
    return CostModel(lowered.plan)


def test_ep_traffic_is_four_k_delta_bsh_per_block_and_microbatch():
    cm = _costs(EP2)
    m, b = cm.model, cm.pipeline.micro_batch
    assert traffic.ep_bytes(2, 2, b, m.seq, m.hidden, 4) == 4 * 2 * 4 * b * m.seq * m.hidden / 2
    (row,) = [t for t in cm.estimate().traffic if t.kind == "ep"]
    per_lane = cm.pipeline.num_microbatches // 4
    assert row.ranks == (0, 1)
    assert row.bytes_per_step == 4 * m.moe.top_k * cm.delta * b * m.seq * m.hidden / 2 * m.layers * per_lane
    assert row.seconds_per_step > 0


def test_a_rank_holds_and_shards_its_share_of_the_experts():
    cm = _costs(EP2)
    m = cm.model
    experts = m.layers * expert_params(m)
    assert cm.numel(0, 0) == model_params(m) - experts / 2
    assert cm.expert_fraction(0, 0) == pytest.approx(experts / 2 / cm.numel(0, 0))
    # ZeRO-1: dense optimizer state over the four lanes, each expert's over the two lanes holding it
    dense = model_params(m) - experts
    optimizer = (dense / 4 + experts / 2 / 2) * cm.states.optimizer
    assert cm.estimate().memory[0].optimizer == pytest.approx(optimizer)
    lowered = compile_plan(EP2)
    bare = dataclasses.replace(lowered.program, ranks=tuple(dataclasses.replace(rp, instrs=())
                                                           for rp in lowered.program.ranks))
    assert rank_peaks(bare, lowered.pipeline, cm)[0].parts["optimizer"] == pytest.approx(optimizer)
