"""Ranks sharing a node's CPU cores (`node { cores = N }`, Note [shared cores] in passes/cost/cores.py)."""

from __future__ import annotations

import json

import pytest

from hetc.cli import main
from hetc.compiler import load_checked
from hetc.frontend.load import load_spec
from hetc.passes.plan.planner import plan_spec
from hetc.passes.cost import CostModel
from hetc.passes.cost.cores import Computing, busy_share, core_slowdown, rank_slowdowns
from hetc.passes.cost.sources.hetc_profile import FORMAT, VERSION, profile_from_dict
from hetc.ir.spec import ScheduleKind
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
    ranks = [Computing(("host", i // 2), "cpu", 0, 1.0) for i in range(3)] + [Computing(("big", 0), "cpu", 0, 1.0)]
    assert rank_slowdowns(ranks, {"host": 1, "big": 0}) == [2.0, 2.0, 1.0, 1.0]
    # the cluster's cores, shared by all four ranks (one machine), slow every node; the node's rule if larger
    assert rank_slowdowns(ranks, {"host": 1}, cluster_cores=2) == [2.0] * 4


def test_a_pipeline_stage_computes_for_its_share_of_the_step():
    """Note [ranks computing at once]: the fill and drain, P − 1 slots of the M + P − 1, are not computed."""
    assert busy_share(ScheduleKind.GPIPE, 1, 4, 4) == 1.0                     # data parallel: always
    assert busy_share(ScheduleKind.GPIPE, 4, 4, 4) == pytest.approx(4 / 7)
    assert busy_share(ScheduleKind.ONE_F_ONE_B, 3, 1, 4) == pytest.approx(1 / 6)   # a lane of few microbatches
    assert busy_share(ScheduleKind.INTERLEAVED, 2, 2, 2, chunks=2) == pytest.approx(4 / 5)
    assert busy_share(ScheduleKind.ZB, 4, 4, 4) > busy_share(ScheduleKind.ONE_F_ONE_B, 4, 4, 4)


def test_a_rank_is_slowed_by_the_ranks_computing_beside_it_not_by_all():
    """Four one-rank stages on two cores compute beside 1 + 3 · 4/7 ranks; four data-parallel ranks beside 4."""
    def ranks(stages: int) -> list[Computing]:
        busy = busy_share(ScheduleKind.GPIPE, stages, 4, 4)
        return [Computing(("host", 0), "cpu", i if stages > 1 else 0, busy) for i in range(4)]

    assert rank_slowdowns(ranks(1), {}, cluster_cores=2) == [2.0] * 4
    assert rank_slowdowns(ranks(4), {}, cluster_cores=2) == pytest.approx([(1 + 3 * 4 / 7) / 2] * 4)
    # a measured slowdown of 4 ranks at once gives the pool its effective cores, 4 / 2.5
    assert rank_slowdowns(ranks(1), {}, 2, {"cpu": (4, 2.5)}) == pytest.approx([2.5] * 4)
    assert rank_slowdowns(ranks(4), {}, 2, {"cpu": (4, 2.5)}) == pytest.approx([(1 + 3 * 4 / 7) / 1.6] * 4)
    # a stage's lane-mates compute together; one with fewer microbatches for its share of them
    mates = [Computing(("host", 0), "cpu", 0, 0.5), Computing(("host", 0), "cpu", 0, 0.25)]
    assert rank_slowdowns(mates, {}, cluster_cores=1) == pytest.approx([1.5, 2.0])


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
    return CostModel(checked.explicit()).compute_time(0, 0, "F")


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
        return CostModel(checked.explicit(), profiles).compute_time(0, 0, "F")

    assert forward("dp", measured) == pytest.approx(1.6 * forward("single", alone))   # 4 ranks: as measured
    assert forward("single", measured) == pytest.approx(forward("single", alone))  # 1 rank on 2 cores
    assert forward("dp", alone) == pytest.approx(2 * forward("single", alone))     # no measurement: the rule


def test_a_pipelines_compute_ops_are_charged_fewer_ranks_at_once_than_data_parallels(tmp_path):
    """Note [ranks computing at once]: GPipe's one-rank stages compute beside 1 + 3 · 4/7 ranks of the four on
    the cluster's two cores, data parallelism's beside all four; the simulator charges each op that too."""
    cluster = "  inter_latency = 500 us\n"
    _, dp = load_checked(demo_with_cores(tmp_path, 2, "dp", cluster))
    _, gpipe = load_checked(demo_with_cores(tmp_path, 2, "gpipe", cluster))
    dp_costs = CostModel(dp.explicit())
    costs = CostModel(gpipe.explicit())
    assert dp_costs.slowdown(0) == pytest.approx(2.0)
    assert [costs.slowdown(r) for r in range(4)] == pytest.approx([(1 + 3 * 4 / 7) / 2] * 4)
    out = tmp_path / "gpipe"
    assert main(["compile", str(tmp_path / "gpipe.het"), "-o", str(out)]) == 0
    events = json.loads((out / "timeline.json").read_text())["events"]
    forward = next(e for e in events if e[0] == 0 and e[2] == "fwd ms=0 mb=0")
    assert forward[6] - forward[5] == pytest.approx(costs.compute_time(0, 0, "F"))


def test_the_planners_score_reads_the_ranks_at_once_as_the_estimate_does(tmp_path):
    """Heterogeneous lanes (3 and 1 microbatches) on shared cores: the planner's class-by-class score and the
    cost model's estimate of the plan it chose part by nothing (candidate_stage.py `_slowdowns`)."""
    demo_with_cores(tmp_path, 2, "dp", "  inter_latency = 500 us\n")
    (tmp_path / "auto.het").write_text('use "job.het"\n\nparallel {\n  schedule = 1f1b\n'
                                       "  stage first {\n    ranks = host[0, 0]\n    layers = auto\n  }\n"
                                       "  stage middle {\n    ranks = [host[0, 1], host[1, 0]]\n    layers = auto\n"
                                       "    lanes = 2\n    microbatches = [3, 1]\n  }\n"
                                       "  stage last {\n    ranks = host[1, 1]\n    layers = auto\n  }\n}\n")
    result = plan_spec(load_spec(tmp_path / "auto.het").spec)
    assert result.score is not None and result.estimate is not None
    assert result.estimate.closed_form_step_s == pytest.approx(result.score.step_time_s, rel=1e-6)
