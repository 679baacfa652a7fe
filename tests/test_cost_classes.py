"""The composition's shared rules (passes/cost/classes.py, plan_time.py, zero_time.py) on small cases."""

from __future__ import annotations

import dataclasses

import pytest

from hetc.passes.cost import schedule
from hetc.passes.cost.classes import flush_tail, throughput
from hetc.passes.cost.plan_time import ministage_borders, peer_lanes, stage_borders
from hetc.passes.cost.schedule import (ChunkSweep, Grouping, LaneTiming, Unit, UnitLane, chunk_loop_wait,
                                      chain_held, in_flight_limits, interleaved_grouping, lockstep_fill,
                                      pipeline_time, sequential_time, in_steady_order, zero_cycle)
from hetc.passes.cost.memory import StateBytes
from hetc.passes.cost.zero_time import ZeroRings, across_nodes, flush_time, sync_time
from hetc.ir.spec import ScheduleKind, ZeroShard, ZeroSpec


def test_a_lanes_peer_serves_most_of_its_microbatches_the_lowest_on_ties():
    # stage a: lane 0 serves microbatches 0-2, lane 1 serves 3; stage b: 0, 1 -> lane 0; 2, 3 -> lane 1
    assert peer_lanes([0, 0, 0, 1], [0, 0, 1, 1], 2) == (0, 1)
    # a tie (one each): the lower lane
    assert peer_lanes([0, 0], [1, 0], 1) == (0,)


def test_borders_are_those_to_other_stages():
    stage_of = [0, 1, 1, 0].__getitem__   # interleaved: stage 0 owns ministages 0 and 3
    assert ministage_borders(0, 0, stage_of, 4) == (1, None)
    assert ministage_borders(3, 0, stage_of, 4) == (None, 1)
    assert ministage_borders(1, 1, stage_of, 4) == (None, 0)
    assert list(stage_borders((0, 3), 0, stage_of, 4)) == [(1, 0), (1, 2)]


def test_a_later_stages_tail_hides_behind_the_drain_of_the_stages_before_it():
    lanes = [LaneTiming(0, 0, 4, 1.0, 1.0, 1.0, 0.5), LaneTiming(1, 0, 4, 1.0, 2.0, 1.0)]
    # stage 0 drains 2.5 s: stage 1's 3 s tail shows 0.5 s, stage 0's own 1 s tail shows whole
    assert flush_tail(lanes, [1.0, 3.0]) == pytest.approx(1.0)
    assert flush_tail(lanes, [0.2, 3.0]) == pytest.approx(0.5)


def test_under_zb_a_later_stages_tail_hides_behind_the_input_gradients_of_the_stages_before_it():
    """Under ZB-H1 the gradient leaves stage 0 after its input gradient (1 s, and 0.5 s of transfer): stage 1's
    last backward ends 1.5 s before stage 0's, less its own weight gradient (1 s) plus stage 0's (1 s)."""
    lanes = [LaneTiming(0, 0, 4, 1.0, 1.0, 1.0, 0.5), LaneTiming(1, 0, 4, 1.0, 2.0, 1.0)]
    assert flush_tail(lanes, [0.2, 3.0], ScheduleKind.ZB) == pytest.approx(1.5)


def test_under_zb_the_bottlenecks_last_weight_gradient_is_inside_the_pipeline():
    """A fast first stage (0.1 ms ops, 5 ms of transfer) before a bottleneck whose weight gradient takes 0.45 s
    (random job 90 under the GEMM curve): the bottleneck's whole work, its last W with it, is the pipeline's
    time, so only its own 30 ms sync and step follow; counted as a later stage's W, it added 0.45 s."""
    lanes = [LaneTiming(0, 0, 8, 1e-4, 0.0, 1e-4, 5e-3), LaneTiming(1, 0, 2, 0.56, 0.87, 0.45, 5e-3)]
    assert flush_tail(lanes, [4e-3, 0.03], ScheduleKind.ZB, bottleneck=1) == pytest.approx(0.03)
    assert flush_tail(lanes, [4e-3, 0.03], ScheduleKind.ZB, bottleneck=0) == pytest.approx(0.03 - 5e-3 - 1e-4 + 0.45)


def test_an_interleaved_lane_waits_for_a_chunks_loop_its_group_does_not_cover():
    """Note [chunk loop]: 4 stages of 1 s forward and 2 s backward per microbatch over 2 chunks (0.5 s and 1 s
    a chunk-op). With p = 4 microbatches in the group the other three stages' chunks are covered; with 2,
    each turn waits 0.5 + 1.5 − 2·0.5 = 1 s forward and 2 s backward."""
    lanes = [LaneTiming(s, 0, 4, 1.0, 2.0, 0.0) for s in range(4)]
    assert chunk_loop_wait(lanes, lanes[0], 2, 4) == 0.0
    assert chunk_loop_wait(lanes, lanes[0], 2, 2) == pytest.approx(3.0)
    grid = pipeline_time(ScheduleKind.INTERLEAVED, lanes, 2, group=lambda t: 4)
    few = pipeline_time(ScheduleKind.INTERLEAVED, lanes, 2, group=lambda t: 2)
    assert few.total == pytest.approx(grid.total + 3.0)


def test_zb_with_few_microbatches_a_lane_is_paced_by_its_chain():
    """Note [paced pipeline]: 5 stages, 2 microbatches a lane; the weight gradients cannot fill ZB-H1's bubble,
    so the last stage's chain (every earlier stage's F + I, then its own span) sets the pipeline."""
    lanes = [LaneTiming(s, 0, 2, 1.0, 1.0, 1.0) for s in range(5)]
    limits = in_flight_limits(ScheduleKind.ZB, lanes, 5)
    paced = pipeline_time(ScheduleKind.ZB, lanes, 1, limits)
    assert paced.total >= 4 * 2.0 + 2 * 3.0
    assert paced.total > 2 * 3.0 + 4 * (1.0 + 1.0 - 1.0)   # ZB-H1's bubble alone


def test_a_zorse_unit_syncs_on_its_own_and_takes_its_share_of_the_stages_step():
    lane = UnitLane.of((0, 1), 1.0, 2.0, 3.0, 0.0, 0.0)   # the boundary copy outlasts the compute
    assert (lane.forward, lane.backward) == (3.0, 3.0)
    # its sync is a collective of its own (latency and core wait included), its step a share of the stage's
    unit = Unit.of(0, (lane,), 0.1, 25.0, 100.0, 4.0, 8.0)
    assert (unit.sync, unit.step) == (4.0, 2.0)


def test_zorse_steps_a_unit_one_op_after_its_sync_and_keeps_the_last_units_gather():
    """Two units on one stage, one lane of two microbatches (F 1 s, B 2 s), each fetched in 5 s and synced
    in 3 s, stepped in 0.5 s: forward sweeps 5..7 and 10..12 (unit 1 fetched from 5, when unit 0's first op
    started); unit 1's backward keeps its gather (12..16); unit 0's backward, fetched from 12, starts at 17;
    unit 1's step waits for its sync (16 + 3) after unit 0's first op (17..19): 19.5, then 21.5, and unit 0
    steps after its own sync ends at 24.5: 25 s."""
    lane = UnitLane((0, 1), 1.0, 2.0)
    units = [Unit(0, (lane,), fetch=5.0, sync=3.0, step=0.5) for _ in range(2)]
    assert sequential_time(units, 2) == pytest.approx(25.0)


def test_hierarchical_zero_syncs_inside_the_node_then_across_at_its_position():
    """ZeRO-1 sharded per node: reduce-scatter and gather inside the node, then the shards' all-reduce."""
    hosts = {0: "a", 1: "a", 2: "b", 3: "b"}
    assert across_nodes((0, 1, 2, 3), hosts.__getitem__, 1) == (1, 3)
    seen = []
    rings = ZeroRings(lambda kind, ranks, nbytes: seen.append((kind, ranks, nbytes)) or 1.0,
                      StateBytes(params=4, grads=4, optimizer=8), (0, 1, 2, 3), (0, 1), (0, 2))
    assert sync_time(ZeroSpec(level=1, shard=ZeroShard.NODE), 8.0, rings) == 3.0
    assert seen == [("reduce_scatter", (0, 1), 8.0), ("all_gather", (0, 1), 8.0), ("all_reduce", (0, 2), 4.0)]
    seen.clear()     # bf16 parameters, fp32 gradients: the reductions move twice the bytes
    rings = dataclasses.replace(rings, states=StateBytes(params=2, grads=4, optimizer=12))
    assert sync_time(ZeroSpec(level=1, shard=ZeroShard.NODE), 8.0, rings) == 3.0
    assert seen == [("reduce_scatter", (0, 1), 16.0), ("all_gather", (0, 1), 8.0), ("all_reduce", (0, 2), 8.0)]
    assert flush_time([1.0, 2.0], [0.5, 0.25]) == 2.5
    assert throughput(100, 0.0) == 0.0 and throughput(100, 4.0) == 25.0


def test_a_zb_lane_keeps_one_microbatch_of_margin_per_lane_it_feeds():
    """Note [in-flight limit]: one lane in front of three keeps three more than Little's law asks, one for each
    lane its microbatches spread over, where one more was the margin for them all."""
    lanes = [LaneTiming(0, 0, 12, 0.1, 0.1, 0.1), *(LaneTiming(1, k, 4, 0.3, 0.3, 0.3) for k in range(3))]
    spread = in_flight_limits(ScheduleKind.ZB, lanes, 2, lane_counts={0: 1, 1: 3})
    one_more = in_flight_limits(ScheduleKind.ZB, lanes, 2)   # lane counts unknown: one microbatch of margin
    assert spread[0] == one_more[0] + 2 and spread[1] == one_more[1] == 1


def test_interleaved_runs_breadth_first_where_a_group_of_p_is_shorter_than_a_chunks_loop():
    """Note [interleaved groups]: two stages of 8 microbatches, 0.3 s of compute each: a group of p = 2 lasts
    2·2.4/8 = 0.6 s at the pace of the busiest lane; a chunk's loop is the other stage's backward (0.2 s)
    and the borders, 0.5 s each way over a slow link."""
    def grouping(p2p: float) -> Grouping:
        lanes = [LaneTiming(s, 0, 8, 0.1, 0.1, 0.1, p2p) for s in range(2)]
        return interleaved_grouping(ScheduleKind.INTERLEAVED, lanes, 2, 2, 8)
    assert grouping(0.01) is Grouping.DEPTH_FIRST
    assert grouping(0.5) is Grouping.BREADTH_FIRST


def test_a_stage_keeps_one_more_in_flight_than_the_lined_up_stage_after_it():
    """Note [in-flight limit] (`_held_upstream`): the last of three one-lane stages is slow and far away, so
    Little's law asks the middle stage for 3 in flight and the first for 3 too; the first holds every
    microbatch the middle one holds and the one the middle waits for, so it keeps 4 (held to 3, the first
    stage's forwards waited for round trips: random deep job 8 compiled 23.1 ms against 13.6 ms). With the
    lanes not lined up (a middle stage of two lanes, each half the microbatches) nothing is raised."""
    lanes = [LaneTiming(0, 0, 16, 0.5, 1.0, 0.0), LaneTiming(1, 0, 16, 1.0, 1.5, 0.0),
             LaneTiming(2, 0, 16, 1.0, 2.0, 0.0, p2p=1.5)]
    assert in_flight_limits(ScheduleKind.ONE_F_ONE_B, lanes, 3) == {0: 4, 1: 3, 2: 1}
    wide = [lanes[0], LaneTiming(1, 0, 8, 1.0, 1.5, 0.0), LaneTiming(1, 1, 8, 1.0, 1.5, 0.0), lanes[2]]
    limits = in_flight_limits(ScheduleKind.ONE_F_ONE_B, wide, 3, lane_counts={0: 1, 1: 2, 2: 1})
    assert limits == {0: 3, 1: 2, 2: 1}


def test_zb_lanes_keep_their_steady_order_where_each_border_trades_in_a_fixed_rotation():
    """Note [async sends]: one lane of 8 microbatches feeding four of 2 takes their gradients back in the order it
    sent the activations; 16 lanes feeding 12, or lanes of one stage serving 171 and 170, do not."""
    assert in_steady_order(ScheduleKind.ZB, [[8], [2, 2, 2, 2]])
    assert in_steady_order(ScheduleKind.ZB, [[16, 16], [4] * 8, [8] * 4])
    assert not in_steady_order(ScheduleKind.ZB, [[3] * 16, [4] * 12])
    assert not in_steady_order(ScheduleKind.ZB, [[2] * 8, [171, 171, 170]])
    assert not in_steady_order(ScheduleKind.ONE_F_ONE_B, [[4], [4]])
    assert in_steady_order(ScheduleKind.INTERLEAVED, [[4], [4]])
    # lanes lined up stage to stage (random job 19: two a stage) are side-by-side pipelines
    assert in_steady_order(ScheduleKind.INTERLEAVED, [[4, 4], [4, 4]])
    assert not in_steady_order(ScheduleKind.INTERLEAVED, [[4], [2, 2]])
    assert not in_steady_order(ScheduleKind.INTERLEAVED, [[4, 4, 4, 4], [1, 1, 7, 7]])


def test_a_lane_holds_no_more_than_the_lanes_before_it_let_it():
    """Note [in-flight limit] (`chain_held`): random job 22's shape, stages of 1, 1, 2, 3 and 3 lanes over 8
    microbatches. The fourth stage's first lane takes microbatches 0, 3 and 6; 0 and 6 are the first and fourth
    of the third stage's first lane, which holds 3, so it never holds all three at once, nor does the second
    (1, 4, 7); the third serves 2. The last stage is lined up with it and capped by its limit."""
    counts = ((8,), (8,), (4, 4), (3, 3, 2), (3, 3, 2))
    assert chain_held(counts, (8, 8, 3, 3, 1)) == (8, 8, 3, 2, 1)
    assert chain_held(counts, (8, 8, 3, 3, 3)) == (8, 8, 3, 2, 2)
    # lanes that line up (or one lane a stage) hold what their own limits allow, the chain capping nothing
    assert chain_held(((4, 4), (4, 4), (4, 4)), (3, 2, 1)) == (3, 2, 1)
    # one lane feeding two in turn: each holds about half of it
    assert chain_held(((16,), (8, 8)), (5, 5)) == (5, 3)
    # the limits lowering holds lanes to and memory counts: the stage rules' (3 on the third stage), then the chain
    lanes = [LaneTiming(0, 0, 8, 0.1, 0.1, 0.1), *(LaneTiming(1, k, 4, 0.1, 0.1, 0.1) for k in range(2)),
             *(LaneTiming(s, k, 3 if k < 2 else 2, 0.2, 0.2, 0.1) for s in (2, 3) for k in range(3))]
    widths = {0: 1, 1: 2, 2: 3, 3: 3}
    assert in_flight_limits(ScheduleKind.ZB, lanes, 4, lane_counts=widths) == {0: 8, 1: 3, 2: 3, 3: 1}
    assert in_flight_limits(ScheduleKind.ZB, lanes, 4, lane_counts=widths, counts=counts[1:]) == \
        {0: 8, 1: 3, 2: 2, 3: 1}


def test_a_zb_stage_wider_than_the_one_before_it_keeps_no_margin_of_its_own():
    """Note [in-flight limit]: a middle stage of two lanes behind one takes every other microbatch of it, and
    that lane keeps one queued for each already; with the stages' lane counts unknown it keeps the margin."""
    lanes = [LaneTiming(0, 0, 16, 0.1, 0.1, 0.1), *(LaneTiming(1, k, 8, 0.2, 0.2, 0.2) for k in range(2)),
             *(LaneTiming(2, k, 8, 0.2, 0.2, 0.2) for k in range(2))]
    counted = in_flight_limits(ScheduleKind.ZB, lanes, 3, lane_counts={0: 1, 1: 2, 2: 2})
    unknown = in_flight_limits(ScheduleKind.ZB, lanes, 3)
    assert counted[1] == unknown[1] - 1
    assert counted[0] == unknown[0] + 1   # the lane in front keeps one for each of the two it feeds


def test_lockstep_lanes_feeding_a_wider_lockstep_stage_keep_one_more(monkeypatch):
    """Note [in-flight limit]: random job 4's shape, two ZeRO-3 lanes feeding four in lockstep, each of whose
    slots takes two microbatches of every feeder at once; lanes in lockstep otherwise keep no margin."""
    lanes = [*(LaneTiming(0, k, 16, 0.1, 0.1, 0.1) for k in range(2)),
             *(LaneTiming(1, k, 8, 0.3, 0.3, 0.3) for k in range(4))]
    as_wide = [*(LaneTiming(0, k, 8, 0.1, 0.1, 0.1) for k in range(4)), *lanes[2:]]
    wider = in_flight_limits(ScheduleKind.ZB, lanes, 2, coupled={0: 2, 1: 4}, lane_counts={0: 2, 1: 4})
    even = in_flight_limits(ScheduleKind.ZB, as_wide, 2, coupled={0: 4, 1: 4}, lane_counts={0: 4, 1: 4})
    monkeypatch.setattr(schedule, "_feeds_wider_slots", lambda *_: False)
    assert wider == {0: 1 + in_flight_limits(ScheduleKind.ZB, lanes, 2, coupled={0: 2, 1: 4},
                                             lane_counts={0: 2, 1: 4})[0], 1: wider[1]}
    assert even == in_flight_limits(ScheduleKind.ZB, as_wide, 2, coupled={0: 4, 1: 4}, lane_counts={0: 4, 1: 4})


def test_a_sweeping_zero2_lane_waits_for_the_reduce_scatters_its_turns_do_not_hide():
    """Note [sweep waits]: job 69's last stage, 2 chunks of 4 microbatches, warm-up 5: three steady gradient ops
    wait what a forward does not hide, three of the cool-down the whole reduce-scatter, the chunk's first none
    (GPipe's count: every one of the seven after the first)."""
    f, i, w, reduce = 5.4, 6.9, 5.1, 6.0
    sweep = ChunkSweep(microbatches=4, chunks=2, warmup=5)
    got = zero_cycle(ScheduleKind.INTERLEAVED, (f, i + w), 0.0, reduce, 0.0, 0.0, (0.5, 0.5), (), sweep)
    waits = 3 * max(0.0, reduce / 2 - f / 2) + 3 * reduce / 2
    assert got.bound == pytest.approx(f + i + w + waits / 4)
    assert got.bound < zero_cycle(ScheduleKind.GPIPE, (f, i + w), 0.0, reduce, 0.0, 0.0, (0.5, 0.5)).bound
    held = ChunkSweep(microbatches=4, chunks=2, warmup=8)   # every gradient op in the cool-down
    assert zero_cycle(ScheduleKind.INTERLEAVED, (f, i + w), 0.0, reduce, 0.0, 0.0, (0.5, 0.5), (), held).bound == \
        pytest.approx(f + i + w + 6 * reduce / 2 / 4)


def test_a_stage_feeding_a_wider_lockstep_stage_drains_the_last_slot_one_backward_after_another():
    """`lockstep_fill`: two lanes feeding four in lockstep: the last slot's first waits for the feeders' second
    forwards (one forward each), and its gradients leave the feeders a backward apart (one each, ZB's input
    gradient); a stage in lockstep behind as many lanes waits for neither."""
    lanes = [*(LaneTiming(0, k, 16, 0.1, 0.2, 0.05) for k in range(2)),
             *(LaneTiming(1, k, 8, 0.3, 0.3, 0.3) for k in range(4))]
    assert lockstep_fill(ScheduleKind.ZB, lanes, 2, {1: 4}, {0: 2, 1: 4}) == pytest.approx(0.1 + 0.2)
    assert lockstep_fill(ScheduleKind.ONE_F_ONE_B, lanes, 2, {1: 4}, {0: 2, 1: 4}) == pytest.approx(0.1 + 0.25)
    assert lockstep_fill(ScheduleKind.ZB, lanes, 2, {1: 4}, {0: 4, 1: 4}) == 0.0


@pytest.mark.parametrize("kind", [ScheduleKind.ONE_F_ONE_B, ScheduleKind.ZB])
def test_a_paced_pipelines_round_trips_are_read_once_per_lane_however_many_lanes(monkeypatch, kind):
    """A plan of thousands of lanes a stage (16,384 GPUs, 12,288 tp-1 lanes) paced each lane by summing the
    later stages' shares over every lane: quadratic, 120 s of one compile. The shares are read a bounded number
    of times per lane, and the step is that of the lanes alone."""
    calls = 0
    share = schedule._round_trip_share

    def counted(kind: ScheduleKind, t: LaneTiming) -> float:
        nonlocal calls
        calls += 1
        return share(kind, t)

    monkeypatch.setattr(schedule, "_round_trip_share", counted)
    totals = []
    for lanes_a_stage in (500, 1000):
        calls = 0
        lanes = [LaneTiming(s, i, 2 + (i % 3 == 0), 1.0 + s / 10, 1.0, 0.5 + (i % 7) / 10, 0.1)
                 for s in range(4) for i in range(lanes_a_stage)]
        totals.append(pipeline_time(kind, lanes, limits={s: 4 - s for s in range(4)}).total)
        assert calls <= 4 * len(lanes)
    assert totals[0] == pytest.approx(totals[1])   # twice the lanes of the same kinds: the same step
