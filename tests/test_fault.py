"""Failures at launch and mid-run: clear messages and exits, never a hang.

The kill test starts a 4-rank plan with `hetc run --local`, SIGKILLs one
rank in the middle of training, and checks that every other rank exits
non-zero by itself (not stopped by the launcher), naming the dead rank. The
test's only deadline is a guard against a hang (how fast the others stop is
printed, not asserted: a busy machine is slower, not wrong).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetc.cli import main as hetc_main
from tests.conftest import ROOT

VICTIM = 2
HANG_GUARD_S = 300.0


def _children(pid: int) -> dict[int, int]:
    """{RANK: pid} of the processes `pid` started (read from /proc)."""
    ranks = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) != pid:
                continue
            env = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue     # the process ended while we looked
        rank = next((e[5:] for e in env if e.startswith(b"RANK=")), None)
        if rank is not None:
            ranks[int(rank)] = int(stat.parent.name)
    return ranks


def _wait_for_steps(metrics: Path, launcher: subprocess.Popen, count: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert launcher.poll() is None, "hetc run ended before the kill"
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= count:
            return
        time.sleep(0.2)
    pytest.fail(f"no {count} steps within {timeout_s:.0f} s")


@pytest.mark.slow
def test_killing_a_rank_mid_step_stops_all_others_naming_it(demo_plan_dirs, tmp_path):
    metrics, log = tmp_path / "m.jsonl", tmp_path / "stderr.txt"
    with open(log, "w") as err:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "hetc", "run", str(demo_plan_dirs["dp"]), "--local", "--steps", "1000000",
             "--metrics", str(metrics)], cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
            stdout=subprocess.DEVNULL, stderr=err)
        try:
            _wait_for_steps(metrics, launcher, 3)
            ranks = _children(launcher.pid)
            assert sorted(ranks) == [0, 1, 2, 3], ranks
            os.kill(ranks[VICTIM], signal.SIGKILL)   # the ranks spend their time inside steps
            killed_at = time.monotonic()
            status = launcher.wait(timeout=HANG_GUARD_S)
            elapsed = time.monotonic() - killed_at
        finally:
            if launcher.poll() is None:
                launcher.kill()
    text = log.read_text()
    print(f"the other ranks exited {elapsed:.1f} s after the kill")   # shown with -rP
    assert status != 0
    exits = {int(r): s for r, s in re.findall(r"rank (\d+) exited with status (.+)", text)}
    assert exits.get(VICTIM, "").endswith("(killed by SIGKILL)"), text
    for rank in (0, 1, 3):
        assert rank in exits and "killed by" not in exits[rank], f"rank {rank} did not exit by itself:\n{text}"
        named = (f"rank {VICTIM} stopped responding (noticed by rank {rank}" in text
                 or f"[rank {rank}] error: rank {VICTIM} stopped responding" in text)
        assert named, f"rank {rank} did not name rank {VICTIM}:\n{text}"
    assert "stopping the ranks still running" not in text


def test_missing_torchrun_environment_is_a_usage_error(demo_plan_dirs, monkeypatch, capsys):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert hetc_main(["run", str(demo_plan_dirs["dp"])]) == 2
    err = capsys.readouterr().err
    assert "not launched by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT unset)" in err
    assert "Traceback" not in err


def test_wrong_world_size_is_a_usage_error(demo_plan_dirs, monkeypatch, capsys):
    env = {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert hetc_main(["run", str(demo_plan_dirs["dp"])]) == 2
    assert "the plan has 4 ranks but WORLD_SIZE is 3" in capsys.readouterr().err


@pytest.mark.parametrize("name, value, says", [
    ("WORLD_SIZE", "abc", "WORLD_SIZE='abc' is not a positive integer, as torchrun sets it"),
    ("WORLD_SIZE", "0", "WORLD_SIZE='0' is not a positive integer"),
    ("RANK", "-1", "RANK='-1' is not a non-negative integer"),
    ("RANK", "4", "RANK=4 is not below WORLD_SIZE=4"),
    ("LOCAL_RANK", "x", "LOCAL_RANK='x' is not a non-negative integer"),
    ("MASTER_PORT", "x", "MASTER_PORT='x' is not a positive integer"),
])
def test_a_torchrun_variable_that_is_not_a_rank_is_a_usage_error(demo_plan_dirs, monkeypatch, capsys, name, value,
                                                                 says):
    """They were read with int(): WORLD_SIZE=abc was an internal error."""
    env = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    for key, text in {**env, name: value}.items():
        monkeypatch.setenv(key, text)
    assert hetc_main(["run", str(demo_plan_dirs["dp"])]) == 2
    assert says in capsys.readouterr().err


def test_a_store_nobody_serves_is_named_not_an_internal_error(monkeypatch):
    """A rank that finds no rendezvous store in --init-timeout: torch's DistNetworkError was an internal error."""
    from hetc.runtime.local import free_port
    from hetc.runtime.worker import EnvError, Launch, rendezvous_store

    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")     # the agent's store: this rank hosts none
    with pytest.raises(EnvError, match=f"launch rank 1 could not reach the rendezvous store at 127.0.0.1:{port} "
                                       "within 0.3 s"):
        rendezvous_store(Launch(1, 2, 1, "host/0", ""), 0.3)


def test_a_bad_emulation_setting_stops_local_before_any_rank(demo_plan_dirs, monkeypatch, capsys):
    monkeypatch.setenv("HETC_EMULATE_NCCL", "maybe")
    assert hetc_main(["run", str(demo_plan_dirs["dp"]), "--local"]) == 2
    err = capsys.readouterr().err
    assert "HETC_EMULATE_NCCL='maybe': set it to 1" in err and "starting" not in err


def test_local_with_the_wrong_rank_count_is_a_usage_error(demo_plan_dirs, capsys):
    assert hetc_main(["run", str(demo_plan_dirs["dp"]), "--local", "3"]) == 2
    assert "the plan has 4 ranks; --local 3 cannot run it" in capsys.readouterr().err
