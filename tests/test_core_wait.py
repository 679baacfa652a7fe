"""A blocking call's wait for a core where ranks share cores (Note [core wait] in passes/cost/cores.py)."""

from __future__ import annotations

import json

import pytest

from hetc.cli import main
from hetc.compiler import load_checked
from hetc.passes.cost import CostModel, ProfileError
from hetc.passes.cost.cores import CoreWait, host_waits
from hetc.passes.cost.sources.hetc_profile import profile_from_dict
from hetc.ir.program import Collective, Phase
from hetc.ir.spec import DeviceSpec
from hetc.ir.topology import Gpu
from tests.conftest import DEMO
from tests.test_shared_cores import cpu_profile, demo_with_cores

COLLECTIVE_WAIT, P2P_WAIT, EXCHANGE_WAIT = 7e-3, 3e-3, 5e-3
CLUSTER = "  inter_latency = 500 us\n"      # the line `cores` goes after: the cluster's, shared by all ranks


def _profile(core_wait: dict | None) -> dict:
    return cpu_profile(core_wait=core_wait) if core_wait else cpu_profile()


MEASURED = {"ranks": 4, "cores": 2, "collective_s": COLLECTIVE_WAIT, "p2p_s": P2P_WAIT, "calls": 24}


def test_the_profile_file_carries_the_wait():
    profiles = profile_from_dict(_profile(MEASURED), "p.json")
    assert profiles.core_wait == {"cpu": CoreWait(4, 2, COLLECTIVE_WAIT, P2P_WAIT)}
    assert profiles.merged(profile_from_dict(_profile(None), "q.json")).core_wait == profiles.core_wait
    assert profile_from_dict(_profile(None), "p.json").core_wait == {}
    shifts = profile_from_dict(_profile({**MEASURED, "exchange_s": EXCHANGE_WAIT}), "p.json")
    assert shifts.core_wait == {"cpu": CoreWait(4, 2, COLLECTIVE_WAIT, P2P_WAIT, EXCHANGE_WAIT)}
    with pytest.raises(ProfileError, match="malformed"):
        profile_from_dict(_profile({**MEASURED, "p2p_s": -1.0}), "p.json")
    with pytest.raises(ProfileError, match="malformed"):
        profile_from_dict(_profile({"ranks": 4}), "p.json")


def test_only_nodes_whose_ranks_outnumber_their_cores_wait():
    cpu = DeviceSpec(name="cpu", memory=2**30)
    gpus = [Gpu(i, "host", i // 2, i % 2, cpu, "default", "") for i in range(3)]
    wait = CoreWait(4, 2, COLLECTIVE_WAIT, P2P_WAIT)
    assert host_waits(gpus, {"host": 1}, 0, {"cpu": wait}) == {("host", 0): wait}   # 2 ranks on 1 core; 1 on 1
    assert host_waits(gpus, {}, 2, {"cpu": wait}) == {("host", 0): wait, ("host", 1): wait}   # 3 on the 2
    assert host_waits(gpus, {}, 4, {"cpu": wait}) == {}
    assert host_waits(gpus, {"host": 1}, 0, {}) == {}            # nothing measured: nothing assumed


def _model(tmp_path, plan: str, core_wait: dict | None, cores: int | None = 2) -> CostModel:
    path = demo_with_cores(tmp_path, cores, plan, CLUSTER) if cores is not None else DEMO / f"{plan}.het"
    _, checked = load_checked(path)
    return CostModel(checked.explicit(), profile_from_dict(_profile(core_wait), "p"))


def test_every_blocking_call_pays_the_wait_once_where_ranks_share_cores(tmp_path):
    waits, alone = _model(tmp_path, "tp2", MEASURED), _model(tmp_path, "tp2", None)
    for nbytes in (8.0, 1e6):
        assert waits.collective_time(Collective.ALL_REDUCE, (0, 1), nbytes) == \
            pytest.approx(alone.collective_time(Collective.ALL_REDUCE, (0, 1), nbytes) + COLLECTIVE_WAIT)
        assert waits.p2p_time(0, 2, nbytes) == pytest.approx(alone.p2p_time(0, 2, nbytes) + P2P_WAIT)
    assert waits.collective_time(Collective.ALL_REDUCE, (0,), 1e6) == 0.0     # no call, no wait
    # tp2: two all-reduces per block, forward and backward, inside the layers; four blocks
    blocks = waits.model.layers
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        assert waits.compute_time(0, 0, phase) == pytest.approx(alone.compute_time(0, 0, phase) +
                                                                2 * blocks * COLLECTIVE_WAIT)


def test_no_wait_where_the_cores_go_round(tmp_path):
    for cores in (None, 4):      # the demo as it is (no cores said), and as many cores as ranks
        waits, alone = _model(tmp_path, "tp2", MEASURED, cores), _model(tmp_path, "tp2", None, cores)
        assert waits.collective_time(Collective.ALL_REDUCE, (0, 1), 1e6) == \
            alone.collective_time(Collective.ALL_REDUCE, (0, 1), 1e6)
        assert waits.compute_time(0, 0, Phase.FORWARD) == alone.compute_time(0, 0, Phase.FORWARD)
        assert waits.estimate().step_time_s == alone.estimate().step_time_s
    single = _model(tmp_path, "single", MEASURED)       # one rank on two cores
    assert single.estimate().step_time_s == _model(tmp_path, "single", None).estimate().step_time_s


def test_the_slowdown_stretches_a_layers_work_not_its_communication(tmp_path):
    two = _model(tmp_path, "tp2", MEASURED)        # four ranks on two cores: twice slower (no measured slowdown)
    own = _model(tmp_path, "tp2", MEASURED, cores=None)
    comm = two.tp_comm_time(0) * two.model.layers
    assert two.compute_time(0, 0, Phase.FORWARD) == \
        pytest.approx(2 * (own.compute_time(0, 0, Phase.FORWARD) - own.tp_comm_time(0) * own.model.layers) + comm)


@pytest.mark.parametrize("plan", ["tp2", "dp"])
def test_explain_and_compile_agree_with_the_wait(plan, tmp_path, capsys):
    path = demo_with_cores(tmp_path, 2, plan, CLUSTER)
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(_profile(MEASURED)))
    steps = []
    for flags in ((), ("--profile", str(profile))):
        assert main(["explain", path, "--json", *flags]) == 0
        explained = json.loads(capsys.readouterr().out)["step_time_s"]
        out = tmp_path / f"plan{len(steps)}"
        assert main(["compile", path, "-o", str(out), *flags]) == 0
        capsys.readouterr()
        compiled = json.loads((out / "summary.json").read_text())["step_time_s"]
        assert compiled == pytest.approx(explained, rel=0.01)
        steps.append(explained)
    alone = tmp_path / "alone.json"
    alone.write_text(json.dumps(_profile(None)))
    assert main(["explain", path, "--json", "--profile", str(alone)]) == 0
    assert steps[1] > json.loads(capsys.readouterr().out)["step_time_s"]     # the waits lengthen the step


@pytest.mark.parametrize("plan, measured, forward, backward", [
    ("ulysses2", MEASURED, 2 * COLLECTIVE_WAIT, 2 * COLLECTIVE_WAIT),   # two all-to-alls a block, each way
    # cp − 1 shifts forward, (cp − 1) + cp backward, each waiting as a shift (Note [exchange wait]) ...
    ("ring2", {**MEASURED, "exchange_s": EXCHANGE_WAIT}, EXCHANGE_WAIT, 3 * EXCHANGE_WAIT),
    ("ring2", MEASURED, P2P_WAIT, 3 * P2P_WAIT),             # ... or as a message where no shift was measured
    # Megatron-SP: an all-gather in and a reduce-scatter out of attention and FFN, each way; backward also
    # all-reduces the two norm weights' gradients; with the ring's shifts beside them
    ("tp2_cp2", MEASURED, 4 * COLLECTIVE_WAIT + P2P_WAIT, 6 * COLLECTIVE_WAIT + 3 * P2P_WAIT),
])
def test_context_parallel_calls_inside_a_layer_wait_each(plan, measured, forward, backward, tmp_path):
    waits, alone = _model(tmp_path, plan, measured), _model(tmp_path, plan, None)
    blocks = waits.model.layers
    for phase, per_block in ((Phase.FORWARD, forward), (Phase.BACKWARD, backward)):
        assert waits.compute_time(0, 0, phase) == pytest.approx(alone.compute_time(0, 0, phase) + blocks * per_block)


WORLD_WAIT = 11e-3


def test_a_collective_over_every_rank_measured_at_once_waits_the_world_wait(tmp_path):
    world = {**MEASURED, "world_collective_s": WORLD_WAIT}
    waits, pairs, alone = _model(tmp_path, "zero3", world), _model(tmp_path, "zero3", MEASURED), \
        _model(tmp_path, "zero3", None)
    for group, wait in (((0, 1, 2, 3), WORLD_WAIT), ((0, 1), COLLECTIVE_WAIT)):   # four ranks were measured
        assert waits.collective_time(Collective.ALL_GATHER, group, 1e6) == \
            pytest.approx(alone.collective_time(Collective.ALL_GATHER, group, 1e6) + wait)
    assert pairs.collective_time(Collective.ALL_GATHER, (0, 1, 2, 3), 1e6) == \
        pytest.approx(alone.collective_time(Collective.ALL_GATHER, (0, 1, 2, 3), 1e6) + COLLECTIVE_WAIT)
    assert profile_from_dict(_profile(world), "p").core_wait["cpu"].world_collective_s == WORLD_WAIT
