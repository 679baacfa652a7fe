"""`hetc run DIR --local`: start the plan's ranks as processes on this machine.

Each rank is `python -m hetc run DIR ...` with the environment torchrun would
give it (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), one thread
each unless OMP_NUM_THREADS says otherwise. If a rank fails, the others are
given time to notice (they name the dead rank themselves) and are then
stopped; the launcher reports every rank that fails and exits with the first
failure's status.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["LAUNCHER_ENV", "NODE_ENV", "free_port", "process_start_time", "spawn_local"]

GRACE_S = 45.0
LAUNCHER_ENV = "HETC_LOCAL_LAUNCHER"   # set in the ranks `--local` starts: the launcher speaks for them
NODE_ENV = "HETC_NODE"   # the plan node a process was launched for (`hetc launch --node`, `hetc run --local`)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_start_time() -> float | None:
    """When this process started (wall clock; from /proc and the boot-time clock on Linux, else None)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - (since_boot - ticks / os.sysconf("SC_CLK_TCK"))


def spawn_local(world: int, argv: list[str], places: list[tuple[str, int]] | None = None) -> int:
    """Run `hetc <argv>` as `world` local ranks; return the exit status.

    `places[r]` (plan node label, local GPU index) says which GPU of the
    plan rank r is, so that placement by discovery (runtime/placement.py)
    finds the launch order the plan's.

    Like torchrun's agent, this process hosts the rendezvous store, so the
    store (and the heartbeats that name a dead rank) outlive any one rank.
    """
    reserved = _reserve_port()
    port = reserved.getsockname()[1]
    procs = []
    for rank in range(world):
        label, local = places[rank] if places is not None else ("", rank)
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   TORCHELASTIC_USE_AGENT_STORE="True", **{NODE_ENV: label, LAUNCHER_ENV: "1"})
        env.setdefault("OMP_NUM_THREADS", "1")
        procs.append(subprocess.Popen([sys.executable, "-m", "hetc", *argv], env=env))
    try:
        _store = _host_store(reserved, world)   # alive while the ranks run
        return _supervise(procs)
    except KeyboardInterrupt:
        _stop(procs)
        return 130
    finally:
        reserved.close()


# Note [store after spawn]: `import torch` takes seconds, in the launcher as in every rank. The ranks are
# started first and the launcher imports torch while they do; meanwhile the store's port is bound but not
# listening, so no other process takes it and a rank that is quicker to connect is refused and retries
# (TCPStore's clients retry until their timeout), never served by anything but the store.
def _reserve_port() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


def _host_store(reserved: socket.socket, world: int) -> object:
    """The rendezvous store on `reserved`'s port (Note [store after spawn]); kept alive by the caller."""
    import torch.distributed as dist

    port = reserved.getsockname()[1]
    reserved.close()
    return dist.TCPStore("127.0.0.1", port, world_size=world, is_master=True, wait_for_workers=False)


def _supervise(procs: list[subprocess.Popen[bytes]]) -> int:
    """Wait for all ranks; report each failed one; stop the rest GRACE_S after the first failure."""
    failed_at, status, reported = None, 0, set()
    while True:
        codes = [p.poll() for p in procs]
        for rank, code in enumerate(codes):
            if code not in (None, 0) and rank not in reported:
                reported.add(rank)
                print(f"hetc run: rank {rank} exited with status {_describe(code)}", file=sys.stderr, flush=True)
                if failed_at is None:
                    status, failed_at = (code if code > 0 else 128 - code), time.monotonic()
        if all(c is not None for c in codes):
            break
        if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
            print(f"hetc run: stopping the ranks still running {GRACE_S:.0f} s after the first failure",
                  file=sys.stderr, flush=True)
            _stop(procs)
            break
        time.sleep(0.2)
    exit_codes = [p.wait() for p in procs]
    if status == 0:
        status = next((c if c > 0 else 128 - c for c in exit_codes if c != 0), 0)
    return status


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"{-code} (killed by {signal.Signals(-code).name})"
        except ValueError:
            return str(code)
    return str(code)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
