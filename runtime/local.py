"""`hetc run DIR --local`: start the plan's ranks as processes on this machine.

Each rank is `python -m hetc run DIR ...` with the environment torchrun would
give it (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), one thread
each unless OMP_NUM_THREADS says otherwise. If a rank fails, the others are
given time to notice (they name the dead rank themselves) and are then
stopped; the launcher reports every rank that fails and exits with the first
status a rank stopped with on its own, else the first death by a signal
(`_answer`). SIGTERM and Ctrl-C are the launcher's to handle: it passes
them on to the ranks (Note [signals under --local]).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from hetc.ir import interrupt

__all__ = ["LAUNCHER_ENV", "NODE_ENV", "free_port", "process_start_time", "spawn_local", "spawned_store",
           "take_signals_as_rank"]

GRACE_S = 45.0
STOP_MARGIN_S = 30.0       # after SIGTERM: a rank's --stop-timeout starts once it handles SIGTERM; this covers its start
INTERRUPT_GRACE_S = 5.0    # after Ctrl-C: a rank still starting up holds SIGINT until hetc.cli runs
LAUNCHER_ENV = "HETC_LOCAL_LAUNCHER"   # the launcher's pid, in the ranks `--local` starts: it speaks for them
NODE_ENV = "HETC_NODE"   # the plan node a process was launched for (`hetc launch --node`, `hetc run --local`)
HELD_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})   # until a rank can take them
STOP_NOW = frozenset({signal.SIGINT, signal.SIGHUP})         # Ctrl-C, the terminal closed: no save

# Note [signals under --local]
# The launcher stands where torchrun's agent stands: it hosts the rendezvous store, and SIGTERM and Ctrl-C
# are its to handle. The ranks run in a process group of their own, so that a Ctrl-C at the terminal
# reaches the launcher alone, which passes each signal on to every rank, once:
# - SIGTERM: every rank stops after the same step, saves it and exits 143 (Note [Preemption]); the store
#   they agree through stays up until the last one exits (the launcher's death took it down, and the ranks
#   printed c10d's C++ frames and blamed rank 0). The launcher waits --stop-timeout plus STOP_MARGIN_S,
#   kills what still runs, and exits 143.
# - SIGINT (and SIGHUP, the terminal closed): a rank ends at once, by the signal's default action: no
#   rank is left blocked in a collective with a peer that has gone, so none reports a failure that is not
#   one. The launcher exits 130 and names the latest complete checkpoint (saves are atomic: Note [Atomic
#   saves]); a second Ctrl-C kills what still runs.
# A rank starts with both signals blocked (the mask survives exec), so one that comes while it still
# imports is held, neither lost nor half-handled: it takes SIGINT when hetc.cli starts
# (`take_signals_as_rank`) and SIGTERM once Preemption's handler is in place. The launcher's own handlers
# only record and forward: a KeyboardInterrupt raised inside `import torch` (the store's) left torch half
# initialised, and the next import of it (the Ctrl-C message's) crashed the interpreter with SIGSEGV.


def free_port() -> int:
    with _reserve_port() as s:
        return s.getsockname()[1]


@contextmanager
def spawned_store(world: int) -> Iterator[dict[str, str]]:
    """A rendezvous store for `world` processes this one spawns, hosted here on a port the system gives it,
    and the environment they rendezvous with (env://, the store as torchrun's agent hosts it). A port picked
    free and bound again by rank 0 can be taken in between: `hetc profile` once failed with EADDRINUSE."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world_size=world, is_master=True, wait_for_workers=False)
    yield {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}


def process_start_time() -> float | None:
    """When this process started (wall clock; from /proc and the boot-time clock on Linux, else None)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - (since_boot - ticks / os.sysconf("SC_CLK_TCK"))


def take_signals_as_rank() -> None:
    """In a rank `--local` started: end with the launcher (Note [ranks end with their launcher]); end at once
    on SIGINT, and take it from now on (Note [signals under --local]); SIGTERM stays held until Preemption
    handles it. Elsewhere: nothing."""
    if LAUNCHER_ENV in os.environ:
        _end_with_launcher(os.environ[LAUNCHER_ENV])
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


# Note [ranks end with their launcher]
# The ranks run in process groups of their own (Note [signals under --local]), so a launcher killed outright
# (kill -9, the OOM killer) reaches none of them. They used to find out through the store it hosted: in a
# step, within seconds, every rank printing c10d's C++ frames and blaming rank 0; still waiting to meet
# there, only when --init-timeout ran out (ten minutes, an orphan holding its GPU). So each rank asks Linux
# to kill it when its parent dies (prctl PR_SET_PDEATHSIG), and ends at once if the launcher is already
# gone (its parent no longer the pid LAUNCHER_ENV names). SIGKILL: the launcher forwards what should save.
_PR_SET_PDEATHSIG = 1


def _end_with_launcher(launcher: str) -> None:
    if not sys.platform.startswith("linux") or not launcher.isdigit():
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != int(launcher):     # it died before the prctl: nothing would kill this rank
        os.kill(os.getpid(), signal.SIGKILL)


def spawn_local(world: int, argv: list[str], places: list[tuple[str, int]] | None = None,
                stop_timeout_s: float = 30.0, env: dict[str, str] | None = None) -> int:
    """Run `hetc <argv>` as `world` local ranks; return the exit status.

    `places[r]` (plan node label, local GPU index) says which GPU of the
    plan rank r is, so that placement by discovery (runtime/placement.py)
    finds the launch order the plan's. `stop_timeout_s` is the ranks'
    --stop-timeout: how long they may take to save after SIGTERM; `env`
    goes into every rank's environment (their options: runtime/options.py).

    Like torchrun's agent, this process hosts the rendezvous store, so the
    store (and the heartbeats that name a dead rank) outlive any one rank.
    """
    with _forwarding_signals() as signals:
        if interrupt.seen():     # a Ctrl-C an import swallowed: start nothing (Note [a Ctrl-C an import swallows])
            return 128 + signal.SIGINT
        reserved = _reserve_port()
        port = reserved.getsockname()[1]
        try:
            for rank in range(world):
                label, local = places[rank] if places is not None else ("", rank)
                rank_env = dict(os.environ, **(env or {}), RANK=str(rank), WORLD_SIZE=str(world),
                                LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                                MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
                                **{NODE_ENV: label, LAUNCHER_ENV: str(os.getpid())})
                rank_env.setdefault("OMP_NUM_THREADS", "1")
                signals.ranks.append(_start_rank([sys.executable, "-m", "hetc", *argv], rank_env))
            _store = _host_store(reserved, world) if signals.signum not in STOP_NOW else None   # kept alive
            return _supervise(signals, stop_timeout_s)
        finally:
            reserved.close()


def _start_rank(cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A rank in its own process group, with SIGINT and SIGTERM held (Note [signals under --local])."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)
    try:
        return subprocess.Popen(cmd, env=env, process_group=0)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


class _Signals:
    """The signal the launcher was sent, passed on to every rank (Note [signals under --local])."""

    def __init__(self) -> None:
        self.ranks: list[subprocess.Popen[bytes]] = []
        self.signum: int | None = None
        self.since = 0.0
        self._told: set[int] = set()       # ranks already sent `signum`

    def receive(self, signum: int, frame: FrameType | None) -> None:
        if self.signum in STOP_NOW:
            if signum in STOP_NOW:      # a second Ctrl-C: no more waiting
                _kill(self.ranks)
            return
        if signum == self.signum:
            return
        self.signum, self.since = signum, time.monotonic()   # SIGTERM, or Ctrl-C during SIGTERM's save
        self._told.clear()
        self.forward()

    def forward(self) -> None:
        """Send the signal to every rank not yet sent it (one may have started after it came)."""
        if self.signum is None:
            return
        for idx, proc in enumerate(self.ranks):
            if idx not in self._told and proc.poll() is None:
                proc.send_signal(self.signum)
            self._told.add(idx)

    def explains(self, code: int) -> bool:
        """Whether a rank's exit status is its answer to the signal rather than a failure."""
        if self.signum is None:
            return False
        answers = {128 + signal.SIGTERM, -signal.SIGTERM}      # Note [Preemption]: also before a Ctrl-C
        if self.signum in STOP_NOW:
            answers |= {128 + self.signum, -self.signum, -signal.SIGKILL}
        return code in answers

    def overdue(self, stop_timeout_s: float) -> bool:
        if self.signum is None:
            return False
        wait_s = INTERRUPT_GRACE_S if self.signum in STOP_NOW else stop_timeout_s + STOP_MARGIN_S
        return time.monotonic() - self.since > wait_s


@contextmanager
def _forwarding_signals() -> Iterator[_Signals]:
    signals = _Signals()
    previous = {signum: signal.signal(signum, signals.receive) for signum in HELD_SIGNALS | STOP_NOW}
    try:
        yield signals
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


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


def _supervise(signals: _Signals, stop_timeout_s: float) -> int:
    """Wait for all ranks; report each failed one; stop the rest GRACE_S after the first failure, or
    once the ranks had their time to answer a signal."""
    procs = signals.ranks
    failed_at: float | None = None     # when the first failure was seen
    reported: set[int] = set()
    statuses: list[int] = []           # every failure's exit code, in the order seen
    while True:
        signals.forward()
        codes = [p.poll() for p in procs]
        for rank, code in enumerate(codes):
            if code in (None, 0) or rank in reported or signals.explains(code):
                continue
            reported.add(rank)
            print(f"hetc run: rank {rank} exited with status {_describe(code)}", file=sys.stderr, flush=True)
            failed_at = failed_at or time.monotonic()
            statuses.append(code)
        if all(c is not None for c in codes):
            break
        if signals.overdue(stop_timeout_s):
            _report_overdue(signals, codes, stop_timeout_s)
            _kill(procs)
            break
        if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
            print(f"hetc run: stopping the ranks still running {GRACE_S:.0f} s after the first failure",
                  file=sys.stderr, flush=True)
            _stop(procs)
            break
        time.sleep(0.2)
    exit_codes = [p.wait() for p in procs]
    if statuses:
        return _answer(statuses)
    if signals.signum is not None and any(code != 0 for code in exit_codes):
        return 128 + signals.signum
    return next((_status(code) for code in exit_codes if code != 0), 0)


def _answer(statuses: list[int]) -> int:
    """The launcher's status from its failed ranks' (in the order seen): the first a rank stopped with on its
    own (2: bad input, 3: diverged, 1: an error it reported), else the first death by a signal. A rank that
    stops on its own can take longer to go (it reports, waits for a save) than a peer that dies as they part:
    a diverged run once had rank 1 abort in its teardown (SIGABRT) before rank 0 exited with 3."""
    own = [code for code in statuses if code > 0]
    return _status(own[0] if own else statuses[0])


def _report_overdue(signals: _Signals, codes: list[int | None], stop_timeout_s: float) -> None:
    if signals.signum in STOP_NOW:
        return      # after Ctrl-C only a rank still starting up is left: nothing of it to report
    running = ", ".join(str(rank) for rank, code in enumerate(codes) if code is None)
    print(f"hetc run: rank(s) {running} still running {stop_timeout_s + STOP_MARGIN_S:.0f} s after SIGTERM "
          f"(--stop-timeout {stop_timeout_s:g} s and {STOP_MARGIN_S:.0f} s to start); killing them",
          file=sys.stderr, flush=True)


def _status(code: int) -> int:
    """A process's exit status as a shell reports it (128 + N for one killed by signal N)."""
    return code if code >= 0 else 128 - code


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


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
