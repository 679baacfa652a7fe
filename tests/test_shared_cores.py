"""Ranks sharing a node's CPU cores (`node { cores = N }`, Note [shared cores] in passes/cost/cores.py)."""

from __future__ import annotations

import json

import pytest

from hetc.cli import main
from hetc.compiler import load_checked
from hetc.passes.cost import CostModel
from hetc.passes.cost.cores import core_slowdown, host_slowdowns
from hetc.passes.cost.sources.hetc_profile import FORMAT, VERSION, profile_from_dict
from hetc.spec import DeviceSpec
from hetc.topology import Gpu
from tests.conftest import DEMO


def test_ranks_beyond_the_cores_slow_down_in_proportion():
    assert core_slowdown(4, 2) == 2.0
    assert core_slowdown(3, 2) == 1.5
    assert core_slowdown(2, 2) == core_slowdown(1, 2) == 1.0
    assert core_slowdown(8, 0) == 1.0          # 0: the ranks do not share cores


def test_a_cpu_profile_measures_the_slowdown_by_each_processs_share_of_the_wall_clock():
    """Note [slowdown by throughput]: per-layer medians at once that hardly move do not hide the turns."""
    from hetc.runtime.measure import LayersAtOnce, LayerSample, slowdown

    alone = [LayerSample("block", 1, 64, 1e-3, 2e-3)]
    same_medians = [LayerSample("block", 1, 64, 1.1e-3, 2.2e-3)]
    assert slowdown(alone, LayersAtOnce(same_medians, wall_per_cpu=2.05)) == 2.05
    assert slowdown(alone, LayersAtOnce(same_medians, wall_per_cpu=0.97)) == 1.0   # never faster than alone


def test_each_node_counts_the_plan_ranks_on_it():
    cpu = DeviceSpec(name="cpu", memory=2**30)
    gpus = [Gpu(i, "host", i // 2, i % 2, cpu, "default", "") for i in range(3)] + \
        [Gpu(3, "big", 0, 0, cpu, "default", "")]
    slow = host_slowdowns(gpus, {"host": 1, "big": 0})
    assert slow == {("host", 0): 2.0, ("host", 1): 1.0, ("big", 0): 1.0}
    # the cluster's cores, shared by all four ranks (one machine), slow every node; the node's rule if larger
    assert host_slowdowns(gpus, {"host": 1}, cluster_cores=2) == {("host", 0): 2.0, ("host", 1): 2.0,
                                                                  ("big", 0): 2.0}


def demo_with_cores(tmp_path, cores: int, plan: str = "dp", where: str = "    gpus = 2\n") -> str:
    """A demo plan over a copy of the demo job whose nodes (or cluster: `where`) say how many cores their
    ranks share."""
    job = (DEMO / "job.het").read_text()
    job = job.replace('use "../catalog.het"', f'use "{DEMO.parent / "catalog.het"}"')
    job = job.replace('path = "data/tiny.txt"', f'path = "{DEMO / "data" / "tiny.txt"}"')
    assert where in job
    job = job.replace(where, f"{where}{where[:len(where) - len(where.lstrip())]}cores = {cores}\n")
    (tmp_path / "job.het").write_text(job)
    (tmp_path / f"{plan}.het").write_text((DEMO / f"{plan}.het").read_text())
    return str(tmp_path / f"{plan}.het")


def _step(capsys, *argv: str) -> float:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)["step_time_s"]


def _forward(path) -> float:
    _, checked = load_checked(path)
    return CostModel(checked.spec, checked.pipeline, checked.topology).compute_time(0, 0, "F")


def test_cores_lengthen_explains_step_and_compile_agrees(tmp_path, capsys):
    own = _step(capsys, "explain", str(DEMO / "dp.het"), "--json")
    path = demo_with_cores(tmp_path, 1)              # two ranks per node on one core
    shared = _step(capsys, "explain", path, "--json")
    assert _forward(path) == pytest.approx(2 * _forward(DEMO / "dp.het"))
    assert shared > own          # the step's messages and collectives do not slow down
    out = tmp_path / "plan"
    assert main(["compile", path, "-o", str(out)]) == 0
    capsys.readouterr()
    assert json.loads((out / "summary.json").read_text())["step_time_s"] == pytest.approx(shared, rel=0.01)
    assert _step(capsys, "plan", path, "--json") == pytest.approx(shared, rel=0.01)
    assert _step(capsys, "explain", demo_with_cores(tmp_path, 2), "--json") == pytest.approx(own)


def test_the_clusters_cores_are_shared_by_all_the_plans_ranks(tmp_path):
    cluster = "  inter_latency = 500 us\n"
    assert _forward(demo_with_cores(tmp_path, 2, "dp", cluster)) == pytest.approx(2 * _forward(DEMO / "dp.het"))
    assert _forward(demo_with_cores(tmp_path, 2, "single", cluster)) == pytest.approx(_forward(DEMO / "single.het"))


def cpu_profile(**measured: object) -> dict:
    """A profile file's contents for the demo model's layers on `cpu`, with the `measured` fields added."""
    return {"format": FORMAT, "version": VERSION, "device": {"kind": "cpu"}, "dtype": "fp32",
            "model": {"hidden": 64, "block_params": 46208},
            "layers": [{"layer": name, "seq": 32, "micro_batch": b, "forward_s": 1e-3 * b, "backward_s": 2e-3 * b}
                       for name in ("embed", "block", "head") for b in (1, 2)], **measured}


def test_a_measured_slowdown_replaces_the_rule_for_as_many_ranks(tmp_path):
    measured = profile_from_dict(cpu_profile(concurrency={"ranks": 4, "cores": 2, "slowdown": 1.6}), "p.json")
    assert measured.shared == {"cpu": (4, 1.6)}
    assert measured.compute[0].fits[("block", 1, "F")](1) == pytest.approx(1e-3)   # the layers alone
    alone = profile_from_dict(cpu_profile(), "p.json")
    cluster = "  inter_latency = 500 us\n"

    def forward(plan: str, profiles) -> float:
        _, checked = load_checked(demo_with_cores(tmp_path, 2, plan, cluster))
        return CostModel(checked.spec, checked.pipeline, checked.topology, profiles).compute_time(0, 0, "F")

    assert forward("dp", measured) == pytest.approx(1.6 * forward("single", alone))   # 4 ranks: as measured
    assert forward("single", measured) == pytest.approx(forward("single", alone))  # 1 rank on 2 cores
    assert forward("dp", alone) == pytest.approx(2 * forward("single", alone))     # no measurement: the rule
