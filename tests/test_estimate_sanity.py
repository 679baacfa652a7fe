"""The estimate moves the right way, and compute times come from the right source."""

from __future__ import annotations

import pytest

from hetc.passes.cost import Profiles
from hetc.passes.cost.sources.hetc_profile import FORMAT, VERSION, profile_from_dict
from hetc.passes.cost.profiles import ProfileError
from hetc.passes.cost.shapes import layer_flops
from hetc.passes.cost.params import block_params
from tests.costspecs import cluster, cost_model, plan_text

DP = """
  zero = {zero}
  stage all {{
    layers = embed..head
    ranks = {ranks}
    lanes = {lanes}
  }}
  idle = [{idle}]
"""

PP = """
  schedule = {schedule}
  zero = {zero}
  stage a {{
    layers = {a}
    ranks = n[0]
    lanes = 4
    ministages = {v}
  }}
  stage b {{
    layers = {b}
    ranks = n[1]
    lanes = 4
    ministages = {v}
  }}
"""


def _dp(tmp_path, lanes: int, zero: int = 0, global_batch: int = 32, **kw):
    ranks = {2: "n[0, 0:2]", 4: "n[0]", 8: "n"}[lanes]
    idle = {2: "n[0, 2:4], n[1]", 4: "n[1]", 8: ""}[lanes]
    body = DP.format(zero=zero, ranks=ranks, lanes=lanes, idle=idle).replace("  idle = []\n", "")
    return cost_model(tmp_path, plan_text(body, global_batch=global_batch, **kw)).estimate()


def _pp(tmp_path, schedule="1f1b", zero=0, v=1, global_batch=32, **kw):
    a, b = ("embed..block3", "block4..head") if v == 1 else \
        ("[embed..block1, block4..block5]", "[block2..block3, block6..head]")
    return cost_model(tmp_path, plan_text(PP.format(schedule=schedule, zero=zero, v=v, a=a, b=b),
                                          global_batch=global_batch, **kw)).estimate()


def test_more_lanes_are_faster_until_the_network_dominates(tmp_path):
    times = [_dp(tmp_path, n, global_batch=512).step_time_s for n in (2, 4, 8)]
    assert times[0] > times[1] > times[2]
    # a tiny step: the 8-lane all-reduce over a 1 GB/s inter-node link costs more than it saves
    slow = cluster(inter="1 GB/s")
    small = [_dp(tmp_path, n, global_batch=32, clusters=slow).step_time_s for n in (4, 8)]
    assert small[0] < small[1]


def test_faster_devices_and_links_are_faster(tmp_path):
    body = DP.format(zero=0, ranks="n", lanes=8, idle="").replace("  idle = []\n", "")
    a100 = cost_model(tmp_path, plan_text(body, global_batch=32)).estimate()
    v100 = cost_model(tmp_path, plan_text(body, global_batch=32, clusters=cluster(device="V100-16")))
    slow = cost_model(tmp_path, plan_text(body, global_batch=32, clusters=cluster(inter="100 MB/s")))
    v100, slow = v100.estimate(), slow.estimate()
    assert a100.step_time_s < v100.step_time_s and a100.step_time_s < slow.step_time_s
    assert a100.peak_flops == 8 * 19.5e12   # the fp32 peak of the cluster's 8 A100s


def test_bubble_shrinks_with_microbatches_and_interleaving(tmp_path):
    few, many = _pp(tmp_path, global_batch=8), _pp(tmp_path, global_batch=64)
    assert few.time.bubble / few.step_time_s > many.time.bubble / many.step_time_s
    ofob, inter = _pp(tmp_path, v=2), _pp(tmp_path, schedule="interleaved", v=2)
    # the stages' lanes line up: interleaved 1F1B's receives overlap the op before their consumer as 1F1B's do
    # (Note [async sends]); it divides the fill by v and adds what its chunks' loop waits (Note [chunk loop])
    worst = next(t for t in ofob.time.lanes if (t.stage, t.lane) == ofob.time.bottleneck)
    lane = next(t for t in inter.time.lanes if (t.stage, t.lane) == inter.time.bottleneck)
    assert worst.p2p > worst.p2p_wait == lane.p2p_wait
    assert ofob.time.bubble / 2 <= inter.time.bubble < ofob.time.bubble
    zb = _pp(tmp_path, schedule="zb")
    assert zb.time.bubble < _pp(tmp_path).time.bubble
    gpipe = _pp(tmp_path, schedule="gpipe")
    assert gpipe.memory[0].activations > _pp(tmp_path).memory[0].activations


def test_zero3_trades_memory_for_traffic(tmp_path):
    z0, z3 = _dp(tmp_path, 8, zero=0), _dp(tmp_path, 8, zero=3)
    m0, m3 = z0.memory[0], z3.memory[0]
    assert m3.params + m3.grads + m3.optimizer < (m0.params + m0.grads + m0.optimizer) / 4
    assert z3.traffic[0].bytes_per_step > z0.traffic[0].bytes_per_step


def test_zorse_gathers_once_per_ministage(tmp_path):
    pipe = _pp(tmp_path, zero=3, v=2)
    zorse = _pp(tmp_path, schedule="zorse", zero=3, v=2)
    dp = [g for g in zorse.traffic if g.kind == "dp"]
    plain = [g for g in pipe.traffic if g.kind == "dp"]
    assert len(dp) == len(plain) == 2
    assert all(z.bytes_per_step < p.bytes_per_step for z, p in zip(dp, plain, strict=True))
    assert zorse.step_time_s > 0 and zorse.fits


def test_checkpointing_trades_time_for_memory(tmp_path):
    none, full = _pp(tmp_path), _pp(tmp_path, ckpt="full")
    assert full.memory[0].activations < none.memory[0].activations
    assert full.step_time_s > none.step_time_s
    assert full.hfu > full.mfu and none.hfu == pytest.approx(none.mfu)


def _profile(device: str, hidden: int, block: int, fwd: tuple[float, float], bwd: tuple[float, float],
             name: str) -> Profiles:
    rows = [{"layer": "block", "tp": 1, "seq": 128, "micro_batch": b, "forward_s": fwd[0] + fwd[1] * b,
             "backward_s": bwd[0] + bwd[1] * b} for b in (1, 2, 4)]
    return profile_from_dict({"format": FORMAT, "version": VERSION, "device": {"kind": device},
                              "dtype": "fp32", "model": {"hidden": hidden, "block_params": block},
                              "layers": rows}, name)


def test_measured_block_times_replace_arithmetic(tmp_path):
    body = DP.format(zero=0, ranks="n", lanes=8, idle="").replace("  idle = []\n", "")
    text = plan_text(body, global_batch=16)
    base = cost_model(tmp_path, text)
    shape = (base.model.hidden, block_params(base.model))
    measured = _profile("A100-40", *shape, (1e-3, 2e-3), (2e-3, 4e-3), "p")
    cm = cost_model(tmp_path, text, measured)
    # the head, which the profile lacks, runs at the FLOP rate the measured block reached
    rate = layer_flops(cm.model, 1, 1).forward / 3e-3
    head = cm.compute.layer("A100-40", "head", 1, 1)
    assert head.forward == pytest.approx(layer_flops(cm.model, cm.model.layers + 1, 1).forward / rate)
    assert "block FLOP rate" in head.source
    assert base.compute.layer("A100-40", "head", 1, 1).source == "arithmetic"
    assert cm.compute.layer("A100-40", "block", 1, 1).forward == pytest.approx(3e-3)
    assert cm.compute.layer("A100-40", "block", 1, 1).backward == pytest.approx(6e-3)
    split = cm.compute_time(0, 0, "I") + cm.compute_time(0, 0, "W")
    assert cm.compute_time(0, 0, "B") == pytest.approx(split)
    # a TP degree the profile lacks: tp = 1 divided by tp, and the all-reduces added by the caller
    half = cm.compute.layer("A100-40", "block", 1, 2)
    assert half.forward == pytest.approx(1.5e-3) and half.needs_tp_comm


def test_profiles_transfer_across_devices_by_a_reference_model(tmp_path):
    body = DP.format(zero=0, ranks="n", lanes=8, idle="").replace("  idle = []\n", "")
    text = plan_text(body, global_batch=16, clusters=cluster(device="H100"))
    base = cost_model(tmp_path, text)
    mine = (base.model.hidden, block_params(base.model))
    ref = (512, 3_000_000)   # another model, profiled on both devices
    profiles = _profile("A100-40", *mine, (0.0, 4e-3), (0.0, 8e-3), "m-a100") \
        .merged(_profile("A100-40", *ref, (0.0, 2e-3), (0.0, 4e-3), "r-a100")) \
        .merged(_profile("H100", *ref, (0.0, 1e-3), (0.0, 1e-3), "r-h100"))
    cm = cost_model(tmp_path, text, profiles)
    t = cm.compute.layer("H100", "block", 2, 1)
    assert t.forward == pytest.approx(8e-3 * 0.5) and t.backward == pytest.approx(16e-3 * 0.25)
    assert "speed ratio" in t.source


def test_tensor_parallel_all_reduces_are_added_to_arithmetic_times(tmp_path):
    one = DP.format(zero=0, ranks="n[0, 0:1]", lanes=1, idle="n[0, 1:4], n[1]")
    two = DP.format(zero=0, ranks="n[0, 0:2]", lanes=1, idle="n[0, 2:4], n[1]")
    two = two.replace("lanes = 1", "lanes = 1\n    tp = 2")
    cm1 = cost_model(tmp_path, plan_text(one, global_batch=4))
    cm2 = cost_model(tmp_path, plan_text(two, global_batch=4))
    block1, block2 = (cm.compute.layer("A100-40", "block", 1, cm.stage_of(0).tp) for cm in (cm1, cm2))
    # half the arithmetic, in multiplies half as wide: no faster per FLOP (Note [GEMM curve])
    assert block1.forward / 2 <= block2.forward < block1.forward and block2.needs_tp_comm
    blocks = cm1.model.layers
    allreduce = cm2.collective_time("all_reduce", cm2.tp_group(0), cm2.hidden_bytes)
    assert allreduce > 0

    def layers(cm, tp: int) -> float:
        return sum(cm.compute.layer("A100-40", kind, 1, tp).forward * (blocks if kind == "block" else 1)
                   for kind in ("embed", "block", "head"))
    # the one ministage's forward: its layers' arithmetic at its tp, and two all-reduces a block at tp 2
    assert cm1.compute_time(0, 0, "F") == pytest.approx(layers(cm1, 1), rel=1e-9)
    assert cm2.compute_time(0, 0, "F") == pytest.approx(layers(cm2, 2) + blocks * 2 * allreduce, rel=1e-9)


def _engine(seconds) -> Profiles:
    return profile_from_dict({"format": FORMAT, "version": VERSION, "device": {"kind": "A100-40"},
                              "model": {"hidden": 1, "block_params": 1}, "microbatch_overhead_s": seconds},
                             "engine.json")


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_engine_overhead_lengthens_every_microbatch_of_every_stage(tmp_path, schedule):
    text = plan_text(PP.format(schedule=schedule, zero=0, v=1, a="embed..block3", b="block4..head"),
                     global_batch=32)
    base = cost_model(tmp_path, text).estimate()
    slow = cost_model(tmp_path, text, _engine(2e-3)).estimate()
    before = {(t.stage, t.lane): t for t in base.time.lanes}
    for t in slow.time.lanes:
        assert t.forward == pytest.approx(before[(t.stage, t.lane)].forward + 2e-3)
        assert t.backward == pytest.approx(before[(t.stage, t.lane)].backward)
    m = base.time.lanes[0].microbatches
    # the bottleneck lane's m microbatches, and the other stage's fill once
    assert slow.step_time_s - base.step_time_s == pytest.approx((m + 1) * 2e-3, rel=1e-6)


@pytest.mark.parametrize("bad", [-1e-3, float("nan"), "fast"])
def test_engine_overhead_must_be_a_time(bad):
    with pytest.raises(ProfileError, match="engine.json"):
        _engine(bad)
