"""Signals under `hetc run --local`, and a taken rendezvous port (issue 28, findings 5 and 12).

The launcher passes SIGTERM and Ctrl-C on to its ranks (Note [signals under --local]); `hetc launch`
refuses a port torchrun would wait minutes on (Note [probing the rendezvous port]).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetc.cli import build_parser
from hetc.cli import main as hetc_main
from hetc.commands.run import run_options
from hetc.runtime.checkpoint import latest_checkpoint
from hetc.runtime.options import RUN_OPTIONS_ENV
from tests.conftest import DEMO, ROOT

STEPS = 120             # enough that the run is still going when SIGTERM comes after its second step
NOISE = ("Traceback", "frame #", "Segmentation", "bug in hetc", "exited with status")

# the demo job on two CPU ranks of one node: the smallest multi-rank plan
DP2 = f"""use "{DEMO / 'job.het'}"

parallel {{
  stage all {{
    layers = embed..head
    ranks = host[0]
    lanes = 2
  }}
  idle = [host[1]]
}}
"""


@pytest.fixture(scope="module")
def dp2_plan(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("signals")
    (folder / "dp2.het").write_text(DP2)
    assert hetc_main(["compile", str(folder / "dp2.het"), "-o", str(folder / "dp2")]) == 0
    return folder / "dp2"


def _launch(plan: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "hetc", "run", str(plan), "--local", "--quiet", *args],
                            cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _steps(metrics: Path) -> list[int]:
    if not metrics.is_file():
        return []
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip()]


def _shell_status(code: int) -> int:
    """What a shell reports: 128 + N for a process signal N ended."""
    return 128 - code if code < 0 else code


def _processes_naming(marker: str) -> list[int]:
    """Live processes whose command line holds `marker` (a rank left running by its launcher)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def _assert_quiet(err: str) -> None:
    assert not [word for word in NOISE if word in err], err


# ---------------------------------------------------------------- finding 5: SIGTERM and Ctrl-C


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_saves_the_step_in_flight_and_the_resume_runs_every_step_once(dp2_plan, tmp_path):
    ckpt, first, second = tmp_path / "ckpt", tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    launcher = _launch(dp2_plan, "--steps", str(STEPS), "--checkpoint", str(ckpt), "--metrics", str(first))
    try:
        deadline = time.monotonic() + 300
        while len(_steps(first)) < 2 and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 143, err
    _assert_quiet(err)
    done = _steps(first)
    assert done == list(range(1, len(done) + 1)) and len(done) < STEPS, done
    assert latest_checkpoint(ckpt) == ckpt / f"step-{len(done)}", err
    assert not _processes_naming(str(first))

    resumed = subprocess.run([sys.executable, "-m", "hetc", "run", str(dp2_plan), "--local", "--quiet", "--steps",
                              str(STEPS), "--checkpoint", str(ckpt), "--resume", "--metrics", str(second)],
                             cwd=ROOT, capture_output=True, text=True, timeout=400, check=False)
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(done + _steps(second)) == list(range(1, STEPS + 1))


@pytest.mark.timeout(600)
def test_a_time_limit_stops_every_rank_after_the_same_step_saves_it_and_exits_0(dp2_plan, tmp_path, capfd):
    """--exit-after (Megatron-LM's --exit-duration-in-mins): a limit passed before the first step ends makes
    every rank stop after step 2 (Note [Preemption]), save it whole and exit 0; a rerun goes on from there."""
    ckpt, first, second = tmp_path / "ckpt", tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    assert hetc_main(["run", str(dp2_plan), "--local", "-q", "--steps", str(STEPS), "--checkpoint", str(ckpt),
                      "--exit-after", "1e-6", "--metrics", str(first)]) == 0
    err = capfd.readouterr().err
    assert f"hetc run: --exit-after 1e-06 min: stopped after step 2; checkpoint {ckpt / 'step-2'} is complete" in err
    assert _steps(first) == [1, 2] and latest_checkpoint(ckpt) == ckpt / "step-2"
    assert hetc_main(["run", str(dp2_plan), "--local", "-q", "--steps", "4", "--checkpoint", str(ckpt),
                      "--resume-if-present", "--metrics", str(second)]) == 0
    assert _steps(second) == [3, 4]


def test_a_time_limit_needs_somewhere_to_save(dp2_plan, capsys):
    assert hetc_main(["run", str(dp2_plan), "--local", "--exit-after", "60"]) == 2
    assert "--exit-after needs --checkpoint DIR" in capsys.readouterr().err


# Python started, about to run `python -m hetc ...`: the first second counts from here. A Ctrl-C while the
# interpreter itself starts (its `site` import, some tens of ms) ends any Python program with CPython's
# "Fatal Python error: init_import_site" before a line of it runs.
AS_HETC = ("import os, runpy, sys; os.write(1, b'ready'); sys.argv[0] = 'hetc'; "
           "runpy.run_module('hetc', run_name='__main__', alter_sys=True)")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ctrl_c_in_the_first_second_exits_130_every_time(dp2_plan, tmp_path):
    metrics = tmp_path / "m.jsonl"      # names this test's ranks, to find any left running
    for tenth in range(1, 11):
        launcher = subprocess.Popen(
            [sys.executable, "-c", AS_HETC, "run", str(dp2_plan), "--local", "--quiet", "--steps", "100000",
             "--metrics", str(metrics)], cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert launcher.stdout is not None and launcher.stdout.read(5) == "ready"
            time.sleep(tenth / 10)
            launcher.send_signal(signal.SIGINT)
            _, err = launcher.communicate(timeout=120)
        finally:
            if launcher.poll() is None:
                launcher.kill()
        assert _shell_status(launcher.returncode) == 130, f"Ctrl-C after {tenth / 10:.1f} s: {err}"
        _assert_quiet(err)
        assert not _processes_naming(str(metrics)), f"Ctrl-C after {tenth / 10:.1f} s left ranks running"


def test_a_rank_of_local_runs_with_its_launchers_options(dp2_plan, monkeypatch):
    """Issue 30: the ranks took a rebuilt command line, which left --heartbeat-timeout out; now they take
    the launcher's RunOptions from their environment (runtime/options.py), whatever their own argv says."""
    from hetc import rank

    launcher = run_options(build_parser().parse_args(
        ["run", str(dp2_plan), "--local", "2", "--steps", "5", "-q", "--every", "3", "--checkpoint", "ck",
         "--resume", "--heartbeat-timeout", "20", "--stop-timeout", "7"]))
    seen: list = []
    monkeypatch.setattr(rank, "run_worker", lambda plan_dir, opts: seen.append(opts) or 0)
    monkeypatch.setenv(RUN_OPTIONS_ENV, launcher.to_json())
    assert hetc_main(["run", str(dp2_plan)]) == 0
    assert seen == [launcher] and seen[0].heartbeat_timeout_s == 20 and seen[0].grace_s == 7


# ---------------------------------------------------------------- finding 12: a taken rendezvous port


@pytest.mark.parametrize("listens", [False, True], ids=["bound", "listening"])
def test_launch_on_a_taken_port_is_an_error_at_once(dp2_plan, listens):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        if listens:
            taken.listen()      # accepts connections and never answers, as a stranger's server would
        port = taken.getsockname()[1]
        launch = subprocess.run([sys.executable, "-m", "hetc", "launch", str(dp2_plan), "--node", "host[0]",
                                 "--rdzv", f"127.0.0.1:{port}"], cwd=ROOT, capture_output=True, text=True,
                                timeout=60, check=False)
    assert launch.returncode == 2, launch.stderr
    assert f"--rdzv 127.0.0.1:{port}: port {port} is in use on this machine" in launch.stderr
    assert "choose a free port, the same for every node, e.g. --rdzv 127.0.0.1:" in launch.stderr


def test_a_port_held_by_a_rendezvous_store_is_joined_not_refused():
    """A second `hetc launch` on the host of the first one's store: torch's TCPStore answers the probe."""
    import torch.distributed as dist

    from hetc.runtime.rdzv_port import rendezvous_port_problem

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert rendezvous_port_problem("127.0.0.1", store.port) is None
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    assert rendezvous_port_problem("127.0.0.1", port) is None
    assert rendezvous_port_problem("192.0.2.1", port) is None    # another machine's port: not probed


def test_a_ctrl_c_an_import_swallowed_still_stops_the_launcher_before_any_rank(monkeypatch):
    """Note [a Ctrl-C an import swallows]: the KeyboardInterrupt may die in importlib's callbacks; the launcher
    still knows, and starts no rank (the one time in ten CI's run caught it trained on for 120 s)."""
    from hetc.ir import interrupt
    from hetc.runtime import local

    monkeypatch.setattr(interrupt, "_seen", False)
    previous = signal.getsignal(signal.SIGINT)
    try:
        interrupt.watch()
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)          # the handler runs here, between bytecodes
        except KeyboardInterrupt:
            pass                   # what importlib's callback does with it: nothing
    finally:
        signal.signal(signal.SIGINT, previous)
    assert interrupt.seen()
    monkeypatch.setattr(local, "_start_rank", lambda *a: pytest.fail("a rank was started after Ctrl-C"))
    assert local.spawn_local(2, ["run", "nowhere"]) == 128 + signal.SIGINT


_LAUNCHER = """
import os, subprocess, sys
from hetc.runtime import local
rank = local._start_rank([sys.executable, "-c", "import time; from hetc.runtime.local import take_signals_as_rank; "
                          "take_signals_as_rank(); print('ready', flush=True); time.sleep(600)"],
                         dict(os.environ, **{local.LAUNCHER_ENV: str(os.getpid())}))
print(rank.pid, flush=True)
sys.stdin.readline()       # the test kills this process here
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_rank_ends_when_its_launcher_is_killed_outright(tmp_path):
    """Note [ranks end with their launcher]: kill -9 of the launcher reaches no rank's process group, and a
    rank still waiting at the rendezvous waited out --init-timeout as an orphan; now Linux ends it."""
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, cwd=ROOT)
    assert launcher.stdout is not None
    lines = sorted(launcher.stdout.readline().strip() for _ in range(2))   # its pid, and the rank's "ready"
    assert lines[1] == "ready" and lines[0].isdigit()       # the rank has asked to end with its parent
    rank = int(lines[0])
    launcher.kill()
    launcher.wait()
    for _ in range(600):            # a liveness bound, not a timing: the rank sleeps 600 s if nothing ends it
        if not Path(f"/proc/{rank}").exists() or " Z " in Path(f"/proc/{rank}/stat").read_text():
            break
        time.sleep(0.1)
    else:
        os.kill(rank, signal.SIGKILL)
        pytest.fail("the rank outlived its launcher")
