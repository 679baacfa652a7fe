"""`hetc launch --emit slurm|jobset|skypilot`: launch files for a mixed cluster (issue 33, item 2).

The files of a three-kind plan (tests/specs/three_kinds.het: H100, A100-80
and L4 node groups) parse and name every node group with its GPU count; the
SLURM script trains the demo through a stand-in `srun` that starts each
component's nodes as local processes.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hetc.cli import main as hetc_main
from hetc.launchfiles import slurm_minutes
from hetc.runtime.local import free_port
from tests.conftest import ROOT

THREE_KINDS = ROOT / "tests" / "specs" / "three_kinds.het"
MIXED_SPEC = ROOT / "tests" / "specs" / "mixed" / "auto.het"
# (group, device kind, nodes, GPUs per node), as three_kinds.het declares them
GROUPS = [("hopper", "H100", 2, 8), ("ampere", "A100-80", 1, 4), ("ada", "L4", 1, 2)]
ELASTIC_ARGS = ["--checkpoint", "/shared/ckpt", "--every", "50"]
STEPS = 2


@pytest.fixture(scope="module")
def three_kinds_plan(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("three_kinds") / "plan"
    assert hetc_main(["compile", str(THREE_KINDS), "-o", str(out)]) == 0
    return out


def _emit(target: Path, kind: str, capsys, *extra: str) -> str:
    assert hetc_main(["launch", str(target), "--emit", kind, *extra]) == 0
    return capsys.readouterr().out


def _slurm_components(script: str) -> list[list[str]]:
    """The #SBATCH options of each hetjob component, in order."""
    components: list[list[str]] = [[]]
    for line in script.splitlines():
        if line == "#SBATCH hetjob":
            components.append([])
        elif line.startswith("#SBATCH "):
            components[-1].append(line.removeprefix("#SBATCH "))
    return components


def test_slurm_script_has_a_hetjob_component_per_node_group(three_kinds_plan, capsys, tmp_path):
    script = _emit(three_kinds_plan, "slurm", capsys)
    (tmp_path / "job.sbatch").write_text(script)
    subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")], check=True)
    components = _slurm_components(script)
    assert len(components) == len(GROUPS)
    for i, ((group, kind, nodes, gpus), options) in enumerate(zip(GROUPS, components, strict=True)):
        assert {f"--nodes={nodes}", f"--gpus-per-node={gpus}", f"--constraint={kind}"} <= set(options), options
        assert f'srun --het-group={i} --nodes={nodes} ' in script
        assert f'--node "{group}[$SLURM_NODEID]"' in script
    assert 'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_0" | sed -n 1p)' in script


def test_jobset_has_a_replicated_job_per_node_group(three_kinds_plan, capsys):
    jobset = yaml.safe_load(_emit(three_kinds_plan, "jobset", capsys, "--image", "reg/hetc:1"))
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and jobset["kind"] == "JobSet"
    assert jobset["spec"]["network"]["enableDNSHostnames"] is True
    jobs = jobset["spec"]["replicatedJobs"]
    assert [j["name"] for j in jobs] == [g for g, *_ in GROUPS]
    for (group, kind, nodes, gpus), job in zip(GROUPS, jobs, strict=True):
        spec = job["template"]["spec"]
        assert (spec["completionMode"], spec["parallelism"], spec["completions"]) == ("Indexed", nodes, nodes)
        pod = spec["template"]["spec"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": kind}
        (container,) = pod["containers"]
        assert container["image"] == "reg/hetc:1"
        assert container["resources"]["limits"] == {"nvidia.com/gpu": gpus}
        assert {"name": "HETC_RDZV_ENDPOINT", "value": "hetc-hopper-0-0.hetc:29500"} in container["env"]
        assert container["command"][:2] == ["bash", "-c"]
        assert f'--node "{group}[$JOB_COMPLETION_INDEX]"' in container["command"][2]


def test_skypilot_has_a_task_per_node_group(three_kinds_plan, capsys, tmp_path):
    tasks = list(yaml.safe_load_all(_emit(three_kinds_plan, "skypilot", capsys)))
    assert [t["name"] for t in tasks] == [f"hetc-{g}" for g, *_ in GROUPS]
    for (group, kind, nodes, gpus), task in zip(GROUPS, tasks, strict=True):
        assert (task["num_nodes"], task["resources"]["accelerators"]) == (nodes, f"{kind}:{gpus}")
        assert f'--node "{group}[$SKYPILOT_NODE_RANK]"' in task["run"]
        (tmp_path / "run.sh").write_text(task["run"])
        subprocess.run(["bash", "-n", str(tmp_path / "run.sh")], check=True)


@pytest.mark.parametrize("kind", ["slurm", "jobset", "skypilot"])
def test_an_elastic_spec_carries_its_checkpoints_into_every_component(kind, capsys):
    text = _emit(MIXED_SPEC, kind, capsys, "--max-restarts", "5", "--run-args", *ELASTIC_ARGS)
    carried = "--rdzv-id hetc --max-restarts 5 --run-args " + " ".join(ELASTIC_ARGS)
    assert text.count(carried) == 2, text    # the spec's cluster has two node groups, big and small
    assert text.count(f"hetc launch {MIXED_SPEC}") == 2


@pytest.mark.parametrize("argv, message", [
    (["--node", "big[0]"], "--emit writes the file for every node: leave out --node"),
    ([], "add `--run-args --checkpoint DIR --every N`"),
])
def test_emit_usage_errors(argv, message, capsys):
    assert hetc_main(["launch", str(MIXED_SPEC), "--emit", "slurm", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("limit, minutes", [("90", 90), ("90:30", 90.5), ("4:00:00", 240), ("1-12", 2160),
                                            ("1-0:30", 1470), ("2-00:00:30", 2880.5)])
def test_slurm_time_limits_read_as_sbatch_reads_them(limit, minutes):
    assert slurm_minutes(limit) == minutes


def test_a_slurm_time_limit_stops_every_run_before_it(three_kinds_plan, capsys):
    """Note [A time limit]: each component gets the limit and each run `--exit-after` it less 5 % (at least
    5, at most 30 minutes), to stop, save and exit 0 before SLURM's SIGTERM and SIGKILL."""
    script = _emit(three_kinds_plan, "slurm", capsys, "--time", "4:00:00", "--run-args", "--checkpoint", "ck")
    assert all("--time=4:00:00" in options for options in _slurm_components(script))
    assert script.count("--run-args --checkpoint ck --exit-after 228") == len(GROUPS), script
    day = _emit(three_kinds_plan, "slurm", capsys, "--time", "1-0", "--run-args", "--checkpoint", "ck")
    assert day.count("--checkpoint ck --exit-after 1410") == len(GROUPS), day     # 30 minutes at most
    own = _emit(three_kinds_plan, "slurm", capsys, "--time", "60", "--run-args", "--checkpoint", "ck",
                "--exit-after", "50")
    assert own.count("--exit-after") == len(GROUPS)      # the user's own, not a second one


@pytest.mark.parametrize("argv, message", [
    (["--emit", "slurm", "--time", "4:00:00"], "--time stops the runs before the limit to save them"),
    (["--emit", "slurm", "--time", "4h", "--run-args", "--checkpoint", "ck"], "--time '4h': a launch file carries"),
    (["--emit", "slurm", "--time", "3", "--run-args", "--checkpoint", "ck"], "needs more than 5 minutes"),
    (["--emit", "jobset", "--time", "60", "--run-args", "--checkpoint", "ck"], "it goes with --emit slurm"),
    (["--node", "big[0]", "--time", "60"], "it goes with --emit slurm"),
])
def test_time_limit_usage_errors(three_kinds_plan, argv, message, capsys):
    assert hetc_main(["launch", str(three_kinds_plan), *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("kind, flag, value", [
    ("slurm", "--partition", "gpu\nrm -rf ~"), ("slurm", "--rdzv-id", "job\n#SBATCH --exclusive"),
    ("jobset", "--image", "reg/hetc:1\nbad: true"), ("jobset", "--rdzv-id", "a b"),
    ("skypilot", "--rdzv", "$(hostname):29500"), ("skypilot", "--rdzv-id", 'a"b'),
])
def test_a_value_a_launch_file_cannot_carry_as_it_is_is_refused(three_kinds_plan, capsys, kind, flag, value):
    """The values go into shell lines, #SBATCH lines and YAML as they are: a newline began a command."""
    assert hetc_main(["launch", str(three_kinds_plan), "--emit", kind, flag, value]) == 2
    assert f"{flag} {value!r}: a launch file carries " in capsys.readouterr().err


def test_names_become_kubernetes_names(three_kinds_plan, capsys):
    text = _emit(three_kinds_plan, "jobset", capsys, "--rdzv-id", "My.Run_1", "--image", "reg.io/team/hetc:1.2")
    doc = yaml.safe_load(text)
    assert doc["metadata"]["name"] == doc["spec"]["network"]["subdomain"] == "my-run-1"
    containers = doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"]
    assert containers[0]["image"] == "reg.io/team/hetc:1.2"


# ---------------------------------------------------------------- the SLURM script, run

# Each `srun --het-group=I --nodes=N ... CMD` starts N local "nodes" running CMD, with the variables
# SLURM gives a step's tasks; `scontrol show hostnames LIST` lists LIST's (comma-separated) hosts.
STAND_IN_SRUN = """#!/bin/bash
group=0; nodes=1
while [[ $1 == --* ]]; do
  case $1 in --het-group=*) group=${1#*=} ;; --nodes=*) nodes=${1#*=} ;; esac
  shift
done
pids=()
for ((i = 0; i < nodes; i++)); do
  SLURM_NODEID=$i SLURM_PROCID=$i SLURM_NNODES=$nodes SLURM_HET_GROUP=$group \\
    "$@" >"$SRUN_LOGS/group$group-node$i.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit "$status"
"""
STAND_IN_SCONTROL = """#!/bin/bash
[[ "$1 $2" == "show hostnames" ]] && tr , '\\n' <<<"$3"
"""


def _stand_ins(bin_dir: Path) -> None:
    bin_dir.mkdir()
    for name, text in (("srun", STAND_IN_SRUN), ("scontrol", STAND_IN_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_slurm_script_trains_the_demo_through_a_stand_in_srun(tmp_path):
    plan, metrics, logs = tmp_path / "plan", tmp_path / "m.jsonl", tmp_path / "logs"
    assert hetc_main(["compile", str(ROOT / "specs" / "demo" / "hetero.het"), "-o", str(plan)]) == 0
    assert hetc_main(["launch", str(plan), "--emit", "slurm", "-o", str(tmp_path / "job.sbatch"), "--run-args",
                      "--steps", str(STEPS), "--metrics", str(metrics), "--heartbeat-timeout", "120"]) == 0
    _stand_ins(tmp_path / "bin")
    logs.mkdir()
    venv_bin = Path(sys.executable).parent      # where `hetc` is installed
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{venv_bin}:{os.environ['PATH']}", SRUN_LOGS=str(logs),
               SLURM_JOB_NODELIST_HET_GROUP_0="127.0.0.1", SLURM_HET_SIZE="1", HETC_RDZV_PORT=str(free_port()),
               OMP_NUM_THREADS="1")
    proc = subprocess.Popen(["bash", str(tmp_path / "job.sbatch")], cwd=tmp_path, env=env, start_new_session=True)
    try:
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    node_logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(logs.iterdir()))
    assert code == 0, node_logs
    assert sorted(p.name for p in logs.iterdir()) == ["group0-node0.log", "group0-node1.log"]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), node_logs
