"""Collectives and links at scale (Notes [node links] and [hierarchical collectives] in passes/cost/links.py).

The ZeRO groups of a stage's lane positions share their node's link; a data-parallel collective
over several nodes runs node by node (reduce-scatter over NVLink, the node's
pieces across nodes at once, all-gather); a group inside one node keeps the
flat ring.
"""

from __future__ import annotations

import pytest

from hetc.passes.cost.hardware import INTRA_NODE_NCCL_FRACTION
from hetc.passes.cost.links import node_split
from hetc.passes.cost.network import TREE_BANDWIDTH_FRACTION, ring_steps
from hetc.ir.program import Collective
from tests.costspecs import cost_model, plan_text

GB = 1e9
INTER, INTER_LATENCY = 10 * GB, 20e-6      # the cluster's default link between nodes
NVLINK, NVLINK_LATENCY = 100 * GB * INTRA_NODE_NCCL_FRACTION, 5e-6   # the node's intra link, as NCCL moves it


def _cluster(nodes: int, gpus: int) -> str:
    return f"""
cluster c {{
  node n {{
    device = A100-40
    count = {nodes}
    gpus = {gpus}
    intra {{ bandwidth = 100 GB/s }}
  }}
  inter_bandwidth = 10 GB/s
}}
"""


DATA_PARALLEL = """
  stage all {
    layers = embed..head
    ranks = [n[0], n[1]]
    lanes = 16
  }
"""


def _ring(kind: Collective, n: int, nbytes: float, rate: float, latency: float) -> float:
    return ring_steps(kind, n) * (nbytes / n / rate + latency)


def test_a_data_parallel_all_reduce_over_two_nodes_runs_node_by_node(tmp_path):
    """16 GPUs on 2 nodes: reduce-scatter over NVLink, the 8 pieces across nodes at once, all-gather."""
    cm = cost_model(tmp_path, plan_text(DATA_PARALLEL, clusters=_cluster(2, 8)))
    ranks = tuple(range(16))
    split = node_split(ranks, lambda r: cm.gpu(r).host)
    assert split is not None and split.per_node == 8 and split.across == (0, 8)
    x = 64e6
    intra = _ring(Collective.REDUCE_SCATTER, 8, x, NVLINK, NVLINK_LATENCY)
    across = _ring(Collective.ALL_REDUCE, 2, x / 8, INTER / 8, INTER_LATENCY)
    expected = 2 * intra + across
    got = cm.collective_time(Collective.ALL_REDUCE, ranks, x)
    assert got == pytest.approx(expected)
    flat = _ring(Collective.ALL_REDUCE, 16, x, INTER, INTER_LATENCY)   # one ring through both nodes
    assert got < flat
    # reduce-scatter and all-gather are its halves
    half = intra + _ring(Collective.REDUCE_SCATTER, 2, x / 8, INTER / 8, INTER_LATENCY)
    assert cm.collective_time(Collective.REDUCE_SCATTER, ranks, x) == pytest.approx(half)
    assert cm.collective_time(Collective.ALL_GATHER, ranks, x) == pytest.approx(half)


def test_nccl_moves_0_8_of_a_declared_link_inside_a_node_and_all_of_one_between_nodes(tmp_path):
    """Note [NCCL inside a node]: 360 of NVLink's 450 GB/s on H100; InfiniBand near its line rate; gloo's
    shared memory on a node of `cpu` ranks at its own."""
    cm = cost_model(tmp_path, plan_text(DATA_PARALLEL, clusters=_cluster(2, 8)))
    same, other = (cm.hardware.link(cm.gpu(0), cm.gpu(peer), 64e6, 2, 1) for peer in (1, 8))
    assert same == pytest.approx((0.8 * 100 * GB, NVLINK_LATENCY))
    assert other == pytest.approx((INTER, INTER_LATENCY))
    # `cpu` ranks run gloo: their node's link at its rate
    cpus = cost_model(tmp_path, plan_text(DATA_PARALLEL, clusters=_cluster(2, 8).replace("A100-40", "cpu")))
    assert cpus.hardware.link(cpus.gpu(0), cpus.gpu(1), 64e6, 2, 1)[0] == pytest.approx(100 * GB)


def test_one_stream_between_nodes_moves_through_one_of_its_nodes_nics(tmp_path):
    """Note [node links]: with `nics = 8` (a DGX's eight rails) one GPU's stream to another node leaves through
    its own NIC, 1/8 of the node pair's link, and so does each of up to eight at once; more than eight share
    it. A node declaring no NICs keeps the whole link for one stream (one NIC), as before."""
    cm = cost_model(tmp_path, plan_text(DATA_PARALLEL, clusters=_cluster(2, 8).replace("gpus = 8", "gpus = 8\n    nics = 8")))
    a, b = cm.gpu(0), cm.gpu(8)
    assert [cm.hardware.link(a, b, 64e6, 2, k)[0] for k in (1, 4, 8, 16)] == \
        pytest.approx([INTER / 8, INTER / 8, INTER / 8, INTER / 16])
    assert cm.hardware.link(a, cm.gpu(1), 64e6, 2, 1)[0] == pytest.approx(0.8 * 100 * GB)   # inside: NVLink
    one = cost_model(tmp_path, plan_text(DATA_PARALLEL, clusters=_cluster(2, 8)))
    assert [one.hardware.link(one.gpu(0), one.gpu(8), 64e6, 2, k)[0] for k in (1, 8)] == \
        pytest.approx([INTER, INTER / 8])
    # a data-parallel all-reduce over both nodes runs node by node: its eight node-local positions cross at once
    # either way
    ranks = tuple(range(16))
    assert cm.collective_time(Collective.ALL_REDUCE, ranks, 64e6) == \
        pytest.approx(one.collective_time(Collective.ALL_REDUCE, ranks, 64e6))


def test_a_group_inside_one_node_keeps_the_flat_ring(tmp_path):
    cm = cost_model(tmp_path, plan_text(DATA_PARALLEL, clusters=_cluster(2, 8)))
    ranks = tuple(range(8))
    assert node_split(ranks, lambda r: cm.gpu(r).host) is None
    for kind in (Collective.ALL_REDUCE, Collective.REDUCE_SCATTER, Collective.ALL_GATHER):
        assert cm.collective_time(kind, ranks, 64e6) == pytest.approx(_ring(kind, 8, 64e6, NVLINK, NVLINK_LATENCY))


def test_groups_of_different_positions_share_the_node_link(tmp_path):
    """tp = 2 lanes, one per node of two GPUs: each of a node's ranks reduces over its own group (one member
    per node) at once, so the two groups share the link; a group with every rank of its node counts its own
    pieces (`hierarchical_time`), not other groups."""
    tp2 = """
  stage all {
    layers = embed..head
    ranks = [n[0], n[1]]
    lanes = 2
    tp = 2
  }
"""
    cm = cost_model(tmp_path, plan_text(tp2, clusters=_cluster(2, 2)))
    group = cm.zero_group(1)
    assert group == (1, 3) and cm.groups_at_once(1, group) == 2
    cm16 = cost_model(tmp_path, plan_text(DATA_PARALLEL, clusters=_cluster(2, 8)))
    assert cm16.groups_at_once(0, cm16.zero_group(0)) == 1
    x = 64e6
    shared = cm.collective_time(Collective.ALL_REDUCE, group, x, 2)
    assert shared == pytest.approx(_ring(Collective.ALL_REDUCE, 2, x, INTER / 2, INTER_LATENCY))


def test_an_all_reduce_over_many_nodes_takes_nccls_tree_for_small_buffers_and_the_ring_for_large(tmp_path):
    """16 nodes of one GPU: the ring pays 30 link latencies, the double binary tree 2·log2(16) = 8 and moves
    2X at 0.9 of the link's rate; NCCL's tuner, and the cost model, take the faster (network.py)."""
    one_each = """
  stage all {
    layers = embed..head
    ranks = n
    lanes = 16
  }
"""
    cm = cost_model(tmp_path, plan_text(one_each, clusters=_cluster(16, 1)))
    ranks = tuple(range(16))
    small, large = 1e3, 1e9
    tree = 8 * INTER_LATENCY + 2 * small / (TREE_BANDWIDTH_FRACTION * INTER)
    assert tree < _ring(Collective.ALL_REDUCE, 16, small, INTER, INTER_LATENCY)
    assert cm.collective_time(Collective.ALL_REDUCE, ranks, small) == pytest.approx(tree)
    ring = _ring(Collective.ALL_REDUCE, 16, large, INTER, INTER_LATENCY)
    assert ring < 8 * INTER_LATENCY + 2 * large / (TREE_BANDWIDTH_FRACTION * INTER)
    assert cm.collective_time(Collective.ALL_REDUCE, ranks, large) == pytest.approx(ring)
    # a reduce-scatter has no tree form in NCCL: always the ring
    assert cm.collective_time(Collective.REDUCE_SCATTER, ranks, small) == pytest.approx(
        _ring(Collective.REDUCE_SCATTER, 16, small, INTER, INTER_LATENCY))
