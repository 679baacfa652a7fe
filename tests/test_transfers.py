"""Border transfers per engine (Note [async sends]) and ZeRO collectives sharing a node's link.

hetc's programs post sends asynchronously and receives one op ahead, so a
lane waits only for what of a transfer outlasts the op before its consumer;
Megatron-DeepSpeed (Sailor's measured runs) blocks on every transfer. The
simulator times a ZeRO collective with its lane-mates' on the same node link,
as the estimate does (`CostModel.groups_at_once`).
"""

from __future__ import annotations

import pytest

from hetc.compiler import load_checked
from hetc.passes.agreement import build, compare
from hetc.passes.cost import Borders, CostModel, Engine
from hetc.passes.cost.transfers import transfer_waits
from hetc.ir.program import Collective, ReduceScatter
from hetc.ir.spec import ScheduleKind
from tests.costspecs import cluster, cost_model, plan_text, write_spec

# (F, I, W) of one microbatch; a lane receiving an activation of 0.8 s and a gradient of 0.5 s
COMPUTE = (1.0, 0.6, 0.6)
BORDERS = Borders(activations=(0.8,), gradients=(0.5,))


def test_a_blocking_engine_waits_for_every_transfer():
    for schedule in ScheduleKind:
        assert transfer_waits(Engine.MEGATRON, schedule, BORDERS, COMPUTE) == pytest.approx(1.3)


def test_hetc_waits_only_for_what_outlasts_the_op_before_the_consumer():
    # 1F1B: a forward follows a backward (1.2 s, hides the 0.8 s activation), a backward follows a forward
    assert transfer_waits(Engine.HETC, ScheduleKind.ONE_F_ONE_B, BORDERS, COMPUTE) == 0.0
    # GPipe: forwards follow forwards and backwards backwards
    slow = Borders(activations=(1.5,), gradients=(1.5,))
    assert transfer_waits(Engine.HETC, ScheduleKind.GPIPE, slow, COMPUTE) == pytest.approx(0.5 + 0.3)
    # two ministages on the stage: each receive overlaps one ministage's op (half the stage's)
    split = Borders(activations=(0.8,), gradients=(0.8,), ministages=2)
    assert transfer_waits(Engine.HETC, ScheduleKind.ONE_F_ONE_B, split, COMPUTE) == pytest.approx(0.2 + 0.3)


def test_schedules_without_a_fixed_order_count_every_transfer():
    """Interleaved 1F1B's chunks come back over the borders between the lane's ops of one microbatch, and
    ZB-H1 runs what is ready: the op a receive overlaps is not known (Note [async sends])."""
    for schedule in (ScheduleKind.INTERLEAVED, ScheduleKind.ZB):
        assert transfer_waits(Engine.HETC, schedule, BORDERS, COMPUTE) == pytest.approx(1.3)


PIPELINE = """
  schedule = 1f1b
  zero = 1
  stage a {
    layers = embed..block3
    ranks = n[0, 0]
    lanes = 1
  }
  stage b {
    layers = block4..head
    ranks = n[1, 0]
    lanes = 1
  }
  idle = [n[0, 1:4], n[1, 1:4]]
"""


def _models(tmp_path, body: str, inter: str) -> tuple[CostModel, CostModel]:
    """The plan's cost model for hetc's programs and for Megatron-DeepSpeed's."""
    _, checked = load_checked(write_spec(tmp_path, plan_text(body, clusters=cluster(inter=inter))))
    assert checked.pipeline is not None
    return (CostModel(checked.explicit(), None, Engine.HETC),
            CostModel(checked.explicit(), None, Engine.MEGATRON))


def test_the_engines_differ_by_the_transfers_hetc_overlaps(tmp_path):
    hetc, megatron = (m.estimate() for m in _models(tmp_path, PIPELINE, "0.1 GB/s"))
    assert megatron.step_time_s > hetc.step_time_s
    lanes = {(t.stage, t.lane): t for t in hetc.time.lanes}
    blocking = {(t.stage, t.lane): t for t in megatron.time.lanes}
    for key, t in lanes.items():
        assert t.p2p == blocking[key].p2p > 0        # the same transfers, on a microbatch's path either way
        assert blocking[key].p2p_wait == t.p2p > t.p2p_wait
    assert hetc.engine is Engine.HETC and megatron.to_json()["engine"] == "megatron"


CROSS_NODE_ZERO = """
  zero = 1
  stage all {
    layers = embed..head
    ranks = [n[0, 0:2], n[1, 0:2]]
    lanes = 2
    tp = 2
  }
  idle = [n[0, 2:4], n[1, 2:4]]
"""


def test_a_zero_collective_shares_the_node_link_with_its_lane_mates(tmp_path):
    """Each tp position of a lane reduces over its own group at the same time, over the same node link."""
    _, checked = load_checked(write_spec(tmp_path, plan_text(CROSS_NODE_ZERO, clusters=cluster(inter="1 GB/s"))))
    built = build(checked.explicit())
    cm, timeline = built.costs, built.timeline
    assert timeline is not None
    events = [e for e in timeline.events if e.rank == 0 and e.text.startswith(ReduceScatter.OP)]
    assert events
    group = next(g.ranks for g in built.program.groups if g.name in events[0].text)
    assert cm.groups_at_once(0, group) == 2
    nbytes = cm.param_bytes(0, 0)
    shared, alone = (cm.collective_time(Collective.REDUCE_SCATTER, group, nbytes, k) for k in (2, 1))
    assert shared > alone
    assert events[0].end - events[0].start == pytest.approx(shared)
    assert abs(compare(built).step_gap) <= 0.10


# PIPELINE with stage a a lane of two tp ranks
MIXED_TP = PIPELINE.replace("ranks = n[0, 0]\n    lanes = 1", "ranks = n[0, 0:2]\n    lanes = 1\n    tp = 2") \
    .replace("idle = [n[0, 1:4]", "idle = [n[0, 2:4]")


def test_a_lane_times_the_borders_it_receives_at_the_senders_streams(tmp_path):
    """Note [node links]: a message leaves through its sender's node, shared by the sender's lane's ranks there
    (`CostModel.message_time`, what the simulator charges every message). The closed form times each border a
    lane receives the same way: stage b's one GPU receives from stage a's two tp ranks, which send at once."""
    from hetc.passes.cost.plan_time import border_time

    cm = cost_model(tmp_path, plan_text(MIXED_TP, clusters=cluster(inter="1 GB/s")))
    a, b = cm.pipeline.stages
    sender, receiver = a.lanes[0].ranks[0], b.lanes[0].ranks[0]
    assert (cm.node_streams(sender), cm.node_streams(receiver)) == (2, 1)
    ms = b.ministages[0]
    share = cm.boundary_bytes(ms - 1)
    assert border_time(cm, b, b.lanes[0], a, ms - 1) == cm.message_time(sender, receiver, share)
    assert cm.message_time(sender, receiver, share) > cm.p2p_time(receiver, sender, share, 1)


TWO_LANES_A_NODE = """
  schedule = 1f1b
  stage a {
    layers = embed..block3
    ranks = n[0, 0:2]
    lanes = 2
  }
  stage b {
    layers = block4..head
    ranks = n[1, 0:2]
    lanes = 2
  }
  idle = [n[0, 2:4], n[1, 2:4]]
"""


def test_a_border_shares_the_node_link_with_every_lane_of_its_stage(tmp_path):
    """Note [node links]: the two lanes of a stage run the same phase at once, each sending its activation to
    the next node over the pair's one link, so each message moves at half its rate, in the estimate and in
    every message of the simulated programs alike."""
    _, checked = load_checked(write_spec(tmp_path, plan_text(TWO_LANES_A_NODE, clusters=cluster(inter="1 GB/s"))))
    built = build(checked.explicit())
    cm = built.costs
    assert [cm.node_streams(r) for r in range(4)] == [2, 2, 2, 2]
    nbytes = cm.hidden_bytes
    assert cm.message_time(0, 2, nbytes) == cm.p2p_time(0, 2, nbytes, 2) > cm.p2p_time(0, 2, nbytes, 1)
    assert abs(compare(built).step_gap) <= 0.10
