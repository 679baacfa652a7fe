"""Traffic volumes (survey II.II, DESIGN.md §3) and the ring model's times."""

from __future__ import annotations

import math

import pytest

from hetc.passes.cost import traffic
from hetc.passes.cost.hardware import INTRA_NODE_NCCL_FRACTION
from hetc.passes.cost.memory import StateBytes
from hetc.passes.cost.network import MeasuredPoints, QuadraticLogFit, collective_bytes_per_rank
from hetc.ir.spec import ScheduleKind
from tests.costspecs import cluster, cost_model, plan_text

PHI_BYTES = 1e9   # δΦ of a stage
N = 8
NVLINK = 100e9 * INTRA_NODE_NCCL_FRACTION   # the 100 GB/s intra link as NCCL moves it (Note [NCCL inside a node])


SAME = StateBytes(params=4, grads=4, optimizer=8)       # fp32: gradients as wide as the parameters
MAIN_GRADS = StateBytes(params=2, grads=4, optimizer=12)  # bf16 with fp32 gradients (Note [gradient dtype])


def test_zero_traffic_per_level():
    ring = (N - 1) / N
    zero = lambda level, schedule, group=N, states=SAME: traffic.zero_bytes(level, schedule, PHI_BYTES, group, 16,
                                                                            states)
    for schedule in (ScheduleKind.ONE_F_ONE_B, ScheduleKind.ZORSE):
        for level in (0, 1):
            assert zero(level, schedule) == 2 * ring * PHI_BYTES   # 2δΦ
    # ZeRO-2 reduce-scatters every microbatch under gradient accumulation (DeepSpeed), then gathers once
    assert zero(2, ScheduleKind.ONE_F_ONE_B) == 17 * ring * PHI_BYTES
    assert zero(2, ScheduleKind.ZORSE) == 2 * ring * PHI_BYTES
    # ZeRO-3: 3δΦ, and that per microbatch under a plain pipeline; Zorse gathers once per ministage
    assert zero(3, ScheduleKind.GPIPE) == 3 * 16 * ring * PHI_BYTES
    assert zero(3, ScheduleKind.ZORSE) == 3 * ring * PHI_BYTES
    assert zero(3, ScheduleKind.ZORSE, group=1) == 0.0   # nothing to sync


def test_zero_reductions_move_fp32_gradients_of_a_bf16_model():
    """`param_bytes` is δΦ of bf16 parameters; their gradients are reduced in fp32, twice the bytes, and the
    parameters gathered in bf16 (Megatron-LM's distributed optimizer under --bf16)."""
    ring = (N - 1) / N
    zero = lambda level, schedule: traffic.zero_bytes(level, schedule, PHI_BYTES, N, 16, MAIN_GRADS)
    assert zero(0, ScheduleKind.ONE_F_ONE_B) == zero(1, ScheduleKind.ONE_F_ONE_B) == 3 * ring * PHI_BYTES
    assert zero(2, ScheduleKind.ONE_F_ONE_B) == (16 * 2 + 1) * ring * PHI_BYTES
    assert zero(3, ScheduleKind.GPIPE) == (2 + 2) * 16 * ring * PHI_BYTES


def test_parallelism_volumes():
    b, s, h, d = 2, 4096, 8192, 2
    bsh = d * b * s * h
    assert traffic.pp_bytes(b, s, h, d, microbatches=10) == 2 * 10 * bsh     # δbSH per direction per mb
    assert traffic.tp_bytes(1 << 20, b, s, h, d) == pytest.approx(8 * bsh, rel=1e-5)   # 4δbSH per sub-block
    assert traffic.tp_bytes(1, b, s, h, d) == 0.0
    sp, kv, q = 8, 8, 64
    assert traffic.ulysses_bytes(sp, kv, q, b, s, h, d) == pytest.approx(4 * (kv / q + 1) * bsh / sp * 7 / 8)
    ring = traffic.ring_attention_bytes(1 << 20, kv, q, b, s, h, d)
    assert ring == pytest.approx(6 * kv / q * bsh, rel=1e-5)
    assert traffic.ep_bytes(1 << 20, 2, b, s, h, d) == pytest.approx(4 * 2 * bsh, rel=1e-5)
    assert collective_bytes_per_rank("all_reduce", 4, 1000.0) == 2 * 3 * 250.0
    assert collective_bytes_per_rank("all_gather", 4, 1000.0) == 3 * 250.0


PLAN = """
  stage all {
    layers = embed..head
    ranks = n
    lanes = 8
  }
"""


def test_ring_time_uses_the_slowest_link(tmp_path):
    cm = cost_model(tmp_path, plan_text(PLAN, clusters=cluster(intra="100 GB/s", inter="10 GB/s")))
    x, intra_lat, inter_lat = 8e8, 5e-6, 20e-6
    inside = cm.collective_time("all_reduce", [0, 1, 2, 3], x)
    assert inside == pytest.approx(2 * 3 * (x / 4 / NVLINK + intra_lat))
    # over two nodes of four: node by node (Note [hierarchical collectives]), the four positions' pieces
    # across nodes at once, each on a quarter of the link
    across = cm.collective_time("all_reduce", list(range(8)), x)
    node = 3 * (x / 4 / NVLINK + intra_lat)
    assert across == pytest.approx(2 * node + 2 * (x / 4 / 2 / (10e9 / 4) + inter_lat))
    assert across < 2 * 7 * (x / 8 / 10e9 + inter_lat)   # below even a flat ring with the whole link
    assert cm.collective_time("all_gather", list(range(8)), x) == pytest.approx(across / 2)
    assert cm.collective_time("all_reduce", [3], x) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        cm.collective_time("broadcast", [0, 1], x)


def test_concurrent_streams_share_a_node_link(tmp_path):
    cm = cost_model(tmp_path, plan_text(PLAN, clusters=cluster(intra="100 GB/s", inter="10 GB/s")))
    one = cm.p2p_time(0, 4, 1e9)
    assert one == pytest.approx(20e-6 + 1e9 / 10e9)
    assert cm.p2p_time(0, 4, 1e9, concurrent=4) == pytest.approx(20e-6 + 4 * 1e9 / 10e9)
    assert cm.p2p_time(0, 1, 1e9, concurrent=4) == pytest.approx(5e-6 + 1e9 / NVLINK)   # NVLink is per GPU
    assert cm.p2p_time(0, 0, 1e9) == 0.0


def test_sailor_fit_shape():
    fit = QuadraticLogFit(a=-0.5, b=4.0, c=10.0, cap=30e9)
    assert fit.rate(1e6) == pytest.approx(10e9)                 # log2(1 MB) = 0 -> c GB/s
    assert fit.rate(16e6) == pytest.approx(18e9)                # the vertex: x = -b / 2a = 4
    assert fit.rate(1e12) == pytest.approx(18e9)                # held past the vertex
    assert QuadraticLogFit(0.0, 10.0, 10.0, 30e9).rate(1e9) == 30e9   # capped
    assert fit.rate(1.0) >= 0.01 * 30e9                         # never negative or zero
    pts = MeasuredPoints((1e3, 1e6), (1e8, 1e9))
    assert pts.rate(1e2) == 1e8 and pts.rate(1e9) == 1e9
    assert pts.rate(math.sqrt(1e3 * 1e6)) == pytest.approx(5.5e8)


def test_explained_traffic_lists_every_group(tmp_path):
    body = """
  zero = 2
  stage a {
    layers = embed..block3
    ranks = n[0]
    lanes = 2
    tp = 2
  }
  stage b {
    layers = block4..head
    ranks = n[1]
    lanes = 2
    tp = 2
  }
"""
    cm = cost_model(tmp_path, plan_text(body, global_batch=8))
    groups = {(g.kind, g.group): g for g in cm.estimate().traffic}
    kinds = sorted(k for k, _ in groups)
    assert kinds == ["dp", "dp", "pp", "tp", "tp", "tp", "tp"]
    m, d = cm.model, 4
    pp = next(g for (k, _), g in groups.items() if k == "pp")
    # both tp ranks of each side hold the whole sequence (no sequence parallelism), but each receives its half
    # and the tp group gathers the halves (Note [scatter-gather borders]): the border carries each token once
    assert pp.bytes_per_step == 2 * 1 * 8 * d * m.seq * m.hidden
    # each rank gathers the other half of every tensor it receives: 4 microbatches a lane, one border each way
    gathered = [g for (k, name), g in groups.items() if k == "tp" and "gathered" in name]
    assert [g.bytes_per_step for g in gathered] == [4 * d * m.seq * m.hidden / 2] * 2
    dp = next(g for (k, name), g in groups.items() if k == "dp" and "stage a" in name)
    phi = cm.numel(0, 0) * d
    assert dp.bytes_per_step == pytest.approx(traffic.zero_bytes(2, ScheduleKind.ONE_F_ONE_B, phi, 2, 4, cm.states))
    tp = next(g for (k, name), g in groups.items() if k == "tp" and "stage a" in name)
    per_layer = traffic.tp_bytes(2, 1, m.seq, m.hidden, d)
    assert tp.bytes_per_step == pytest.approx(4 * 4 * per_layer)   # 4 blocks, 4 microbatches
