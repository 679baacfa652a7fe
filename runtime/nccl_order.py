"""NCCL's order on gloo: `HETC_EMULATE_NCCL=1` makes CPU runs hang where NCCL would, and fail fast.

Note [NCCL order on gloo]
NCCL starts a rank's operations on one communicator in posting order, one
at a time, and a receive (or send) holds the communicator's stream until its
partner arrives (Note [NCCL order] in passes/verify/machine.py); gloo starts
each op when it is posted. A program that trains on gloo could hang on GPUs
(with one communicator a rank pair, a receive posted ahead of a send to the
same peer did). With the emulation on, `Comm` (runtime/comm.py) puts each of
the interpreter's communication ops on a *line*, one per communicator as
NCCL has them: the direction (sender, receiver) of an isend/irecv, which
travels on a process group of its own (Note [one communicator per
direction] in runtime/comm.py), the process group of a collective. An op is
started on gloo only once every op its rank posted earlier on that line has
completed. So a CPU run holds the claim that NCCL's order hangs nothing
gloo runs to the programs as they execute, and a hand-edited program that
NCCL would hang fails fast here too.

Each line that has ops runs one thread: it starts the op at the head of
the line on gloo, waits for it, pops it, and takes the next; it ends when
the line is empty and the next post starts another. The interpreter never
blocks at post time (it posts ahead and waits later, as NCCL lets it), and
its `wait` waits for the op's completion. Threads rather than chaining on
gloo's Work futures: a future's callback runs on one of gloo's own worker
threads, where starting the next gloo op is re-entrant, and a thread per
busy line keeps the order, the start and the completion of every op in
one place that a stalled wait can read to say what it is stuck behind.
Starting ops from several threads keeps each group's calls in one order
(one thread per group), and gloo matches point-to-point messages by tag,
so the direction threads sharing a group do not mix them up.

A hang fails fast: a wait whose op has not completed after `stall_s`
raises `NcclOrderDeadlock` naming the rank, the op, the communicator and
the op it is queued behind (or the op queued behind it), instead of
waiting out the collective timeout. Completed, not started: in the typical
deadlock each rank waits on an op that heads its line and has started;
what has not started is its partner, queued behind the *other* rank's op
(two groups' collectives called in opposite orders, tests/test_nccl_emulation.py).

Not on lines: the compute's own synchronous calls (tensor, context and
expert parallelism's collectives, ring attention's batched exchanges). They
run on groups only compute uses and are waited before the compute returns,
and NCCL's rule never blocks more than gloo's (Note [NCCL order]), so no
deadlock is lost.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hetc.ir.errors import UsageError
from hetc.passes.verify.machine import Communicator, communicator_name

if TYPE_CHECKING:
    from hetc.runtime.comm import Waitable

__all__ = ["DEFAULT_STALL_S", "EMULATE_ENV", "STALL_ENV", "LineWork", "NcclEmulation", "NcclOrder",
           "NcclOrderDeadlock", "emulation_from_env"]

EMULATE_ENV = "HETC_EMULATE_NCCL"          # "1": hold gloo to NCCL's order
STALL_ENV = "HETC_EMULATE_NCCL_STALL_S"    # seconds a wait may stall before it fails
DEFAULT_STALL_S = 20.0


class NcclOrderDeadlock(RuntimeError):
    """Under the emulation, an op did not complete in time: the programs deadlock under NCCL's order.

    Not a `CommFailure`: no peer failed; the program's posting order is wrong."""


@dataclass(frozen=True)
class NcclEmulation:
    """How the local runtime holds gloo to NCCL's order (Note [NCCL order on gloo])."""

    stall_s: float = DEFAULT_STALL_S
    """A wait whose op has not completed after this many seconds fails, naming what it is stuck behind."""

    def __post_init__(self) -> None:
        if not self.stall_s > 0:
            raise ValueError(f"the stall limit must be positive, not {self.stall_s}")


def emulation_from_env(environ: Mapping[str, str] = os.environ) -> NcclEmulation | None:
    """The emulation `HETC_EMULATE_NCCL` asks for (None: off), read once when a rank starts."""
    value = environ.get(EMULATE_ENV, "").strip()
    if value in ("", "0"):
        return None
    if value != "1":
        raise UsageError(f"{EMULATE_ENV}={value!r}: set it to 1 (hold gloo to NCCL's order) or 0 (off)")
    stall = environ.get(STALL_ENV, "").strip()
    if not stall:
        return NcclEmulation()
    try:
        return NcclEmulation(float(stall))
    except ValueError:
        raise UsageError(f"{STALL_ENV}={stall!r}: give the seconds a wait may stall, a positive number") from None


class _Op:
    """One communication op on a line: how to start it on gloo, and what became of it."""

    __slots__ = ("done", "error", "label", "start")

    def __init__(self, label: str, start: Callable[[], Waitable]) -> None:
        self.label = label
        self.start = start          # posts the op on gloo
        self.done = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.start().wait()
        except BaseException as err:  # noqa: BLE001 - handed to the waiter, which raises it
            self.error = err
        finally:
            self.done.set()


class _Line:
    """A communicator's ops of one rank, in posting order; the head is the one running."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.ops: deque[_Op] = deque()
        self.lock = threading.Lock()

    def post(self, op: _Op) -> None:
        with self.lock:
            self.ops.append(op)
            idle = len(self.ops) == 1
        if idle:    # no thread runs this line: start one (the previous one has popped its last op)
            threading.Thread(target=self._drain, name=f"nccl-order {self.comm}", daemon=True).start()

    def _drain(self) -> None:
        while True:
            with self.lock:
                op = self.ops[0]
            op.run()
            with self.lock:
                self.ops.popleft()
                if not self.ops:
                    return

    def around(self, op: _Op) -> tuple[_Op | None, list[_Op]]:
        """(the op `op` is queued behind, if it has not started; the ops queued behind it)."""
        with self.lock:
            ops = list(self.ops)
        if op not in ops:
            return None, []
        at = ops.index(op)
        return (ops[0] if at > 0 else None), ops[at + 1:]


class LineWork:
    """The Work of an op on a line: `wait` waits for it to complete, and fails fast on a stall."""

    __slots__ = ("line", "op", "order")

    def __init__(self, order: NcclOrder, line: _Line, op: _Op) -> None:
        self.order, self.line, self.op = order, line, op

    def wait(self) -> None:
        if not self.op.done.wait(self.order.emulation.stall_s):
            raise NcclOrderDeadlock(self.order.stall_message(self.line, self.op))
        if self.op.error is not None:
            raise self.op.error     # typed already (a CommFailure): the line started it through collectives


class NcclOrder:
    """One rank's communicators, each a line of ops started in posting order (Note [NCCL order on gloo])."""

    def __init__(self, rank: int, emulation: NcclEmulation) -> None:
        self.rank = rank
        self.emulation = emulation
        self._lines: dict[Communicator, _Line] = {}

    def post(self, comm: Communicator, label: str, start: Callable[[], Waitable]) -> LineWork:
        """Queue the op `start` posts on gloo behind this rank's earlier ops on `comm`; never blocks."""
        line = self._lines.get(comm)
        if line is None:
            line = self._lines[comm] = _Line(comm)
        op = _Op(label, start)
        line.post(op)
        return LineWork(self, line, op)

    def stall_message(self, line: _Line, op: _Op) -> str:
        where = communicator_name(line.comm)
        ahead, behind = line.around(op)
        stalled = f"deadlock under NCCL's order: rank {self.rank}'s `{op.label}`"
        limit = f"{self.emulation.stall_s:g} s"
        if ahead is not None:
            what = (f"{stalled} has not started after {limit}: on {where} it is queued behind "
                    f"`{ahead.label}`, which has not completed")
        elif behind:
            what = (f"{stalled} has not completed after {limit}: it holds {where}, with `{behind[0].label}` "
                    "queued behind it")
        else:
            what = f"{stalled} has not completed after {limit} on {where}: its partner has not started"
        return (f"{what}. NCCL would hang here ({EMULATE_ENV}=1 holds gloo to NCCL's order; "
                f"`hetc verify DIR --backend nccl` names the instructions; {STALL_ENV} sets the limit)")
