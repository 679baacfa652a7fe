"""torchrun agents as loopback "nodes" for the multi-node tests (tests/test_elastic.py, benchmarks/elastic.py).

Each agent is `python -m torch.distributed.run` in a session of its own, so
that a test can take a whole node away (agent and workers) with one killpg.
Only 127.0.0.1 addresses; the c10d rendezvous is hosted by the agent that
binds the port first, so callers start the agent that must survive first
and wait for its port (killing the host agent ends the job: a known
torchrun limitation).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Agent", "metrics_records", "start_agent", "start_launched", "wait_for", "wait_listening"]

ROOT = Path(__file__).resolve().parent.parent
# Short rendezvous timeouts: a survivor's next round closes 2 s after the
# last join instead of 30, and a dead node is dropped after 3 missed beats of 1 s.
RDZV_CONF = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=120"
# a rendezvous that waits 10 s for further nodes once the fewest it accepts are in: a node whose agent starts
# seconds after the first, as a loaded machine starts it, joins the first plan instead of a restart
PATIENT_RDZV_CONF = RDZV_CONF.replace("last_call_timeout=2", "last_call_timeout=10")
# a node joining a running job: it judges the job's agents by their heartbeats, and on a loaded machine one
# once came more than 3 s late, so the joiner took the job's node for dead, formed a round of its own and
# found the checkpoint directory locked by the job it was meant to join (a CI run of test_elastic)
JOINER_RDZV_CONF = PATIENT_RDZV_CONF.replace("keep_alive_max_attempt=3", "keep_alive_max_attempt=30")


@dataclass
class Agent:
    name: str
    proc: subprocess.Popen
    log: Path
    started: float = field(default_factory=time.time)

    def kill_node(self) -> float:
        """SIGKILL the agent and its workers (a lost node); the wall time of the kill.

        torchrun starts each worker in a session of its own, so they are killed one by one."""
        now = time.time()
        workers = self.workers()
        os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(30)
        return now

    def workers(self) -> list[int]:
        """Pids of this agent's worker processes."""
        out = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == self.proc.pid:
                    out.append(int(stat.parent.name))
            except (OSError, ValueError, IndexError):
                continue
        return out

    def text(self) -> str:
        return self.log.read_text() if self.log.is_file() else ""


def start_agent(name: str, nproc: int, port: int, args: list[str], out: Path, nnodes: str = "2",
                max_restarts: int = 0, env: dict | None = None, entry: tuple[str, ...] = ("-m", "hetc"),
                rdzv_conf: str = RDZV_CONF) -> Agent:
    """torchrun of `entry` (default `-m hetc`) with `args`, as node `name` of `nproc` processes."""
    log = out / f"{name}.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", str(nproc),
           "--max-restarts", str(max_restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-conf", rdzv_conf, "--local-addr", "127.0.0.1", "--monitor-interval", "0.5",
           *entry, *args]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **(env or {}))
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return Agent(name, proc, log)


def start_launched(name: str, node: str, port: int, target: Path, run_args: list[str], out: Path) -> Agent:
    """`hetc launch TARGET --node NODE` as a node (torchrun with the node's own process count)."""
    log = out / f"{name}.log"
    cmd = [sys.executable, "-m", "hetc", "launch", str(target), "--node", node, "--rdzv", f"127.0.0.1:{port}",
           "--local-addr", "127.0.0.1", "--run-args", *run_args]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return Agent(name, proc, log)


def wait_listening(port: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout_s:.0f} s")


def wait_for(condition, what: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise TimeoutError(f"{what} did not happen within {timeout_s:.0f} s")


def metrics_records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
