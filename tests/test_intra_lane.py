"""The planner's hook for intra-lane layouts (passes/cost/intra_lane.py) on the demo cluster."""

from __future__ import annotations

from hetc.passes.cost.intra_lane import LaneLayout, lane_layouts, tp_degrees
from hetc.ir.spec import CPKind
from tests.conftest import DEMO
from tests.plans import compile_plan


def _demo():
    lowered = compile_plan(DEMO / "single.het")
    return lowered.spec.model, lowered.topology


def test_tp_stays_inside_a_node_and_splits_the_heads():
    model, topo = _demo()                      # 2 nodes x 2 CPU "GPUs", 4 heads, 2 K/V heads
    across = topo.gpus                         # a lane over both nodes
    assert tp_degrees(model, topo, across) == (1, 2)          # tp 4 would leave a node (and split K/V heads)
    assert tp_degrees(model, topo, across[:2]) == (1, 2)
    assert tp_degrees(model, topo, [across[1], across[2]]) == (1,)   # a pair that straddles the nodes
    assert tp_degrees(model, topo, across[:2], min_bandwidth=50e9) == (1,)   # 10 GB/s is no NVLink


def test_tp_splits_no_moe_block():
    """The validator refuses tp > 1 on MoE blocks; the planner's layouts and its Megatron-grid baseline asked
    for it on a random MoE job, and `hetc plan` failed on its own candidate, located at <generated>."""
    lowered = compile_plan(DEMO / "moe_single.het")
    model, topo = lowered.spec.model, lowered.topology
    assert model.moe is not None and tp_degrees(model, topo, topo.gpus[:2]) == (1,)
    assert all(layout.tp == 1 for layout in lane_layouts(model, topo, topo.gpus))


def test_lane_layouts_pair_tp_with_cp_the_sequence_allows():
    model, topo = _demo()
    got = lane_layouts(model, topo, topo.gpus)
    assert got == (LaneLayout(1, 4, CPKind.RING), LaneLayout(1, 4, CPKind.ULYSSES),
                   LaneLayout(2, 2, CPKind.RING, True), LaneLayout(2, 2, CPKind.ULYSSES, True))
